//! The cluster runners. Local-cluster mode: the plan is cut into a job graph and run by a driver and
//! N workers in this process, which talk only through tonic gRPC and Arrow Flight on loopback — the
//! wire path separate processes use. Cluster mode: the same driver, with its workers in processes of
//! their own. Either cluster starts on the first query and serves every later query of the session.

use std::sync::Arc;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::{JobGraph, JobGraphOptions};
use sluice_runtime::codec::distributed_graph_options_with;
use sluice_runtime::runner::lazy_stream;
use sluice_runtime::{DriverHandle, JobRunner};
use tokio::sync::OnceCell;

use crate::local_cluster::{ClusterOptions, LocalCluster};
use crate::process_cluster::{ProcessCluster, ProcessClusterOptions};

/// Runs plans as job graphs on a local cluster.
#[derive(Debug, Clone)]
pub struct LocalClusterRunner {
    options: ClusterOptions,
    cluster: Arc<OnceCell<LocalCluster>>,
}

impl LocalClusterRunner {
    /// A runner whose cluster (started on first use) has `workers` workers whose Flight data plane
    /// uses `compression`.
    pub fn new(workers: usize, compression: Option<CompressionType>) -> Self {
        Self::with_options(ClusterOptions {
            workers,
            compression,
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
    pub async fn cluster(&self) -> Result<&LocalCluster> {
        let options = self.options.clone();
        self.cluster
            .get_or_try_init(|| LocalCluster::start(options))
            .await
    }
}

impl JobRunner for LocalClusterRunner {
    fn mode_name(&self) -> &'static str {
        "local-cluster"
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let graph = JobGraph::try_new_with(plan, &self.graph_options())?;
        let schema = graph.schema().clone();
        let runner = self.clone();
        Ok(lazy_stream(schema, async move {
            let cluster = runner.cluster().await?;
            Ok(cluster.execute(graph, task_ctx))
        }))
    }

    fn graph_options(&self) -> JobGraphOptions {
        distributed_graph_options_with(self.options.exchange)
    }

    fn driver(&self) -> Option<DriverHandle> {
        self.cluster.get().map(|cluster| cluster.driver().clone())
    }
}

/// Runs plans as job graphs on a cluster of processes (`--mode cluster`): the driver in this
/// process, workers in processes it starts (and any that join it).
#[derive(Debug, Clone)]
pub struct ProcessClusterRunner {
    options: ProcessClusterOptions,
    cluster: Arc<OnceCell<ProcessCluster>>,
}

impl ProcessClusterRunner {
    /// A runner whose cluster starts on first use.
    pub fn new(options: ProcessClusterOptions) -> Self {
        Self {
            options,
            cluster: Arc::new(OnceCell::new()),
        }
    }

    /// The cluster, starting it if this is the first use.
    pub async fn cluster(&self) -> Result<&ProcessCluster> {
        let options = self.options.clone();
        self.cluster
            .get_or_try_init(|| ProcessCluster::start(options))
            .await
    }
}

impl JobRunner for ProcessClusterRunner {
    fn mode_name(&self) -> &'static str {
        "cluster"
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let graph = JobGraph::try_new_with(plan, &self.graph_options())?;
        let schema = graph.schema().clone();
        let runner = self.clone();
        Ok(lazy_stream(schema, async move {
            let cluster = runner.cluster().await?;
            Ok(cluster.execute(graph, task_ctx))
        }))
    }

    fn graph_options(&self) -> JobGraphOptions {
        distributed_graph_options_with(self.options.exchange)
    }

    fn driver(&self) -> Option<DriverHandle> {
        self.cluster.get().map(|cluster| cluster.driver().clone())
    }
}
