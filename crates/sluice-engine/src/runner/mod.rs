//! Job runners: the one interface through which every query executes.
//!
//! A [`JobRunner`] takes a DataFusion physical plan (after all optimizer rules) and returns the job's
//! output as a lazy record-batch stream: no work starts until the stream is polled, and dropping the
//! stream cancels the job. The CLI, the TPC-H harness and the SQL logic test runner only ever see this
//! trait, so a new execution mode plugs in by adding a runner and an [`ExecutionMode`] variant.
//!
//! ```text
//!   SQL ─► logical plan ─► physical plan ─► JobRunner::execute ─► SendableRecordBatchStream
//!                                              │
//!                                              ├─ local: DataFusion execute_stream
//!                                              └─ local-graph: JobGraph + in-process job executor
//! ```

mod graph;
mod local;

use std::fmt::Debug;
use std::sync::Arc;

use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;

pub use graph::LocalGraphRunner;
pub use local::LocalRunner;

use crate::config::ExecutionMode;
use crate::error::Result;

/// Executes a physical plan as a job and streams its output.
pub trait JobRunner: Debug + Send + Sync {
    /// The mode this runner implements.
    fn mode(&self) -> ExecutionMode;

    /// Starts `plan` lazily: the returned stream does the work as it is polled and cancels the job when
    /// dropped. Planning errors are returned here; execution errors arrive in the stream.
    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream>;
}

/// The runner for `mode`.
pub fn runner_for(mode: ExecutionMode) -> Arc<dyn JobRunner> {
    match mode {
        ExecutionMode::Local => Arc::new(LocalRunner),
        ExecutionMode::LocalGraph => Arc::new(LocalGraphRunner),
    }
}
