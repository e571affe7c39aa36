//! Job runners: the one interface through which every query executes.
//!
//! A [`JobRunner`] takes a DataFusion physical plan (after all optimizer rules) and returns the job's
//! output as a lazy record-batch stream: no work starts until the stream is polled, and dropping the
//! stream cancels the job. The session, the CLI, the TPC-H harness and the SQL logic test runner only
//! ever see this trait, so an execution mode plugs in by adding a runner.
//!
//! ```text
//!   physical plan ─► JobRunner::execute ─► SendableRecordBatchStream
//!                       ├─ local: DataFusion execute_stream, on the task runtime
//!                       ├─ local-graph: JobGraph + the driver + an in-process worker
//!                       └─ local-cluster (sluice-cluster): JobGraph + the driver + workers over
//!                          gRPC and Arrow Flight on loopback
//! ```

mod driven;
mod graph;
mod local;
mod state;

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::future::BoxFuture;
use futures::{TryStreamExt, stream};
use sluice_planner::JobGraphOptions;

use crate::driver::{DriverCounters, DriverHandle, progress_line};

pub use driven::{DriverBackend, DriverRunner};
pub use graph::{LocalGraph, LocalGraphOptions, LocalGraphRunner};
pub use local::{LocalRunner, spawn_stream};
pub use state::{ClusterState, WorkerState};

/// Executes a physical plan as a job and streams its output.
pub trait JobRunner: Debug + Send + Sync {
    /// The mode's name, as `--mode` spells it.
    fn mode_name(&self) -> &'static str;

    /// Starts `plan` lazily: the returned stream does the work as it is polled and cancels the job
    /// when dropped. Planning errors are returned here; execution errors arrive in the stream.
    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream>;

    /// Whether this runner cuts plans into job graphs whose tasks each run one partition (every
    /// runner but local mode's): such plans are prepared for it first (balanced scans).
    fn runs_job_graphs(&self) -> bool {
        true
    }

    /// How this runner cuts plans into job graphs (EXPLAIN DISTRIBUTED shows the same graph).
    fn graph_options(&self) -> JobGraphOptions {
        crate::codec::distributed_graph_options()
    }

    /// Starts now what the runner would start on its first query (a cluster and its workers), so a
    /// server is ready before its first client; returns lines naming its endpoints (none for
    /// in-process modes).
    fn start_now(&self) -> BoxFuture<'static, Result<Vec<String>>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// What the cluster holds now (jobs, tasks, stream outputs, memory per worker), once it
    /// started; `None` for modes without a driver or before the first query.
    fn cluster_state(&self) -> BoxFuture<'static, Result<Option<ClusterState>>> {
        Box::pin(async { Ok(None) })
    }

    /// The driver that runs this runner's jobs, once it started; `None` for modes without one.
    fn driver(&self) -> Option<DriverHandle> {
        None
    }

    /// One line describing the running jobs' progress (per stage: tasks done of total, rows), for a
    /// terminal; `None` when the mode has none or nothing runs.
    fn progress_line(&self) -> BoxFuture<'static, Option<String>> {
        let driver = self.driver();
        Box::pin(async move { progress_line(&driver?.progress().await.ok()?) })
    }

    /// Lines a user should read since the last call (a lost worker, a retried region), oldest
    /// first; empty for modes without a driver.
    fn take_notices(&self) -> BoxFuture<'static, Vec<String>> {
        let driver = self.driver();
        Box::pin(async move {
            match driver {
                Some(driver) => driver.take_notices().await.unwrap_or_default(),
                None => Vec::new(),
            }
        })
    }

    /// What the driver's jobs did so far: retries, spilled and shuffled bytes (zero for modes
    /// without a driver).
    fn counters(&self) -> BoxFuture<'static, DriverCounters> {
        let driver = self.driver();
        Box::pin(async move {
            match driver {
                Some(driver) => driver
                    .snapshot()
                    .await
                    .map(|snapshot| snapshot.counters)
                    .unwrap_or_default(),
                None => DriverCounters::default(),
            }
        })
    }
}

/// A stream of `schema` that runs `start` on its first poll and then yields what `start` returned:
/// how a runner stays lazy while the thing it runs on (a driver, a cluster) starts on first use.
pub fn lazy_stream<F>(schema: SchemaRef, start: F) -> SendableRecordBatchStream
where
    F: Future<Output = Result<SendableRecordBatchStream>> + Send + 'static,
{
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        stream::once(start).try_flatten(),
    ))
}
