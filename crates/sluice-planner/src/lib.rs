//! Sluice's distributed planner: the pure-code steps between a DataFusion physical plan and task
//! definitions.
//!
//! ```text
//!  physical plan ──rewrites──► JobGraph::try_new ──► stages (plans with StageInputExec<usize>)
//!        └── reads ≤ single_task_bytes ──────────────► one stage: the whole plan, one task
//!                                                       │
//!                                         JobGraph::topology ──► task regions + dependencies (computed once)
//!                                                       │
//!                                        input_keys ──► which producer streams each task reads
//! ```
//!
//! Nothing here performs IO or spawns tasks: every function is a deterministic transformation that is
//! unit-tested on its own. Execution lives in `sluice-runtime`.

pub mod distribution;
pub mod explain;
pub mod ids;
pub mod job_graph;
pub mod plan;
pub mod topology;

pub use distribution::{
    Boundary, ChildUsage, DistributedExec, DistributionRules, NodeDistribution,
};
pub use ids::{
    AttemptKey, InputKey, JobId, RegionId, StageId, StreamId, TaskAttempt, TaskId, TaskStreamKey,
    WorkerId,
};
pub use job_graph::input_keys::{task_input_keys, task_input_keys_of};
pub use job_graph::partition_reads::{InputReads, input_reads};
pub use job_graph::{
    DISTRIBUTED_BROADCAST_THRESHOLD, DISTRIBUTED_SETTINGS, FilterDelivery, InputMode, JobGraph,
    JobGraphOptions, OutputDistribution, OutputMode, RuntimeFilter, SingleTask, SkewJoin, Stage,
    StageInput, TaskPlacement, WireCheck, WireForm,
};
pub use plan::rescale::RescaleExec;
pub use plan::stage_input::StageInputExec;
pub use topology::{ComponentId, Dependency, JobTopology, TaskRegion};
