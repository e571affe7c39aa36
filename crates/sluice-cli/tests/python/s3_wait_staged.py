"""Waits until a write has staged a file in a moto S3 bucket, for tests/object_store.rs.

Usage: s3_wait_staged.py ENDPOINT KEY_ID SECRET BUCKET

Lists BUCKET every 20 ms until some key or some multipart upload under way lies under a
`.sluice-staging/` prefix (a write has staged, or is staging, a file), prints it and exits 0; exits 1
after 60 s without one.
"""

import sys
import time

import boto3


def main():
    endpoint, key_id, secret, bucket = sys.argv[1:5]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=key_id, aws_secret_access_key=secret)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                if ".sluice-staging/" in item["Key"]:
                    print(item["Key"])
                    return
        for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            if ".sluice-staging/" in upload["Key"]:
                print(upload["Key"])
                return
        time.sleep(0.02)
    sys.exit("nothing was staged within 60 s")


if __name__ == "__main__":
    main()
