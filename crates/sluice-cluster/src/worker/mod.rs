//! A worker: runs task attempts and keeps their output streams. It serves `WorkerService` (RunTask,
//! StopTask, CleanUpJob, StopWorker) and Arrow Flight (its stream store) on one address, and reports
//! each attempt's status to the driver.
//!
//! ```text
//!   RunTask(bytes) ─► decode TaskDefinition ─► task runner (JoinSet) ─► task::run_attempt
//!                                                   │ Running ─► report
//!                                                   │ execute: readers ─► stage plan ─► writer ─► store
//!                                                   └ Succeeded | Failed(error) | Canceled ─► report
//!   StopTask ─► the attempt's stop signal (its stream is dropped, its output removed)
//!   CleanUpJob ─► stop the job's attempts, remove its streams
//! ```
//!
//! Invariants: malformed request bytes get an `InvalidArgument` reply and the worker keeps serving;
//! every task runs inside the worker's `JoinSet`, so dropping the worker aborts them all; each attempt
//! reports exactly one final status (sequence 2) after its `Running` (sequence 1).

mod service;
mod task;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::runtime::{JoinSet, SpawnedTask};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::future::BoxFuture;
use tokio::sync::{Notify, mpsc, oneshot};
use tonic::transport::Server;

use crate::flight::{FlightClients, StreamFlightService};
use crate::net::{bind_loopback, incoming};
use crate::proto;
use crate::store::{StoreCounts, WorkerStreamStore};
use crate::wire::AttemptKey;

pub(crate) use service::worker_service;

/// Names a task attempt for a [`FaultHook`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskAttemptRef {
    /// The job.
    pub job: u64,
    /// The stage.
    pub stage: usize,
    /// The partition.
    pub partition: usize,
    /// The attempt (0 for the first).
    pub attempt: usize,
}

/// A test hook: called before each task attempt runs; `Some(message)` makes the attempt fail with it.
pub type FaultHook = Arc<dyn Fn(&TaskAttemptRef) -> Option<String> + Send + Sync>;

/// How a worker runs.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Task attempts it runs at once.
    pub slots: usize,
    /// How long a read waits for a stream whose task has not started yet.
    pub read_timeout: Duration,
    /// Arrow IPC compression on the Flight data plane (`None` for uncompressed).
    pub compression: Option<CompressionType>,
    /// Fails chosen attempts (tests only).
    pub fault: Option<FaultHook>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            slots: 64,
            read_timeout: Duration::from_secs(60),
            compression: None,
            fault: None,
        }
    }
}

impl fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("slots", &self.slots)
            .field("read_timeout", &self.read_timeout)
            .field("compression", &self.compression)
            .field("fault", &self.fault.is_some())
            .finish()
    }
}

/// Where a worker sends its task status reports.
pub(crate) trait StatusReporter: Send + Sync {
    /// Delivers one report (errors are the reporter's to log; a lost report is a lost worker).
    fn report(&self, report: proto::TaskStatusReport) -> BoxFuture<'static, ()>;
}

/// What runs one attempt from the in-memory plan instead of decoding its bytes (driver stages).
pub(crate) struct LocalPlan {
    pub plan: Arc<dyn ExecutionPlan>,
    pub context: Arc<TaskContext>,
}

/// The state every request handler and task of a worker shares.
pub(crate) struct WorkerShared {
    pub name: String,
    pub address: String,
    pub worker_id: AtomicU64,
    pub store: Arc<WorkerStreamStore>,
    pub flight: FlightClients,
    pub options: WorkerOptions,
    tasks: Mutex<HashMap<AttemptKey, oneshot::Sender<()>>>,
    spawn: mpsc::UnboundedSender<BoxFuture<'static, ()>>,
    reporter: Mutex<Option<Arc<dyn StatusReporter>>>,
    template: Arc<TaskContext>,
    shutdown: Notify,
}

/// A running worker; dropping it stops its server and aborts its tasks.
pub(crate) struct Worker {
    shared: Arc<WorkerShared>,
    _server: SpawnedTask<()>,
    _runner: SpawnedTask<()>,
}

impl Worker {
    /// Starts a worker serving on `127.0.0.1` at an ephemeral port.
    pub async fn start(name: String, options: WorkerOptions) -> Result<Self> {
        let (listener, address) = bind_loopback(&name).await?;
        let runtime = Arc::new(RuntimeEnv::default());
        let template =
            SessionContext::new_with_config_rt(SessionConfig::new(), runtime.clone()).task_ctx();
        let (spawn, tasks_in) = mpsc::unbounded_channel();
        let shared = Arc::new(WorkerShared {
            store: Arc::new(WorkerStreamStore::new(name.clone(), runtime)),
            name,
            address,
            worker_id: AtomicU64::new(0),
            flight: FlightClients::default(),
            tasks: Mutex::new(HashMap::new()),
            spawn,
            reporter: Mutex::new(None),
            template,
            options,
            shutdown: Notify::new(),
        });
        let flight = StreamFlightService::new(
            shared.store.clone(),
            shared.options.read_timeout,
            shared.options.compression,
        );
        let service = worker_service(shared.clone());
        let stop = shared.clone();
        let server = SpawnedTask::spawn(async move {
            let shutdown = async move { stop.shutdown.notified().await };
            // Serving ends on StopWorker; a transport error ends it too (the driver sees a lost worker).
            let _ = Server::builder()
                .add_service(service)
                .add_service(flight)
                .serve_with_incoming_shutdown(incoming(listener), shutdown)
                .await;
        });
        let runner = SpawnedTask::spawn(run_tasks(tasks_in));
        Ok(Self {
            shared,
            _server: server,
            _runner: runner,
        })
    }

    pub fn shared(&self) -> &Arc<WorkerShared> {
        &self.shared
    }

    /// The address serving `WorkerService` and Flight.
    pub fn address(&self) -> &str {
        &self.shared.address
    }

    /// Sets where status reports go and this worker's id at the driver.
    pub fn set_reporter(&self, worker_id: u64, reporter: Arc<dyn StatusReporter>) -> Result<()> {
        self.shared.worker_id.store(worker_id, Ordering::Relaxed);
        *self.shared.reporter_lock()? = Some(reporter);
        Ok(())
    }

    /// Attempts running and streams held, for tests and diagnostics.
    pub fn counts(&self) -> (usize, StoreCounts) {
        let running = self.shared.tasks_lock().map(|t| t.len()).unwrap_or(0);
        (running, self.shared.store.counts())
    }
}

/// The task runner: owns every task of the worker in one `JoinSet`.
async fn run_tasks(mut tasks_in: mpsc::UnboundedReceiver<BoxFuture<'static, ()>>) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            next = tasks_in.recv() => match next {
                Some(task) => {
                    tasks.spawn(task);
                }
                None => break,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            else => {}
        }
    }
}

impl WorkerShared {
    fn tasks_lock(&self) -> Result<MutexGuard<'_, HashMap<AttemptKey, oneshot::Sender<()>>>> {
        self.tasks
            .lock()
            .map_err(|_| DataFusionError::Internal(format!("{}: task table poisoned", self.name)))
    }

    fn reporter_lock(&self) -> Result<MutexGuard<'_, Option<Arc<dyn StatusReporter>>>> {
        self.reporter
            .lock()
            .map_err(|_| DataFusionError::Internal(format!("{}: reporter poisoned", self.name)))
    }

    /// Starts one task attempt (from its bytes, or from `local` on the driver).
    pub fn start_task(
        self: &Arc<Self>,
        definition: proto::TaskDefinition,
        local: Option<LocalPlan>,
    ) -> Result<()> {
        let key = AttemptKey::of_definition(&definition);
        let (stop, stopped) = oneshot::channel();
        {
            let mut tasks = self.tasks_lock()?;
            if tasks.contains_key(&key) {
                return Err(DataFusionError::Execution(format!(
                    "{}: {key} is already running",
                    self.name
                )));
            }
            tasks.insert(key, stop);
        }
        let shared = self.clone();
        let attempt = Box::pin(task::run_attempt(shared, definition, local, stopped));
        self.spawn.send(attempt).map_err(|_| {
            DataFusionError::Execution(format!("{}: the worker is shutting down", self.name))
        })
    }

    /// Stops one attempt; `false` when it is not running here.
    pub fn stop_task(&self, key: AttemptKey) -> Result<bool> {
        let stop = self.tasks_lock()?.remove(&key);
        Ok(match stop {
            Some(stop) => {
                let _ = stop.send(());
                true
            }
            None => false,
        })
    }

    /// Stops every attempt of `job` and removes its streams.
    pub fn clean_up_job(&self, job: sluice_runtime::JobId) -> Result<()> {
        let stops: Vec<oneshot::Sender<()>> = {
            let mut tasks = self.tasks_lock()?;
            let keys: Vec<AttemptKey> = tasks.keys().filter(|k| k.job == job).copied().collect();
            keys.iter().filter_map(|k| tasks.remove(k)).collect()
        };
        for stop in stops {
            let _ = stop.send(());
        }
        self.store.remove_job(job)
    }

    /// Stops serving (StopWorker).
    pub fn shut_down(&self) {
        self.shutdown.notify_one();
    }

    /// Called by an attempt when it ends.
    fn forget_task(&self, key: AttemptKey) {
        if let Ok(mut tasks) = self.tasks_lock() {
            tasks.remove(&key);
        }
    }

    async fn report(&self, report: proto::TaskStatusReport) {
        let reporter = self.reporter_lock().ok().and_then(|r| r.clone());
        if let Some(reporter) = reporter {
            reporter.report(report).await;
        }
    }
}
