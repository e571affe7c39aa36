#!/usr/bin/env python3
"""TPC-H answers computed by DuckDB over the files `sluice tpch gen` wrote, for `tpch run --answers`.

Sluice's own `--compare-local` checks a distributed run against Sluice's local mode; this checks any
mode against an independent engine, at any scale factor (the official answers exist for SF 1 only).
It reads the query texts `sluice tpch queries` writes (the same parameters `tpch run` uses), runs
each in DuckDB over views of the Parquet files, and writes `q01.tbl` ... `q22.tbl` in the official
answers' form: a `|`-separated header line, then one line per row.

    pip install duckdb
    scripts/tpch-answers-duckdb.py --sluice target/release/sluice --data /work/data/sf10 --out answers-sf10
    sluice --memory-limit 4G tpch run --data /work/data/sf10 --answers answers-sf10

With `--iterations N` each query runs N times and its time is the median, and `--json FILE`
writes those times in the form `sluice tpch run --json` does (`queries[].query`, `.median`), for
BENCHMARKS.md's comparisons:

    scripts/tpch-answers-duckdb.py --sluice target/release/sluice --data /work/data/sf1 \
        --out /tmp/answers-sf1 --threads 2 --iterations 3 --json duckdb.json

Needs only the `duckdb` package. A query DuckDB cannot run stops the script with its error.
"""

import argparse
import datetime
import decimal
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TABLES = ["region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem"]


def cell(value):
    """One value as the official answers write it."""
    if value is None:
        return "NULL"
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return format(value, "f")
    if isinstance(value, float):
        return repr(value)
    return str(value).strip()


def statements(text):
    """The statements of one query file (separated by lines holding only `;`)."""
    parts, current = [], []
    for line in text.splitlines():
        if line.strip() == ";":
            parts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    parts.append("\n".join(current))
    return [p.strip().rstrip(";") for p in parts if p.strip().rstrip(";").strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sluice", required=True, help="the sluice binary (writes the query texts)")
    parser.add_argument("--data", required=True, type=Path, help="a directory `sluice tpch gen` wrote")
    parser.add_argument("--out", required=True, type=Path, help="directory for q01.tbl ... q22.tbl")
    parser.add_argument("--threads", type=int, default=0, help="DuckDB threads (default: its own)")
    parser.add_argument("--iterations", type=int, default=1, help="runs per query (median time)")
    parser.add_argument("--json", type=Path, help="write the per-query median times here")
    args = parser.parse_args()

    import duckdb  # imported here so that --help works without it

    manifest = json.loads((args.data / "tpch.json").read_text())
    scale = manifest["scale_factor"]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as queries:
        subprocess.run(
            [args.sluice, "tpch", "queries", "--scale", str(scale), "--out", queries], check=True
        )
        db = duckdb.connect()
        if args.threads:
            db.execute(f"set threads = {args.threads}")
        for table in TABLES:
            files = str(args.data / table / "*.parquet")
            db.execute(f"create view {table} as select * from read_parquet('{files}')")
        total = 0.0
        timings = []
        for number in range(1, 23):
            text = (Path(queries) / f"q{number:02}.sql").read_text()
            runs = []
            for _ in range(max(args.iterations, 1)):
                start = time.monotonic()
                columns, rows = None, None
                for statement in statements(text):
                    result = db.execute(statement)
                    if result.description is not None:
                        fetched = result.fetchall()
                        if fetched or columns is None:
                            columns = [d[0] for d in result.description]
                            rows = fetched
                runs.append(time.monotonic() - start)
            seconds = statistics.median(runs)
            timings.append({"query": number, "median": seconds})
            total += seconds
            if columns is None:
                sys.exit(f"q{number}: no statement returned rows")
            lines = ["|".join(columns)] + ["|".join(cell(v) for v in row) for row in rows]
            (args.out / f"q{number:02}.tbl").write_text("\n".join(lines) + "\n")
            print(f"q{number}: {len(rows)} rows, {seconds:.3f} s", file=sys.stderr)
        print(f"DuckDB {duckdb.__version__}, SF {scale}: total {total:.3f} s", file=sys.stderr)
        if args.json:
            report = {"engine": f"duckdb {duckdb.__version__}", "queries": timings}
            args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
