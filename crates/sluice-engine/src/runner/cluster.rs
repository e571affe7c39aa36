//! Local-cluster mode: the plan is cut into a job graph and run by a driver and N workers in this
//! process, which talk only through tonic gRPC and Arrow Flight on loopback — the wire path separate
//! processes use. The cluster starts on the first query and serves every later query of the session.

use std::sync::Arc;

use datafusion::arrow::ipc::CompressionType;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::future::BoxFuture;
use futures::{TryStreamExt, stream};
use sluice_cluster::{ClusterOptions, JobProgress, LocalCluster, WorkerOptions};
use sluice_planner::JobGraph;
use tokio::sync::OnceCell;

use super::JobRunner;
use crate::config::{ExecutionMode, FlightCompression};
use crate::error::Result;

/// Runs plans as job graphs on a local cluster.
#[derive(Debug, Clone)]
pub struct LocalClusterRunner {
    options: ClusterOptions,
    cluster: Arc<OnceCell<LocalCluster>>,
}

impl LocalClusterRunner {
    /// A runner whose cluster (started on first use) has `workers` workers whose Flight data plane
    /// uses `compression`.
    pub fn new(workers: usize, compression: FlightCompression) -> Self {
        let compression = match compression {
            FlightCompression::None => None,
            FlightCompression::Lz4 => Some(CompressionType::LZ4_FRAME),
            FlightCompression::Zstd => Some(CompressionType::ZSTD),
        };
        Self::with_options(ClusterOptions {
            workers,
            worker: WorkerOptions {
                compression,
                ..WorkerOptions::default()
            },
            ..ClusterOptions::default()
        })
    }

    /// A runner with explicit cluster options (tests: fault hooks, task slots).
    pub fn with_options(options: ClusterOptions) -> Self {
        Self {
            options,
            cluster: Arc::new(OnceCell::new()),
        }
    }

    /// The cluster, starting it if this is the first use.
    pub async fn cluster(&self) -> datafusion::common::Result<&LocalCluster> {
        let options = self.options.clone();
        self.cluster
            .get_or_try_init(|| LocalCluster::start(options))
            .await
    }
}

impl JobRunner for LocalClusterRunner {
    fn mode(&self) -> ExecutionMode {
        ExecutionMode::LocalCluster
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let graph = JobGraph::try_new(plan)?;
        let schema = graph.schema().clone();
        let runner = self.clone();
        let start = async move {
            let cluster = runner.cluster().await?;
            Ok::<_, datafusion::common::DataFusionError>(cluster.execute(graph, task_ctx))
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream::once(start).try_flatten(),
        )))
    }

    fn progress_line(&self) -> BoxFuture<'static, Option<String>> {
        let cell = Arc::clone(&self.cluster);
        Box::pin(async move {
            let jobs = cell.get()?.progress().await.ok()?;
            let lines: Vec<String> = jobs.iter().map(JobProgress::line).collect();
            (!lines.is_empty()).then(|| lines.join(" | "))
        })
    }
}
