"""Roles and roots through both doors of one `sluice server`: ADBC's Flight SQL driver sees
PermissionDenied (UNAUTHORIZED) and psycopg SQLSTATE 42501 for what a role may not do, and the
statement it may do runs.

Run by tests/clients.rs: SLUICE_ROLES_FLIGHT_SQL and SLUICE_ROLES_PG are a server whose users
file holds rita (no role: a reader), wes (writer) and ada (admin), each with password "s3cret-roles";
SLUICE_ROLES_DIR holds data/ (the server's --data, so its read root), out/ (its write root) and
secret.csv (under neither); SLUICE_ROLES_ELSEWHERE is a directory outside both roots.
"""

import os

import adbc_driver_flightsql.dbapi as flight_sql
import adbc_driver_manager
import psycopg
import pytest

DIR = os.path.realpath(os.environ["SLUICE_ROLES_DIR"])
ELSEWHERE = os.path.realpath(os.environ["SLUICE_ROLES_ELSEWHERE"])
DOORS = ["flight_sql", "postgres"]


def connect(door, user):
    if door == "flight_sql":
        return flight_sql.connect(
            os.environ["SLUICE_ROLES_FLIGHT_SQL"],
            db_kwargs={"username": user, "password": "s3cret-roles"},
            autocommit=True,
        )
    host, port = os.environ["SLUICE_ROLES_PG"].rsplit(":", 1)
    return psycopg.connect(host=host, port=port, user=user, password="s3cret-roles", dbname="sluice", autocommit=True)


def cursor(conn, simple):
    """A cursor; on the Postgres wire `simple` picks the simple query protocol (as psql sends
    statements; psycopg's client-side-binding cursor uses it) over the extended one (psycopg's
    default)."""
    if simple and isinstance(conn, psycopg.Connection):
        return psycopg.ClientCursor(conn)
    return conn.cursor()


def rows(door, user, sql, simple=False):
    with connect(door, user) as conn:
        with cursor(conn, simple) as cur:
            cur.execute(sql)
            return cur.fetchall()


def refusal(door, user, sql, simple=False):
    """The message of the refusal `sql` gets, after checking it is a permission error."""
    with connect(door, user) as conn:
        with cursor(conn, simple) as cur:
            if door == "flight_sql":
                with pytest.raises(adbc_driver_manager.Error) as caught:
                    cur.execute(sql)
                    cur.fetchall()
                assert caught.value.status_code == adbc_driver_manager.AdbcStatusCode.UNAUTHORIZED, caught.value
                return str(caught.value)
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
                cur.execute(sql)
            assert caught.value.sqlstate == "42501"
            return caught.value.diag.message_primary


@pytest.mark.parametrize("door", DOORS)
def test_a_reader_reads_the_registered_tables_and_under_the_read_root_only(door):
    assert rows(door, "rita", "select count(*) from t") == [(3,)]
    assert rows(door, "rita", f"select count(*) from '{DIR}/data/t.csv'") == [(3,)]
    who = "permission denied for user 'rita' (reader)"
    refused = {
        "select * from '/etc/passwd'": f"{who}: cannot read '/etc/passwd'",
        f"select * from '{DIR}/data/../secret.csv'": f"{who}: cannot read '{DIR}/data/../secret.csv' ({DIR}/secret.csv)",
        f"select * from 'file://{DIR}/data/%2e%2e/secret.csv'": f"{who}: cannot read 'file://{DIR}/data/%2e%2e/secret.csv' ({DIR}/secret.csv)",
        "create external table p stored as csv location '/etc/passwd'": f"{who}: CREATE EXTERNAL TABLE needs the admin role",
        f"copy (select 1) to '{DIR}/out/r_{door}.csv'": f"{who}: COPY needs the writer role",
        "insert into t values (4, 'w')": f"{who}: INSERT on table 't' needs the writer role",
        "set datafusion.runtime.memory_limit = '100G'": f"{who}: 'datafusion.runtime.memory_limit' is a server-wide setting: it needs the admin role",
    }
    for sql, message in refused.items():
        got = refusal(door, "rita", sql)
        # ADBC puts the status in front of the server's message; psycopg gives it as sent.
        assert (message in got) if door == "flight_sql" else got.startswith(message), (sql, got)
    assert not os.path.exists(f"{DIR}/out/r_{door}.csv")


@pytest.mark.parametrize("door", DOORS)
def test_a_writer_writes_under_the_write_root_only(door):
    target = f"{DIR}/out/w_{door}.csv"
    assert rows(door, "wes", f"copy (select 1 as a) to '{target}'", simple=True) == [(1,)]
    assert os.path.exists(target)
    who = "permission denied for user 'wes' (writer)"
    outside = f"{ELSEWHERE}/w_{door}.csv"
    assert (
        f"{who}: cannot write to '{outside}' ({outside}): it is not under a write root ({DIR}/out)"
        in refusal(door, "wes", f"copy (select 1 as a) to '{outside}'", simple=True)
    )
    assert f"{who}: CREATE EXTERNAL TABLE needs the admin role" in refusal(
        door, "wes", f"create external table s stored as csv location '{DIR}/secret.csv'"
    )
    assert not os.path.exists(outside)


@pytest.mark.parametrize("door", DOORS)
def test_an_admin_writes_outside_the_roots_and_reads_anything(door):
    target = f"{ELSEWHERE}/a_{door}.csv"
    assert rows(door, "ada", f"copy (select 1 as a) to '{target}'") == [(1,)]
    assert os.path.exists(target)
    assert rows(door, "ada", f"select count(*) from '{DIR}/secret.csv'") == [(1,)]
