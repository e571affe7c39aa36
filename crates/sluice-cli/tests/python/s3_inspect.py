"""Looks into a moto S3 bucket for tests/object_store.rs, with clients independent of Sluice.

Usage: s3_inspect.py ENDPOINT KEY_ID SECRET BUCKET [PARQUET_PREFIX]

Prints JSON: {"keys": every key in BUCKET, sorted} and, with PARQUET_PREFIX, "groups": the hive-
partitioned Parquet dataset under it read with pyarrow, as "flag,rows,sum(l_orderkey),
sum(l_linenumber)" lines per l_returnflag, sorted.
"""

import json
import sys
from urllib.parse import urlparse

import boto3
import pyarrow.dataset as ds
import pyarrow.fs as pafs


def main():
    endpoint, key_id, secret, bucket = sys.argv[1:5]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=key_id, aws_secret_access_key=secret)
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    result = {"keys": sorted(keys)}
    if len(sys.argv) > 5:
        url = urlparse(endpoint)
        fs = pafs.S3FileSystem(access_key=key_id, secret_key=secret, region="us-east-1",
                               endpoint_override=url.netloc, scheme=url.scheme)
        table = ds.dataset(f"{bucket}/{sys.argv[5]}", filesystem=fs, format="parquet",
                           partitioning="hive").to_table()
        grouped = table.group_by("l_returnflag").aggregate(
            [("l_orderkey", "count"), ("l_orderkey", "sum"), ("l_linenumber", "sum")])
        result["groups"] = sorted(
            f"{row['l_returnflag']},{row['l_orderkey_count']},{row['l_orderkey_sum']},"
            f"{row['l_linenumber_sum']}" for row in grouped.to_pylist())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
