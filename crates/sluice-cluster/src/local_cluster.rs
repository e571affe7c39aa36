//! A local cluster: one driver and N workers in this process, talking only through tonic gRPC and
//! Arrow Flight on 127.0.0.1 ephemeral ports — the same wire path separate processes use. The only
//! shortcut is the one every worker takes: a task reading a stream of its own worker reads the store
//! directly.
//!
//! Invariant: dropping the cluster stops every server, actor and task it started.

use std::time::Duration;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use sluice_planner::{JobGraph, OutputMode};
use sluice_runtime::runner::ClusterState;
use sluice_runtime::{DriverHandle, DriverOptions, DriverSnapshot, JobProgress, WorkerOptions};
use std::sync::Arc;

use crate::auth::{ClusterLink, ClusterSecret, ClusterTls};
use crate::driver_server::ClusterDriver;
use crate::worker_server::WorkerServer;

/// How to start a local cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of workers (at least 1).
    pub workers: usize,
    /// Options of every worker (and of the driver's executor).
    pub worker: WorkerOptions,
    /// Options of the driver.
    pub driver: DriverOptions,
    /// Arrow IPC compression on the Flight data plane (`None` for uncompressed).
    pub compression: Option<CompressionType>,
    /// How often workers send a heartbeat.
    pub heartbeat_interval: Duration,
    /// The output mode of every exchange.
    pub exchange: OutputMode,
    /// The secret every call carries (`None`: a random one per cluster).
    pub secret: Option<ClusterSecret>,
    /// Mutual TLS on every call (`None`: plain TCP on loopback).
    pub tls: Option<ClusterTls>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            workers: 4,
            worker: WorkerOptions::default(),
            driver: DriverOptions::default(),
            compression: None,
            heartbeat_interval: Duration::from_secs(2),
            exchange: OutputMode::Pipelined,
            secret: None,
            tls: None,
        }
    }
}

/// What the cluster holds right now, for tests and diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterSnapshot {
    /// The driver actor's state.
    pub driver: DriverSnapshot,
    /// Per worker, the driver's executor first: task attempts running.
    pub worker_tasks: Vec<usize>,
    /// Per worker, the driver's executor first: task outputs held in its stream store.
    pub worker_outputs: Vec<usize>,
    /// Per worker, the driver's executor first: attempt futures still alive (running, or stopped
    /// inside an operator's long poll; not part of idleness).
    pub worker_live_attempts: Vec<usize>,
}

impl ClusterSnapshot {
    /// Nothing runs and nothing is stored anywhere.
    pub fn is_idle(&self) -> bool {
        self.driver.jobs == 0
            && self.driver.scheduler_jobs == 0
            && self.driver.running_tasks == 0
            && self.worker_tasks.iter().all(|t| *t == 0)
            && self.worker_outputs.iter().all(|o| *o == 0)
    }
}

/// A driver and its workers in this process; see the module docs.
pub struct LocalCluster {
    driver: ClusterDriver,
    workers: Vec<WorkerServer>,
    link: ClusterLink,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("driver", &self.driver.address())
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl LocalCluster {
    /// Starts the driver and `options.workers` workers; each registers with the driver over gRPC.
    pub async fn start(options: ClusterOptions) -> Result<Self> {
        if options.workers == 0 {
            return Err(DataFusionError::Configuration(
                "a local cluster needs at least one worker".to_string(),
            ));
        }
        let link = ClusterLink::for_cluster(options.secret.as_ref(), options.tls.as_ref())?;
        let driver = ClusterDriver::start(
            options.driver.clone(),
            options.worker.clone(),
            options.compression,
            link.clone(),
        )
        .await?;
        let mut workers = Vec::with_capacity(options.workers);
        for index in 0..options.workers {
            let mut worker = WorkerServer::start(
                format!("worker {}", index + 1),
                options.worker.clone(),
                options.compression,
                link.clone(),
            )
            .await?;
            worker
                .join(
                    driver.address(),
                    options.heartbeat_interval,
                    options.driver.heartbeat_timeout * 3,
                )
                .await?;
            workers.push(worker);
        }
        Ok(Self {
            driver,
            workers,
            link,
        })
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The driver's handle (progress, notices, snapshots).
    pub fn driver(&self) -> &DriverHandle {
        self.driver.driver().handle()
    }

    /// Runs `graph` on the cluster; the stream is lazy and cancels the job when dropped.
    pub fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        self.driver.driver().execute(graph, context)
    }

    /// What the driver and the workers hold now.
    pub async fn snapshot(&self) -> Result<ClusterSnapshot> {
        let driver = self.driver.driver().snapshot().await?;
        let workers: Vec<&sluice_runtime::Worker> = std::iter::once(self.driver.executor())
            .chain(self.workers.iter().map(|w| w.worker()))
            .collect();
        let counts: Vec<_> = workers.iter().map(|w| w.counts()).collect();
        Ok(ClusterSnapshot {
            driver,
            worker_tasks: counts.iter().map(|(t, _)| *t).collect(),
            worker_outputs: counts.iter().map(|(_, s)| s.outputs).collect(),
            worker_live_attempts: workers.iter().map(|w| w.live_attempts()).collect(),
        })
    }

    /// What the driver and every worker hold now (over the same gRPC path as a process cluster).
    pub async fn state(&self) -> Result<ClusterState> {
        self.driver.state(&self.link).await
    }

    /// The progress of every running job.
    pub async fn progress(&self) -> Result<Vec<JobProgress>> {
        self.driver.driver().progress().await
    }

    /// Worker `index`'s address (gRPC `WorkerService` and Flight), for tests.
    pub fn worker_address(&self, index: usize) -> Option<&str> {
        self.workers.get(index).map(|w| w.worker().address())
    }

    /// The secret its calls carry, for tests that call it themselves.
    pub fn secret(&self) -> &ClusterSecret {
        self.link.secret()
    }

    /// The driver's address (gRPC `DriverService` and the executor's Flight), for tests.
    pub fn driver_address(&self) -> &str {
        self.driver.address()
    }
}
