//! The job graph run by the driver on an in-process worker (`local-graph`) must return exactly what
//! local mode returns.
//!
//! TPC-H SF 0.01 (4 files per large table, 4 target partitions) for all 22 queries, every task
//! running from its decoded wire form; each distributed-correctness rewrite with a query that is
//! wrong without it; EXPLAIN snapshots.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, displayable};
use sluice_engine::session::collect_stream;
use sluice_engine::{ExecutionMode, SluiceSession, SluiceStatement};
use sluice_planner::explain::explain_text;
use sluice_planner::{JobGraph, JobGraphOptions};
use sluice_runtime::LocalGraphRunner;
use sluice_tpch::answers::format_rows;
use sluice_tpch::bench::run_tpch_query;
use sluice_tpch::queries::tpch_query;

use common::{session, tpch_session};

/// A local-graph session whose runner the test also drives directly (graphs it built itself).
async fn graph_session(settings: &[(&str, &str)]) -> (SluiceSession, LocalGraphRunner) {
    let runner = LocalGraphRunner::default();
    let session = tpch_session(
        ExecutionMode::LocalGraph,
        settings,
        Arc::new(runner.clone()),
    )
    .await;
    (session, runner)
}

async fn rows(session: &SluiceSession, sql: &str) -> Vec<Vec<String>> {
    let outputs = session.run_sql(sql).await.unwrap();
    format_rows(&outputs.last().unwrap().batches).unwrap()
}

async fn try_run_graph(
    (session, runner): &(SluiceSession, LocalGraphRunner),
    plan: Arc<dyn ExecutionPlan>,
    apply_rewrites: bool,
) -> Result<Vec<Vec<String>>, String> {
    let options = JobGraphOptions {
        apply_rewrites,
        ..JobGraphOptions::default()
    };
    let graph = JobGraph::try_new_with(plan, &options).map_err(|e| e.to_string())?;
    let local = runner.backend().await.unwrap();
    let stream = local.driver().execute(graph, session.context().task_ctx());
    let batches = collect_stream(stream)
        .await
        .map_err(|e| e.to_string())?
        .batches;
    Ok(format_rows(&batches).unwrap())
}

async fn run_graph(
    (session, runner): &(SluiceSession, LocalGraphRunner),
    plan: Arc<dyn ExecutionPlan>,
    apply_rewrites: bool,
) -> Vec<Vec<String>> {
    let options = JobGraphOptions {
        apply_rewrites,
        ..JobGraphOptions::default()
    };
    let graph = JobGraph::try_new_with(plan, &options).unwrap();
    let local = runner.backend().await.unwrap();
    let stream = local.driver().execute(graph, session.context().task_ctx());
    let batches: Vec<RecordBatch> = collect_stream(stream).await.unwrap().batches;
    format_rows(&batches).unwrap()
}

async fn physical_plan(session: &SluiceSession, sql: &str) -> Arc<dyn ExecutionPlan> {
    let Some(SluiceStatement::Sql(statement)) = session.parse_sql(sql).unwrap().pop() else {
        panic!("not a DataFusion statement: {sql}");
    };
    session.plan_statement(statement).await.unwrap()
}

fn sorted(mut rows: Vec<Vec<String>>) -> Vec<Vec<String>> {
    rows.sort();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_tpch_queries_match_local_mode() {
    let local = session(ExecutionMode::Local, &[]).await;
    let graph = session(ExecutionMode::LocalGraph, &[]).await;
    let mut failures = Vec::new();
    for number in 1..=22u8 {
        let query = tpch_query(number, 0.01).unwrap();
        let expected = format_rows(&run_tpch_query(&local, &query).await.unwrap()).unwrap();
        let actual = format_rows(&run_tpch_query(&graph, &query).await.unwrap()).unwrap();
        // Every TPC-H query with more than one row orders it completely.
        if expected != actual {
            failures.push(format!(
                "q{number}: local {} rows, local-graph {} rows; first difference {:?}",
                expected.len(),
                actual.len(),
                expected.iter().zip(&actual).find(|(e, a)| e != a)
            ));
        }
        assert!(
            !expected.is_empty() || number == 15,
            "q{number} returned no rows"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `repartition_joins = false` makes DataFusion plan every hash join collect-left.
const COLLECT_LEFT: &[(&str, &str)] = &[("datafusion.optimizer.repartition_joins", "false")];

const LEFT_JOIN: &str = "select c_custkey, count(o_orderkey) as orders \
     from customer left join orders on c_custkey = o_custkey and o_totalprice > 300000 \
     group by c_custkey order by c_custkey";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn left_join_with_a_collect_left_build_side_is_rewritten_and_correct() {
    let local = session(ExecutionMode::Local, COLLECT_LEFT).await;
    let graph_and_runner = graph_session(COLLECT_LEFT).await;
    let graph = &graph_and_runner.0;
    let plan = physical_plan(graph, LEFT_JOIN).await;
    let text = displayable(plan.as_ref()).indent(false).to_string();
    assert!(text.contains("mode=CollectLeft, join_type=Left"), "{text}");
    assert!(plan_partitions_above_one(&plan), "{text}");

    let expected = rows(&local, LEFT_JOIN).await;
    assert_eq!(expected.len(), 1500);
    assert_eq!(rows(graph, LEFT_JOIN).await, expected);

    let job = graph.job_graph(LEFT_JOIN).await.unwrap();
    let explained = explain_text(&job);
    assert!(
        explained.contains("mode=Partitioned, join_type=Left"),
        "{explained}"
    );

    // Without the rewrite every task emits the customers it did not match itself.
    let wrong = run_graph(&graph_and_runner, plan, false).await;
    assert_ne!(sorted(wrong), sorted(expected));
}

fn plan_partitions_above_one(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.children()
        .iter()
        .any(|c| c.output_partitioning().partition_count() > 1 || plan_partitions_above_one(c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_loop_left_join_gets_a_single_probe_partition() {
    let sql = "select n_name, count(c_custkey) as c from nation left join customer \
               on n_nationkey > c_nationkey + 22 group by n_name order by n_name";
    let local = session(ExecutionMode::Local, &[]).await;
    let graph_and_runner = graph_session(&[]).await;
    let graph = &graph_and_runner.0;
    let plan = physical_plan(graph, sql).await;
    let text = displayable(plan.as_ref()).indent(false).to_string();
    assert!(
        text.contains("NestedLoopJoinExec: join_type=Left"),
        "{text}"
    );
    let expected = rows(&local, sql).await;
    assert_eq!(expected.len(), 25);
    assert_eq!(rows(graph, sql).await, expected);
    let wrong = run_graph(&graph_and_runner, plan, false).await;
    assert_ne!(wrong, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn piecewise_merge_left_join_runs_as_one_partition() {
    const PWMJ: &[(&str, &str)] = &[("datafusion.optimizer.enable_piecewise_merge_join", "true")];
    // Nation is buffered; orders (4 files) streams in 4 partitions.
    let sql = "select n_name, count(o_orderkey) as c from nation left join orders \
               on n_nationkey * 1000 > o_orderkey group by n_name order by n_name";
    // The reference is local mode without the (experimental) piecewise merge join: DataFusion 55's
    // own single-process run of it counts `target_partitions` streamed partitions where the
    // streamed side has fewer, and then never emits the unmatched rows either.
    let local = session(ExecutionMode::Local, &[]).await;
    let graph_and_runner = graph_session(PWMJ).await;
    let graph = &graph_and_runner.0;
    let plan = physical_plan(graph, sql).await;
    let text = displayable(plan.as_ref()).indent(false).to_string();
    assert!(text.contains("PiecewiseMergeJoin"), "{text}");
    let expected = rows(&local, sql).await;
    assert_eq!(expected.len(), 25);
    assert_eq!(rows(graph, sql).await, expected);
    // Without the rewrite no task is the last of its instance: unmatched nations go missing.
    let wrong = run_graph(&graph_and_runner, plan, false).await;
    assert_ne!(wrong, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_limit_over_several_partitions_reads_one() {
    let graph = graph_session(&[]).await;
    // A hand-built plan: DataFusion itself would have coalesced below the limit.
    let scan = physical_plan(&graph.0, "select o_orderkey from orders").await;
    assert!(scan.output_partitioning().partition_count() > 1);
    let limit: Arc<dyn ExecutionPlan> = Arc::new(GlobalLimitExec::new(scan, 0, Some(15_000)));
    assert_eq!(run_graph(&graph, limit.clone(), true).await.len(), 15_000);
    // Without the rewrite the limit would see one task's partition; DataFusion 55 refuses that shape
    // at execution, so the failure is loud rather than a short result.
    let error = try_run_graph(&graph, limit, false).await.unwrap_err();
    assert!(error.contains("single input partition"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_explain_snapshots() {
    let graph = session(ExecutionMode::LocalGraph, &[]).await;
    let data = common::tpch_dir().display().to_string();
    let data = data.trim_start_matches('/');
    for number in 1..=22u8 {
        let query = tpch_query(number, 0.01).unwrap();
        let sql = &query.statements[query.result_statement];
        if number == 15 {
            graph.run_sql(&query.statements[0]).await.unwrap();
        }
        let job = graph.job_graph(sql).await.unwrap();
        let text = explain_text(&job).replace(data, "[DATA]");
        insta::assert_snapshot!(format!("tpch_q{number:02}"), text);
        if number == 15 {
            graph.run_sql(&query.statements[2]).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q5_explain_json_has_shuffles_with_target_partition_channels() {
    let graph = session(ExecutionMode::LocalGraph, &[]).await;
    let query = tpch_query(5, 0.01).unwrap();
    let job = graph.job_graph(&query.statements[0]).await.unwrap();
    let json = sluice_planner::explain::explain_json(&job);
    let stages = json["stages"].as_array().unwrap();
    assert!(stages.len() >= 3);
    assert!(stages.iter().any(|s| {
        s["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["mode"] == "Shuffle")
    }));
    assert!(
        stages
            .iter()
            .any(|s| s["distribution"]["kind"] == "Hash" && s["distribution"]["channels"] == 4)
    );
    // The default exchange is pipelined: the whole job is one region of every task.
    let regions = json["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 1, "{regions:?}");
    let tasks: usize = job.stages().iter().map(|s| s.partitions()).sum();
    assert_eq!(regions[0]["tasks"].as_array().unwrap().len(), tasks);
    assert_eq!(job.topology().regions().len(), 1);
}
