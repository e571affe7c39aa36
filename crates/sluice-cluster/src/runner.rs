//! The cluster runners. Local-cluster mode: the plan is cut into a job graph and run by a driver and
//! N workers in this process, which talk only through tonic gRPC and Arrow Flight on loopback — the
//! wire path separate processes use. Cluster mode: the same driver, with its workers in processes of
//! their own. Either cluster starts on the first query and serves every later query of the session.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use futures::future::BoxFuture;
use sluice_planner::{JobGraph, OutputMode};
use sluice_runtime::DriverHandle;
use sluice_runtime::runner::{ClusterState, DriverBackend, DriverRunner};

use crate::local_cluster::{ClusterOptions, LocalCluster};
use crate::process_cluster::{ProcessCluster, ProcessClusterOptions};

impl DriverBackend for LocalCluster {
    type Options = ClusterOptions;
    const MODE: &'static str = "local-cluster";

    fn start(options: ClusterOptions) -> BoxFuture<'static, Result<Self>> {
        Box::pin(LocalCluster::start(options))
    }

    fn exchange(options: &ClusterOptions) -> OutputMode {
        options.exchange
    }

    fn handle(&self) -> &DriverHandle {
        self.driver()
    }

    fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        LocalCluster::execute(self, graph, context)
    }

    fn state(&self) -> BoxFuture<'_, Result<ClusterState>> {
        Box::pin(LocalCluster::state(self))
    }

    fn endpoints(&self) -> Vec<String> {
        vec![format!(
            "driver on {} (in-process workers)",
            self.driver_address()
        )]
    }
}

impl DriverBackend for ProcessCluster {
    type Options = ProcessClusterOptions;
    const MODE: &'static str = "cluster";

    fn start(options: ProcessClusterOptions) -> BoxFuture<'static, Result<Self>> {
        Box::pin(ProcessCluster::start(options))
    }

    fn exchange(options: &ProcessClusterOptions) -> OutputMode {
        options.exchange
    }

    fn handle(&self) -> &DriverHandle {
        self.driver()
    }

    fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        ProcessCluster::execute(self, graph, context)
    }

    fn state(&self) -> BoxFuture<'_, Result<ClusterState>> {
        Box::pin(ProcessCluster::state(self))
    }

    fn endpoints(&self) -> Vec<String> {
        vec![format!(
            "driver on {} (external workers: sluice worker --driver {})",
            self.driver_address(),
            self.driver_address()
        )]
    }
}

/// Runs plans as job graphs on a local cluster (started on the first query).
pub type LocalClusterRunner = DriverRunner<LocalCluster>;

/// Runs plans as job graphs on a cluster of processes (`--mode cluster`): the driver in this
/// process, workers in processes it starts (and any that join it).
pub type ProcessClusterRunner = DriverRunner<ProcessCluster>;
