//! Faults fired at named points inside workers (`sluice_runtime::faults`), in this process: a
//! producer that fails or panics mid-stream must never feed its consumers partial input, and the
//! job must still return exactly local mode's rows after its region is retried.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use sluice_cluster::{ClusterOptions, LocalClusterRunner};
use sluice_engine::session::collect_stream;
use sluice_engine::{ExecutionMode, SluiceError, SluiceSession};
use sluice_runtime::faults::{FaultPoint, FaultPoints};
use sluice_runtime::runner::LocalGraphOptions;
use sluice_runtime::{JobRunner, LocalGraphRunner, WorkerOptions};
use sluice_tpch::answers::format_rows;

use common::{session, tpch_session};

/// Per return flag and line status: rows, quantity and the largest order key. Each producer task
/// (scan + partial aggregate) sends its groups only at the end of its input, so a producer whose
/// output ends early would leave its rows out of every group.
const SQL: &str = "select l_returnflag, l_linestatus, count(*) as n, sum(l_quantity) as q, \
                   max(l_orderkey) as k from lineitem group by 1, 2 order by 1, 2";

async fn rows(session: &SluiceSession, sql: &str) -> Result<Vec<Vec<String>>, SluiceError> {
    let statement = session.parse_sql(sql).unwrap().pop().unwrap();
    let stream = session.execute_statement(statement).await?;
    let batches = collect_stream(stream).await?.batches;
    Ok(format_rows(&batches).unwrap())
}

fn armed(spec: &str) -> Arc<FaultPoints> {
    Arc::new(spec.parse().unwrap())
}

/// A local-graph session (one worker: every consumer reads its producers in the same worker)
/// whose worker holds `faults`.
async fn graph_session(faults: &Arc<FaultPoints>) -> (SluiceSession, Arc<LocalGraphRunner>) {
    let runner = Arc::new(LocalGraphRunner::with_options(LocalGraphOptions {
        worker: WorkerOptions {
            faults: Some(Arc::clone(faults)),
            ..LocalGraphOptions::default().worker
        },
        ..LocalGraphOptions::default()
    }));
    let session = tpch_session(
        ExecutionMode::LocalGraph,
        &[],
        Arc::clone(&runner) as Arc<dyn JobRunner>,
    )
    .await;
    (session, runner)
}

async fn expected() -> Vec<Vec<String>> {
    let expected = rows(&session(ExecutionMode::Local, &[]).await, SQL)
        .await
        .unwrap();
    assert_eq!(expected.len(), 4, "{expected:?}");
    expected
}

/// A local cluster of `workers` workers (over gRPC and Flight) whose workers hold `faults`.
async fn cluster_session(
    workers: usize,
    faults: &Arc<FaultPoints>,
) -> (SluiceSession, LocalClusterRunner) {
    cluster_session_with(workers, faults, &[]).await
}

/// [`cluster_session`] with session `settings`.
async fn cluster_session_with(
    workers: usize,
    faults: &Arc<FaultPoints>,
    settings: &[(&str, &str)],
) -> (SluiceSession, LocalClusterRunner) {
    let runner = LocalClusterRunner::with_options(ClusterOptions {
        workers,
        worker: WorkerOptions {
            faults: Some(Arc::clone(faults)),
            ..WorkerOptions::default()
        },
        ..ClusterOptions::default()
    });
    let session = tpch_session(
        ExecutionMode::LocalCluster,
        settings,
        Arc::new(runner.clone()),
    )
    .await;
    (session, runner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_failing_mid_stream_never_feeds_its_consumer_in_the_same_worker_partial_input() {
    let expected = expected().await;
    // One worker: the consumer (the final aggregate) reads the failed producer's stream from the
    // same worker's store. Every status report takes 300 ms to leave, so the consumer finishes
    // long before the driver hears of the producer's failure: a stream that ended cleanly after
    // the failure would let the consumer's rows, computed without that producer's groups, reach
    // the caller as approved output.
    let faults = armed("producer_mid_stream=1*error;report_before_send=delay(300)");
    let (session, runner) = cluster_session(1, &faults).await;
    assert_eq!(rows(&session, SQL).await.unwrap(), expected);
    assert_eq!(faults.fired(FaultPoint::ProducerMidStream), 1);
    let counters = runner.counters().await;
    assert_eq!(counters.regions_retried, 1, "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_that_fails_or_panics_mid_stream_is_retried_in_every_distributed_mode() {
    let expected = expected().await;
    for action in ["1*error", "1*panic"] {
        let faults = armed(&format!("producer_mid_stream={action}"));
        let (session, runner) = graph_session(&faults).await;
        assert_eq!(rows(&session, SQL).await.unwrap(), expected, "{action}");
        assert_eq!(faults.fired(FaultPoint::ProducerMidStream), 1, "{action}");
        let counters = runner.counters().await;
        assert_eq!(counters.regions_retried, 1, "{action}: {counters:?}");

        let faults = armed(&format!("producer_mid_stream={action}"));
        let (session, runner) = cluster_session(2, &faults).await;
        assert_eq!(rows(&session, SQL).await.unwrap(), expected, "{action}");
        assert_eq!(faults.fired(FaultPoint::ProducerMidStream), 1, "{action}");
        let counters = runner.counters().await;
        assert_eq!(counters.regions_retried, 1, "{action}: {counters:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_task_job_failing_mid_stream_is_retried_and_returns_local_modes_rows_once() {
    // Ordered, and many batches: the job output has taken rows of the first attempt when it fails,
    // so the second attempt's output resumes after them. (The filter keeps the sort out of the
    // scan: a scan told to read in the sort's order does not reach workers exactly, and such a
    // plan is cut instead.)
    let sql = "select l_orderkey, l_linenumber, l_quantity from lineitem where l_quantity > 0 \
               order by 1, 2";
    let expected = rows(&session(ExecutionMode::Local, &[]).await, sql)
        .await
        .unwrap();
    assert!(expected.len() > 50_000, "{} rows", expected.len());
    let faults = armed("producer_mid_stream=1*error");
    let one_task = [("sluice.single_task_bytes", "67108864")];
    let (session, runner) = cluster_session_with(2, &faults, &one_task).await;
    assert_eq!(rows(&session, sql).await.unwrap(), expected);
    assert_eq!(faults.fired(FaultPoint::ProducerMidStream), 1);
    let counters = runner.counters().await;
    // One task, run twice: its first attempt failed, its region (the task alone) ran again.
    assert_eq!(
        (counters.regions_retried, counters.tasks_started),
        (1, 2),
        "{counters:?}"
    );
}
