#!/usr/bin/env python3
"""Chaos run: every TPC-H query on a fresh `--mode cluster` cluster, one worker killed mid-query.

For each query it starts `sluice --mode cluster --workers N tpch run -q Q --compare-local --json F`,
waits until the N workers joined (the job starts right after), sleeps a random fraction of the
query's time measured on an undisturbed run, and sends SIGKILL (or SIGSTOP) to one worker process.
The query must still return exactly local mode's rows. It prints one line per query (the delay, the
time from the signal to the query's end, the workers lost and regions and tasks retried) and ends
with `N passed, M failed`; the exit code is 1 when any query failed.

    scripts/chaos.py --data /path/to/sf1 [--signal KILL|STOP] [--exchange pipelined|blocking]
                     [--workers 3] [--queries 1,5,9] [--seed 7] [--sluice target/release/sluice]

Only the standard library is used.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time


def worker_pids(parent):
    """The `sluice worker` processes whose parent is `parent`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state not in ("Z", "X") and b"worker" in argv:
            pids.append(int(entry))
    return sorted(pids)


def try_kill(pid, sig):
    """Sends `sig` to `pid`; False when it is gone already."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def run_query(args, query, disturb, iterations=1):
    """Runs one query; `disturb(client)` runs once the workers joined (the job starts then).

    Returns (the query's JSON report or None, stdout, stderr lines, exit code, what disturb said).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        command = [
            args.sluice, "--mode", "cluster", "--workers", str(args.workers),
            "--exchange", args.exchange, "tpch", "run", "--data", args.data,
            "-q", str(query), "--iterations", str(iterations), "--compare-local",
            "--json", report_path,
        ]
        # Worker join lines go to the log (target sluice::cluster, info), not to the terminal.
        env = dict(os.environ, SLUICE_LOG="sluice::cluster=info")
        client = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        stderr = client.stderr
        client.stderr = None  # read by the thread below only (communicate reads stdout)
        lines = []
        joined = threading.Event()

        def read_stderr():
            for line in stderr:
                lines.append(line.rstrip("\n"))
                if sum(" joined the driver at " in l for l in lines) >= args.workers:
                    joined.set()
            joined.set()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        outcome = {}
        if joined.wait(timeout=120) and client.poll() is None:
            outcome = disturb(client) or {}
        try:
            stdout, _ = client.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # A hung query: stop the client and its workers, and report it as failed.
            for pid in worker_pids(client.pid):
                try_kill(pid, signal.SIGKILL)
            client.kill()
            stdout, _ = client.communicate()
            lines.append(f"chaos: timed out after {args.timeout} s")
        finally:
            victim = outcome.get("signalled")
            if victim is not None:
                try_kill(victim, signal.SIGKILL)  # a stopped worker cannot see its stdin close
        reader.join(timeout=5)
        report = None
        if os.path.exists(report_path):
            with open(report_path) as f:
                report = json.load(f)["queries"][0]
        return report, stdout, lines, client.returncode, outcome


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="directory written by `sluice tpch gen`")
    parser.add_argument("--sluice", default="target/release/sluice", help="the sluice binary")
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    parser.add_argument("--exchange", choices=["pipelined", "blocking"], default="pipelined")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--queries", default="all", help="comma-separated numbers, or all")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per query")
    args = parser.parse_args()
    if not os.path.isfile(args.sluice):
        sys.exit(f"error: no sluice binary at {args.sluice} (build it, or pass --sluice)")
    if not os.path.isdir(args.data):
        sys.exit(f"error: no TPC-H data directory at {args.data}")
    queries = range(1, 23) if args.queries == "all" else [int(q) for q in args.queries.split(",")]
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP
    print(f"chaos: SIG{args.signal} one of {args.workers} workers per query, "
          f"{args.exchange} exchanges, seed {seed}", flush=True)
    print(f"{'query':<6} {'undisturbed':>11} {'signal at':>9} {'done after':>10}  "
          f"{'lost':>4} {'regions':>7} {'tasks':>5}  result", flush=True)
    passed = failed = 0
    totals = [0, 0, 0]
    for query in queries:
        # Two undisturbed iterations: the first includes starting the cluster, the second not.
        baseline, _, lines, code, _ = run_query(args, query, lambda client: None, iterations=2)
        if baseline is None or code != 0:
            failed += 1
            print(f"q{query:<5} undisturbed run failed (exit {code}):", flush=True)
            print("\n".join("  " + l for l in lines[-10:]), flush=True)
            continue
        undisturbed = baseline["seconds"][1]
        startup = max(baseline["seconds"][0] - undisturbed, 0.0)
        delay = rng.uniform(0.1, 0.9) * undisturbed

        def disturb(client, delay=delay):
            time.sleep(delay)
            pids = worker_pids(client.pid)
            if not pids:
                return {"signalled": None}
            victim = rng.choice(pids)
            if not try_kill(victim, sig):
                return {"signalled": None}
            return {"signalled": victim}

        report, stdout, lines, code, outcome = run_query(args, query, disturb)
        ok = report is not None and code == 0 and report.get("error") is None \
            and report.get("matches_local") is True
        if ok:
            passed += 1
        else:
            failed += 1
        if report is not None:
            counts = (report["workers_lost"], report["regions_retried"], report["tasks_retried"])
            # The query's time includes starting the cluster (estimated from the undisturbed run).
            done_after = max(report["seconds"][0] - startup - delay, 0.0) if report["seconds"] \
                else float("nan")
        else:
            counts, done_after = (0, 0, 0), float("nan")
        totals = [t + c for t, c in zip(totals, counts)]
        what = "same as local" if ok else "FAILED"
        if outcome.get("signalled") is None:
            what += " (no worker to signal: the query ended first)"
        print(f"q{query:<5} {undisturbed:>10.3f}s {delay:>8.3f}s {done_after:>9.3f}s  "
              f"{counts[0]:>4} {counts[1]:>7} {counts[2]:>5}  {what}", flush=True)
        if not ok:
            print(stdout, flush=True)
            print("\n".join("  " + l for l in lines[-20:]), flush=True)
    print(f"retried: {totals[0]} workers lost, {totals[1]} regions, {totals[2]} tasks", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    sys.exit(0 if failed == 0 else 1)


if __name__ == "__main__":
    main()
