//! A local cluster: one driver and N workers in this process, talking only through tonic gRPC and
//! Arrow Flight on 127.0.0.1 ephemeral ports — the same wire path separate processes use. The only
//! shortcut is the one every worker takes: a task reading a stream of its own worker reads the store
//! directly.
//!
//! Invariant: dropping the cluster stops every server, actor and task it started.

use std::sync::Arc;
use std::time::Duration;

use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use sluice_planner::JobGraph;

use crate::driver::{Driver, DriverOptions, RemoteReporter};
use crate::net::endpoint;
use crate::proto;
use crate::proto::driver_service_client::DriverServiceClient;
use crate::store::StoreCounts;
use crate::worker::{Worker, WorkerOptions};

/// How often workers send a heartbeat.
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);

/// How to start a local cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of workers (at least 1).
    pub workers: usize,
    /// Options of every worker.
    pub worker: WorkerOptions,
    /// Options of the driver.
    pub driver: DriverOptions,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            workers: 4,
            worker: WorkerOptions::default(),
            driver: DriverOptions::default(),
        }
    }
}

/// What the cluster holds right now, for tests and diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterSnapshot {
    /// The driver actor's state.
    pub driver: crate::driver::DriverSnapshot,
    /// Per worker: task attempts running.
    pub worker_tasks: Vec<usize>,
    /// Per worker: task outputs held in its stream store.
    pub worker_outputs: Vec<usize>,
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
    driver: Driver,
    workers: Vec<Worker>,
    _heartbeats: Vec<SpawnedTask<()>>,
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
        let driver = Driver::start(options.driver.clone(), options.worker.clone()).await?;
        let channel = endpoint(driver.address())?
            .connect()
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        let client = DriverServiceClient::new(channel);
        let mut workers = Vec::with_capacity(options.workers);
        let mut heartbeats = Vec::with_capacity(options.workers);
        for index in 0..options.workers {
            let worker = Worker::start(format!("worker {index}"), options.worker.clone()).await?;
            let response = client
                .clone()
                .register_worker(proto::RegisterWorkerRequest {
                    address: worker.address().to_string(),
                    slots: u32::try_from(options.worker.slots.max(1)).unwrap_or(u32::MAX),
                })
                .await
                .map_err(|status| {
                    DataFusionError::Execution(format!(
                        "worker {index} could not register with the driver: {}",
                        status.message()
                    ))
                })?;
            let worker_id = response.into_inner().worker_id;
            worker.set_reporter(worker_id, Arc::new(RemoteReporter::new(client.clone())))?;
            let mut beat = client.clone();
            heartbeats.push(SpawnedTask::spawn(async move {
                let mut interval = tokio::time::interval(HEARTBEAT_INTERVAL);
                loop {
                    interval.tick().await;
                    let _ = beat.heartbeat(proto::HeartbeatRequest { worker_id }).await;
                }
            }));
            workers.push(worker);
        }
        Ok(Self {
            driver,
            workers,
            _heartbeats: heartbeats,
        })
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Runs `graph` on the cluster; the stream is lazy and cancels the job when dropped.
    pub fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        self.driver.execute(graph, context)
    }

    /// What the driver and the workers hold now.
    pub async fn snapshot(&self) -> Result<ClusterSnapshot> {
        let driver = self.driver.snapshot().await?;
        let counts: Vec<(usize, StoreCounts)> = self.workers.iter().map(Worker::counts).collect();
        Ok(ClusterSnapshot {
            driver,
            worker_tasks: counts.iter().map(|(t, _)| *t).collect(),
            worker_outputs: counts.iter().map(|(_, s)| s.outputs).collect(),
        })
    }

    /// The progress of every running job.
    pub async fn progress(&self) -> Result<Vec<crate::JobProgress>> {
        self.driver.progress().await
    }

    /// Worker `index`'s address (gRPC `WorkerService` and Flight), for tests.
    pub fn worker_address(&self, index: usize) -> Option<&str> {
        self.workers.get(index).map(Worker::address)
    }
}
