//! One task attempt on a worker: from its definition to its final status report.
//!
//! ```text
//!   TaskDefinition ─► stage plan (decoded from its bytes, or the driver's in-memory plan)
//!                  ─► inputs: each StageInputExec<usize> reads its locators
//!                        same worker: the local stream store │ elsewhere: the StreamFetcher
//!                  ─► ShuffleWriterExec ─► this worker's store (channels × replicas)
//! ```
//!
//! Invariants: the attempt reports `Running` (sequence 1) before it reads or writes anything, and
//! `Succeeded` or `Failed` (sequence 2) last unless a stop claimed the final report first (the
//! worker then reports `Canceled` and aborts this future, which drops the task's stream and with it
//! its readers and writer); the plan is executed inside the attempt's future, so operators that
//! spawn do so on the task runtime. A succeeded attempt's report carries the rows it wrote, its wall
//! time and (for `EXPLAIN ANALYZE`) its plan with metrics.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use datafusion::common::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;
use futures::StreamExt;
use sluice_planner::AttemptKey;

use super::WorkerShared;
use super::streams::AttemptStreams;
use crate::analyze::{TaskMetrics, executed_task};
use crate::codec::decode_stage_plan;
use crate::definition::{StagePlan, TaskDefinition, TaskState, TaskStatusReport};
use crate::error::RemoteError;
use crate::memory::capped;
use crate::stream_store::TaskStreams;
use crate::task::assemble_task;

/// Runs one attempt and reports its status; see the module docs.
pub(super) async fn run_attempt(
    shared: Arc<WorkerShared>,
    definition: TaskDefinition,
    finished: Arc<AtomicBool>,
) {
    let key = definition.attempt;
    shared
        .report(report(&shared, key, 1, TaskState::Running))
        .await;
    let started = Instant::now();
    let state = match execute(&shared, definition).await {
        Ok(mut metrics) => {
            metrics.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            TaskState::Succeeded(metrics)
        }
        Err(error) => TaskState::Failed(RemoteError::of(&error)),
    };
    if shared.finish(key, &finished) {
        shared.report(report(&shared, key, 2, state)).await;
    }
}

fn report(
    shared: &WorkerShared,
    key: AttemptKey,
    sequence: u64,
    state: TaskState,
) -> TaskStatusReport {
    TaskStatusReport {
        worker: shared.worker_id(),
        attempt: key,
        sequence,
        state,
    }
}

async fn execute(shared: &Arc<WorkerShared>, definition: TaskDefinition) -> Result<TaskMetrics> {
    let key = definition.attempt;
    #[cfg(feature = "testing")]
    if let Some(fault) = &shared.options.fault
        && let Some(message) = fault(&key)
    {
        return Err(crate::error::transport_error(format!(
            "injected fault in {key}: {message}"
        )));
    }
    let with_plan = definition.report_plan_metrics;
    let (plan, context): (Arc<dyn ExecutionPlan>, Arc<TaskContext>) = match &definition.plan {
        StagePlan::InMemory { plan, context } => (Arc::clone(plan), Arc::clone(context)),
        StagePlan::Encoded(bytes) => {
            let context = task_context(shared, &definition)?;
            (decode_stage_plan(bytes, &context)?, context)
        }
        StagePlan::Decoded(plan) => (Arc::clone(plan), task_context(shared, &definition)?),
    };
    let streams = Arc::new(AttemptStreams::try_new(shared, &definition, &plan)?);
    let inputs = streams.inputs().to_vec();
    let task_streams: Arc<dyn TaskStreams> = Arc::clone(&streams) as Arc<dyn TaskStreams>;
    let task_plan = assemble_task(
        key.stage,
        plan,
        &inputs,
        definition.output.clone(),
        &task_streams,
    )?;
    let mut output = task_plan.execute(key.partition, context)?;
    while let Some(batch) = output.next().await {
        batch?;
    }
    // The wall time is measured by the caller, around the whole attempt.
    let mut metrics = executed_task(&task_plan, 0, with_plan);
    metrics.spilled_bytes += streams.output_spilled_bytes();
    Ok(metrics)
}

/// The task context of a decoded attempt: the session's settings with the distributed ones on top,
/// and the worker's function registry.
fn task_context(shared: &WorkerShared, definition: &TaskDefinition) -> Result<Arc<TaskContext>> {
    let mut config = SessionConfig::from_string_hash_map(&definition.config)?;
    for (name, value) in sluice_planner::DISTRIBUTED_SETTINGS {
        config.options_mut().set(name, value)?;
    }
    let template = &shared.template;
    // Every task of the worker draws on the worker's one pool (and its disk for spills); a session
    // that set a memory limit of its own also holds each of its tasks to it.
    let worker_runtime = template.runtime_env();
    let runtime = match definition.memory_limit {
        Some(cap) => capped(
            &worker_runtime,
            usize::try_from(cap).unwrap_or(usize::MAX),
            "the session's memory limit per task",
        ),
        None => worker_runtime,
    };
    Ok(Arc::new(TaskContext::new(
        Some(definition.attempt.to_string()),
        format!("job-{}", definition.attempt.job),
        config,
        template.scalar_functions().clone(),
        template.higher_order_functions().clone(),
        template.aggregate_functions().clone(),
        template.window_functions().clone(),
        runtime,
    )))
}
