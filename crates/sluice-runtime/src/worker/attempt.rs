//! One task attempt on a worker: from its definition to its final status report.
//!
//! ```text
//!   TaskDefinition ─► stage plan (decoded from its bytes, or the driver's in-memory plan)
//!                  ─► inputs: each StageInputExec<usize> reads its locators
//!                        same worker: the local stream store │ elsewhere: the StreamFetcher
//!                  ─► ShuffleWriterExec ─► this worker's store (channels × replicas)
//! ```
//!
//! Invariants: the attempt reports `Running` (sequence 1) as it starts (delivered while it runs) if
//! its definition says the driver acts on it (`announce_running`: a final-stage task), otherwise
//! only once it outlives the worker's grace ([`RUNNING_REPORT_GRACE`] by default); it reports `Succeeded` or `Failed` (sequence 2)
//! last, and, when it sent `Running`, only once `Running`'s delivery ended
//! (acknowledged, refused, or given up after the driver timeout), unless a stop claimed the final
//! report first (a panic inside the attempt is caught and reported `Failed`, an internal, retryable error keeping the
//! panic's message, so its slot and region never wait for a report that cannot come; the
//! worker then reports `Canceled` and aborts this future, which drops the task's stream and with it
//! its readers and writer); the plan is executed inside the attempt's future, so operators that
//! spawn do so on the task runtime. A succeeded attempt's report carries the rows it wrote, its wall
//! time, what it read (batches, rows, local and remote bytes), its compute time, spills and peak
//! memory (its operators' reservations, measured by its view of the worker's pool) and (for
//! `EXPLAIN ANALYZE`) its plan with metrics.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;
use futures::{FutureExt, StreamExt};
use sluice_planner::AttemptKey;

use super::WorkerShared;
use super::streams::AttemptStreams;
use crate::analyze::{TaskMetrics, executed_task};
use crate::codec::decode_stage_plan;
use crate::definition::{StagePlan, TaskDefinition, TaskState, TaskStatusReport};
use crate::error::{ErrorKind, RemoteError, sluice_error};
use crate::memory::task_pool;
use crate::options::{RUNTIME_FILTER_WAIT_MS, SluiceOptions};
use crate::plan::await_filters::AwaitRuntimeFiltersExec;
use crate::plan::key_summary::{KeySummaryExec, take_summary};
use crate::stream_store::TaskStreams;
use crate::task::assemble_task;

/// How long an attempt whose `Running` report the driver does not act on runs before it sends one,
/// by default. Most tasks of small jobs end within it, and each report it saves is a round trip to
/// the driver on the job's path. What the driver loses: a `RunTask` whose reply is lost is taken
/// for a started task only if the task reported, so within the grace such a loss counts against
/// the worker (as one that never answered), not only against the reply.
pub const RUNNING_REPORT_GRACE: std::time::Duration = std::time::Duration::from_millis(20);

/// Runs one attempt and reports its status; see the module docs. A panic outside its execution
/// (in delivering a report) leaves the attempt unknown to the worker, so the driver, whose
/// heartbeats show it missing, fails it and runs its region again.
pub(super) async fn run_attempt(
    shared: Arc<WorkerShared>,
    definition: TaskDefinition,
    finished: Arc<AtomicBool>,
) {
    let key = definition.attempt;
    let run = AssertUnwindSafe(run_and_report(&shared, definition, &finished));
    if let Err(panic) = run.catch_unwind().await {
        let error = panicked(key, panic.as_ref());
        tracing::warn!(target: "sluice::worker", %error, "a status report of the attempt panicked");
        drop(shared.finish(key, &finished));
    }
}

async fn run_and_report(
    shared: &Arc<WorkerShared>,
    definition: TaskDefinition,
    finished: &AtomicBool,
) {
    let key = definition.attempt;
    let started = Instant::now();
    // `Running` goes out while the attempt already runs (its delivery is a round trip to the
    // driver, resent until acknowledged); the final report waits for that delivery to end, so the
    // driver still gets them in order. An attempt the driver does not wait on reports it only once
    // it outlives the grace: a short one sends its final report (sequence 2) alone.
    let announce = definition.announce_running;
    let execution = AssertUnwindSafe(execute(shared, definition)).catch_unwind();
    let running = || shared.report(report(shared, key, 1, TaskState::Running));
    let executed = if announce {
        tokio::join!(running(), execution).1
    } else {
        let mut execution = std::pin::pin!(execution);
        tokio::select! {
            biased;
            executed = &mut execution => executed,
            () = tokio::time::sleep(shared.options.running_report_grace) => tokio::join!(running(), execution).1,
        }
    };
    let executed = executed.unwrap_or_else(|panic| Err(panicked(key, panic.as_ref())));
    let state = match executed {
        Ok(mut metrics) => {
            metrics.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            TaskState::Succeeded(metrics)
        }
        Err(error) => {
            tracing::info!(target: "sluice::worker", %error, "task attempt failed");
            TaskState::Failed(RemoteError::of(&error))
        }
    };
    if let Some(_reporting) = shared.finish(key, finished) {
        // Logged only for the outcome the driver is told of (a stop may end the attempt first).
        if let TaskState::Succeeded(metrics) = &state {
            tracing::debug!(
                target: "sluice::worker",
                rows = metrics.rows,
                elapsed_ms = metrics.elapsed_ms,
                scanned_bytes = metrics.scanned_bytes,
                peak_memory_bytes = metrics.peak_memory_bytes,
                "task attempt succeeded"
            );
        }
        shared.report(report(shared, key, 2, state)).await;
    }
}

/// The error of attempt `key` whose execution panicked with `payload`.
fn panicked(key: AttemptKey, payload: &(dyn std::any::Any + Send)) -> DataFusionError {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string());
    sluice_error(ErrorKind::Internal, format!("{key} panicked: {message}"))
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
    // Every task of the worker draws on the worker's one pool (and its disk for spills) through a
    // view of its own: it measures the task's peak and, if the session set a memory limit per
    // task, holds the task to it.
    let cap = definition
        .memory_limit
        .map(|cap| usize::try_from(cap).unwrap_or(usize::MAX));
    let (plan, context, memory) = match &definition.plan {
        StagePlan::InMemory { plan, context } => {
            let (runtime, memory) = task_pool(&context.runtime_env(), cap);
            let context = TaskContext::new(
                context.task_id(),
                context.session_id(),
                task_config(context.session_config().clone(), shared, key),
                context.scalar_functions().clone(),
                context.higher_order_functions().clone(),
                context.aggregate_functions().clone(),
                context.window_functions().clone(),
                runtime,
            );
            (Arc::clone(plan), Arc::new(context), memory)
        }
        StagePlan::Encoded(_) | StagePlan::Decoded(_) => {
            let (runtime, memory) = task_pool(&shared.template.runtime_env(), cap);
            let context = task_context(shared, &definition, runtime)?;
            let plan: Arc<dyn ExecutionPlan> = match &definition.plan {
                StagePlan::Encoded(bytes) => decode_stage_plan(bytes, &context)?,
                StagePlan::Decoded(plan) | StagePlan::InMemory { plan, .. } => Arc::clone(plan),
            };
            (plan, context, memory)
        }
    };
    // Runtime filters delivered while the task runs go in before it starts (they keep every row
    // until their source's keys arrive); the guard lists them on the worker's board meanwhile.
    let (plan, _live_filters) = if definition.runtime_filters.is_empty() {
        (plan, None)
    } else {
        let (plan, installed) = shared.live_filters.install(
            key,
            plan,
            &definition.runtime_filters,
            context.session_config().options(),
        );
        // The task starts reading once they arrived (or after `sluice.runtime_filter_wait_ms`).
        let wait = context
            .session_config()
            .options()
            .extensions
            .get::<SluiceOptions>()
            .map_or(RUNTIME_FILTER_WAIT_MS, |o| o.runtime_filter_wait_ms);
        let plan: Arc<dyn ExecutionPlan> = if installed.pending().is_empty() || wait == 0 {
            plan
        } else {
            Arc::new(AwaitRuntimeFiltersExec::new(
                plan,
                installed.pending().to_vec(),
                Duration::from_millis(wait),
            ))
        };
        (plan, Some(installed))
    };
    let streams = Arc::new(AttemptStreams::try_new(shared, &definition, &plan)?);
    let inputs = streams.inputs().to_vec();
    let task_streams: Arc<dyn TaskStreams> = Arc::clone(&streams) as Arc<dyn TaskStreams>;
    // A runtime filter's source task summarises its build keys under its writer.
    let (plan, summary) = if definition.summarise_columns.is_empty() {
        (plan, None)
    } else {
        let exec = KeySummaryExec::new(plan, definition.summarise_columns.clone());
        let slot = exec.slot();
        (Arc::new(exec) as Arc<dyn ExecutionPlan>, Some(slot))
    };
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
    let mut metrics = executed_task(&task_plan, with_plan);
    let (spill_files, spilled_bytes) = streams.output_spills();
    metrics.spill_count += spill_files;
    metrics.spilled_bytes += spilled_bytes;
    streams.read().add_to(&mut metrics);
    metrics.peak_memory_bytes = memory.peak() as u64;
    if let Some(slot) = &summary {
        metrics.key_summary = take_summary(slot);
    }
    Ok(metrics)
}

/// `config` with the attempt's key (where its file writers name their staging directory) and the
/// worker's fault points (where its writers and readers find them).
fn task_config(config: SessionConfig, shared: &WorkerShared, key: AttemptKey) -> SessionConfig {
    let config = config.with_extension(Arc::new(key));
    match &shared.options.faults {
        Some(faults) => config.with_extension(Arc::clone(faults)),
        None => config,
    }
}

/// The task context of a decoded attempt: the session's settings with the distributed ones on top,
/// the worker's function registry, and `runtime` (the worker's, through the task's memory view).
fn task_context(
    shared: &WorkerShared,
    definition: &TaskDefinition,
    runtime: Arc<RuntimeEnv>,
) -> Result<Arc<TaskContext>> {
    let config = shared.configs.of(&definition.config)?;
    let template = &shared.template;
    Ok(Arc::new(TaskContext::new(
        Some(definition.attempt.to_string()),
        format!("job-{}", definition.attempt.job),
        task_config(config, shared, definition.attempt),
        template.scalar_functions().clone(),
        template.higher_order_functions().clone(),
        template.aggregate_functions().clone(),
        template.window_functions().clone(),
        runtime,
    )))
}
