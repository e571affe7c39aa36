//! Sluice's job runtime: everything that runs a job graph's tasks, whatever carries them.
//!
//! ```text
//!   JobGraph ─► driver (actor over the pure JobScheduler: regions, attempts, retries, placement)
//!                 │ TaskDefinition (definition)            ▲ TaskStatusReport
//!                 ▼ WorkerClient (transport)               │ StatusReporter
//!               worker: task::assemble_task = ShuffleReaderExec leaves + stage plan
//!                       + ShuffleWriterExec root, run on the task runtime
//!                 │ writes                                 ▲ reads (same store, or StreamFetcher)
//!                 ▼                                        │
//!               stream_store: per attempt, pipelined (take-once) or blocking (replayable) outputs
//!   job output ◄─ the final stage's streams (driver::output)
//! ```
//!
//! The in-process transport lives here ([`transport`]), so `local-graph` runs the very driver and
//! worker code a cluster runs; `sluice-cluster` adds tonic gRPC and Arrow Flight implementations of
//! the same traits. [`runner`] holds the `JobRunner` trait and the local and local-graph runners;
//! [`error`] carries errors across hops with their kind and text; [`analyze`] builds the per-stage
//! rows `EXPLAIN ANALYZE` adds in every distributed mode; [`faults`] holds the named fault points
//! tests fire in workers; [`object_stores`] is each process's registry of object stores, built from
//! its own environment.

pub mod analyze;
pub mod cluster_manager;
pub mod codec;
pub mod definition;
pub mod delta;
pub mod driver;
pub mod error;
pub mod faults;
pub mod key_bloom;
pub mod key_bloom_expr;
mod memory;
pub mod object_stores;
pub mod options;
pub mod plan;
pub mod runner;
pub mod runtime_filter;
pub mod scaling;
pub mod scheduler;
pub mod simulation;
pub mod stream_store;
pub mod task;
pub mod task_runtime;
pub mod transport;
pub mod worker;
pub mod write;

pub use definition::{
    LiveRuntimeFilter, RuntimeFilterUpdate, StagePlan, StreamLocator, TaskDefinition,
    TaskInputStreams, TaskState, TaskStatusReport,
};
pub use driver::{
    Driver, DriverCounters, DriverHandle, DriverOptions, DriverSnapshot, JobLabel, JobProgress,
    JobRecord, JobState, StageProgress, StageSummary, TaskRecord, TaskRecordState, WorkerSnapshot,
    stage_summaries, telemetry,
};
pub use error::{ErrorKind, RemoteError, SluiceFailure};
pub use runner::{JobRunner, LocalGraphOptions, LocalGraphRunner, LocalRunner};
pub use stream_store::{StoreCounts, StreamStore, TaskSender, TaskStreams, receiver_stream};
pub use task::{TaskInput, assemble_task, task_inputs};
pub use worker::{Worker, WorkerOptions};

/// Makes ring the process's default TLS provider (once; a later call changes nothing). tonic's
/// TLS setups take the process default, and the build holds two providers (the Delta kernel's
/// HTTP client brings rustls's aws-lc-rs provider beside the ring one every other client uses),
/// so without this there would be none: every TLS setup calls it first.
pub fn install_default_crypto_provider() {
    // Already installed: the first one stands.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
