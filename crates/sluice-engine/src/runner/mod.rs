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
//!                                              ├─ local-graph: JobGraph + in-process job executor
//!                                              └─ local-cluster: JobGraph + driver and workers
//!                                                   (gRPC + Arrow Flight on loopback)
//! ```

mod cluster;
mod graph;
mod local;

use std::fmt::Debug;
use std::sync::Arc;

use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use futures::future::BoxFuture;

pub use cluster::LocalClusterRunner;
pub use graph::LocalGraphRunner;
pub use local::LocalRunner;

use crate::config::{ExecutionMode, SluiceConfig};
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

    /// One line describing the running jobs' progress (per stage: tasks done of total, rows), for a
    /// terminal; `None` when the mode has none or nothing runs.
    fn progress_line(&self) -> BoxFuture<'static, Option<String>> {
        Box::pin(async { None })
    }
}

/// The runner for `config`'s mode (`workers` and `flight_compression` size a local cluster).
pub fn runner_for(config: &SluiceConfig) -> Arc<dyn JobRunner> {
    match config.mode.value {
        ExecutionMode::Local => Arc::new(LocalRunner),
        ExecutionMode::LocalGraph => Arc::new(LocalGraphRunner),
        ExecutionMode::LocalCluster => Arc::new(LocalClusterRunner::new(
            config.workers.value,
            config.flight_compression.value,
        )),
    }
}
