//! Sluice's job runtime: everything that runs a job graph's tasks.
//!
//! ```text
//!   JobGraph + JobTopology ──► executor (driver loop: regions in dependency order)
//!                                 │ per task
//!                                 ▼
//!        task::prepare_task: stage plan + ShuffleReaderExec leaves + ShuffleWriterExec root
//!                                 │ writes / reads
//!                                 ▼
//!                         stream_store: channels × replicas per task, bounded memory, spill
//! ```
//!
//! This crate is the in-process path: the distributed runtime reuses task preparation, the writer and
//! reader nodes and the stream store, and adds RPC and Arrow Flight around them. `scheduler` is the
//! driver's pure state machine (events in, actions out) that the cluster runtime's driver actor will
//! wrap; `analyze` builds the per-stage rows `EXPLAIN ANALYZE` adds in every distributed mode.

pub mod analyze;
pub mod codec;
pub mod executor;
pub mod plan;
pub mod scheduler;
pub mod stream_store;
pub mod task;

pub use executor::{ExecutorOptions, execute_graph, execute_graph_with};
pub use stream_store::{
    JobId, StreamStore, TaskSender, TaskStreamKey, TaskStreams, receiver_stream,
};
pub use task::{TaskInput, assemble_task, prepare_task, task_inputs};
