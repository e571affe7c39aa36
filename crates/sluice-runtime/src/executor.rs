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
//! Invariants: nothing runs before the output stream is first polled; dropping the stream aborts the
//! driver loop and every task (all are owned by `JoinSet`s); the first task failure fails the job with
//! an error naming the stage and partition; the stream ends only after every task finished, so a
//! failure anywhere is never hidden behind a complete-looking output.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::common::runtime::JoinSet;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::{RecordBatchReceiverStream, RecordBatchStreamAdapter};
use futures::{StreamExt, TryStreamExt, stream};
use sluice_planner::{InputKey, JobGraph, JobTopology, StageId, TaskId};

use crate::stream_store::{JobId, StreamStore};
use crate::task::prepare_task;

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

/// Runs `graph` in this process; the returned stream is lazy and cancels the job when dropped.
pub fn execute_graph(graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
    let schema = graph.schema().clone();
    let start = stream::once(async move { start_job(graph, context) }).try_flatten();
    Box::pin(RecordBatchStreamAdapter::new(schema, start))
}

fn start_job(graph: JobGraph, context: Arc<TaskContext>) -> Result<SendableRecordBatchStream> {
    let job = JobId(NEXT_JOB.fetch_add(1, Ordering::Relaxed));
    let topology = JobTopology::try_new(&graph)?;
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
            store.take_stream(final_stage, key)
        })
        .collect::<Result<Vec<_>>>()?;

    let mut builder = RecordBatchReceiverStream::builder(graph.schema().clone(), 2);
    let tx = builder.tx();
    builder.spawn(async move {
        let mut output = stream::select_all(outputs);
        while let Some(batch) = output.next().await {
            if tx.send(batch).await.is_err() {
                break;
            }
        }
        Ok(())
    });
    builder.spawn(run_regions(job, Arc::new(graph), topology, store, context));
    Ok(builder.build())
}

async fn run_task(
    graph: Arc<JobGraph>,
    task: TaskId,
    store: Arc<StreamStore>,
    context: Arc<TaskContext>,
) -> Result<()> {
    let plan = prepare_task(&graph, task.stage, task.partition, &store)?;
    let mut stream = plan.execute(task.partition, context)?;
    while let Some(batch) = stream.next().await {
        batch?;
    }
    Ok(())
}

/// The driver loop: schedules regions in dependency order and waits for their tasks.
async fn run_regions(
    job: JobId,
    graph: Arc<JobGraph>,
    topology: JobTopology,
    store: Arc<StreamStore>,
    context: Arc<TaskContext>,
) -> Result<()> {
    let regions = topology.regions();
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
                let (graph, store, context, task) =
                    (graph.clone(), store.clone(), context.clone(), *task);
                tasks.spawn(async move {
                    let result = run_task(graph, task, store, context).await;
                    (id, task, result)
                });
            }
        }
        if remaining.iter().all(|r| *r == 0) {
            return Ok(());
        }
        let Some(joined) = tasks.join_next().await else {
            return internal_err!("job {job}: regions are waiting but no task is running");
        };
        let (region, task, result) = joined.map_err(|e| {
            DataFusionError::Execution(format!("job {job}: a task panicked or was aborted: {e}"))
        })?;
        result.map_err(|e| {
            e.context(format!(
                "job {job} stage {} partition {}",
                task.stage, task.partition
            ))
        })?;
        remaining[region] -= 1;
        stage_remaining[task.stage.0] -= 1;
        if stage_remaining[task.stage.0] == 0 {
            release_inputs(&graph, &store, task.stage)?;
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
