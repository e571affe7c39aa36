//! Local-cluster mode (a driver and workers over gRPC and Arrow Flight on loopback) must return
//! exactly what local mode returns, retry a region whose task failed for a reason another attempt
//! may not meet, fail at once (with local mode's text) on a user error, fail with the task's own
//! error when retries run out, and stop everything on every worker when the caller drops the output
//! — also while tasks are CPU-bound.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use sluice_cluster::{ClusterOptions, ClusterSnapshot, LocalClusterRunner};
use sluice_engine::session::collect_stream;
use sluice_engine::{ExecutionMode, SluiceSession, SluiceStatement};
use sluice_planner::AttemptKey;
use sluice_runtime::analyze::TaskMetrics;
use sluice_runtime::runner::LocalGraphOptions;
use sluice_runtime::worker::FaultHook;
use sluice_runtime::{JobRunner, LocalGraphRunner, WorkerOptions, stage_summaries};
use sluice_tpch::answers::format_rows;
use sluice_tpch::bench::run_tpch_query;
use sluice_tpch::queries::tpch_query;

use common::{session, tpch_session};

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

async fn cluster_session(runner: &LocalClusterRunner) -> SluiceSession {
    tpch_session(ExecutionMode::LocalCluster, &[], Arc::new(runner.clone())).await
}

async fn all_tpch_queries_match_local_mode_on(workers: usize) {
    let local = session(ExecutionMode::Local, &[]).await;
    let runner = cluster_runner(workers, None);
    let cluster = cluster_session(&runner).await;
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
    let snapshot = wait_idle(&runner, Duration::from_secs(2)).await;
    assert!(snapshot.is_idle(), "{snapshot:?}");
    assert_eq!(snapshot.driver.workers.len(), workers);
    assert_eq!(snapshot.driver.busy_slots(), vec![0; workers]);
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
async fn wait_idle(runner: &LocalClusterRunner, within: Duration) -> ClusterSnapshot {
    let cluster = runner.backend().await.unwrap();
    let deadline = Instant::now() + within;
    loop {
        let snapshot = cluster.snapshot().await.unwrap();
        if snapshot.is_idle() || Instant::now() > deadline {
            return snapshot;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Attempts started, per (stage, partition, attempt).
type Attempts = Arc<Mutex<HashMap<(usize, usize, usize), usize>>>;

/// Counts the attempts the workers start; `fail` picks the ones that fail with an injected
/// (transport) fault.
fn counting_hook(
    fail: impl Fn(&AttemptKey) -> bool + Send + Sync + 'static,
) -> (FaultHook, Attempts) {
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let counts = seen.clone();
    let hook: FaultHook = Arc::new(move |key: &AttemptKey| {
        *counts
            .lock()
            .unwrap()
            .entry((key.stage.0, key.partition, key.attempt))
            .or_insert(0) += 1;
        fail(key).then(|| "disk on fire".to_string())
    });
    (hook, seen)
}

const Q3: u8 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_fails_once_is_retried_and_the_answer_is_right() {
    let (hook, seen) =
        counting_hook(|key| key.stage.0 == 0 && key.partition == 1 && key.attempt == 0);
    let local = session(ExecutionMode::Local, &[]).await;
    let runner = cluster_runner(2, Some(hook));
    let cluster = cluster_session(&runner).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
    let actual = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
    assert_eq!(actual, expected);
    let seen = seen.lock().unwrap().clone();
    // The failed attempt ran once, and its region ran again as attempt 1, every task of it.
    assert_eq!(seen.get(&(0, 1, 0)), Some(&1), "{seen:?}");
    assert_eq!(seen.get(&(0, 1, 1)), Some(&1), "{seen:?}");
    assert!(seen.keys().all(|(_, _, attempt)| *attempt <= 1), "{seen:?}");
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// The rows of `sql` run on `session`, each cell formatted (NULL as `NULL`).
async fn rows_of(session: &SluiceSession, sql: &str) -> Vec<Vec<String>> {
    let outputs = session.run_sql(sql).await.unwrap();
    format_rows(&outputs.last().unwrap().batches).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sluice_tables_show_a_retried_jobs_every_attempt_with_its_metrics() {
    let (hook, seen) =
        counting_hook(|key| key.stage.0 == 0 && key.partition == 1 && key.attempt == 0);
    let runner = cluster_runner(2, Some(hook));
    let cluster = cluster_session(&runner).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let answer = run_tpch_query(&cluster, &query).await.unwrap();
    let answer_rows: usize = answer.iter().map(|b| b.num_rows()).sum();
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
    let job = rows_of(
        &cluster,
        "select job_id, state, rows, retries, stages, tasks, error from sluice.jobs",
    )
    .await;
    assert_eq!(job.len(), 1, "{job:?}");
    let (stages, tasks) = (job[0][4].clone(), job[0][5].clone());
    assert_eq!(
        job[0][..4],
        ["1", "succeeded", &answer_rows.to_string(), "1"],
        "{job:?}"
    );
    assert_eq!(job[0][6], "NULL");

    let attempts = rows_of(
        &cluster,
        "select stage, partition, attempt, state, error, rows, ended_ms >= started_ms, \
         worker_id is not null from sluice.tasks where job_id = 1 order by stage, partition, attempt",
    )
    .await;
    let keys: Vec<(usize, usize, usize)> = attempts
        .iter()
        .map(|r| {
            (
                r[0].parse().unwrap(),
                r[1].parse().unwrap(),
                r[2].parse().unwrap(),
            )
        })
        .collect();
    let mut started: Vec<(usize, usize, usize)> = seen.lock().unwrap().keys().copied().collect();
    started.sort();
    // One row per attempt placed: every one a worker started, and those stopped before they
    // started (cancelled with their region).
    for key in &started {
        assert_eq!(
            keys.iter().filter(|k| *k == key).count(),
            1,
            "{key:?}: {keys:?}"
        );
    }
    for (row, key) in attempts.iter().zip(&keys) {
        assert!(started.contains(key) || row[3] == "cancelled", "{row:?}");
    }
    let failed: Vec<&Vec<String>> = attempts.iter().filter(|r| r[3] == "failed").collect();
    assert_eq!(failed.len(), 1, "{attempts:?}");
    assert_eq!(failed[0][..3], ["0", "1", "0"]);
    assert!(failed[0][4].contains("disk on fire"), "{failed:?}");
    // Rows are what a succeeded attempt reported; the others did not finish.
    assert!(
        attempts.iter().all(|r| r[3] == "succeeded" || r[5] == "0"),
        "{attempts:?}"
    );
    // Each task succeeded with its last attempt; the failed one's region partners before it were
    // stopped (or had finished).
    let last_attempt = |stage: usize, partition: usize| {
        keys.iter()
            .filter(|k| (k.0, k.1) == (stage, partition))
            .map(|k| k.2)
            .max()
    };
    for (row, (stage, partition, attempt)) in attempts.iter().zip(&keys) {
        let expected: &[&str] = if Some(*attempt) == last_attempt(*stage, *partition) {
            &["succeeded"]
        } else if (*stage, *partition) == (0, 1) {
            &["failed"]
        } else {
            // Stopped with its region, or done before the region failed.
            &["cancelled", "succeeded"]
        };
        assert!(expected.contains(&row[3].as_str()), "{row:?}");
        assert_eq!(row[6..], ["true", "true"], "{row:?}");
    }
    let last_ones = keys
        .iter()
        .filter(|k| Some(k.2) == last_attempt(k.0, k.1))
        .count();
    assert_eq!(last_ones.to_string(), tasks, "{attempts:?}");

    // Per stage: the rows its tasks' last attempts wrote and the most one of them wrote, as
    // `sluice.stages` sums them; the final stage's are the answer's.
    let stage_count: usize = stages.parse().unwrap();
    let mut expected_stages = Vec::new();
    for stage in 0..stage_count {
        let rows: Vec<u64> = attempts
            .iter()
            .zip(&keys)
            .filter(|(_, k)| k.0 == stage && Some(k.2) == last_attempt(k.0, k.1))
            .map(|(r, _)| r[5].parse().unwrap())
            .collect();
        let partitions = keys.iter().filter(|k| k.0 == stage && k.2 == 0).count();
        let attempts_of_stage = keys.iter().filter(|k| k.0 == stage).count();
        expected_stages.push(vec![
            stage.to_string(),
            partitions.to_string(),
            partitions.to_string(),
            attempts_of_stage.to_string(),
            rows.iter().sum::<u64>().to_string(),
            rows.iter().max().unwrap().to_string(),
        ]);
    }
    assert_eq!(
        expected_stages.last().unwrap()[4],
        answer_rows.to_string(),
        "{attempts:?}"
    );
    let per_stage = rows_of(
        &cluster,
        "select stage, tasks, succeeded, attempts, rows, task_rows_max from sluice.stages \
         where job_id = 1 order by stage",
    )
    .await;
    assert_eq!(per_stage, expected_stages);
    // The two workers and the driver's own executor, all idle.
    let workers = rows_of(
        &cluster,
        "select count(*), sum(running_tasks), count(*) filter (where address = 'driver') \
         from sluice.workers",
    )
    .await;
    assert_eq!(workers, vec![vec!["3", "0", "1"]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_always_fails_fails_the_query_with_its_own_error() {
    let (hook, seen) = counting_hook(|key| key.stage.0 == 0 && key.partition == 0);
    let runner = cluster_runner(2, Some(hook));
    let cluster = cluster_session(&runner).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let error = run_tpch_query(&cluster, &query)
        .await
        .unwrap_err()
        .to_string();
    // "job 1: stage 0 partition 0 failed on worker 2 (127.0.0.1:…) after 4 attempts (attempt 0:
    //  stage 0 partition 0: injected fault in … attempt 0: disk on fire; …) caused by External
    //  error: injected fault in job 1 stage 0 partition 0 attempt 3: disk on fire"
    assert!(
        error.starts_with("job 1: stage 0 partition 0 failed on worker "),
        "{error}"
    );
    let history: Vec<String> = (0..4)
        .map(|n| {
            format!(
                "attempt {n}: stage 0 partition 0: injected fault in job 1 stage 0 partition 0 \
                 attempt {n}: disk on fire"
            )
        })
        .collect();
    let expected = format!(
        " after 4 attempts ({}) caused by External error: injected fault in job 1 stage 0 \
         partition 0 attempt 3: disk on fire",
        history.join("; ")
    );
    assert!(error.contains(&expected), "{error}");
    assert!(!error.contains("cancelled"), "{error}");
    let seen = seen.lock().unwrap().clone();
    for attempt in 0..4 {
        assert_eq!(seen.get(&(0, 0, attempt)), Some(&1), "{seen:?}");
    }
    assert_eq!(seen.get(&(0, 0, 4)), None, "{seen:?}");
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_consumer_of_blocking_outputs_rereads_them_without_recomputing_its_producers() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let final_stage = Arc::new(AtomicUsize::new(usize::MAX));
    let fail_at = final_stage.clone();
    let (hook, seen) = counting_hook(move |key| {
        key.stage.0 == fail_at.load(Ordering::SeqCst) && key.partition == 0 && key.attempt == 0
    });
    let local = session(ExecutionMode::Local, &[]).await;
    let runner = cluster_runner(2, Some(hook));
    let cluster = cluster_session(&runner).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let sql = &query.statements[query.result_statement];
    let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
    let Some(SluiceStatement::Sql(statement)) = cluster.parse_sql(sql).unwrap().pop() else {
        panic!("one statement");
    };
    let plan = cluster.plan_statement(statement).await.unwrap();
    let options = sluice_planner::JobGraphOptions {
        exchange_mode: sluice_planner::OutputMode::Blocking,
        ..Default::default()
    };
    let graph = sluice_planner::JobGraph::try_new_with(plan, &options).unwrap();
    // Every stage is a region of its own: the final one runs after all others succeeded.
    assert!(graph.topology().regions().len() >= graph.stages().len());
    final_stage.store(graph.final_stage().0, Ordering::SeqCst);
    let stream = runner
        .backend()
        .await
        .unwrap()
        .execute(graph, cluster.context().task_ctx());
    let batches = collect_stream(stream).await.unwrap().batches;
    assert_eq!(format_rows(&batches).unwrap(), expected);
    let seen = seen.lock().unwrap().clone();
    let last = final_stage.load(Ordering::SeqCst);
    assert_eq!(
        seen.get(&(last, 0, 1)),
        Some(&1),
        "the final task ran again: {seen:?}"
    );
    // Its producers ran once: their blocking outputs were read again, not recomputed.
    assert!(
        seen.iter()
            .filter(|((stage, _, _), _)| *stage != last)
            .all(|((_, _, attempt), n)| *attempt == 0 && *n == 1),
        "{seen:?}"
    );
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// The error text of `sql` in `session`.
async fn error_of(session: &SluiceSession, sql: &str) -> String {
    let statement = session.parse_sql(sql).unwrap().pop().unwrap();
    let stream = session.execute_statement(statement).await.unwrap();
    collect_stream(stream).await.unwrap_err().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_error_on_a_worker_reads_as_in_local_mode_and_its_task_runs_once() {
    let sql = "select l_orderkey / (l_partkey - l_partkey) from lineitem";
    let local = error_of(&session(ExecutionMode::Local, &[]).await, sql).await;
    // The session names the table a data error came from, in every mode alike.
    assert!(local.starts_with("reading table 'lineitem' ("), "{local}");
    assert!(
        local.ends_with(") caused by Arrow error: Divide by zero error"),
        "{local}"
    );

    let (hook, seen) = counting_hook(|_| false);
    let runner = cluster_runner(2, Some(hook));
    assert_eq!(error_of(&cluster_session(&runner).await, sql).await, local);
    assert!(
        seen.lock()
            .unwrap()
            .keys()
            .all(|(_, _, attempt)| *attempt == 0)
    );

    let (hook, graph_seen) = counting_hook(|_| false);
    let graph_runner = LocalGraphRunner::with_options(LocalGraphOptions {
        worker: WorkerOptions {
            fault: Some(hook),
            ..LocalGraphOptions::default().worker
        },
        ..LocalGraphOptions::default()
    });
    let graph = tpch_session(ExecutionMode::LocalGraph, &[], Arc::new(graph_runner)).await;
    assert_eq!(error_of(&graph, sql).await, local);
    let graph_seen = graph_seen.lock().unwrap().clone();
    assert!(!graph_seen.is_empty());
    assert!(
        graph_seen
            .iter()
            .all(|((_, _, attempt), n)| *attempt == 0 && *n == 1),
        "{graph_seen:?}"
    );
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_output_stops_every_task_and_frees_every_stream() {
    let runner = cluster_runner(2, None);
    let cluster = cluster_session(&runner).await;
    // 60k × 60k rows: minutes of work. The caller reads one batch and then stops reading, so tasks
    // block on full channels all over the cluster.
    let sql = "select a.l_orderkey, b.l_partkey from lineitem a, lineitem b";
    let Some(SluiceStatement::Sql(statement)) = cluster.parse_sql(sql).unwrap().pop() else {
        panic!("one statement");
    };
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
    let busy = runner.backend().await.unwrap().snapshot().await.unwrap();
    assert!(
        busy.worker_tasks.iter().sum::<usize>() > 0 && busy.driver.running_tasks > 0,
        "tasks should be running: {busy:?}"
    );
    drop(stream);
    let snapshot = wait_idle(&runner, Duration::from_secs(2)).await;
    assert!(
        snapshot.is_idle(),
        "still busy 2 s after the drop: {snapshot:?}"
    );
}

/// The CPU-bound cross join of the cancellation requirement: minutes of nested-loop work.
const CROSS_JOIN: &str = "select count(*) from generate_series(1, 200000) a, \
                          generate_series(1, 200000) b where a.value + b.value = 7";

/// Starts `CROSS_JOIN` in `session`, waits until its tasks run, drops it, and returns how long the
/// system took to have no task running and no stream held (`idle` says when), or the state left.
async fn cancel_cross_join<F, Fut>(session: &SluiceSession, idle: F) -> Duration
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = (bool, String)>,
{
    let statement = session.parse_sql(CROSS_JOIN).unwrap().pop().unwrap();
    let mut stream = session.execute_statement(statement).await.unwrap();
    // Poll it for a while: the tasks start and burn CPU.
    let polled = tokio::time::timeout(Duration::from_millis(1500), stream.next()).await;
    assert!(polled.is_err(), "the cross join ended early: {polled:?}");
    let (is_idle, state) = idle().await;
    assert!(!is_idle, "nothing runs before the drop: {state}");
    let dropped = Instant::now();
    drop(stream);
    loop {
        let (is_idle, state) = idle().await;
        if is_idle {
            return dropped.elapsed();
        }
        assert!(
            dropped.elapsed() < Duration::from_secs(1),
            "tasks still run 1 s after the job was dropped: {state}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_bound_job_stops_on_every_worker_within_a_second_of_its_cancellation() {
    let runner = cluster_runner(2, None);
    let cluster = cluster_session(&runner).await;
    let handle = runner.clone();
    let took = cancel_cross_join(&cluster, || {
        let handle = handle.clone();
        async move {
            let snapshot = handle.backend().await.unwrap().snapshot().await.unwrap();
            (snapshot.is_idle(), format!("{snapshot:?}"))
        }
    })
    .await;
    eprintln!("local-cluster: idle {took:?} after the drop");

    let graph_runner = LocalGraphRunner::default();
    let graph = tpch_session(
        ExecutionMode::LocalGraph,
        &[],
        Arc::new(graph_runner.clone()),
    )
    .await;
    let took = cancel_cross_join(&graph, || {
        let handle = graph_runner.clone();
        async move {
            let (driver, workers) = handle.backend().await.unwrap().snapshot().await.unwrap();
            let idle = driver.jobs == 0
                && driver.running_tasks == 0
                && workers
                    .iter()
                    .all(|(tasks, store)| *tasks == 0 && store.outputs == 0);
            (idle, format!("{driver:?} {workers:?}"))
        }
    })
    .await;
    eprintln!("local-graph: idle {took:?} after the drop");
}

async fn assert_explain_analyze_shows_every_stage(session: &SluiceSession) {
    let sql = "EXPLAIN ANALYZE SELECT o_orderpriority, count(*) FROM orders \
               JOIN lineitem ON l_orderkey = o_orderkey GROUP BY o_orderpriority";
    let graph = session.job_graph(sql).await.unwrap();
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
    // Each earlier stage's row: its tasks, rows and time per task (the skew), its totals.
    let rows = format_rows(batches).unwrap();
    let row = |title: &str| -> String {
        let found: Vec<&Vec<String>> = rows.iter().filter(|r| r[0] == title).collect();
        assert_eq!(found.len(), 1, "{title}: {text}");
        found[0][1].clone()
    };
    for (index, stage) in graph.stages().iter().enumerate().take(earlier) {
        let report = row(&format!("Stage {index}"));
        let tasks = stage.partitions();
        assert!(
            report.starts_with(&format!("{tasks} tasks; rows per task ")),
            "{report}"
        );
        assert!(report.contains("; time per task "), "{report}");
        assert!(report.contains("\nwritten: "), "{report}");
        assert!(report.contains("; peak memory "), "{report}");
    }
    assert!(text.contains(" (skew "), "{text}");
    let job = row("Job");
    assert!(
        job.starts_with(&format!(
            "{} stages (the final one included), ",
            graph.stages().len()
        )),
        "{job}"
    );
    assert!(text.contains("ShuffleWriterExec"), "{text}");
    assert!(text.contains("channel_rows="), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_shows_every_stage_with_its_metrics() {
    let runner = cluster_runner(2, None);
    let cluster = cluster_session(&runner).await;
    assert_explain_analyze_shows_every_stage(&cluster).await;
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
    let graph = session(ExecutionMode::LocalGraph, &[]).await;
    assert_explain_analyze_shows_every_stage(&graph).await;
}

/// Every task's structured metrics, read from the driver's records: rows and batches leave a stage
/// as many as its readers take in, bytes read (local plus over Flight) are the bytes written, the
/// scans read every row of the table once, and an aggregating task's memory peak is measured.
async fn task_metrics_balance_on(mode: ExecutionMode, runner: Arc<dyn JobRunner>) {
    let session = tpch_session(mode, &[], Arc::clone(&runner)).await;
    // Each stage boundary here is read once per row (no broadcast), so the sums must meet.
    let sql = "select n_regionkey, count(*) from nation group by n_regionkey order by 1";
    let rows = rows_of(&session, sql).await;
    assert_eq!(rows.len(), 5, "{rows:?}");
    let job = newest_job(runner.as_ref()).await;
    let summaries = stage_summaries(&job.stage_tasks, &job.attempts);
    let last = summaries.len() - 1;
    assert!(last >= 1, "{:?}", job.stage_inputs);
    for (stage, inputs) in job.stage_inputs.iter().enumerate() {
        if inputs.is_empty() {
            continue;
        }
        assert!(
            inputs.iter().all(|(_, mode)| *mode != "Broadcast"),
            "{inputs:?}"
        );
        let read = &summaries[stage].totals;
        let written: TaskMetrics = inputs.iter().map(|(i, _)| &summaries[*i].totals).sum();
        assert_eq!(
            (read.input_rows, read.input_batches),
            (written.rows, written.batches),
            "stage {stage} of {mode:?}"
        );
        assert_eq!(
            read.read_local_bytes + read.read_remote_bytes,
            written.shuffled_bytes,
            "stage {stage} of {mode:?}"
        );
        assert!(written.shuffled_bytes > 0, "stage {stage} of {mode:?}");
    }
    let scanned: u64 = summaries.iter().map(|s| s.totals.scanned_rows).sum();
    assert_eq!(scanned, 25, "nation's rows, each scanned once");
    // The final stage writes the answer's 5 rows to the job output.
    assert_eq!(summaries[last].totals.rows, 5);
    // Aggregating stages reserve memory for their hash tables.
    let peak = summaries.iter().map(|s| s.totals.peak_memory_bytes).max();
    assert!(peak > Some(0), "{summaries:?}");
    // Every attempt succeeded once, so each stage's totals count each of its tasks once.
    assert!(job.attempts.iter().all(|a| a.state.name() == "succeeded"));
    assert_eq!(job.attempts.len(), job.stage_tasks.iter().sum::<usize>());
    let remote: u64 = summaries.iter().map(|s| s.totals.read_remote_bytes).sum();
    if mode == ExecutionMode::LocalGraph {
        assert_eq!(remote, 0, "one in-process worker reads nothing over Flight");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_metrics_balance_between_stages_in_local_graph_mode() {
    let runner: Arc<dyn JobRunner> = Arc::new(LocalGraphRunner::default());
    task_metrics_balance_on(ExecutionMode::LocalGraph, runner).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_metrics_balance_between_stages_on_a_two_worker_cluster() {
    let runner: Arc<dyn JobRunner> = Arc::new(cluster_runner(2, None));
    task_metrics_balance_on(ExecutionMode::LocalCluster, runner).await;
}

/// The newest ended job's records on `runner`'s driver.
async fn newest_job(runner: &dyn JobRunner) -> sluice_runtime::JobRecord {
    let driver = runner.driver().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let jobs = driver.jobs().await.unwrap();
        let newest = jobs.into_iter().max_by_key(|j| j.job);
        if let Some(job) = newest.filter(|j| j.ended_ms.is_some() && !j.attempts.is_empty()) {
            return job;
        }
        assert!(Instant::now() < deadline, "the job never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_task_of_a_distributed_scan_reads_one_equal_share_of_its_row_groups() {
    // Byte ranges for these small files too, as DataFusion cuts large ones: four ranges of equal
    // bytes over lineitem's four files (one row group each) end a few bytes into the next file,
    // whose row group the range then takes, so one partition would read two files and another
    // none. Distributed, each of the four tasks reads one whole file.
    let settings = [("datafusion.optimizer.repartition_file_min_size", "0")];
    let local = session(ExecutionMode::Local, &settings).await;
    let scan = "select l_quantity from lineitem where l_quantity > 5";
    let Some(SluiceStatement::Sql(statement)) = local.parse_sql(scan).unwrap().pop() else {
        panic!("one statement");
    };
    let plan = local.plan_statement(statement).await.unwrap();
    let text = datafusion::physical_plan::displayable(plan.as_ref())
        .indent(true)
        .to_string();
    assert!(
        text.contains("part-2.parquet:0.."),
        "DataFusion's ranges cut into a file: {text}"
    );

    let runner = cluster_runner(2, None);
    let cluster = tpch_session(
        ExecutionMode::LocalCluster,
        &settings,
        Arc::new(runner.clone()),
    )
    .await;
    let sql = "select l_returnflag, count(*), sum(l_quantity) from lineitem \
               where l_quantity > 5 group by l_returnflag order by 1";
    assert_eq!(rows_of(&cluster, sql).await, rows_of(&local, sql).await);
    let job = newest_job(&runner).await;
    let mut scanned: Vec<u64> = job
        .attempts
        .iter()
        .filter(|a| a.attempt.task.stage.0 == 0)
        .map(|a| a.metrics.scanned_rows)
        .collect();
    scanned.sort_unstable();
    let mut files: Vec<u64> = (0..4)
        .map(|part| {
            use datafusion::parquet::file::reader::{FileReader, SerializedFileReader};
            let path = common::tpch_dir().join(format!("lineitem/part-{part}.parquet"));
            let reader = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
            assert_eq!(reader.metadata().num_row_groups(), 1);
            reader.metadata().file_metadata().num_rows() as u64
        })
        .collect();
    files.sort_unstable();
    assert_eq!(scanned, files, "each task scanned exactly one file");
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// A fact table of keys 0..100,000 in row groups of 1,000 rows (sorted, so each row group holds a
/// narrow key range) and a dimension whose 21 `hot` keys fall in row groups 50 to 52.
async fn runtime_filter_tables(dir: &std::path::Path) {
    let ctx = datafusion::prelude::SessionContext::new();
    let copies = [
        format!(
            "COPY (SELECT value AS k, value % 7 AS v FROM generate_series(0, 99999)) \
             TO '{}/fact/part-0.parquet' STORED AS PARQUET \
             OPTIONS ('format.max_row_group_size' '1000')",
            dir.display()
        ),
        format!(
            "COPY (SELECT value * 100 AS k, CASE WHEN value BETWEEN 500 AND 520 THEN 'hot' \
             ELSE 'cold' END AS tag FROM generate_series(0, 999)) \
             TO '{}/dim/part-0.parquet' STORED AS PARQUET",
            dir.display()
        ),
    ];
    for copy in copies {
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    }
}

/// Settings that make every equi-join a partitioned one: no side is broadcast.
const PARTITIONED_JOINS: [(&str, &str); 2] = [
    (
        "datafusion.optimizer.hash_join_single_partition_threshold",
        "0",
    ),
    (
        "datafusion.optimizer.hash_join_single_partition_threshold_rows",
        "0",
    ),
];

/// Partitioned joins that stay partitioned when their build side finishes small.
const PARTITIONED_JOINS_KEPT: [(&str, &str); 3] = [
    PARTITIONED_JOINS[0],
    PARTITIONED_JOINS[1],
    ("sluice.broadcast_join_switch", "false"),
];

async fn runtime_filter_session(
    dir: &std::path::Path,
    mode: ExecutionMode,
    runner: Arc<dyn JobRunner>,
    settings: &[(&str, &str)],
) -> SluiceSession {
    let mut session = SluiceSession::new(&common::config(mode, settings), runner).unwrap();
    for table in ["fact", "dim"] {
        session
            .register_table(sluice_engine::catalog::TableSource {
                name: table.to_string(),
                location: dir.join(table).display().to_string(),
                format: sluice_engine::catalog::TableFormat::Parquet,
                extension: ".parquet".to_string(),
            })
            .await
            .unwrap();
    }
    session
}

/// A local cluster of 2 workers with blocking exchanges whose workers fail attempts by `hook`.
fn blocking_cluster_failing_by(hook: FaultHook) -> LocalClusterRunner {
    LocalClusterRunner::with_options(ClusterOptions {
        workers: 2,
        exchange: sluice_planner::OutputMode::Blocking,
        worker: WorkerOptions {
            fault: Some(hook),
            ..WorkerOptions::default()
        },
        ..ClusterOptions::default()
    })
}

/// How many runtime filters the job graph of `sql` has.
/// `EXPLAIN ANALYZE` of `sql` on `session`, rendered.
async fn explain_analyze(session: &SluiceSession, sql: &str) -> String {
    let outputs = session
        .run_sql(&format!("EXPLAIN ANALYZE {sql}"))
        .await
        .unwrap();
    arrow::util::pretty::pretty_format_batches(&outputs.last().unwrap().batches)
        .unwrap()
        .to_string()
}

async fn runtime_filters_of(session: &SluiceSession, sql: &str) -> usize {
    session
        .job_graph(sql)
        .await
        .unwrap()
        .runtime_filters()
        .len()
}

/// The rows every scan of the newest job on `runner` read, summed.
async fn rows_scanned_by_newest_job(runner: &dyn JobRunner) -> u64 {
    let job = newest_job(runner).await;
    let summaries = stage_summaries(&job.stage_tasks, &job.attempts);
    summaries.iter().map(|s| s.totals.scanned_rows).sum()
}

/// The rows a `SELECT` returns, formatted.
async fn formatted(session: &SluiceSession, sql: &str) -> Vec<Vec<String>> {
    let outputs = session.run_sql(sql).await.unwrap();
    format_rows(&outputs.last().unwrap().batches).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_scan_in_another_stage_skips_the_row_groups_a_finished_build_side_rules_out() {
    let dir = tempfile::tempdir().unwrap();
    runtime_filter_tables(dir.path()).await;
    let sql = "SELECT count(*), sum(f.v) FROM fact f JOIN dim d ON f.k = d.k WHERE d.tag = 'hot'";
    let local = runtime_filter_session(
        dir.path(),
        ExecutionMode::Local,
        common::runner(ExecutionMode::Local),
        &PARTITIONED_JOINS,
    )
    .await;
    let expected = formatted(&local, sql).await;
    assert_eq!(expected, [["21", "63"]], "the 21 hot keys and their values");

    // The first attempt of one source task and of one target task fails (set once the graph is
    // known): the summary comes from the source's retried attempt, and the target's retried
    // attempt runs the filtered plan too.
    use std::sync::atomic::{AtomicUsize, Ordering};
    let failing = Arc::new([AtomicUsize::new(usize::MAX), AtomicUsize::new(usize::MAX)]);
    let fail_at = Arc::clone(&failing);
    let (hook, seen) = counting_hook(move |key| {
        key.partition == 0
            && key.attempt == 0
            && fail_at
                .iter()
                .any(|s| s.load(Ordering::SeqCst) == key.stage.0)
    });
    let runner = blocking_cluster_failing_by(hook);
    // The build side finishes small, but the join stays partitioned: the probe scan runs in its
    // own stage.
    let cluster = runtime_filter_session(
        dir.path(),
        ExecutionMode::LocalCluster,
        Arc::new(runner.clone()),
        &PARTITIONED_JOINS_KEPT,
    )
    .await;
    // The join's build side (the dim scan) filters its probe side's producer (the fact scan).
    let graph = cluster.job_graph(sql).await.unwrap();
    let [filter] = graph.runtime_filters() else {
        panic!("one runtime filter: {:?}", graph.runtime_filters());
    };
    // A stage's plan and the plans of the stages it reads, rendered.
    fn scan_text(graph: &sluice_planner::JobGraph, stage: sluice_planner::StageId) -> String {
        let stage = graph.stage(stage).unwrap();
        let mut text = datafusion::physical_plan::displayable(stage.plan.as_ref())
            .indent(false)
            .to_string();
        for input in &stage.inputs {
            text.push_str(&scan_text(graph, input.stage));
        }
        text
    }
    let scan_text = |stage| scan_text(&graph, stage);
    assert!(
        scan_text(filter.source).contains("dim/part-0.parquet"),
        "{}",
        scan_text(filter.source)
    );
    assert!(
        scan_text(filter.target).contains("fact/part-0.parquet"),
        "{}",
        scan_text(filter.target)
    );
    assert!(filter.target_path.is_empty(), "{filter:?}");

    failing[0].store(filter.source.0, Ordering::SeqCst);
    failing[1].store(filter.target.0, Ordering::SeqCst);
    assert_eq!(formatted(&cluster, sql).await, expected);
    let retried = seen.lock().unwrap().clone();
    for stage in [filter.source.0, filter.target.0] {
        assert_eq!(retried.get(&(stage, 0, 1)), Some(&1), "{retried:?}");
    }
    failing[0].store(usize::MAX, Ordering::SeqCst);
    failing[1].store(usize::MAX, Ordering::SeqCst);
    let job = newest_job(&runner).await;
    let summaries = stage_summaries(&job.stage_tasks, &job.attempts);
    // Without the filter the fact scan reads all 100,000 rows; with it, the three row groups
    // that hold hot keys (the succeeded attempts' count; the failed one read nothing).
    let scanned = summaries[filter.target.0].totals.scanned_rows;
    assert_eq!(scanned, 3000, "fact rows scanned");

    // EXPLAIN ANALYZE names the filter the scan stage got, and the scan's pruning.
    let text = explain_analyze(&cluster, sql).await;
    let hot: Vec<String> = (500..=520).map(|k| (k * 100).to_string()).collect();
    let note = format!(
        "runtime filter: k@0 >= 50000 AND k@0 <= 52000 AND k@0 IN (SET) ([{}]) (from stage {}, \
         for HashJoinExec Inner on (k@0 = k@0) in stage",
        hot.join(", "),
        filter.source
    );
    assert!(text.contains(&note), "{note}\n{text}");
    // The fact scan's 100 row groups, 97 of them skipped by their statistics.
    assert!(
        text.contains("row_groups_pruned_statistics=100 total → 3 matched"),
        "{text}"
    );

    // Joins of other types and keys, and a limit under the probe side: with partitioned joins
    // (this session) and broadcast ones (the default threshold), the answers are local mode's.
    let hot = "(SELECT k, tag, CASE WHEN k % 300 = 0 THEN NULL ELSE k % 7 END AS v FROM dim \
               WHERE tag = 'hot')";
    let queries = [
        format!("SELECT count(*) FROM fact WHERE k IN (SELECT k FROM {hot} h)"),
        format!(
            "SELECT count(*) FROM fact WHERE NOT EXISTS (SELECT 1 FROM {hot} h WHERE h.k = fact.k)"
        ),
        format!("SELECT count(*) FROM fact WHERE k NOT IN (SELECT k FROM {hot} h)"),
        format!("SELECT count(*), count(f.k) FROM {hot} h LEFT JOIN fact f ON f.k = h.k"),
        format!("SELECT count(*), count(h.k) FROM {hot} h RIGHT JOIN fact f ON f.k = h.k"),
        format!("SELECT count(*), sum(f.v) FROM fact f JOIN {hot} h ON f.k = h.k AND f.v = h.v"),
        format!(
            "SELECT count(*) FROM (SELECT * FROM fact ORDER BY k LIMIT 5000) f \
             JOIN {hot} h ON f.k = h.k"
        ),
    ];
    let broadcast = runtime_filter_session(
        dir.path(),
        ExecutionMode::LocalCluster,
        Arc::new(runner.clone()),
        &[],
    )
    .await;
    let mut filtered = 0;
    for query in &queries {
        let expected = formatted(&local, query).await;
        for session in [&cluster, &broadcast] {
            assert_eq!(formatted(session, query).await, expected, "{query}");
            filtered += runtime_filters_of(session, query).await;
        }
    }
    assert!(filtered >= 8, "runtime filters in these jobs: {filtered}");
    // A broadcast join's filter goes above its probe side in the join's own stage, and down into
    // the fact scan there: the dim table and three row groups of the fact table are read.
    assert_eq!(formatted(&broadcast, sql).await, expected);
    let scanned = rows_scanned_by_newest_job(&runner).await;
    assert_eq!(scanned, 1000 + 3000, "dim and fact rows scanned");

    // Turning dynamic filters off turns runtime filters off: the scan reads every row.
    let unfiltered = runtime_filter_session(
        dir.path(),
        ExecutionMode::LocalCluster,
        Arc::new(runner.clone()),
        &PARTITIONED_JOINS,
    )
    .await;
    unfiltered
        .run_sql("SET datafusion.optimizer.enable_dynamic_filter_pushdown = false")
        .await
        .unwrap();
    assert_eq!(runtime_filters_of(&unfiltered, sql).await, 0);
    assert_eq!(formatted(&unfiltered, sql).await, expected);
    let scanned = rows_scanned_by_newest_job(&runner).await;
    assert_eq!(scanned, 100_000 + 1000, "every fact and dim row");

    // With pipelined exchanges the probe scan does not wait for its build side: the filter is
    // sent to it while it runs (what it skips then depends on when the filter arrives).
    let pipelined = runtime_filter_session(
        dir.path(),
        ExecutionMode::LocalGraph,
        common::runner(ExecutionMode::LocalGraph),
        &PARTITIONED_JOINS,
    )
    .await;
    assert_eq!(runtime_filters_of(&pipelined, sql).await, 1);
    assert_eq!(formatted(&pipelined, sql).await, expected);
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// A build side of 500 keys spread over the probe keys' whole range: its bounds rule out nothing,
/// too many keys to list, so the probe side in another stage drops what the union of the build
/// tasks' Bloom filters rules out; with `sluice.runtime_filter_bloom` off it keeps the bounds only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_side_of_many_keys_filters_its_probe_side_by_a_bloom_filter() {
    let dir = tempfile::tempdir().unwrap();
    runtime_filter_tables(dir.path()).await;
    let sql = "SELECT count(*), sum(f.v) FROM fact f JOIN dim d ON f.k = d.k WHERE d.k % 200 = 0";
    let local = runtime_filter_session(
        dir.path(),
        ExecutionMode::Local,
        common::runner(ExecutionMode::Local),
        &PARTITIONED_JOINS,
    )
    .await;
    let expected = formatted(&local, sql).await;
    // Keys 0, 200, ..., 99,800 of the fact table; k % 7 summed over them.
    let sum: i64 = (0..500).map(|i| (i * 200) % 7).sum();
    assert_eq!(expected, [["500".to_string(), sum.to_string()]]);

    let runner = LocalClusterRunner::with_options(ClusterOptions {
        workers: 2,
        exchange: sluice_planner::OutputMode::Blocking,
        ..ClusterOptions::default()
    });
    let cluster = runtime_filter_session(
        dir.path(),
        ExecutionMode::LocalCluster,
        Arc::new(runner.clone()),
        &PARTITIONED_JOINS_KEPT,
    )
    .await;
    let graph = cluster.job_graph(sql).await.unwrap();
    let [filter] = graph.runtime_filters() else {
        panic!("one runtime filter: {:?}", graph.runtime_filters());
    };
    let target = filter.target.0;
    // The rows the fact scan's stage sent on to the join, over its tasks.
    let sent_rows = |job: &sluice_runtime::JobRecord| {
        stage_summaries(&job.stage_tasks, &job.attempts)[target]
            .totals
            .rows
    };

    assert_eq!(formatted(&cluster, sql).await, expected);
    // Every build task saw about 250 keys: each listed them, but 500 are too many to list.
    assert_eq!(
        sent_rows(&newest_job(&runner).await),
        500,
        "fact rows after the filter"
    );
    let text = explain_analyze(&cluster, sql).await;
    let note = format!(
        "runtime filter: k@0 >= 0 AND k@0 <= 99800 AND (k@0) IN BLOOM FILTER (8 KiB, 500 rows) \
         (from stage {}, for HashJoinExec Inner on (k@0 = k@0) in stage",
        filter.source
    );
    assert!(text.contains(&note), "{note}\n{text}");

    cluster
        .run_sql("SET sluice.runtime_filter_bloom = false")
        .await
        .unwrap();
    assert_eq!(formatted(&cluster, sql).await, expected);
    // The bounds keep keys 0..=99,800.
    assert_eq!(
        sent_rows(&newest_job(&runner).await),
        99_801,
        "fact rows after the bounds"
    );
    let text = explain_analyze(&cluster, sql).await;
    let note = format!(
        "runtime filter: k@0 >= 0 AND k@0 <= 99800 (from stage {}",
        filter.source
    );
    assert!(
        text.contains(&note) && !text.contains("BLOOM"),
        "{note}\n{text}"
    );
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// A fact table of 200,000 rows in four files, 90 % of them on key 7 (the rest on keys ending in
/// 9), and a dimension holding keys 0..1,000 once each. No column is written in order, so no
/// scan keeps its files' order.
async fn skewed_tables(dir: &std::path::Path) {
    let ctx = datafusion::prelude::SessionContext::new();
    let mut copies: Vec<String> = (0..4)
        .map(|part| {
            format!(
                "COPY (SELECT CASE WHEN value % 10 < 9 THEN 7 ELSE value % 1000 END AS k, \
                 (value * 7919) % 200000 AS v FROM generate_series({}, {})) \
                 TO '{}/fact/part-{part}.parquet' STORED AS PARQUET",
                part * 50_000,
                part * 50_000 + 49_999,
                dir.display()
            )
        })
        .collect();
    copies.push(format!(
        "COPY (SELECT (value * 7) % 1000 AS k, (value * 7) % 1000 * 3 AS w \
         FROM generate_series(0, 999)) TO '{}/dim/part-0.parquet' STORED AS PARQUET",
        dir.display()
    ));
    for copy in copies {
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    }
}

/// The input rows of each succeeded task of `stage` in the newest job on `runner`, largest first.
async fn input_rows_of_stage(runner: &dyn JobRunner, stage: sluice_planner::StageId) -> Vec<u64> {
    let job = newest_job(runner).await;
    let mut rows: Vec<u64> = job
        .attempts
        .iter()
        .filter(|a| {
            a.attempt.task.stage == stage && a.state == sluice_runtime::TaskRecordState::Succeeded
        })
        .map(|a| a.metrics.input_rows)
        .collect();
    rows.sort_unstable_by(|a, b| b.cmp(a));
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sorted_parquet_file_is_scanned_on_workers_and_keeps_its_order() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = datafusion::prelude::SessionContext::new();
    // Written in `k` order: DataFusion records the order in the file and relies on it.
    for (table, range) in [("fact", "0, 49999"), ("dim", "0, 999")] {
        let copy = format!(
            "COPY (SELECT value AS k, value * 3 AS v FROM generate_series({range})) \
             TO '{}/{table}/part-0.parquet' STORED AS PARQUET",
            dir.path().display()
        );
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    }
    let local = runtime_filter_session(
        dir.path(),
        ExecutionMode::Local,
        common::runner(ExecutionMode::Local),
        &[],
    )
    .await;
    let runner = blocking_cluster_failing_by(Arc::new(|_: &AttemptKey| None::<String>));
    let cluster = runtime_filter_session(
        dir.path(),
        ExecutionMode::LocalCluster,
        Arc::new(runner.clone()),
        &[],
    )
    .await;
    // The scan declares the file's order; its stage runs on a worker.
    let sql = "SELECT k, v FROM fact WHERE k % 7 = 3 ORDER BY k";
    let graph = cluster.job_graph(sql).await.unwrap();
    let scans: Vec<String> = graph
        .stages()
        .iter()
        .map(|stage| {
            let text = datafusion::physical_plan::displayable(stage.plan.as_ref())
                .indent(false)
                .to_string();
            format!("{:?}: {text}", stage.placement)
        })
        .filter(|text| text.contains("fact/part-0.parquet"))
        .collect();
    assert_eq!(scans.len(), 1, "{scans:?}");
    assert!(scans[0].starts_with("Worker: "), "{scans:?}");
    assert!(scans[0].contains("output_ordering=[k@0 ASC"), "{scans:?}");
    // Its rows come back in local mode's order (the plan may rely on the file's order).
    let expected = formatted(&local, sql).await;
    assert_eq!(expected.len(), 7143);
    assert_eq!(formatted(&cluster, sql).await, expected);
    let top = "SELECT f.k, d.v FROM fact f JOIN dim d ON f.k = d.k ORDER BY f.k DESC LIMIT 3";
    assert_eq!(
        formatted(&cluster, top).await,
        [["999", "2997"], ["998", "2994"], ["997", "2991"]]
    );
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// The join of the skewed tables, whose stage is the final one (its tasks stream the job's output).
const SKEWED_ROWS_SQL: &str = "SELECT f.v, d.w FROM fact f JOIN dim d ON f.k = d.k";
/// An aggregate over that join.
const SKEWED_TOTALS_SQL: &str =
    "SELECT count(*), sum(f.v), sum(d.w) FROM fact f JOIN dim d ON f.k = d.k";

/// The skewed tables, local mode's answers over them, and a blocking cluster of 2 whose workers
/// fail the first attempt of every task of the stage `fail_stage` holds (none until it is set).
struct SkewedJoinFixture {
    _dir: tempfile::TempDir,
    /// Local mode's rows of `SKEWED_ROWS_SQL`, sorted.
    expected_rows: Vec<Vec<String>>,
    /// Local mode's answer to `SKEWED_TOTALS_SQL`.
    expected_totals: Vec<Vec<String>>,
    fail_stage: Arc<std::sync::atomic::AtomicUsize>,
    seen: Attempts,
    runner: LocalClusterRunner,
    cluster: SluiceSession,
}

impl SkewedJoinFixture {
    async fn new(settings: &[(&str, &str)]) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dir = tempfile::tempdir().unwrap();
        skewed_tables(dir.path()).await;
        let local = runtime_filter_session(
            dir.path(),
            ExecutionMode::Local,
            common::runner(ExecutionMode::Local),
            settings,
        )
        .await;
        let mut expected_rows = formatted(&local, SKEWED_ROWS_SQL).await;
        expected_rows.sort();
        assert_eq!(expected_rows.len(), 200_000);
        let expected_totals = formatted(&local, SKEWED_TOTALS_SQL).await;
        let fail_stage = Arc::new(AtomicUsize::new(usize::MAX));
        let fail_at = Arc::clone(&fail_stage);
        let (hook, seen) = counting_hook(move |key| {
            key.attempt == 0 && fail_at.load(Ordering::SeqCst) == key.stage.0
        });
        let runner = blocking_cluster_failing_by(hook);
        let cluster = runtime_filter_session(
            dir.path(),
            ExecutionMode::LocalCluster,
            Arc::new(runner.clone()),
            settings,
        )
        .await;
        Self {
            _dir: dir,
            expected_rows,
            expected_totals,
            fail_stage,
            seen,
            runner,
            cluster,
        }
    }

    /// The one join of `sql`, with its build and probe producer stages.
    async fn join_of(&self, sql: &str) -> (sluice_planner::SkewJoin, StageIdPair) {
        let graph = self.cluster.job_graph(sql).await.unwrap();
        let [join] = graph.skew_joins() else {
            panic!("one candidate: {:?}", graph.skew_joins());
        };
        let inputs = &graph.stage(join.stage).unwrap().inputs;
        let stages = (
            inputs[join.build_input].stage,
            inputs[join.probe_input].stage,
        );
        (join.clone(), stages)
    }

    /// Runs `SKEWED_ROWS_SQL` with the first attempt of every task of `stage` failing, checks
    /// its rows against local mode's and that each of the stage's 4 tasks ran twice.
    async fn rows_right_when_first_attempts_of(&self, stage: sluice_planner::StageId) {
        use std::sync::atomic::Ordering;
        self.fail_stage.store(stage.0, Ordering::SeqCst);
        let mut rows = formatted(&self.cluster, SKEWED_ROWS_SQL).await;
        rows.sort();
        self.fail_stage.store(usize::MAX, Ordering::SeqCst);
        assert!(
            rows == self.expected_rows,
            "the join's rows differ from local mode's"
        );
        let retried = self.seen.lock().unwrap().clone();
        for partition in 0..4 {
            assert_eq!(
                retried.get(&(stage.0, partition, 1)),
                Some(&1),
                "task {partition} ran again: {retried:?}"
            );
        }
    }

    /// The rows of `SKEWED_ROWS_SQL` now equal local mode's.
    async fn assert_rows_right(&self) {
        let mut rows = formatted(&self.cluster, SKEWED_ROWS_SQL).await;
        rows.sort();
        assert!(
            rows == self.expected_rows,
            "the join's rows differ from local mode's"
        );
    }

    /// `EXPLAIN ANALYZE` of `SKEWED_TOTALS_SQL`, rendered, after checking its answer.
    async fn analyzed_totals(&self) -> String {
        assert_eq!(
            formatted(&self.cluster, SKEWED_TOTALS_SQL).await,
            self.expected_totals
        );
        let outputs = self
            .cluster
            .run_sql(&format!("EXPLAIN ANALYZE {SKEWED_TOTALS_SQL}"))
            .await
            .unwrap();
        arrow::util::pretty::pretty_format_batches(&outputs.last().unwrap().batches)
            .unwrap()
            .to_string()
    }
}

/// A join's (build, probe) producer stages.
type StageIdPair = (sluice_planner::StageId, sluice_planner::StageId);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_join_partition_is_split_across_tasks_even_when_their_first_attempts_fail() {
    // The build side (1,000 rows) would be broadcast: the join stays partitioned here.
    let settings = [
        PARTITIONED_JOINS_KEPT[0],
        PARTITIONED_JOINS_KEPT[1],
        PARTITIONED_JOINS_KEPT[2],
        ("sluice.skew_join_min_rows", "1000"),
    ];
    let fixture = SkewedJoinFixture::new(&settings).await;
    let (join, (_, probe)) = fixture.join_of(SKEWED_ROWS_SQL).await;
    let graph = fixture.cluster.job_graph(SKEWED_ROWS_SQL).await.unwrap();
    assert_eq!(join.stage, graph.final_stage());
    assert_eq!(graph.stage(probe).unwrap().partitions(), 4);

    fixture.rows_right_when_first_attempts_of(join.stage).await;
    // 180,000 probe rows share one channel; its four producers' pieces went to four tasks, so
    // no task read more than a quarter of them plus its own channel and the build rows.
    let runner = &fixture.runner;
    let split = input_rows_of_stage(runner, join.stage).await;
    assert_eq!(split.len(), 4, "{split:?}");
    assert!(split[0] < 60_000, "input rows per task: {split:?}");
    assert!(split[3] > 45_000, "input rows per task: {split:?}");

    // An aggregate over the join, and EXPLAIN ANALYZE saying what was split.
    let text = fixture.analyzed_totals().await;
    assert_eq!(text.matches("skew split: partition ").count(), 1, "{text}");
    assert!(
        text.contains("each reading its build rows too (over 4 times the median partition and 1000 rows), for HashJoinExec Inner on (k@0 = k@0)"),
        "{text}"
    );

    // Switched off, one task reads the whole hot channel.
    fixture
        .cluster
        .run_sql("SET sluice.skew_join_split = false")
        .await
        .unwrap();
    fixture.assert_rows_right().await;
    let unsplit = input_rows_of_stage(runner, join.stage).await;
    assert!(unsplit[0] > 180_000, "input rows per task: {unsplit:?}");
    assert!(wait_idle(runner, Duration::from_secs(2)).await.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_join_whose_build_side_finished_small_becomes_a_broadcast_join_even_when_its_first_attempts_fail()
 {
    let fixture = SkewedJoinFixture::new(&PARTITIONED_JOINS).await;
    let runner = &fixture.runner;
    let (join, (build, probe)) = fixture.join_of(SKEWED_ROWS_SQL).await;
    // The dim scan is the build side; its keys filter the fact scan, which waits for it.
    let graph = fixture.cluster.job_graph(SKEWED_ROWS_SQL).await.unwrap();
    assert_eq!(graph.runtime_filters().len(), 1);
    assert_eq!(graph.runtime_filters()[0].target, probe);
    assert_eq!(graph.stage(probe).unwrap().partitions(), 4);

    fixture.rows_right_when_first_attempts_of(join.stage).await;
    // The probe rows were never shuffled: the fact scan's stage wrote nothing, and the join's
    // tasks scanned the fact table and read the 1,000 build rows each.
    let job = newest_job(runner).await;
    let summaries = stage_summaries(&job.stage_tasks, &job.attempts);
    let (producer, joined) = (&summaries[probe.0].totals, &summaries[join.stage.0].totals);
    assert_eq!((producer.rows, producer.scanned_rows), (0, 0));
    assert_eq!(joined.scanned_rows, 200_000);
    assert_eq!(joined.input_rows, 4 * 1000);
    assert_eq!(summaries[build.0].totals.rows, 1000);

    // An aggregate over the join, and EXPLAIN ANALYZE saying what was switched.
    let text = fixture.analyzed_totals().await;
    assert_eq!(text.matches("broadcast switch: ").count(), 1, "{text}");
    // The probe side's runtime filter went with its scan into the join's tasks (the probe stage's
    // own plan is empty).
    assert!(
        text.contains("FilterExec: k@0 >= 0 AND k@0 <= 999, metrics="),
        "{text}"
    );
    assert!(text.contains("EmptyExec"), "{text}");
    let (join, (build, probe)) = fixture.join_of(SKEWED_TOTALS_SQL).await;
    assert!(
        text.contains(&format!(
            "broadcast switch: stage {build} finished with 1000 rows ("
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "bytes, at most 10485760 may be broadcast); every task reads all of it and runs stage \
             {probe}'s plan in place of reading its shuffled rows, for HashJoinExec Inner on \
             (k@0 = k@0) in stage {}",
            join.stage
        )),
        "{text}"
    );

    // Switched off, the fact rows go through the shuffle.
    fixture
        .cluster
        .run_sql("SET sluice.broadcast_join_switch = false")
        .await
        .unwrap();
    fixture.assert_rows_right().await;
    let job = newest_job(runner).await;
    let summaries = stage_summaries(&job.stage_tasks, &job.attempts);
    let (_, (_, probe)) = fixture.join_of(SKEWED_ROWS_SQL).await;
    assert_eq!(summaries[probe.0].totals.rows, 200_000);
    assert!(wait_idle(runner, Duration::from_secs(2)).await.is_idle());
}

/// A two-worker local cluster with blocking exchanges, a TPC-H (SF 0.01) session on it, and a
/// local-mode session to compare with.
async fn blocking_tpch_sessions() -> (LocalClusterRunner, SluiceSession, SluiceSession) {
    let runner = LocalClusterRunner::with_options(ClusterOptions {
        workers: 2,
        exchange: sluice_planner::OutputMode::Blocking,
        ..ClusterOptions::default()
    });
    let cluster = tpch_session(ExecutionMode::LocalCluster, &[], Arc::new(runner.clone())).await;
    let local = session(ExecutionMode::Local, &[]).await;
    (runner, cluster, local)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_shows_the_runtime_filters_of_tpch_joins_with_blocking_exchanges() {
    let (runner, cluster, local) = blocking_tpch_sessions().await;
    for number in [5, 9, 17, 18, 21] {
        let query = tpch_query(number, 0.01).unwrap();
        let sql = &query.statements[query.result_statement];
        let graph = cluster.job_graph(sql).await.unwrap();
        let filters = graph.runtime_filters().len();
        assert!(filters >= 2, "q{number}: {filters} runtime filters");
        let text = explain_analyze(&cluster, sql).await;
        // One line per filter, each a predicate over the probe keys with the stage it came from
        // (a filter whose build side held no key is `false`).
        let applied = text.matches("runtime filter: ").count();
        let with_source = text.matches(" (from stage ").count();
        assert_eq!(
            (applied, with_source),
            (filters, filters),
            "q{number}:\n{text}"
        );
        assert!(
            text.contains("row_groups_pruned_statistics="),
            "q{number}:\n{text}"
        );
        // And the answer is local mode's.
        let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
        let answer = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
        assert_eq!(answer, expected, "q{number}");
    }
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// With pipelined exchanges every stage runs at once: each filter's summary goes to its target's
/// running tasks when its source finished. EXPLAIN ANALYZE says so for each, and the answers stay
/// local mode's (how many rows a filter drops depends on when it arrives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_shows_the_runtime_filters_sent_to_running_tasks_with_pipelined_exchanges()
{
    let runner = LocalClusterRunner::with_options(ClusterOptions {
        workers: 2,
        ..ClusterOptions::default()
    });
    let cluster = tpch_session(ExecutionMode::LocalCluster, &[], Arc::new(runner.clone())).await;
    let local = session(ExecutionMode::Local, &[]).await;
    for number in [5, 9, 17, 18, 21] {
        let query = tpch_query(number, 0.01).unwrap();
        let sql = &query.statements[query.result_statement];
        let graph = cluster.job_graph(sql).await.unwrap();
        let filters = graph.runtime_filters();
        assert!(!filters.is_empty(), "q{number}: no runtime filter");
        assert!(
            filters
                .iter()
                .all(|f| f.delivery == sluice_planner::FilterDelivery::WhileRunning),
            "q{number}: {filters:?}"
        );
        let text = explain_analyze(&cluster, sql).await;
        // Sent to the workers running the target's tasks, or to none if they all finished first.
        let sent = text.matches(" running its tasks").count()
            + text
                .matches(", not sent: no task of the stage still ran")
                .count();
        assert_eq!(sent, filters.len(), "q{number}:\n{text}");
        let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
        let answer = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
        assert_eq!(answer, expected, "q{number}");
    }
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// q18's semi join (`o_orderkey IN` the orders whose lineitems sum to over 300) probes the inner
/// join of customer, orders and lineitem. Its build side's keys follow `o_orderkey` down through
/// that join into the stage before, and there through the customer join to the orders scan, so
/// that stage writes only the orders the subquery kept (2 at SF 0.01) before lineitem is joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semi_joins_keys_filter_the_scan_below_the_inner_join_it_probes() {
    let (runner, cluster, local) = blocking_tpch_sessions().await;
    let query = tpch_query(18, 0.01).unwrap();
    let sql = &query.statements[query.result_statement];
    let graph = cluster.job_graph(sql).await.unwrap();
    let explained = sluice_planner::explain::explain_text(&graph);
    let semi: Vec<_> = graph
        .runtime_filters()
        .iter()
        .filter(|f| f.join.contains("RightSemi"))
        .collect();
    let [semi] = semi[..] else {
        panic!("one semi join filter:\n{explained}");
    };
    let text = |plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>| {
        datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string()
    };
    // Not in the semi join's stage: on top of the orders scan, over its first column, o_orderkey.
    let target = &graph.stages()[semi.target.0].plan;
    assert!(!text(target).contains("RightSemi"), "{explained}");
    let node =
        sluice_planner::job_graph::runtime_filters::node_at(target, &semi.target_path).unwrap();
    assert!(
        text(&node).starts_with("DataSourceExec")
            && text(&node).contains("projection=[o_orderkey, o_custkey"),
        "{semi:?}\n{explained}"
    );
    assert_eq!(semi.target_columns, [0], "{explained}");

    let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
    let answer = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
    assert_eq!(answer, expected);
    let job = newest_job(&runner).await;
    let summaries = stage_summaries(&job.stage_tasks, &job.attempts);
    assert_eq!(
        (
            summaries[semi.source.0].totals.rows,
            summaries[semi.target.0].totals.rows
        ),
        (2, 2),
        "{explained}"
    );
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

/// `sluice.single_task_bytes` at 64 MiB: every TPC-H query at SF 0.01 (3.5 MB) runs as one task.
const SINGLE_TASK: [(&str, &str); 1] = [("sluice.single_task_bytes", "67108864")];

/// A 2-worker cluster whose workers run `hook`, with local mode beside it, both over the TPC-H
/// data; the cluster's session runs small jobs as one task ([`SINGLE_TASK`]).
async fn single_task_sessions(
    hook: FaultHook,
) -> (SluiceSession, LocalClusterRunner, SluiceSession) {
    let local = session(ExecutionMode::Local, &[]).await;
    let runner = cluster_runner(2, Some(hook));
    let cluster = tpch_session(
        ExecutionMode::LocalCluster,
        &SINGLE_TASK,
        Arc::new(runner.clone()),
    )
    .await;
    (local, runner, cluster)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_tpch_jobs_run_as_one_task_each_with_the_answers_of_local_mode() {
    let (hook, seen) = counting_hook(|_| false);
    let (local, runner, cluster) = single_task_sessions(hook).await;
    for number in 1..=22u8 {
        let query = tpch_query(number, 0.01).unwrap();
        let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
        let actual = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
        assert_eq!(actual, expected, "q{number}");
    }
    // One attempt of one task (stage 0, partition 0) per job, and no other.
    let jobs = runner.driver().unwrap().jobs().await.unwrap();
    assert!(jobs.len() >= 22, "{} jobs", jobs.len());
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, HashMap::from([((0, 0, 0), jobs.len())]));
    assert!(wait_idle(&runner, Duration::from_secs(2)).await.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_task_job_whose_first_attempt_fails_is_retried_and_the_answer_is_right() {
    let (hook, seen) = counting_hook(|key| key.attempt == 0);
    let (local, _runner, cluster) = single_task_sessions(hook).await;
    let query = tpch_query(Q3, 0.01).unwrap();
    let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
    let actual = format_rows(&run_tpch_query(&cluster, &query).await.unwrap()).unwrap();
    assert_eq!(actual, expected);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, HashMap::from([((0, 0, 0), 1), ((0, 0, 1), 1)]));
}

/// The first line and the stage lines of `EXPLAIN DISTRIBUTED sql` in `session`.
async fn explained(session: &SluiceSession, sql: &str) -> (String, Vec<String>) {
    let text = rows_of(session, &format!("EXPLAIN DISTRIBUTED {sql}"))
        .await
        .concat()
        .join("\n");
    let stages = text
        .lines()
        .filter(|l| l.starts_with("Stage "))
        .map(str::to_string)
        .collect();
    (text.lines().next().unwrap_or_default().to_string(), stages)
}

/// The first line of `EXPLAIN DISTRIBUTED` of q3 in `session`, and its count of stages.
async fn explained_q3(session: &SluiceSession) -> (String, usize) {
    let query = tpch_query(Q3, 0.01).unwrap();
    let (first, stages) = explained(session, &query.statements[query.result_statement]).await;
    (first, stages.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_distributed_says_a_job_runs_as_one_task_and_one_byte_less_cuts_it() {
    let small = session(ExecutionMode::LocalCluster, &SINGLE_TASK).await;
    let (first, stages) = explained_q3(&small).await;
    assert_eq!(stages, 1, "{first}");
    let read: u64 = first
        .strip_prefix("Single task: the scans read ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{first}"));
    // Every byte of customer's, orders' and lineitem's files, each read once.
    let files: u64 = ["customer", "orders", "lineitem"]
        .iter()
        .flat_map(|table| std::fs::read_dir(common::tpch_dir().join(table)).unwrap())
        .map(|entry| entry.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(read, files, "{first}");
    let at_limit = read.to_string();
    let exact = session(
        ExecutionMode::LocalCluster,
        &[("sluice.single_task_bytes", at_limit.as_str())],
    )
    .await;
    assert_eq!(explained_q3(&exact).await.1, 1);
    let below = (read - 1).to_string();
    let cut = session(
        ExecutionMode::LocalCluster,
        &[("sluice.single_task_bytes", below.as_str())],
    )
    .await;
    let (first, stages) = explained_q3(&cut).await;
    assert!(first.starts_with("Stage 0: "), "{first}");
    assert!(stages > 1, "{stages}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_plan_that_cannot_reach_a_worker_exactly_is_cut_and_only_that_stage_runs_on_the_driver()
 {
    // A Float16 literal travels as a Float32: the scan's stage cannot leave the driver, and run
    // whole, the job would run there.
    let sql = "select l_returnflag, count(*) as n from lineitem \
               where arrow_cast(l_linenumber, 'Float16') > arrow_cast(2.5, 'Float16') \
               group by 1 order by 1";
    let small = session(ExecutionMode::LocalCluster, &SINGLE_TASK).await;
    let (first, stages) = explained(&small, sql).await;
    assert!(first.starts_with("Stage 0: placement=Driver"), "{first}");
    assert_eq!(stages.len(), 3, "{stages:?}");
    assert!(
        stages[1..].iter().all(|s| s.contains("placement=Worker")),
        "{stages:?}"
    );
    let local = session(ExecutionMode::Local, &[]).await;
    assert_eq!(rows_of(&small, sql).await, rows_of(&local, sql).await);
}
