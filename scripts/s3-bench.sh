#!/usr/bin/env bash
# TPC-H from an S3 API server against the same files on local disk, in local and cluster modes.
#
# Usage: scripts/s3-bench.sh SLUICE DATA_DIR [ITERATIONS [WORKERS]]
#
# Starts moto (the S3 server the tests use, from crates/sluice-cli/tests/python/requirements-s3.txt,
# installed into a venv under $HOME/.cache/sluice-s3-bench) on a free loopback port, with IAM checks
# on; uploads DATA_DIR (a `sluice tpch gen` output) to s3://lake/tpch/ with boto3; then runs
# `SLUICE tpch run --json` four times, one after the other: local files and S3 in local mode, local
# files and S3 in `--mode cluster --workers WORKERS` (default 2). Each run's JSON (times and, per
# query, the bytes its scans fetched) goes to ./s3-bench-<mode>-<source>.json and a table of
# medians and bytes fetched is printed. The server is stopped on exit.
set -euo pipefail

sluice=$(realpath "$1")
data=$(realpath "$2")
iterations=${3:-3}
workers=${4:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
python_dir=$here/crates/sluice-cli/tests/python
venv=$HOME/.cache/sluice-s3-bench
if [[ ! -x $venv/bin/moto_server ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -r "$python_dir/requirements-s3.txt"
fi
port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
endpoint=http://127.0.0.1:$port
INITIAL_NO_AUTH_ACTION_COUNT=3 "$venv/bin/moto_server" -H 127.0.0.1 -p "$port" >/dev/null 2>&1 &
moto=$!
trap 'kill $moto 2>/dev/null' EXIT
# Wait for the port without a request: the first three requests must be the setup's IAM calls.
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.1
done
key=$("$venv/bin/python" "$python_dir/s3_setup.py" "$endpoint" lake tpch "$data")
export AWS_ACCESS_KEY_ID=$(jq -r .id <<<"$key")
export AWS_SECRET_ACCESS_KEY=$(jq -r .secret <<<"$key")
export AWS_ENDPOINT_URL=$endpoint AWS_ALLOW_HTTP=true AWS_REGION=us-east-1

run() { # mode source args...
  local mode=$1 source=$2
  shift 2
  local url=$data
  [[ $source == s3 ]] && url=s3://lake/tpch
  echo "== $mode, $source ($url)" >&2
  "$sluice" "$@" tpch run --data "$url" --iterations "$iterations" \
    --json "s3-bench-$mode-$source.json" >&2
}
run local files
run local s3
run cluster files --mode cluster --workers "$workers"
run cluster s3 --mode cluster --workers "$workers"

python3 - "$iterations" <<'EOF'
import json, sys
runs = {(m, s): json.load(open(f"s3-bench-{m}-{s}.json"))
        for m in ("local", "cluster") for s in ("files", "s3")}
iterations = int(sys.argv[1])
print("query  local files  local S3  cluster files  cluster S3   fetched from S3 (MiB/run, local)  (cluster)")
def row(label, pick):
    cells = [pick(runs[k]) for k in runs]
    return cells
queries = [q["query"] for q in runs[("local", "files")]["queries"]]
for i, q in enumerate(queries):
    med = [runs[k]["queries"][i]["median"] for k in runs]
    fetched = [runs[(m, "s3")]["queries"][i]["scanned_bytes"] / iterations / 2**20
               for m in ("local", "cluster")]
    print(f"q{q:<5} {med[0]:>11.3f} {med[1]:>9.3f} {med[2]:>14.3f} {med[3]:>11.3f} "
          f"{fetched[0]:>25.1f} {fetched[1]:>18.1f}")
totals = [runs[k]["total_median"] for k in runs]
fetched = [sum(q["scanned_bytes"] for q in runs[(m, "s3")]["queries"]) / iterations / 2**20
           for m in ("local", "cluster")]
print(f"total  {totals[0]:>11.3f} {totals[1]:>9.3f} {totals[2]:>14.3f} {totals[3]:>11.3f} "
      f"{fetched[0]:>25.1f} {fetched[1]:>18.1f}")
EOF
