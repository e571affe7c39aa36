"""Prepares a moto S3 server for tests/object_store.rs.

Usage: s3_setup.py ENDPOINT BUCKET PREFIX LOCAL_DIR

The server was started with INITIAL_NO_AUTH_ACTION_COUNT=3: the three IAM calls below make a user,
its access key and a policy allowing S3; every later call is signed with that key and checked.
Then it creates BUCKET and uploads every file under LOCAL_DIR to PREFIX/ (one put per file), and
prints the key as JSON: {"id": ..., "secret": ...}.
"""

import json
import pathlib
import sys

import boto3


def main():
    endpoint, bucket, prefix, local = sys.argv[1:5]
    anonymous = dict(endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="setup", aws_secret_access_key="setup")
    iam = boto3.client("iam", **anonymous)
    iam.create_user(UserName="sluice")
    key = iam.create_access_key(UserName="sluice")["AccessKey"]
    policy = {"Version": "2012-10-17",
              "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="sluice", PolicyName="s3", PolicyDocument=json.dumps(policy))
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=key["AccessKeyId"],
                      aws_secret_access_key=key["SecretAccessKey"])
    s3.create_bucket(Bucket=bucket)
    root = pathlib.Path(local)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")
    print(json.dumps({"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}))


if __name__ == "__main__":
    main()
