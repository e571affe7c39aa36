#!/usr/bin/env python3
"""Times the 22 TPC-H queries through ADBC's Flight SQL driver against a running `sluice server`.

    sluice tpch queries --scale 1 --out /tmp/q-sf1
    sluice server --data <SF1> --workers 2 &
    python3 scripts/flight_sql_bench.py grpc://127.0.0.1:50051 /tmp/q-sf1 --iterations 3

Needs `pip install adbc-driver-flightsql pyarrow` (the versions in
crates/sluice-cli/tests/python/requirements.txt). Prints per query the rows, min and median seconds
(each timed from execute to the last batch fetched), then the totals of the mins and medians, in the
layout `sluice tpch run` uses.
"""

import argparse
import pathlib
import statistics
import time

import adbc_driver_flightsql.dbapi as flight_sql


def statements_of(path):
    return [s.strip() for s in path.read_text().split("\n;\n") if s.strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("queries", type=pathlib.Path)
    parser.add_argument("--iterations", type=int, default=1)
    args = parser.parse_args()
    total_min = total_median = 0.0
    with flight_sql.connect(args.url, autocommit=True) as conn:
        print(f"{'query':<8}{'rows':>8}{'min (s)':>11}{'median (s)':>12}")
        for number in range(1, 23):
            statements = statements_of(args.queries / f"q{number:02}.sql")
            times, rows = [], 0
            for _ in range(args.iterations):
                start = time.perf_counter()
                with conn.cursor() as cur:
                    for statement in statements:
                        cur.execute(statement)
                        table = cur.fetch_arrow_table()
                        if statement.lower().startswith(("select", "with")):
                            rows = table.num_rows
                times.append(time.perf_counter() - start)
            low, mid = min(times), statistics.median(times)
            total_min += low
            total_median += mid
            print(f"q{number:<7}{rows:>8}{low:>11.3f}{mid:>12.3f}")
    print(f"{'total':<16}{total_min:>11.3f}{total_median:>12.3f}")


if __name__ == "__main__":
    main()
