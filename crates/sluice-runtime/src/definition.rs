//! What the driver tells a worker and what a worker tells the driver, as Rust values: the
//! [`TaskDefinition`] of one task attempt and the [`TaskStatusReport`]s about it. The in-process
//! transport hands them over as they are; the cluster's gRPC transport encodes them (`sluice-cluster`'s
//! `wire`).
//!
//! ```text
//!   TaskDefinition {attempt, plan: bytes (or, on the driver, the in-memory plan), inputs: per stage
//!                   input, per input partition, the StreamLocators to read, output distribution,
//!                   replicas, output mode, session settings and memory limit}
//!   TaskStatusReport {worker, attempt, sequence, Running | Succeeded(metrics) | Failed(error) | Canceled}
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;
use sluice_planner::{
    AttemptKey, InputKey, InputMode, JobId, OutputDistribution, OutputMode, StageId, StreamId,
    WorkerId,
};

use crate::analyze::TaskMetrics;
use crate::error::RemoteError;

/// The stage plan a task runs.
#[derive(Clone)]
pub enum StagePlan {
    /// Encoded with the wire codec, once per stage; every worker task decodes its own instance.
    Encoded(bytes::Bytes),
    /// Already decoded by a transport (the cluster's worker service decodes a `RunTask`'s plan
    /// once, to check it and to read its output schema); it belongs to this one attempt.
    Decoded(Arc<dyn ExecutionPlan>),
    /// The in-memory plan and the session's context, for tasks on the driver's own executor
    /// (driver-placed stages: sinks into the driver's catalog, generated series, plans whose wire
    /// form is not exact).
    InMemory {
        /// The stage plan.
        plan: Arc<dyn ExecutionPlan>,
        /// The session's task context.
        context: Arc<TaskContext>,
    },
}

impl fmt::Debug for StagePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StagePlan::Encoded(bytes) => write!(f, "Encoded({} bytes)", bytes.len()),
            StagePlan::Decoded(plan) => write!(f, "Decoded({})", plan.name()),
            StagePlan::InMemory { plan, .. } => write!(f, "InMemory({})", plan.name()),
        }
    }
}

/// Where one stream lives: the address of the worker holding it, and its id there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLocator {
    /// The holder's data-plane address.
    pub address: String,
    /// The stream.
    pub stream: StreamId,
}

impl StreamLocator {
    /// The stream as its consumer stage names it.
    pub fn input_key(&self) -> InputKey {
        InputKey {
            partition: self.stream.stream.partition,
            channel: self.stream.stream.channel,
            replica: self.stream.replica,
        }
    }
}

/// One stage input of a task (the `StageInputExec` with the same index in the stage plan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInputStreams {
    /// The producer stage.
    pub stage: StageId,
    /// How it is read.
    pub mode: InputMode,
    /// Per input partition the task reads, the streams it reads, in order: `partitions[k]` is
    /// input partition `first + k`.
    pub partitions: Vec<Vec<StreamLocator>>,
    /// The first input partition listed (0 unless the task reads only its own partition).
    pub first: usize,
}

/// Everything a worker needs to run one task attempt.
#[derive(Debug, Clone)]
pub struct TaskDefinition {
    /// The attempt.
    pub attempt: AttemptKey,
    /// The stage plan.
    pub plan: StagePlan,
    /// The stage's inputs.
    pub inputs: Vec<TaskInputStreams>,
    /// How the task routes its output rows to channels.
    pub output: OutputDistribution,
    /// How many readers take each output channel.
    pub replicas: usize,
    /// Pipelined (read while written, take-once) or blocking (read after the task ended,
    /// replayable).
    pub output_mode: OutputMode,
    /// The session's DataFusion settings.
    pub config: Arc<HashMap<String, String>>,
    /// The session's own memory limit in bytes: each task of the job is held to it, within its
    /// worker's pool (`None`: the worker's pool alone).
    pub memory_limit: Option<u64>,
    /// The job is an `EXPLAIN ANALYZE`: the final report carries the plan rendered with metrics.
    pub report_plan_metrics: bool,
    /// Output columns whose key summary the succeeded report carries (`TaskMetrics::key_summary`):
    /// the build keys of a runtime filter whose source is this stage; empty: none.
    pub summarise_columns: Vec<usize>,
    /// The runtime filters the stage plan gets while it runs (`FilterDelivery::WhileRunning`: the
    /// stage reads pipelined exchanges); empty: none.
    pub runtime_filters: Vec<LiveRuntimeFilter>,
    /// The driver acts on this attempt's `Running` report (a final-stage task: the job output
    /// starts reading it then), so it goes out as the attempt starts. Any other attempt reports
    /// `Running` only once it outlives the worker's grace (`worker::attempt::RUNNING_REPORT_GRACE`):
    /// a short task sends its final report alone.
    pub announce_running: bool,
}

/// A runtime filter a task's plan gets while it runs: a filter that keeps every row goes on top of
/// the node at `path` (pushed down into its scans) as the task starts, and becomes the source's
/// key summary when that arrives, with the definition or later ([`RuntimeFilterUpdate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRuntimeFilter {
    /// The filter's index in its job graph's `runtime_filters()`.
    pub filter: usize,
    /// Child indices from the stage plan's root to the node the filter goes on top of.
    pub path: Vec<usize>,
    /// The probe keys, as columns of that node's output.
    pub columns: Vec<usize>,
    /// The source's merged key summary (`KeySummary::encode`), if the driver had it when it
    /// defined the attempt.
    pub summary: Option<bytes::Bytes>,
    /// Whether the attempt waits for the summary before it starts reading (at most
    /// `sluice.runtime_filter_wait_ms`, see `plan::await_filters`): only while the driver has not
    /// settled the filter yet, and where the source can finish without the target reading
    /// anything: the target is neither the join's own stage nor a reader of the source.
    pub wait: bool,
}

/// The key summary of a runtime filter's source, for the running tasks of its target stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeFilterUpdate {
    /// The job.
    pub job: JobId,
    /// The target stage.
    pub stage: StageId,
    /// The filter's index in the job graph's `runtime_filters()`.
    pub filter: usize,
    /// The source's merged key summary (`KeySummary::encode`); empty when none could be built:
    /// the tasks waiting for the filter go on, keeping every row.
    pub summary: bytes::Bytes,
}

/// What a task attempt's report says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskState {
    /// Executing (the first report, sequence 1).
    Running,
    /// Finished; its output is complete.
    Succeeded(TaskMetrics),
    /// Failed with this error.
    Failed(RemoteError),
    /// Stopped on request.
    Canceled,
}

impl TaskState {
    /// Whether this is an attempt's last report.
    pub fn is_final(&self) -> bool {
        !matches!(self, TaskState::Running)
    }
}

/// One report about one task attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStatusReport {
    /// The reporting worker.
    pub worker: WorkerId,
    /// The attempt.
    pub attempt: AttemptKey,
    /// Increases with every report of one attempt (1 for `Running`, 2 for the final one).
    pub sequence: u64,
    /// What happened.
    pub state: TaskState,
}

/// DataFusion settings another one overwrites when it is applied (`enable_dynamic_filter_pushdown`
/// sets all three, and `SessionConfig::from_string_hash_map` applies it after them): a task
/// definition always carries them, and [`session_config_of`] applies them again last.
pub(crate) const CASCADED_SETTINGS: &[&str] = &[
    "datafusion.optimizer.enable_topk_dynamic_filter_pushdown",
    "datafusion.optimizer.enable_join_dynamic_filter_pushdown",
    "datafusion.optimizer.enable_aggregate_dynamic_filter_pushdown",
];

/// The session settings a task runs with, rebuilt on DataFusion's defaults from the ones its
/// definition carries (`driver::shipping::shipped_settings`).
pub(crate) fn session_config_of(settings: &HashMap<String, String>) -> Result<SessionConfig> {
    // DataFusion's own settings first (it knows no others), then Sluice's on their extension.
    let (ours, theirs): (HashMap<String, String>, HashMap<String, String>) = settings
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .partition(|(key, _)| key.starts_with("sluice."));
    let mut config =
        crate::options::with_sluice_options(SessionConfig::from_string_hash_map(&theirs)?);
    for (key, value) in &ours {
        config.options_mut().set(key, value)?;
    }
    for key in CASCADED_SETTINGS {
        if let Some(value) = settings.get(*key) {
            config.options_mut().set(key, value)?;
        }
    }
    Ok(config)
}
