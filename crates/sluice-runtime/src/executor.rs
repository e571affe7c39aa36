//! The in-process job executor: runs a job graph inside this process through the same task-level
//! pieces a worker uses (task preparation, shuffle writer, stream store, shuffle readers).
//!
//! ```text
//!   first poll of the output stream
//!      │
//!      ├─ driver loop: start every region whose dependencies are done (all its tasks at once),
//!      │               wait for tasks, mark regions done, release unread streams of finished stages
//!      └─ output: the final stage's streams, interleaved, forwarded to the caller as they arrive
//! ```
//!
//! Worker-placed stage plans are encoded once with the wire codec, so a plan that cannot travel to a
//! worker fails the job before any task starts; with `decode_from_wire` every task also runs from its
//! own decoded instance, as a remote worker will.
//!
//! Invariants: nothing runs before the output stream is first polled; dropping the stream aborts the
//! driver loop and every task (all are owned by `JoinSet`s); the first task failure fails the job with
//! an error naming the stage and partition; the stream ends only after every task finished, so a
//! failure anywhere is never hidden behind a complete-looking output. For `EXPLAIN ANALYZE`, a row per
//! earlier stage follows the final stage's output (`crate::analyze`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use datafusion::common::runtime::JoinSet;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::{RecordBatchReceiverStream, RecordBatchStreamAdapter};
use futures::{StreamExt, TryStreamExt, stream};
use sluice_planner::{InputKey, JobGraph, JobTopology, StageId, TaskId, TaskPlacement};

use tokio::sync::oneshot;

use crate::analyze::{
    StageReport, TaskMetrics, executed_task, is_analyze, report_batch, stage_reports,
};
use crate::codec::{decode_stage_plan, encode_stage_plan};

use crate::stream_store::{JobId, StreamStore, TaskStreams};
use crate::task::prepare_task;

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

/// How the in-process executor runs tasks.
#[derive(Debug, Clone, Copy)]
pub struct ExecutorOptions {
    /// Encode every worker stage at job start and fail the job if one cannot travel to a worker (on
    /// by default; off only for in-process-only plans such as tests' synthetic sources).
    pub require_wire_form: bool,
    /// Run each worker task from its decoded wire form instead of the in-memory stage plan. Every
    /// worker stage is encoded either way (a plan that cannot travel fails the job up front); decoding
    /// too proves the round trip, but datafusion-proto 55 does not round-trip every plan exactly (a
    /// `Float16` literal comes back as `Float32`), so `local-graph` leaves it off.
    pub decode_from_wire: bool,
}

impl Default for ExecutorOptions {
    fn default() -> Self {
        Self {
            require_wire_form: true,
            decode_from_wire: false,
        }
    }
}

/// Runs `graph` in this process; the returned stream is lazy and cancels the job when dropped.
pub fn execute_graph(graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
    execute_graph_with(graph, context, ExecutorOptions::default())
}

/// [`execute_graph`] with options.
pub fn execute_graph_with(
    graph: JobGraph,
    context: Arc<TaskContext>,
    options: ExecutorOptions,
) -> SendableRecordBatchStream {
    let schema = graph.schema().clone();
    let start = stream::once(async move { start_job(graph, context, options) }).try_flatten();
    Box::pin(RecordBatchStreamAdapter::new(schema, start))
}

fn start_job(
    graph: JobGraph,
    context: Arc<TaskContext>,
    options: ExecutorOptions,
) -> Result<SendableRecordBatchStream> {
    let job = JobId(NEXT_JOB.fetch_add(1, Ordering::Relaxed));
    let topology = JobTopology::try_new(&graph)?;
    let mut wire = if options.require_wire_form || options.decode_from_wire {
        encode_worker_stages(&graph)?
    } else {
        Vec::new()
    };
    if !options.decode_from_wire {
        wire.iter_mut().for_each(|w| *w = None);
    }
    let store = Arc::new(StreamStore::for_graph(job, &graph, &context.runtime_env()));
    let final_stage = graph.final_stage();
    let final_partitions = graph
        .stage(final_stage)
        .map_or(0, |stage| stage.partitions());
    let outputs = (0..final_partitions)
        .map(|partition| {
            let key = InputKey {
                partition,
                channel: 0,
                replica: 0,
            };
            store.take_stream_inner(final_stage, key)
        })
        .collect::<Result<Vec<_>>>()?;

    let mut builder = RecordBatchReceiverStream::builder(graph.schema().clone(), 2);
    let tx = builder.tx();
    let schema = graph.schema().clone();
    let (reports_tx, reports) = oneshot::channel::<Vec<StageReport>>();
    builder.spawn(async move {
        let mut output = stream::select_all(outputs);
        while let Some(batch) = output.next().await {
            if tx.send(batch).await.is_err() {
                return Ok(());
            }
        }
        // EXPLAIN ANALYZE: the earlier stages' rows follow the final stage's, once every task ended
        // (a failed job drops the sender, and its error ends the stream instead).
        if let Ok(reports) = reports.await
            && let Some(batch) = report_batch(&schema, &reports)
        {
            let _ = tx.send(Ok(batch)).await;
        }
        Ok(())
    });
    let analyze = is_analyze(&graph);
    let stages = Arc::new(JobStages {
        graph,
        wire,
        analyze,
    });
    builder.spawn(run_regions(
        job, stages, topology, store, context, reports_tx,
    ));
    Ok(builder.build())
}

/// A job's graph with each worker stage's plan encoded once, as it travels to workers (kept only when
/// tasks decode from it).
struct JobStages {
    graph: JobGraph,
    wire: Vec<Option<bytes::Bytes>>,
    /// The job is an `EXPLAIN ANALYZE`: tasks render their plans with metrics.
    analyze: bool,
}

/// Encodes every worker-placed stage plan; a node without a wire form fails the job here, before any
/// task runs, naming the stage.
fn encode_worker_stages(graph: &JobGraph) -> Result<Vec<Option<bytes::Bytes>>> {
    graph
        .stages()
        .iter()
        .enumerate()
        .map(|(id, stage)| match stage.placement {
            TaskPlacement::Driver => Ok(None),
            TaskPlacement::Worker => encode_stage_plan(Arc::clone(&stage.plan))
                .map(Some)
                .map_err(|e| {
                    DataFusionError::Plan(format!(
                        "stage {id} cannot be sent to workers: {e}; run it with --mode local"
                    ))
                }),
        })
        .collect()
}

async fn run_task(
    stages: Arc<JobStages>,
    task: TaskId,
    store: Arc<StreamStore>,
    context: Arc<TaskContext>,
) -> Result<TaskMetrics> {
    let graph = &stages.graph;
    // Worker stages run from their wire form, exactly as a remote worker decodes them.
    let stage_plan = match stages.wire.get(task.stage.0) {
        Some(Some(bytes)) => decode_stage_plan(bytes, &context)?,
        _ => graph
            .stage(task.stage)
            .map(|s| Arc::clone(&s.plan))
            .ok_or_else(|| DataFusionError::Internal(format!("no stage {}", task.stage)))?,
    };
    let streams: Arc<dyn TaskStreams> = store;
    let started = Instant::now();
    let plan = prepare_task(graph, task.stage, stage_plan, task.partition, &streams)?;
    let mut stream = plan.execute(task.partition, context)?;
    while let Some(batch) = stream.next().await {
        batch?;
    }
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    Ok(executed_task(&plan, elapsed_ms, stages.analyze))
}

/// The driver loop: schedules regions in dependency order and waits for their tasks.
async fn run_regions(
    job: JobId,
    stages: Arc<JobStages>,
    topology: JobTopology,
    store: Arc<StreamStore>,
    context: Arc<TaskContext>,
    reports: oneshot::Sender<Vec<StageReport>>,
) -> Result<()> {
    let graph = &stages.graph;
    let regions = topology.regions();
    let mut metrics = HashMap::new();
    let mut started = vec![false; regions.len()];
    let mut remaining: Vec<usize> = regions.iter().map(|r| r.tasks.len()).collect();
    let mut stage_remaining: Vec<usize> = graph.stages().iter().map(|s| s.partitions()).collect();
    let mut tasks = JoinSet::new();
    loop {
        for (id, region) in regions.iter().enumerate() {
            let ready = region.depends_on.iter().all(|d| remaining[d.0] == 0);
            if started[id] || !ready {
                continue;
            }
            started[id] = true;
            for task in &region.tasks {
                let (stages, store, context, task) =
                    (stages.clone(), store.clone(), context.clone(), *task);
                tasks.spawn(async move {
                    let result = run_task(stages, task, store, context).await;
                    (id, task, result)
                });
            }
        }
        if remaining.iter().all(|r| *r == 0) {
            if stages.analyze {
                let _ = reports.send(stage_reports(graph, &metrics));
            }
            return Ok(());
        }
        let Some(joined) = tasks.join_next().await else {
            return internal_err!("job {job}: regions are waiting but no task is running");
        };
        let (region, task, result) = joined.map_err(|e| {
            DataFusionError::Execution(format!("job {job}: a task panicked or was aborted: {e}"))
        })?;
        let reported = result.map_err(|e| {
            e.context(format!(
                "job {job} stage {} partition {}",
                task.stage, task.partition
            ))
        })?;
        metrics.insert(task, reported);
        remaining[region] -= 1;
        stage_remaining[task.stage.0] -= 1;
        if stage_remaining[task.stage.0] == 0 {
            release_inputs(graph, &store, task.stage)?;
        }
    }
}

/// Once every task of `stage` finished, streams of its inputs it did not read never will be.
fn release_inputs(graph: &JobGraph, store: &StreamStore, stage: StageId) -> Result<()> {
    let Some(stage) = graph.stage(stage) else {
        return Ok(());
    };
    for input in &stage.inputs {
        store.release_stage(input.stage)?;
    }
    Ok(())
}
