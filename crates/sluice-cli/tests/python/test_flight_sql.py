"""`sluice server` through ADBC's Flight SQL driver (DBAPI), the way a Python user reaches it; the
fifty-client test mixes ADBC and psycopg clients.

Run by tests/clients.rs, which starts two servers over the same TPC-H data: SLUICE_FLIGHT_SQL (the
cluster under test, two worker processes) and SLUICE_FLIGHT_SQL_LOCAL (local mode, the reference).
SLUICE_TPCH_QUERIES is a directory of qNN.sql files, one statement per line group separated by
lines holding only ';'.
"""

import concurrent.futures
import os

import adbc_driver_flightsql.dbapi as flight_sql
import adbc_driver_manager
import pytest

import test_postgres
from common import (
    CLUSTER_URL,
    LONG_QUERY,
    cancel_long_query,
    holds_no_work,
    query_index,
    server_state,
    statements_of,
    wait_until,
)

def connect(url):
    return flight_sql.connect(url, autocommit=True)


@pytest.fixture(scope="module")
def cluster():
    with connect(CLUSTER_URL) as conn:
        yield conn


@pytest.fixture(scope="module")
def local():
    with connect(os.environ["SLUICE_FLIGHT_SQL_LOCAL"]) as conn:
        yield conn


def run(conn, statements):
    """Runs the statements in order and returns the last result as an Arrow table."""
    result = None
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
            result = cur.fetch_arrow_table()
    return result


@pytest.mark.parametrize("number", range(1, 23))
def test_tpch_query_equals_local_mode(cluster, local, number):
    statements = statements_of(number)
    # q15 creates a view, queries it and drops it: take the query's result.
    index = query_index(statements)
    got = run(cluster, statements[: index + 1])
    want = run(local, statements[: index + 1])
    for statement in statements[index + 1 :]:
        run(cluster, [statement])
        run(local, [statement])
    assert got.schema == want.schema
    assert got.num_rows == want.num_rows
    assert got.num_rows > 0
    assert got.equals(want), f"q{number}: rows differ"


def test_tables_and_their_schemas_are_listed(cluster):
    objects = cluster.adbc_get_objects(depth="tables").read_all().to_pylist()
    tables = sorted(
        (schema["db_schema_name"], table["table_name"])
        for catalog in objects
        for schema in catalog["catalog_db_schemas"] or []
        for table in schema["db_schema_tables"] or []
    )
    tpch = ["customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier"]
    system = ["jobs", "stages", "tasks", "workers"]
    assert tables == sorted([("public", t) for t in tpch] + [("sluice", t) for t in system])
    schema = cluster.adbc_get_table_schema("nation")
    assert schema.names == ["n_nationkey", "n_name", "n_regionkey", "n_comment"]
    assert str(schema.field("n_nationkey").type) == "int64"


def test_a_prepared_statement_takes_parameters(cluster):
    with cluster.cursor() as cur:
        cur.execute("select n_name from nation where n_nationkey = $1", parameters=(7,))
        assert cur.fetchall() == [("GERMANY",)]
        cur.execute(
            "select count(*) as n from orders where o_orderkey < $1 and o_orderstatus = $2",
            parameters=(1000, "F"),
        )
        (n,) = cur.fetchone()
    with cluster.cursor() as cur:
        cur.execute("select count(*) as n from orders where o_orderkey < 1000 and o_orderstatus = 'F'")
        assert cur.fetchone() == (n,)
    assert n > 0


def error_of(conn, sql):
    with conn.cursor() as cur:
        with pytest.raises(adbc_driver_manager.Error) as caught:
            cur.execute(sql)
            cur.fetchall()
    return caught.value


def test_incremental_execution_hands_out_the_partition_of_a_planned_statement(cluster, local):
    """ADBC's incremental execution runs on PollFlightInfo: the first call hands out the one
    partition of a planned statement (its JSON state says so, progress 0), reading it runs the job
    and gives local mode's rows, and a later call finds no further partition. (The poll's later
    states are checked by the Rust test `poll_flight_info_reports_…`: ADBC does not expose them.)"""
    import pyarrow.flight
    from adbc_driver_flightsql import StatementOptions as FlightOptions
    from adbc_driver_manager import StatementOptions

    sql = "select l_returnflag, count(*) as n from lineitem group by l_returnflag order by l_returnflag"
    with cluster.cursor() as cur:
        cur.adbc_statement.set_options(**{StatementOptions.INCREMENTAL.value: "true"})
        partitions, schema = cur.adbc_execute_partitions(sql)
        assert len(partitions) == 1
        assert cur.adbc_statement.get_option_float(StatementOptions.PROGRESS.value) == 0.0
        info = cur.adbc_statement.get_option_bytes(FlightOptions.LAST_FLIGHT_INFO.value)
        assert pyarrow.flight.FlightInfo.deserialize(info).app_metadata == b'{"state":"planned"}'
        with cluster.cursor() as reader:
            reader.adbc_read_partition(partitions[0])
            got = reader.fetch_arrow_table()
        more, _ = cur.adbc_execute_partitions(sql)
        assert more == [], "one statement, one partition"
    assert got.schema == schema
    assert got.equals(run(local, [sql]))


def test_a_syntax_error_is_invalid_argument_with_the_local_text(cluster):
    error = error_of(cluster, "selec 1")
    assert error.status_code == adbc_driver_manager.AdbcStatusCode.INVALID_ARGUMENT
    assert "Expected: an SQL statement, found: selec at Line: 1, Column: 1" in str(error)


def test_an_unknown_table_is_not_found(cluster):
    error = error_of(cluster, "select * from no_such_table")
    assert error.status_code == adbc_driver_manager.AdbcStatusCode.NOT_FOUND
    assert "table 'datafusion.public.no_such_table' not found" in str(error)


def test_cancelling_a_long_query_stops_every_worker_task_within_a_second():
    with connect(CLUSTER_URL) as conn:
        cur = conn.cursor()

        def run_long():
            cur.execute(LONG_QUERY)
            cur.fetchall()

        failures = cancel_long_query(run_long, cur.adbc_cancel, adbc_driver_manager.Error)
        assert len(failures) == 1, failures
        assert failures[0].status_code == adbc_driver_manager.AdbcStatusCode.CANCELLED, failures[0]
        cur.close()


def test_fifty_concurrent_clients_of_both_protocols_get_the_local_answers_and_leave_nothing_behind(local):
    numbers = list(range(1, 23))
    expected = {n: run(local, statements_of(n)) for n in numbers}
    with test_postgres.connect(test_postgres.LOCAL) as conn:
        expected_pg = {n: test_postgres.run(conn, statements_of(n))[1] for n in numbers}
    sessions_before = server_state()["sessions"]

    def flight_sql_client(index):
        # Each client logs in (any name on a server without accounts), so it has a session of its
        # own: q15's view is created and dropped in each client's session without colliding.
        credentials = {"username": f"client{index}", "password": ""}
        with flight_sql.connect(CLUSTER_URL, db_kwargs=credentials, autocommit=True) as conn:
            differing = []
            for number in client_queries(index):
                got = run(conn, statements_of(number))
                if not got.equals(expected[number]):
                    # What differs, so a rare failure tells no rows, other rows and another
                    # schema apart.
                    differing.append((number, "flight-sql", str(got.schema), got.to_pylist()[:5]))
            return differing

    def postgres_client(index):
        # A Postgres connection is a session of its own too.
        with test_postgres.connect(test_postgres.CLUSTER, user=f"client{index}") as conn:
            differing = []
            for number in client_queries(index):
                names, rows = test_postgres.run(conn, statements_of(number))
                if rows != expected_pg[number]:
                    differing.append((number, "postgres", names, (rows or [])[:5]))
            return differing

    def client_queries(index):
        return [numbers[(index * 10 + k) % len(numbers)] for k in range(10)]

    def client(index):
        return (flight_sql_client if index % 2 == 0 else postgres_client)(index)

    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(client, range(50)))
    differing = [d for r in results for d in r]
    wanted = {
        "flight-sql": lambda n: (str(expected[n].schema), expected[n].to_pylist()[:5]),
        "postgres": lambda n: expected_pg[n][:5],
    }
    assert differing == [], [(d, wanted[d[1]](d[0])) for d in differing]
    assert server_state()["sessions"] == sessions_before + 25
    # Cleanup after a job ends is asynchronous (stream releases, CleanUpJob, a closed socket's
    # connection task): give it a moment.
    wait_until(
        lambda s: holds_no_work(s) and s["postgres_connections"] == 0,
        5.0,
        "the server still holds work or connections",
    )


def test_wrong_or_missing_credentials_are_refused():
    url = os.environ["SLUICE_FLIGHT_SQL_LOGIN"]
    refused = [{}, {"username": "ann", "password": "wrong"}, {"username": "nobody", "password": "s3cret"}]
    for credentials in refused:
        with pytest.raises(adbc_driver_manager.Error) as caught:
            with flight_sql.connect(url, db_kwargs=credentials, autocommit=True) as conn:
                with conn.cursor() as cur:
                    cur.execute("select 1")
                    cur.fetchall()
        assert caught.value.status_code == adbc_driver_manager.AdbcStatusCode.UNAUTHENTICATED, (credentials, caught.value)
    with flight_sql.connect(url, db_kwargs={"username": "ann", "password": "s3cret"}, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.execute("select 1 as one")
            assert cur.fetchall() == [(1,)]
