//! The driver's and workers' tracing spans, as an OpenTelemetry exporter receives them: through
//! `tracing-opentelemetry` into the SDK's in-memory exporter (the same layer `sluice --otlp-endpoint`
//! puts in front of the OTLP exporter). One test per binary: it installs the global subscriber.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::trace::{SpanId, TracerProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sluice_cluster::{ClusterOptions, LocalClusterRunner};
use sluice_engine::ExecutionMode;
use sluice_runtime::JobRunner;
use sluice_tpch::answers::format_rows;
use tracing_subscriber::layer::SubscriberExt;

use common::tpch_session;

/// The span's attribute `key`, as text.
fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_spans_nest_job_stage_and_task_attempt_with_their_ids_and_end_states() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("sluice-test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let runner: Arc<dyn JobRunner> = Arc::new(LocalClusterRunner::with_options(ClusterOptions {
        workers: 2,
        ..ClusterOptions::default()
    }));
    let session = tpch_session(ExecutionMode::LocalCluster, &[], Arc::clone(&runner)).await;
    let sql = "select n_regionkey, count(*) from nation group by n_regionkey order by 1";
    let outputs = session.run_sql(sql).await.unwrap();
    assert_eq!(format_rows(&outputs[0].batches).unwrap().len(), 5);

    // The job's span closes when the job leaves the driver, after every attempt ended; a worker's
    // span closes when its attempt's future ends, which may be just after its final report.
    let deadline = Instant::now() + Duration::from_secs(10);
    let spans = loop {
        let spans = exporter.get_finished_spans().unwrap();
        let worker_spans = named(&spans, "task attempt").len();
        if !named(&spans, "job").is_empty() && worker_spans >= named(&spans, "task").len() {
            break spans;
        }
        assert!(Instant::now() < deadline, "no job span: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let records = runner.driver().unwrap().jobs().await.unwrap();
    assert_eq!(records.len(), 1);
    let record = &records[0];

    let jobs = named(&spans, "job");
    assert_eq!(jobs.len(), 1, "{jobs:#?}");
    let job = jobs[0];
    assert_eq!(attribute(job, "job").as_deref(), Some("1"));
    assert_eq!(attribute(job, "state").as_deref(), Some("succeeded"));
    assert_eq!(job.parent_span_id, SpanId::INVALID);

    // Every stage span is the job's child; every stage of the graph has one (each stage ran its
    // attempts in one go: nothing was retried).
    let stages = named(&spans, "stage");
    let stage_of: HashMap<SpanId, String> = stages
        .iter()
        .map(|s| (s.span_context.span_id(), attribute(s, "stage").unwrap()))
        .collect();
    assert!(
        stages
            .iter()
            .all(|s| s.parent_span_id == job.span_context.span_id()),
        "{stages:#?}"
    );
    let stage_ids: BTreeSet<String> = stage_of.values().cloned().collect();
    let expected_stages: BTreeSet<String> = (0..record.stage_tasks.len())
        .map(|s| s.to_string())
        .collect();
    assert_eq!(stage_ids, expected_stages);
    assert_eq!(stages.len(), record.stage_tasks.len());

    // One driver-side task span per attempt the driver recorded, under its stage's span, with the
    // attempt's worker address and end state.
    let key = |s: &SpanData| {
        (
            attribute(s, "stage").unwrap(),
            attribute(s, "partition").unwrap(),
            attribute(s, "attempt").unwrap(),
        )
    };
    let tasks = named(&spans, "task");
    let mut seen = BTreeSet::new();
    for task in &tasks {
        assert_eq!(
            stage_of.get(&task.parent_span_id),
            attribute(task, "stage").as_ref(),
            "{task:#?}"
        );
        assert_eq!(attribute(task, "job").as_deref(), Some("1"));
        assert_eq!(attribute(task, "state").as_deref(), Some("succeeded"));
        assert!(seen.insert(key(task)), "two spans for {:?}", key(task));
    }
    let recorded: BTreeSet<(String, String, String)> = record
        .attempts
        .iter()
        .map(|a| {
            (
                a.attempt.task.stage.0.to_string(),
                a.attempt.task.partition.to_string(),
                a.attempt.attempt.to_string(),
            )
        })
        .collect();
    assert_eq!(seen, recorded);
    let addresses: HashMap<(String, String, String), String> = record
        .attempts
        .iter()
        .map(|a| {
            let key = (
                a.attempt.task.stage.0.to_string(),
                a.attempt.task.partition.to_string(),
                a.attempt.attempt.to_string(),
            );
            (key, a.address.clone())
        })
        .collect();
    for task in &tasks {
        assert_eq!(
            attribute(task, "worker"),
            addresses.get(&key(task)).cloned()
        );
    }

    // Each attempt also ran under a worker-side span carrying the same ids.
    let ran: BTreeSet<(String, String, String)> = named(&spans, "task attempt")
        .iter()
        .inspect(|s| assert_eq!(attribute(s, "job").as_deref(), Some("1")))
        .map(|s| key(s))
        .collect();
    assert_eq!(ran, recorded);
    provider.shutdown().unwrap();
}
