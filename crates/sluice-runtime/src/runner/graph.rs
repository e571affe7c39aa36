//! Local-graph mode: the plan is cut into a job graph and run by the driver — the same actor and
//! scheduler a cluster runs — on an in-process worker, through the same task code, stream store,
//! shuffle writer and readers. Only the transport differs: direct calls instead of gRPC, direct
//! store reads instead of Arrow Flight. It proves the job graph and the driver against local mode
//! without networking.
//!
//! ```text
//!   JobGraph ─► Driver (actor + JobScheduler) ── InProcessClient ──► worker "in-process worker"
//!                  └─ driver executor (driver stages)                   │ stream store
//!   job output ◄── InProcessNetwork (reads either store) ◄──────────────┘
//! ```

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use futures::future::BoxFuture;
use sluice_planner::{JobGraph, OutputMode, WorkerId};

use super::driven::{DriverBackend, DriverRunner};
use super::state::{ClusterState, WorkerState};
use crate::driver::{
    Driver, DriverHandle, DriverOptions, DriverSnapshot, ExecutorEndpoint, Liveness,
    WorkerRegistration,
};
use crate::stream_store::StoreCounts;
use crate::transport::{InProcessClient, InProcessNetwork};
use crate::worker::{Worker, WorkerOptions};

/// Address of the driver's executor in this process.
const EXECUTOR_ADDRESS: &str = "in-process:driver";
/// Address of the worker in this process.
const WORKER_ADDRESS: &str = "in-process:worker";

/// How the in-process graph runs.
#[derive(Debug, Clone)]
pub struct LocalGraphOptions {
    /// The driver's options.
    pub driver: DriverOptions,
    /// The worker's options (its slots bound how many tasks run at once).
    pub worker: WorkerOptions,
    /// The output mode of every exchange.
    pub exchange: OutputMode,
}

impl Default for LocalGraphOptions {
    fn default() -> Self {
        Self {
            driver: DriverOptions::default(),
            worker: WorkerOptions {
                // Every task of a region runs at once; in-process, nothing else competes for them.
                slots: 4096,
                ..WorkerOptions::default()
            },
            exchange: OutputMode::Pipelined,
        }
    }
}

/// A driver and one worker in this process.
#[derive(Debug)]
pub struct LocalGraph {
    driver: Driver,
    executor: Worker,
    worker: Worker,
}

impl LocalGraph {
    /// Starts the driver (on the current runtime) and registers the worker.
    pub async fn start(options: LocalGraphOptions) -> Result<Self> {
        let network = InProcessNetwork::default();
        let fetcher = Arc::new(network.clone());
        let executor = Worker::new(
            "the driver",
            EXECUTOR_ADDRESS,
            options.worker.clone(),
            fetcher.clone(),
        )?;
        let worker = Worker::new(
            "in-process worker",
            WORKER_ADDRESS,
            options.worker.clone(),
            fetcher.clone(),
        )?;
        network.add(&executor);
        network.add(&worker);
        let driver = Driver::start(
            options.driver,
            ExecutorEndpoint {
                address: EXECUTOR_ADDRESS.to_string(),
                client: Arc::new(InProcessClient(executor.clone())),
            },
            fetcher,
        );
        executor.set_reporter(WorkerId::DRIVER, driver.reporter())?;
        let id = driver
            .register_worker(WorkerRegistration {
                address: WORKER_ADDRESS.to_string(),
                slots: worker.slots(),
                client: Arc::new(InProcessClient(worker.clone())),
                liveness: Liveness::InProcess,
            })
            .await?;
        worker.set_reporter(id, driver.reporter())?;
        Ok(Self {
            driver,
            executor,
            worker,
        })
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The driver's state and, for the executor and the worker, attempts running and streams held.
    pub async fn snapshot(&self) -> Result<(DriverSnapshot, Vec<(usize, StoreCounts)>)> {
        let driver = self.driver.snapshot().await?;
        Ok((driver, vec![self.executor.counts(), self.worker.counts()]))
    }
}

impl DriverBackend for LocalGraph {
    type Options = LocalGraphOptions;
    const MODE: &'static str = "local-graph";

    fn start(options: LocalGraphOptions) -> BoxFuture<'static, Result<Self>> {
        Box::pin(LocalGraph::start(options))
    }

    fn exchange(options: &LocalGraphOptions) -> OutputMode {
        options.exchange
    }

    fn handle(&self) -> &DriverHandle {
        self.driver.handle()
    }

    fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        self.driver.execute(graph, context)
    }

    fn state(&self) -> BoxFuture<'_, Result<ClusterState>> {
        Box::pin(async move {
            let driver = self.driver.snapshot().await?;
            let mut worker = WorkerState::of("worker", &self.worker);
            if let Some(seen) = driver.workers.first() {
                worker = worker.seen_by_driver(seen);
            }
            Ok(ClusterState {
                workers: vec![WorkerState::of("driver", &self.executor), worker],
                driver,
            })
        })
    }
}

/// Runs plans as job graphs in this process; the driver starts on the first query and serves every
/// later one of the session.
pub type LocalGraphRunner = DriverRunner<LocalGraph>;
