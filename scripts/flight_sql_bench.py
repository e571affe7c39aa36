#!/usr/bin/env python3
"""Times the 22 TPC-H queries against a running `sluice server`: through ADBC's Flight SQL driver
(a grpc:// URL) or psycopg on the Postgres wire (a postgres://HOST:PORT URL).

    sluice tpch queries --scale 1 --out /tmp/q-sf1
    sluice server --data <SF1> --workers 2 &
    python3 scripts/flight_sql_bench.py grpc://127.0.0.1:50051 /tmp/q-sf1 --iterations 3
    python3 scripts/flight_sql_bench.py postgres://127.0.0.1:5433 /tmp/q-sf1 --iterations 3

Needs `pip install adbc-driver-flightsql pyarrow psycopg[binary]` (the versions in
crates/sluice-cli/tests/python/requirements.txt). Prints per query the rows, min and median seconds
(each timed from execute to the last row fetched), then the totals of the mins and medians, in the
layout `sluice tpch run` uses.
"""

import argparse
import pathlib
import statistics
import time



def statements_of(path):
    return [s.strip() for s in path.read_text().split("\n;\n") if s.strip()]


def connect(url):
    if url.startswith("postgres://"):
        import psycopg

        host, port = url.removeprefix("postgres://").rsplit(":", 1)
        return psycopg.connect(host=host, port=port, user="sluice", dbname="sluice", autocommit=True)
    import adbc_driver_flightsql.dbapi as flight_sql

    return flight_sql.connect(url, autocommit=True)


def fetch(cur):
    """Fetches the whole result; its row count."""
    if hasattr(cur, "fetch_arrow_table"):
        return cur.fetch_arrow_table().num_rows
    return len(cur.fetchall()) if cur.description is not None else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("queries", type=pathlib.Path)
    parser.add_argument("--iterations", type=int, default=1)
    args = parser.parse_args()
    total_min = total_median = 0.0
    with connect(args.url) as conn:
        print(f"{'query':<8}{'rows':>8}{'min (s)':>11}{'median (s)':>12}")
        for number in range(1, 23):
            statements = statements_of(args.queries / f"q{number:02}.sql")
            times, rows = [], 0
            for _ in range(args.iterations):
                start = time.perf_counter()
                with conn.cursor() as cur:
                    for statement in statements:
                        cur.execute(statement)
                        fetched = fetch(cur)
                        if statement.lower().startswith(("select", "with")):
                            rows = fetched
                times.append(time.perf_counter() - start)
            low, mid = min(times), statistics.median(times)
            total_min += low
            total_median += mid
            print(f"q{number:<7}{rows:>8}{low:>11.3f}{mid:>12.3f}")
    print(f"{'total':<16}{total_min:>11.3f}{total_median:>12.3f}")


if __name__ == "__main__":
    main()
