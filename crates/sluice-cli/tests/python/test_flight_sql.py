"""`sluice server` through ADBC's Flight SQL driver (DBAPI), the way a Python user reaches it.

Run by tests/clients.rs, which starts two servers over the same TPC-H data: SLUICE_FLIGHT_SQL (the
cluster under test, two worker processes) and SLUICE_FLIGHT_SQL_LOCAL (local mode, the reference).
SLUICE_TPCH_QUERIES is a directory of qNN.sql files, one statement per line group separated by
lines holding only ';'.
"""

import os
import pathlib

import adbc_driver_flightsql.dbapi as flight_sql
import adbc_driver_manager
import pytest

QUERIES = pathlib.Path(os.environ["SLUICE_TPCH_QUERIES"])


def connect(url):
    return flight_sql.connect(url, autocommit=True)


@pytest.fixture(scope="module")
def cluster():
    with connect(os.environ["SLUICE_FLIGHT_SQL"]) as conn:
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


def statements_of(number):
    text = (QUERIES / f"q{number:02}.sql").read_text()
    return [s.strip() for s in text.split("\n;\n") if s.strip()]


@pytest.mark.parametrize("number", range(1, 23))
def test_tpch_query_equals_local_mode(cluster, local, number):
    statements = statements_of(number)
    # q15 creates a view, queries it and drops it: take the query's result.
    query_index = next(i for i, s in enumerate(statements) if s.lower().lstrip().startswith(("select", "with")))
    got = run(cluster, statements[: query_index + 1])
    want = run(local, statements[: query_index + 1])
    for statement in statements[query_index + 1 :]:
        run(cluster, [statement])
        run(local, [statement])
    assert got.schema == want.schema
    assert got.num_rows == want.num_rows
    assert got.num_rows > 0
    assert got.equals(want), f"q{number}: rows differ"


def test_tables_and_their_schemas_are_listed(cluster):
    objects = cluster.adbc_get_objects(depth="tables").read_all().to_pylist()
    tables = sorted(
        table["table_name"]
        for catalog in objects
        for schema in catalog["catalog_db_schemas"] or []
        for table in schema["db_schema_tables"] or []
    )
    assert tables == sorted(
        ["customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier"]
    )
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


def test_a_syntax_error_is_invalid_argument_with_the_local_text(cluster):
    error = error_of(cluster, "selec 1")
    assert error.status_code == adbc_driver_manager.AdbcStatusCode.INVALID_ARGUMENT
    assert "Expected: an SQL statement, found: selec at Line: 1, Column: 1" in str(error)


def test_an_unknown_table_is_not_found(cluster):
    error = error_of(cluster, "select * from no_such_table")
    assert error.status_code == adbc_driver_manager.AdbcStatusCode.NOT_FOUND
    assert "table 'datafusion.public.no_such_table' not found" in str(error)
