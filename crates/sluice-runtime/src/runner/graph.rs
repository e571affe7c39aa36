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
use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::{JobGraph, JobGraphOptions, OutputMode, WorkerId};
use tokio::sync::OnceCell;

use super::{JobRunner, lazy_stream};
use crate::codec::distributed_graph_options_with;
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

/// Runs plans as job graphs in this process; the driver starts on the first query and serves every
/// later one of the session.
#[derive(Debug, Clone, Default)]
pub struct LocalGraphRunner {
    options: LocalGraphOptions,
    graph: Arc<OnceCell<LocalGraph>>,
}

impl LocalGraphRunner {
    /// A runner with explicit options (tests: fault hooks, retries).
    pub fn with_options(options: LocalGraphOptions) -> Self {
        Self {
            options,
            graph: Arc::new(OnceCell::new()),
        }
    }

    /// The driver and worker, starting them if this is the first use.
    pub async fn local_graph(&self) -> Result<&LocalGraph> {
        let options = self.options.clone();
        self.graph
            .get_or_try_init(|| LocalGraph::start(options))
            .await
    }
}

impl JobRunner for LocalGraphRunner {
    fn mode_name(&self) -> &'static str {
        "local-graph"
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
            let local = runner.local_graph().await?;
            Ok(local.driver.execute(graph, task_ctx))
        }))
    }

    fn graph_options(&self) -> JobGraphOptions {
        distributed_graph_options_with(self.options.exchange)
    }

    fn driver(&self) -> Option<DriverHandle> {
        self.graph.get().map(|local| local.driver.handle().clone())
    }
}
