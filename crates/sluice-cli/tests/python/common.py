"""What the client suites share: the server's state (through its `sluice.state` Flight action) and
the TPC-H query files (SLUICE_TPCH_QUERIES: qNN.sql, statements separated by lines holding only ';').
"""

import json
import os
import pathlib
import threading
import time

import pyarrow.flight

QUERIES = pathlib.Path(os.environ["SLUICE_TPCH_QUERIES"])

CLUSTER_URL = os.environ["SLUICE_FLIGHT_SQL"]


def server_state(url=CLUSTER_URL):
    """The server's `sluice.state` action: sessions, statements, the driver's jobs, each worker."""
    client = pyarrow.flight.FlightClient(url)
    try:
        [result] = list(client.do_action(pyarrow.flight.Action("sluice.state", b"")))
        return json.loads(result.body.to_pybytes())
    finally:
        client.close()


def tasks_running(state):
    return state["driver"]["running_tasks"] + sum(
        w["running_tasks"] + w["live_attempts"] for w in state["workers"]
    )


def wait_until(condition, seconds, what):
    """Polls the server state until `condition(state)`; returns the seconds it took."""
    start = time.monotonic()
    while True:
        state = server_state()
        if condition(state):
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, f"{what} after {seconds} s: {state}"
        time.sleep(0.02)


def holds_no_work(state):
    """No job, task, stream output, pending statement or reserved memory on the driver or a worker."""
    return (
        state["driver"]["jobs"] == 0
        and tasks_running(state) == 0
        and state["pending_statements"] == 0
        and state["running_statements"] == 0
        and all(w["stream_outputs"] == 0 and w["memory_used"] == 0 for w in state["workers"])
    )


def statements_of(number):
    text = (QUERIES / f"q{number:02}.sql").read_text()
    return [s.strip() for s in text.split("\n;\n") if s.strip()]


def query_index(statements):
    """Where the query is among a TPC-H query's statements (q15 creates and drops a view)."""
    return next(i for i, s in enumerate(statements) if s.lower().lstrip().startswith(("select", "with")))


# Minutes of work in many short steps: 5 billion rows through a shuffle into a distinct count (a
# nested-loop join would not do: DataFusion checks for cancellation between its batches, and one
# batch of a non-matching join filter can take seconds).
LONG_QUERY = "select count(distinct value % 1000003) from generate_series(1, 5000000000)"


def workers_busy(state):
    return sum(w["running_tasks"] for w in state["workers"][1:]) > 0


def cancel_long_query(run_long, cancel, error_type):
    """Runs `run_long` (LONG_QUERY on the cluster) in a thread, calls `cancel` once workers run its
    tasks and asserts every task and job is gone within a second. Returns the errors `run_long`
    raised (of `error_type`) and the seconds the cluster took to go idle."""
    assert server_state()["mode"] == "cluster"
    failures = []

    def run():
        try:
            run_long()
        except error_type as error:
            failures.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(workers_busy, 30, "no worker task ran")
    cancel()
    took = wait_until(lambda s: tasks_running(s) == 0 and s["driver"]["jobs"] == 0, 1.0, "tasks still ran")
    thread.join(10)
    assert not thread.is_alive()
    print(f"idle {took:.3f} s after the cancel")
    return failures
