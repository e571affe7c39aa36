"""The server's memory stays bounded when a client asks for a large result it then does not read
as rows: a Flight SQL statement update (DoPut) of a 10 M-row SELECT is streamed and counted, and a
Postgres query string whose first statement returns 10 M rows stops at the result buffer with
SQLSTATE 54000. The server's peak RSS grows by less than 4x the result buffer (64 MiB).

Run by tests/clients.rs: SLUICE_LIMITS_FLIGHT_SQL and SLUICE_LIMITS_PG are a local-mode server
with the default limits, SLUICE_LIMITS_PID its process id (its /proc/PID/status is read; root may
also reset its peak through /proc/PID/clear_refs).
"""

import os

import adbc_driver_flightsql.dbapi as flight_sql
import psycopg
import pytest

PID = int(os.environ["SLUICE_LIMITS_PID"])
RESULT_BUFFER = 64 << 20
# 10 M rows of two BIGINTs and a 16-byte string: about 360 MB if they were held.
WIDE = "select value, value + 1 as next, repeat('x', 16) as pad from generate_series(1, 10000000)"


def kib(field):
    with open(f"/proc/{PID}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{PID}/status")


def test_large_results_that_are_not_read_as_rows_keep_the_servers_memory_bounded():
    try:
        with open(f"/proc/{PID}/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    before = kib("VmRSS")
    with flight_sql.connect(os.environ["SLUICE_LIMITS_FLIGHT_SQL"], autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.adbc_statement.set_sql_query(WIDE)
            assert cur.adbc_statement.execute_update() == 10_000_000
    host, port = os.environ["SLUICE_LIMITS_PG"].rsplit(":", 1)
    with psycopg.connect(host=host, port=port, user="sluice", dbname="sluice", autocommit=True) as conn:
        with psycopg.ClientCursor(conn) as cur:
            with pytest.raises(psycopg.errors.ProgramLimitExceeded) as caught:
                cur.execute(f"{WIDE}; select 1")
            assert caught.value.sqlstate == "54000"
            assert caught.value.diag.message_primary == (
                "a statement followed by others in one query string is held until it ends, "
                "and its result is larger than result_buffer (64 MiB): send it on its own"
            )
            # The connection goes on.
            cur.execute("select 1 as one")
            assert cur.fetchall() == [(1,)]
    growth = (kib("VmHWM") - before) * 1024
    assert growth < 4 * RESULT_BUFFER, f"the server's peak RSS grew by {growth >> 20} MiB"
