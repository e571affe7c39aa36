//! The runner of every mode with a driver: a backend (the driver and its workers) started on the
//! first query and serving every later one of the session, whose jobs it runs as job graphs.
//!
//! ```text
//!   physical plan ─► stage_file_writes ─► JobGraph::try_new_with(exchange mode)
//!                 ─► lazy stream ─► backend (started once) ─► Driver::execute(graph)
//!                 (a file write's stream inside its StagedWriteGuard)
//! ```
//!
//! Invariants: nothing starts before the first stream is polled; a backend that failed to start is
//! tried again by the next query; every query of a runner (and its clones) runs on one backend.

use std::fmt;
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use futures::future::BoxFuture;
use sluice_planner::{JobGraph, JobGraphOptions, OutputMode};
use tokio::sync::OnceCell;

use super::{ClusterState, JobRunner, lazy_stream};
use crate::codec::distributed_graph_options_with;
use crate::driver::DriverHandle;
use crate::write::{StagedWriteGuard, stage_file_writes};

/// A driver with its workers, as a [`DriverRunner`] starts and uses it.
pub trait DriverBackend: Send + Sync + 'static {
    /// How to start it.
    type Options: Clone + fmt::Debug + Send + Sync + 'static;
    /// The mode's name, as `--mode` spells it.
    const MODE: &'static str;

    /// Starts the driver and its workers.
    fn start(options: Self::Options) -> BoxFuture<'static, Result<Self>>
    where
        Self: Sized;
    /// The output mode of every exchange of its jobs.
    fn exchange(options: &Self::Options) -> OutputMode;
    /// The driver's handle (progress, notices, counters).
    fn handle(&self) -> &DriverHandle;
    /// Runs `graph`; the stream is lazy and cancels the job when dropped.
    fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream;
    /// What the driver and its workers hold now.
    fn state(&self) -> BoxFuture<'_, Result<ClusterState>>;
    /// Lines naming where it listens (the driver's address), for a server to print at start.
    fn endpoints(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Runs plans as job graphs on a `B` started on first use; see the module docs.
pub struct DriverRunner<B: DriverBackend> {
    options: B::Options,
    backend: Arc<OnceCell<B>>,
}

impl<B: DriverBackend> Clone for DriverRunner<B> {
    fn clone(&self) -> Self {
        Self {
            options: self.options.clone(),
            backend: Arc::clone(&self.backend),
        }
    }
}

impl<B: DriverBackend> fmt::Debug for DriverRunner<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverRunner")
            .field("mode", &B::MODE)
            .field("options", &self.options)
            .field("started", &self.backend.initialized())
            .finish()
    }
}

impl<B: DriverBackend> Default for DriverRunner<B>
where
    B::Options: Default,
{
    fn default() -> Self {
        Self::with_options(B::Options::default())
    }
}

impl<B: DriverBackend> DriverRunner<B> {
    /// A runner whose backend starts with `options` on first use.
    pub fn with_options(options: B::Options) -> Self {
        Self {
            options,
            backend: Arc::new(OnceCell::new()),
        }
    }

    /// The backend, starting it if this is the first use.
    pub async fn backend(&self) -> Result<&B> {
        let options = self.options.clone();
        self.backend.get_or_try_init(|| B::start(options)).await
    }
}

impl<B: DriverBackend> JobRunner for DriverRunner<B> {
    fn mode_name(&self) -> &'static str {
        B::MODE
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let (plan, staging) = stage_file_writes(plan)?;
        let options = crate::codec::with_session_switches(
            self.graph_options(),
            task_ctx.session_config().options(),
        );
        let graph = JobGraph::try_new_with(plan, &options)?;
        let schema = graph.schema().clone();
        let runner = self.clone();
        let runtime = task_ctx.runtime_env();
        let output = lazy_stream(schema, async move {
            Ok(runner.backend().await?.execute(graph, task_ctx))
        });
        Ok(match staging {
            Some(staging) => Box::pin(StagedWriteGuard::new(output, staging, runtime)),
            None => output,
        })
    }

    fn graph_options(&self) -> JobGraphOptions {
        distributed_graph_options_with(B::exchange(&self.options))
    }

    fn driver(&self) -> Option<DriverHandle> {
        self.backend.get().map(|backend| backend.handle().clone())
    }

    fn cluster_state(&self) -> BoxFuture<'static, Result<Option<ClusterState>>> {
        let runner = self.clone();
        Box::pin(async move {
            match runner.backend.get() {
                Some(backend) => Ok(Some(backend.state().await?)),
                None => Ok(None),
            }
        })
    }

    fn start_now(&self) -> BoxFuture<'static, Result<Vec<String>>> {
        let runner = self.clone();
        Box::pin(async move { Ok(runner.backend().await?.endpoints()) })
    }
}
