"""`sluice server` through the Postgres wire with psycopg 3, the way a Python user of Postgres reaches it.

Run by tests/clients.rs: SLUICE_PG is the cluster under test (two worker processes; its Flight SQL
endpoint SLUICE_FLIGHT_SQL reports its state), SLUICE_PG_LOCAL the same tables in local mode (the
reference, through the same wire), SLUICE_PG_LOGIN a server with one account, ann / s3cret.
"""

import base64
import datetime
import decimal
import os
import socket
import struct

import adbc_driver_flightsql.dbapi as flight_sql
import psycopg
import pytest

from common import (
    LONG_QUERY,
    cancel_long_query,
    holds_no_work,
    query_index,
    statements_of,
    wait_until,
)

CLUSTER = os.environ["SLUICE_PG"]
LOCAL = os.environ["SLUICE_PG_LOCAL"]


def connect(address, user="sluice", password=None):
    host, port = address.rsplit(":", 1)
    kwargs = {"host": host, "port": port, "user": user, "dbname": "sluice", "autocommit": True}
    if password is not None:
        kwargs["password"] = password
    return psycopg.connect(**kwargs)


def run(conn, statements):
    """Runs the statements in order; the last one's column names and rows."""
    names, rows = None, None
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
            if cur.description is not None:
                names = [column.name for column in cur.description]
                rows = cur.fetchall()
    return names, rows


@pytest.fixture(scope="module")
def cluster():
    with connect(CLUSTER) as conn:
        yield conn


@pytest.fixture(scope="module")
def local():
    with connect(LOCAL) as conn:
        yield conn


@pytest.fixture(scope="module")
def local_flight_sql():
    with flight_sql.connect(os.environ["SLUICE_FLIGHT_SQL_LOCAL"], autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("number", range(1, 23))
def test_tpch_query_equals_local_mode(cluster, local, local_flight_sql, number):
    statements = statements_of(number)
    index = query_index(statements)
    got_names, got = run(cluster, statements[: index + 1])
    want_names, want = run(local, statements[: index + 1])
    for statement in statements[index + 1 :]:
        run(cluster, [statement])
        run(local, [statement])
    assert got_names == want_names
    assert len(got) > 0
    assert got == want, f"q{number}: rows differ"
    # And the wire carries local mode's values, not just the same text twice: the same rows as
    # local mode's Arrow result through Flight SQL.
    with local_flight_sql.cursor() as cur:
        for statement in statements[: index + 1]:
            cur.execute(statement)
            table = cur.fetch_arrow_table()
        for statement in statements[index + 1 :]:
            cur.execute(statement)
            cur.fetch_arrow_table()
    assert [tuple(row.values()) for row in table.to_pylist()] == [tuple(row) for row in got]


def sqlstate_of(conn, sql):
    with pytest.raises(psycopg.Error) as caught:
        with conn.cursor() as cur:
            cur.execute(sql)
            cur.fetchall()
    return caught.value.sqlstate, caught.value.diag.message_primary


def test_errors_carry_their_sqlstate_and_the_local_text(cluster):
    assert sqlstate_of(cluster, "selec 1") == (
        "42601",
        'SQL error: ParserError("Expected: an SQL statement, found: selec at Line: 1, Column: 1")',
    )
    assert sqlstate_of(cluster, "select * from no_such_table") == (
        "42P01",
        "Error during planning: table 'datafusion.public.no_such_table' not found",
    )
    assert sqlstate_of(cluster, "select no_such_column from nation")[0] == "42703"
    assert sqlstate_of(cluster, "select 1 / 0") == ("22012", "Arrow error: Divide by zero error")
    # The connection is still usable after errors.
    assert run(cluster, ["select 1 as one"]) == (["one"], [(1,)])


def test_a_statement_with_parameters_binds_them(cluster):
    with cluster.cursor() as cur:
        cur.execute("select n_name from nation where n_nationkey = %s", (7,))
        assert cur.fetchall() == [("GERMANY",)]
        cur.execute(
            "select count(*) from orders where o_orderkey < %s and o_orderstatus = %s", (1000, "F")
        )
        (n,) = cur.fetchone()
        cur.execute("select count(*) from orders where o_orderkey < 1000 and o_orderstatus = 'F'")
        assert cur.fetchone() == (n,)
    assert n > 0


def test_values_keep_their_types():
    with connect(CLUSTER) as conn:
        names, rows = run(
            conn,
            [
                "select cast(1.5 as decimal(10, 2)) as d, date '2020-01-02' as day, "
                "timestamp '2020-01-01 10:00:00' as ts, interval '1 day 2 hours' as span, "
                "[1, 2, 3] as list, 'text' as t, 2.5 as f, true as b, cast(null as int) as nothing"
            ],
        )
    assert names == ["d", "day", "ts", "span", "list", "t", "f", "b", "nothing"]
    assert rows == [
        (
            decimal.Decimal("1.50"),
            datetime.date(2020, 1, 2),
            datetime.datetime(2020, 1, 1, 10, 0),
            datetime.timedelta(days=1, hours=2),
            [1, 2, 3],
            "text",
            2.5,
            True,
            None,
        )
    ]


def test_a_session_keeps_its_settings_views_and_tables_to_itself():
    with connect(CLUSTER) as one, connect(CLUSTER) as other:
        run(one, ["create view mine as select 41 + 1 as answer"])
        run(one, ["create table kept as select n_name from nation where n_nationkey < 3"])
        assert run(one, ["select * from mine"]) == (["answer"], [(42,)])
        assert run(one, ["select count(*) as n from kept"]) == (["n"], [(3,)])
        for name in ["mine", "kept"]:
            with pytest.raises(psycopg.Error) as caught:
                run(other, [f"select * from {name}"])
            assert caught.value.sqlstate == "42P01", name
        run(one, ["set datafusion.execution.batch_size = 123"])
        assert run(one, ["show datafusion.execution.batch_size"])[1] == [
            ("datafusion.execution.batch_size", "123")
        ]
        assert run(other, ["show datafusion.execution.batch_size"])[1] == [
            ("datafusion.execution.batch_size", "8192")
        ]


def test_the_statements_of_one_query_string_run_in_order(cluster):
    run(cluster, ["create table counted as select 1 as a"])
    with cluster.cursor() as cur:
        # No parameters: psycopg sends the three as one simple query.
        cur.execute("select count(*) from counted; insert into counted values (2); select count(*) from counted")
        assert cur.fetchall() == [(1,)], "the first count does not see the later insert"
        assert cur.nextset()
        assert cur.rowcount == 1
        assert cur.nextset()
        assert cur.fetchall() == [(2,)]
    run(cluster, ["drop table counted"])


def test_a_write_inside_a_transaction_is_refused_but_reads_run():
    host, port = CLUSTER.rsplit(":", 1)
    with psycopg.connect(host=host, port=port, user="sluice", dbname="sluice") as conn:
        assert not conn.autocommit
        with conn.cursor() as cur:
            cur.execute("select count(*) from nation")
            assert cur.fetchall() == [(25,)]
            with pytest.raises(psycopg.errors.FeatureNotSupported) as caught:
                cur.execute("create view not_made as select 1 as a")
        assert caught.value.sqlstate == "0A000"
        assert "cannot take a write inside BEGIN" in caught.value.diag.message_primary
        conn.rollback()
        conn.autocommit = True
        assert run(conn, ["create view made as select 1 as a", "select * from made"]) == (["a"], [(1,)])


def test_cancelling_a_long_query_stops_every_worker_task_within_a_second():
    with connect(CLUSTER) as conn:

        def run_long():
            with conn.cursor() as cur:
                cur.execute(LONG_QUERY)
                cur.fetchall()

        failures = cancel_long_query(run_long, conn.cancel_safe, psycopg.Error)
        assert [(f.sqlstate, f.diag.message_primary) for f in failures] == [
            ("57014", "canceling statement due to user request")
        ]
        # The connection goes on.
        assert run(conn, ["select 2 as two"]) == (["two"], [(2,)])
    wait_until(holds_no_work, 5.0, "the server still holds work")


def test_wrong_or_missing_credentials_are_refused():
    address = os.environ["SLUICE_PG_LOGIN"]
    # No password at all: the server asks for SCRAM, which libpq cannot answer.
    with pytest.raises(psycopg.OperationalError) as caught:
        connect(address, user="ann").close()
    assert "no password supplied" in str(caught.value), caught.value
    for user, password in [("ann", "wrong"), ("nobody", "s3cret")]:
        with pytest.raises(psycopg.OperationalError) as caught:
            connect(address, user=user, password=password).close()
        assert f'FATAL:  password authentication failed for user "{user}"' in str(caught.value), (
            user,
            caught.value,
        )
    with connect(address, user="ann", password="s3cret") as conn:
        assert run(conn, ["select 1 as one"]) == (["one"], [(1,)])


def messages(sock):
    """The server's messages, (type, body), until it closes the socket or goes quiet."""
    data = b""
    sock.settimeout(3)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    found = []
    while len(data) >= 5:
        kind, length = data[:1], struct.unpack("!i", data[1:5])[0]
        found.append((kind, data[5 : 1 + length]))
        data = data[1 + length :]
    return found


def test_nothing_runs_on_a_connection_whose_login_failed():
    """pgwire keeps reading after a failed SCRAM proof: a query sent anyway must not run."""
    host, port = os.environ["SLUICE_PG_LOGIN"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        params = b"user\0ann\0database\0sluice\0\0"
        sock.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
        sock.settimeout(3)
        assert sock.recv(1) == b"R"  # AuthenticationSASL
        sock.recv(65536)
        first = b"n,,n=,r=abcdefgh"
        body = b"SCRAM-SHA-256\0" + struct.pack("!i", len(first)) + first
        sock.sendall(b"p" + struct.pack("!i", 4 + len(body)) + body)
        reply = sock.recv(65536)
        assert reply[:1] == b"R" and struct.unpack("!i", reply[5:9])[0] == 11, reply  # SASLContinue
        server_first = reply[9:].decode()
        nonce = server_first.split(",")[0][2:]
        proof = base64.b64encode(bytes(32)).decode()
        final = f"c=biws,r={nonce},p={proof}".encode()
        sock.sendall(b"p" + struct.pack("!i", 4 + len(final)) + final)
        query = b"select 1 as leaked\0"
        try:
            sock.sendall(b"Q" + struct.pack("!i", 4 + len(query)) + query)
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = messages(sock)
    kinds = [kind for kind, _ in got]
    assert kinds[0] == b"E", got
    assert b"28P01" in got[0][1] and b"password authentication failed" in got[0][1], got
    assert b"T" not in kinds and b"D" not in kinds and b"C" not in kinds, got
