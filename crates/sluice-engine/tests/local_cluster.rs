//! Local-cluster mode (a driver and workers over gRPC and Arrow Flight on loopback) must return
//! exactly what local mode returns, retry a failed task region, fail with the task's own error when
//! retries run out, and stop everything when the caller drops the output.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use sluice_cluster::{ClusterOptions, FaultHook, TaskAttemptRef, WorkerOptions};
use sluice_engine::config::ConfigLayer;
use sluice_engine::runner::LocalClusterRunner;
use sluice_engine::tpch::answers::format_rows;
use sluice_engine::tpch::bench::{open_tpch_data, run_tpch_query};
use sluice_engine::tpch::queries::tpch_query;
use sluice_engine::{ExecutionMode, SluiceConfig, SluiceSession};

async fn session(mode: ExecutionMode, runner: Option<LocalClusterRunner>) -> SluiceSession {
    let mut config = SluiceConfig::default();
    let layer = ConfigLayer {
        mode: Some(mode),
        session: vec![(
            "datafusion.execution.target_partitions".to_string(),
            "4".to_string(),
        )],
        ..Default::default()
    };
    config.apply(layer, "test").unwrap();
    let mut session = SluiceSession::new(&config).unwrap();
    if let Some(runner) = runner {
        session.set_runner(Arc::new(runner));
    }
    open_tpch_data(&mut session, common::tpch_dir(), Some(0.01))
        .await
        .unwrap();
    session
}

fn cluster_runner(workers: usize, fault: Option<FaultHook>) -> LocalClusterRunner {
    LocalClusterRunner::with_options(ClusterOptions {
        workers,
        worker: WorkerOptions {
            fault,
            ..WorkerOptions::default()
        },
        ..ClusterOptions::default()
    })
}

async fn all_tpch_queries_match_local_mode_on(workers: usize) {
    let local = session(ExecutionMode::Local, None).await;
    let runner = cluster_runner(workers, None);
    let cluster = session(ExecutionMode::LocalCluster, Some(runner.clone())).await;
    let mut failures = Vec::new();
    for number in 1..=22u8 {
        let query = tpch_query(number, 0.01).unwrap();
        let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
        match run_tpch_query(&cluster, &query).await {
            // Every TPC-H query with more than one row orders it completely.
            Ok(batches) => {
                let actual = format_rows(&batches).unwrap();
                if actual != expected {
                    failures.push(format!(
                        "q{number}: local {} rows, local-cluster {} rows",
                        expected.len(),
                        actual.len()
                    ));
                }
            }
            Err(e) => failures.push(format!("q{number}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let snapshot = wait_idle(&runner).await;
    assert!(snapshot.is_idle(), "{snapshot:?}");
    assert_eq!(snapshot.driver.workers, workers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_tpch_queries_match_local_mode_on_2_workers() {
    all_tpch_queries_match_local_mode_on(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_tpch_queries_match_local_mode_on_4_workers() {
    all_tpch_queries_match_local_mode_on(4).await;
}

/// Waits until the cluster holds no job, task or stream (cleanup RPCs are asynchronous).
async fn wait_idle(runner: &LocalClusterRunner) -> sluice_cluster::ClusterSnapshot {
    let cluster = runner.cluster().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let snapshot = cluster.snapshot().await.unwrap();
        if snapshot.is_idle() || Instant::now() > deadline {
            return snapshot;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const Q3: u8 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_fails_once_is_retried_and_the_answer_is_right() {
    let failures = Arc::new(AtomicUsize::new(0));
    let seen = failures.clone();
    let hook: FaultHook = Arc::new(move |task: &TaskAttemptRef| {
        (task.stage == 0 && task.partition == 1 && task.attempt == 0).then(|| {
            seen.fetch_add(1, Ordering::SeqCst);
            "disk on fire".to_string()
        })
    });
    let local = session(ExecutionMode::Local, None).await;
    let runner = cluster_runner(2, Some(hook));
    let cluster = session(ExecutionMode::LocalCluster, Some(runner.clone())).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
    let actual = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
    assert_eq!(actual, expected);
    assert_eq!(
        failures.load(Ordering::SeqCst),
        1,
        "the fault hook never fired"
    );
    assert!(wait_idle(&runner).await.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_always_fails_fails_the_query_with_its_own_error() {
    let hook: FaultHook = Arc::new(|task: &TaskAttemptRef| {
        (task.stage == 0 && task.partition == 0).then(|| "disk on fire".to_string())
    });
    let runner = cluster_runner(2, Some(hook));
    let cluster = session(ExecutionMode::LocalCluster, Some(runner.clone())).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let error = run_tpch_query(&cluster, &query)
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("disk on fire"), "{error}");
    assert!(error.contains("stage 0 partition 0"), "{error}");
    assert!(error.contains("after 3 attempts"), "{error}");
    assert!(!error.contains("cancelled"), "{error}");
    assert!(wait_idle(&runner).await.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_output_stops_every_task_and_frees_every_stream() {
    let runner = cluster_runner(2, None);
    let cluster = session(ExecutionMode::LocalCluster, Some(runner.clone())).await;
    // 60k × 60k rows: minutes of work. The caller reads one batch and then stops reading, so tasks
    // block on full channels all over the cluster.
    let sql = "select a.l_orderkey, b.l_partkey from lineitem a, lineitem b";
    let statement = cluster.parse_sql(sql).unwrap().pop().unwrap();
    let plan = cluster.plan_statement(statement).await.unwrap();
    let mut stream = cluster
        .runner()
        .execute(plan, cluster.context().task_ctx())
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(60), stream.next()).await;
    assert!(
        matches!(first, Ok(Some(Ok(_)))),
        "no first batch: {first:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = runner.cluster().await.unwrap().snapshot().await.unwrap();
    assert!(
        busy.worker_tasks.iter().sum::<usize>() > 0 && busy.driver.running_tasks > 0,
        "tasks should be running: {busy:?}"
    );
    drop(stream);
    let snapshot = wait_idle(&runner).await;
    assert!(
        snapshot.is_idle(),
        "still busy 2 s after the drop: {snapshot:?}"
    );
}

async fn assert_explain_analyze_shows_every_stage(session: &SluiceSession) {
    let sql = "EXPLAIN ANALYZE SELECT o_orderpriority, count(*) FROM orders \
               JOIN lineitem ON l_orderkey = o_orderkey GROUP BY o_orderpriority";
    let (graph, _) = session.job_graph(sql).await.unwrap();
    let outputs = session.run_sql(sql).await.unwrap();
    let batches = &outputs.last().unwrap().batches;
    let text = arrow::util::pretty::pretty_format_batches(batches)
        .unwrap()
        .to_string();
    assert!(text.contains("Plan with Metrics"), "{text}");
    let earlier = graph.stages().len() - 1;
    assert!(earlier > 0, "the query should have more than one stage");
    for stage in 0..earlier {
        assert!(text.contains(&format!("Stage {stage} ")), "{text}");
    }
    assert!(text.contains("rows written; task time median"), "{text}");
    assert!(text.contains("ShuffleWriterExec"), "{text}");
    assert!(text.contains("channel_rows="), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_shows_every_stage_with_its_metrics() {
    let runner = cluster_runner(2, None);
    let cluster = session(ExecutionMode::LocalCluster, Some(runner.clone())).await;
    assert_explain_analyze_shows_every_stage(&cluster).await;
    assert!(wait_idle(&runner).await.is_idle());
    let graph = session(ExecutionMode::LocalGraph, None).await;
    assert_explain_analyze_shows_every_stage(&graph).await;
}
