//! The job graph: a DataFusion physical plan cut into stages at its exchanges.
//!
//! ```text
//!   AggregateExec(final)                          stage 1: AggregateExec(final)
//!     RepartitionExec Hash(k, 4)        ──►                  StageInputExec(input 0 = stage 0, Shuffle)
//!       AggregateExec(partial)                    stage 0: AggregateExec(partial)      Hash{[k], 4}
//!         DataSourceExec (3 files)                           DataSourceExec (3 partitions)
//! ```
//!
//! Vocabulary: a job has stages; a stage has partitions (its plan's output partitions); a task runs one
//! partition of one stage and splits its output into channels by the stage's [`OutputDistribution`].
//! A consumer stage reads a producer through a [`StageInput`] whose [`InputMode`] says which producer
//! (partition, channel) streams each consumer partition reads (see [`input_keys`]).
//!
//! Invariants of a built [`JobGraph`]:
//! - stages are in topological order (every input stage comes before its consumer); the last stage is
//!   the final stage, whose output is the job's output;
//! - every stage plan is a plain DataFusion plan whose only leaves that read other stages are
//!   `StageInputExec<usize>` indexing that stage's `inputs`; no `RepartitionExec`,
//!   multi-partition `CoalescePartitionsExec` or multi-partition `SortPreservingMergeExec` remains
//!   inside a stage, except in a job run whole as one task ([`single_task`]): its only stage is the
//!   whole plan, with one partition;
//! - a stage that reads a `Forward` input has the producer's partition count at that placeholder;
//! - every stage but the final one feeds exactly one input of one later stage.

mod builder;
pub mod input_keys;
pub mod partition_reads;
pub mod rewrites;
pub mod runtime_filters;
pub mod single_task;
pub mod skew_joins;
mod wire_fidelity;

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::distribution::DistributionRules;
pub use crate::ids::StageId;
use crate::topology::JobTopology;
pub use runtime_filters::{FilterDelivery, RuntimeFilter};
pub use single_task::SingleTask;
pub use skew_joins::SkewJoin;

/// DataFusion settings a plan must be planned with before it is cut into a job graph, because its
/// stages run as separate tasks, each with its own plan instance (a job run whole as one task is
/// planned with them too: whether it is cut is decided after planning, and they cost it only speed):
/// - a scan must not steal files from its sibling partitions: a task's scan instance would put every
///   file group into its one shared queue and its one partition would read them all (rows read N
///   times across the N tasks);
/// - a hash join's dynamic filter waits for a report from every partition of its instance (probe
///   partitions for collect-left, build partitions for partitioned joins), which run in other
///   tasks: the one partition a task runs would wait forever;
/// - a physical scalar subquery's value cannot cross a stage boundary.
pub const DISTRIBUTED_SETTINGS: &[(&str, &str)] = &[
    (
        "datafusion.execution.enable_file_stream_work_stealing",
        "false",
    ),
    (
        "datafusion.optimizer.enable_join_dynamic_filter_pushdown",
        "false",
    ),
    (
        "datafusion.optimizer.enable_physical_uncorrelated_scalar_subquery",
        "false",
    ),
];

/// The largest estimated build side (bytes) a distributed run broadcasts to every task of a hash
/// join instead of hash-shuffling both sides, unless the user set
/// `datafusion.optimizer.hash_join_single_partition_threshold` (Spark's
/// `spark.sql.autoBroadcastJoinThreshold` is the same 10 MiB).
///
/// In one process DataFusion's 1 MiB default weighs a collected build side against repartitioning
/// the probe side in memory. Across tasks the trade is different: a shuffle encodes the whole probe
/// side, sends most of it to other workers and decodes it there, while a broadcast sends only the
/// build side, once per task. TPC-H SF 1 on two workers: q3, q5 and q21 stop shuffling lineitem.
pub const DISTRIBUTED_BROADCAST_THRESHOLD: (&str, &str) = (
    "datafusion.optimizer.hash_join_single_partition_threshold",
    "10485760",
);

/// How a consumer stage reads a producer stage's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputMode {
    /// Consumer partition `p` reads producer partition `p` (all its channels). Equal partition counts.
    Forward,
    /// Every consumer task reads every producer partition as its own input partition (an
    /// order-preserving merge runs in the consumer).
    Merge,
    /// Consumer partition `c` reads channel `c` of every producer partition.
    Shuffle,
    /// Every consumer task reads every channel of every producer partition.
    Broadcast,
    /// Consumer partition `p` of `M` reads the contiguous producer partitions `[p*N/M, (p+1)*N/M)`.
    Rescale,
}

impl InputMode {
    /// The name used in EXPLAIN output.
    pub fn name(self) -> &'static str {
        match self {
            InputMode::Forward => "Forward",
            InputMode::Merge => "Merge",
            InputMode::Shuffle => "Shuffle",
            InputMode::Broadcast => "Broadcast",
            InputMode::Rescale => "Rescale",
        }
    }

    /// Whether every consumer task reads the streams (so the producer keeps one replica per
    /// consumer partition).
    pub fn replicated(self) -> bool {
        matches!(self, InputMode::Merge | InputMode::Broadcast)
    }
}

/// When a stage's output may be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputMode {
    /// Consumers read while the producer runs; producer and consumers are scheduled together.
    Pipelined,
    /// Consumers start only after the producer finished; the output is kept until then.
    Blocking,
}

impl OutputMode {
    /// The name used in EXPLAIN output.
    pub fn name(self) -> &'static str {
        match self {
            OutputMode::Pipelined => "Pipelined",
            OutputMode::Blocking => "Blocking",
        }
    }
}

/// How each task of a stage splits its output rows into channels.
#[derive(Debug, Clone)]
pub enum OutputDistribution {
    /// By hash of the keys, exactly as DataFusion's `RepartitionExec` routes rows.
    Hash {
        /// Key expressions over the stage's output schema.
        keys: Vec<Arc<dyn PhysicalExpr>>,
        /// Number of channels.
        channels: usize,
    },
    /// Whole batches in turn, starting at a staggered channel.
    RoundRobin {
        /// Number of channels.
        channels: usize,
    },
}

impl OutputDistribution {
    /// Number of output channels.
    pub fn channels(&self) -> usize {
        match self {
            OutputDistribution::Hash { channels, .. }
            | OutputDistribution::RoundRobin { channels } => *channels,
        }
    }

    /// `"Hash"` or `"RoundRobin"`.
    pub fn kind(&self) -> &'static str {
        match self {
            OutputDistribution::Hash { .. } => "Hash",
            OutputDistribution::RoundRobin { .. } => "RoundRobin",
        }
    }

    /// The hash keys, rendered; empty for round-robin.
    pub fn key_names(&self) -> Vec<String> {
        match self {
            OutputDistribution::Hash { keys, .. } => keys.iter().map(|k| k.to_string()).collect(),
            OutputDistribution::RoundRobin { .. } => Vec::new(),
        }
    }
}

/// Where a stage's tasks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskPlacement {
    /// On the driver: nodes that cannot be shipped to workers (system tables, generated series,
    /// recursive queries, sinks into the driver's catalog) and plans whose wire form is not exact
    /// (a `Float16` literal).
    Driver,
    /// On workers.
    Worker,
}

impl TaskPlacement {
    /// The name used in EXPLAIN output.
    pub fn name(self) -> &'static str {
        match self {
            TaskPlacement::Driver => "Driver",
            TaskPlacement::Worker => "Worker",
        }
    }
}

/// One input of a stage: which stage it reads and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StageInput {
    /// The producer stage.
    pub stage: StageId,
    /// How its streams are read.
    pub mode: InputMode,
}

/// One stage: a plan run once per partition, its inputs and how its output is split.
#[derive(Debug, Clone)]
pub struct Stage {
    /// The producer stages read by the plan's `StageInputExec<usize>` leaves, by index.
    pub inputs: Vec<StageInput>,
    /// The stage plan.
    pub plan: Arc<dyn ExecutionPlan>,
    /// When the output may be read.
    pub mode: OutputMode,
    /// How each task's output is split into channels.
    pub distribution: OutputDistribution,
    /// Where the tasks run.
    pub placement: TaskPlacement,
    /// The plan's encoded form, as the wire check made it (a worker stage built with a
    /// [`WireCheck`]); used only while `plan` is the plan it encodes ([`Stage::wire_bytes`]).
    pub wire_form: Option<WireForm>,
}

impl Stage {
    /// Number of partitions, i.e. tasks.
    pub fn partitions(&self) -> usize {
        self.plan.output_partitioning().partition_count()
    }

    /// The encoded form of the stage's current plan, if the wire check made one for it: a plan
    /// replaced since (`stage.plan = …`) has none, so its bytes are never those of an older plan.
    pub fn wire_bytes(&self) -> Option<&bytes::Bytes> {
        self.wire_form
            .as_ref()
            .filter(|form| Arc::ptr_eq(&form.plan, &self.plan))
            .map(|form| &form.bytes)
    }
}

/// A stage plan's encoded form, kept with the plan it encodes.
#[derive(Clone)]
pub struct WireForm {
    plan: Arc<dyn ExecutionPlan>,
    bytes: bytes::Bytes,
}

impl WireForm {
    /// `bytes` encode `plan`.
    pub fn new(plan: &Arc<dyn ExecutionPlan>, bytes: bytes::Bytes) -> Self {
        Self {
            plan: Arc::clone(plan),
            bytes,
        }
    }
}

impl std::fmt::Debug for WireForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WireForm({} bytes)", self.bytes.len())
    }
}

/// Whether a stage plan survives the trip to a worker exactly (encoded, decoded, the same plan): its
/// encoded form if it does, which the stage keeps ([`Stage::wire_form`]) so the plan is encoded
/// once. The runtime supplies it (it owns the codec); a stage that does not survive runs on the
/// driver, from memory.
pub type WireCheck = Arc<dyn Fn(&Arc<dyn ExecutionPlan>) -> Option<bytes::Bytes> + Send + Sync>;

/// Choices the job-graph builder makes that are not dictated by the plan.
#[derive(Clone)]
pub struct JobGraphOptions {
    /// How plan nodes distribute (built-in rules plus registered extensions).
    pub rules: DistributionRules,
    /// The output mode of every stage that feeds another stage.
    pub exchange_mode: OutputMode,
    /// Apply the distributed-correctness rewrites (see [`rewrites`]). Always on when running
    /// queries; tests turn it off to show the wrong answers each rewrite prevents.
    pub apply_rewrites: bool,
    /// Whether a worker stage's plan survives the wire exactly; without one, only the planner's own
    /// knowledge of datafusion-proto's gaps applies (see `wire_fidelity`).
    pub wire_check: Option<WireCheck>,
    /// Filter a join's probe side by what its build side's producer stage held, once it finished
    /// (see [`runtime_filters`]): on unless the session turned dynamic filters off
    /// (`datafusion.optimizer.enable_dynamic_filter_pushdown`). With blocking exchanges the target
    /// waits for the filter; with pipelined ones the filter reaches its running tasks.
    pub runtime_filters: bool,
    /// Run a job whose leaves read at most this many bytes whole, as one task, instead of cutting
    /// it into stages (see [`single_task`]); `None` cuts every job.
    pub single_task_bytes: Option<u64>,
}

impl fmt::Debug for JobGraphOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobGraphOptions")
            .field("exchange_mode", &self.exchange_mode)
            .field("apply_rewrites", &self.apply_rewrites)
            .field("wire_check", &self.wire_check.is_some())
            .field("runtime_filters", &self.runtime_filters)
            .field("single_task_bytes", &self.single_task_bytes)
            .finish_non_exhaustive()
    }
}

impl Default for JobGraphOptions {
    fn default() -> Self {
        Self {
            rules: DistributionRules::default(),
            exchange_mode: OutputMode::Pipelined,
            apply_rewrites: true,
            wire_check: None,
            runtime_filters: true,
            single_task_bytes: None,
        }
    }
}

/// A physical plan cut into stages; see the module docs.
#[derive(Debug, Clone)]
pub struct JobGraph {
    stages: Vec<Stage>,
    schema: SchemaRef,
    topology: JobTopology,
    runtime_filters: Vec<RuntimeFilter>,
    skew_joins: Vec<SkewJoin>,
    single_task: Option<SingleTask>,
}

impl JobGraph {
    /// Cuts `plan` (taken after every DataFusion physical optimizer rule) into stages with the
    /// default rules.
    pub fn try_new(plan: Arc<dyn ExecutionPlan>) -> Result<Self> {
        Self::try_new_with(plan, &JobGraphOptions::default())
    }

    /// Cuts `plan` into stages with `options`.
    pub fn try_new_with(plan: Arc<dyn ExecutionPlan>, options: &JobGraphOptions) -> Result<Self> {
        let schema = plan.schema();
        if let Some(limit) = options.single_task_bytes
            && let Some(single) = single_task::single_task_of(&plan, &options.rules, limit)
        {
            let stages = builder::build_whole_plan_stage(Arc::clone(&plan), options)?;
            // A whole plan that would not reach a worker exactly is cut as usual instead, so only
            // the stages that cannot travel run on the driver.
            if stages.iter().all(|s| s.placement == TaskPlacement::Worker) {
                let mut graph = Self::from_parts(stages, schema, Vec::new(), Vec::new())?;
                graph.single_task = Some(single);
                return Ok(graph);
            }
        }
        let plan = if options.apply_rewrites {
            rewrites::apply_all(plan)?
        } else {
            plan
        };
        let stages = builder::build_stages(plan, options)?;
        let filters = if options.runtime_filters {
            runtime_filters::find(&stages)
        } else {
            Vec::new()
        };
        let skew_joins = skew_joins::find(&stages);
        Self::from_parts(stages, schema, filters, skew_joins)
    }

    /// Assembles a graph from stages already in topological order (for tests and tools).
    pub fn from_stages(stages: Vec<Stage>, schema: SchemaRef) -> Result<Self> {
        Self::from_parts(stages, schema, Vec::new(), Vec::new())
    }

    fn from_parts(
        stages: Vec<Stage>,
        schema: SchemaRef,
        runtime_filters: Vec<RuntimeFilter>,
        skew_joins: Vec<SkewJoin>,
    ) -> Result<Self> {
        for (index, stage) in stages.iter().enumerate() {
            if let Some(bad) = stage.inputs.iter().find(|i| i.stage.0 >= index) {
                return datafusion::common::plan_err!(
                    "stage {index} reads stage {} which does not come before it",
                    bad.stage
                );
            }
        }
        for index in 0..stages.len() {
            let readers = stages
                .iter()
                .flat_map(|s| s.inputs.iter())
                .filter(|i| i.stage.0 == index)
                .count();
            if readers > 1 {
                return datafusion::common::plan_err!(
                    "stage {index} is read by {readers} inputs; a stage feeds exactly one input"
                );
            }
        }
        if stages.is_empty() {
            return datafusion::common::plan_err!("a job graph needs at least one stage");
        }
        // A filter's target starts only after its source finished: a target that does not read
        // the whole source (a producer below the join, or a join reading it `Forward`, partition
        // by partition) waits for it as if it did.
        let waits: Vec<(StageId, StageId)> = runtime_filters
            .iter()
            .filter(|f| f.delivery == FilterDelivery::BeforeStart)
            .filter(|f| {
                stages.get(f.target.0).is_some_and(|t| {
                    !t.inputs
                        .iter()
                        .any(|i| i.stage == f.source && i.mode != InputMode::Forward)
                })
            })
            .map(|f| (f.source, f.target))
            .collect();
        let topology = JobTopology::build(&stages, &waits)?;
        Ok(Self {
            stages,
            schema,
            topology,
            runtime_filters,
            skew_joins,
            single_task: None,
        })
    }

    /// The stages in topological order; the last is the final stage.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// One stage.
    pub fn stage(&self, id: StageId) -> Option<&Stage> {
        self.stages.get(id.0)
    }

    /// The final stage's id.
    pub fn final_stage(&self) -> StageId {
        StageId(self.stages.len().saturating_sub(1))
    }

    /// The job's output schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The runtime filters: which stage's output filters which stage's plan once it finished.
    pub fn runtime_filters(&self) -> &[RuntimeFilter] {
        &self.runtime_filters
    }

    /// The partitioned joins whose hot partitions the driver may split across tasks once their
    /// inputs finished (see [`skew_joins`]).
    pub fn skew_joins(&self) -> &[SkewJoin] {
        &self.skew_joins
    }

    /// Why the job runs whole as one task, when it does (see [`single_task`]).
    pub fn single_task(&self) -> Option<SingleTask> {
        self.single_task
    }

    /// The task regions, computed once when the graph was built.
    pub fn topology(&self) -> &JobTopology {
        &self.topology
    }

    /// The consumers of `stage`: (consumer stage, the input it reads it through).
    pub fn consumers(&self, stage: StageId) -> impl Iterator<Item = (StageId, StageInput)> + '_ {
        self.stages.iter().enumerate().flat_map(move |(id, s)| {
            s.inputs
                .iter()
                .filter(move |i| i.stage == stage)
                .map(move |i| (StageId(id), *i))
        })
    }

    /// How many times each output stream of `stage` is read: one replica per consumer partition for
    /// `Merge` and `Broadcast` inputs, one otherwise; one for the final stage (read by the job output).
    /// Every stage feeds at most one input, so there is no sum over consumers.
    pub fn replicas(&self, stage: StageId) -> usize {
        let total: usize = self
            .consumers(stage)
            .map(|(consumer, input)| {
                if input.mode.replicated() {
                    self.stages[consumer.0].partitions()
                } else {
                    1
                }
            })
            .sum();
        total.max(1)
    }
}
