#!/usr/bin/env bash
# Runs every DataFusion 55.2 `test_files/*.slt` file that needs no external data in local,
# local-graph and local-cluster mode and compares the modes file by file: the same records must
# pass, fail and be skipped in every mode (failing records named by file and line).
#
#   scripts/datafusion-slt.sh [SLUICE_BINARY]     (default: target/release/sluice)
#
# The test files come from the `datafusion-sqllogictest` 55.2.0 crate, fetched from crates.io into
# Cargo's registry. Results go to target/datafusion-slt/ (one file per mode, and the comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
SLUICE="${1:-${CARGO_TARGET_DIR:-target}/release/sluice}"
OUT="${CARGO_TARGET_DIR:-target}/datafusion-slt"
mkdir -p "$OUT"

registry_dir() {
    ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/datafusion-sqllogictest-55.2.0 2>/dev/null | head -1
}
if [ -z "$(registry_dir)" ]; then
    fetch="$OUT/fetch"
    mkdir -p "$fetch/src"
    printf '[package]\nname = "fetch-slt"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\ndatafusion-sqllogictest = "=55.2.0"\n' > "$fetch/Cargo.toml"
    echo 'fn main() {}' > "$fetch/src/main.rs"
    (cd "$fetch" && cargo fetch --quiet)
fi
FILES_DIR="$(registry_dir)/test_files"

# Files that read data from outside the crate (DataFusion's testing submodules, core test data) or
# write files where they expect other ones are left out.
files=()
for f in "$FILES_DIR"/*.slt; do
    if grep -qE "\.\./|testing/|parquet-testing|core/tests" "$f"; then
        continue
    fi
    files+=("$f")
done
echo "${#files[@]} files need no external data" >&2

summary() { grep -E '\.slt  [0-9]+ passed' | sed -E 's/ \([0-9.]+s\)$//; s#.*/test_files/##' || true; }
failures() { grep -oE 'test_files/[a-z0-9_]+\.slt:[0-9]+' | sed 's#test_files/##' | sort -u || true; }

# Every query cut into stages, however little it reads, so the distributed path is what is compared.
export SLUICE_SET=sluice.single_task_bytes=0
for mode in local local-graph local-cluster; do
    echo "== $mode" >&2
    "$SLUICE" --mode "$mode" slt "${files[@]}" > "$OUT/$mode.txt" 2>&1 || true
    tail -1 "$OUT/$mode.txt" >&2
    summary < "$OUT/$mode.txt" > "$OUT/$mode.files"
    failures < "$OUT/$mode.txt" > "$OUT/$mode.failures"
done

status=0
for mode in local-graph local-cluster; do
    if diff -u "$OUT/local.files" "$OUT/$mode.files" > "$OUT/$mode.diff" \
        && diff -u "$OUT/local.failures" "$OUT/$mode.failures" >> "$OUT/$mode.diff"; then
        echo "$mode: the same records as local mode in every file" >&2
    else
        echo "$mode differs from local mode: see $OUT/$mode.diff" >&2
        status=1
    fi
done
exit $status
