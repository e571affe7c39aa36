"""Delta Lake tables written and read by Python `deltalake`, the independent side of tests/delta.rs.

  make URI      writes a table partitioned by k in three versions (0: a write, 1: an append,
                2: a delete that rewrites files), then prints what deltalake answers at version 1
                and at the latest version
  answers URI   prints the latest version and what deltalake answers at it

Answers are the CSV Sluice prints for the queries in QUERIES, computed from deltalake's own read.
Storage options (an S3 endpoint and key) come as JSON in DELTA_STORAGE_OPTIONS.
"""

import json
import os
import sys

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake


def storage():
    text = os.environ.get("DELTA_STORAGE_OPTIONS")
    return json.loads(text) if text else None


def batch(start, stop, keys):
    ids = list(range(start, stop))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "k": pa.array([f"k{i % keys}" for i in ids], pa.string()),
            "v": pa.array([i % 97 for i in ids], pa.int32()),
        }
    )


def groups(table, where=None):
    """`select k, count(*) as n, sum(id) as s, sum(v) as w from t [where] group by k order by k`."""
    if where is not None:
        table = table.filter(where(table))
    out = ["k,n,s,w"]
    grouped = table.group_by("k").aggregate([("id", "count"), ("id", "sum"), ("v", "sum")])
    rows = sorted(grouped.to_pylist(), key=lambda r: r["k"])
    for row in rows:
        out.append(f"{row['k']},{row['id_count']},{row['id_sum']},{row['v_sum']}")
    return "\n".join(out) + "\n"


def answers(uri, version):
    table = DeltaTable(uri, version=version, storage_options=storage()).to_pyarrow_table()
    return {
        "all": groups(table),
        "k1": groups(table, lambda t: pc.equal(t["k"], "k1")),
        "small_ids": groups(table, lambda t: pc.less(t["id"], 300)),
    }


def main():
    command, uri = sys.argv[1], sys.argv[2]
    if command == "make":
        write_deltalake(uri, batch(0, 3000, 3), partition_by=["k"], storage_options=storage())
        write_deltalake(
            uri, batch(3000, 4500, 4), partition_by=["k"], mode="append", storage_options=storage()
        )
        DeltaTable(uri, storage_options=storage()).delete("id % 10 = 0")
        latest = DeltaTable(uri, storage_options=storage()).version()
        print(json.dumps({"version": latest, "v1": answers(uri, 1), "latest": answers(uri, None)}))
    elif command == "answers":
        latest = DeltaTable(uri, storage_options=storage()).version()
        print(json.dumps({"version": latest, "latest": answers(uri, None)}))
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
    # deltalake's native threads can abort the interpreter's teardown ("terminate called without an
    # active exception") after the work is done: leave without it once the answer is out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
