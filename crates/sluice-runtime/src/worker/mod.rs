//! A worker: runs task attempts and keeps their output streams. The same code serves every
//! distributed mode: in-process (`local-graph`, the driver's own executor) the driver calls it
//! directly; in a cluster, `sluice-cluster` puts `WorkerService` and Arrow Flight in front of it.
//!
//! ```text
//!   run_task(TaskDefinition) ─► task runtime (JoinSet) ─► attempt::run_attempt
//!                                   │ Running ─► StatusReporter (at once if announced, else past the grace)
//!                                   │ execute: readers ─► stage plan ─► ShuffleWriterExec ─► store
//!                                   └ Succeeded | Failed(error) | Canceled ─► StatusReporter
//!   apply_runtime_filter ─► the live filters of the stage's running tasks (see [`live_filters`])
//!   stop_task ─► the attempt's stop signal (its stream is dropped, its output removed)
//!   clean_up_job ─► stop the job's attempts, remove its streams
//! ```
//!
//! Invariants: every attempt runs on the task runtime inside the worker's `JoinSet`, so dropping the
//! last handle of the worker aborts them all, and the control plane (another runtime) always
//! answers; each attempt reports exactly one final status (sequence 2), after its `Running`
//! (sequence 1) if it sent one (see [`attempt`]'s docs: a short attempt the driver does not wait
//! on sends none): whoever finishes it first — the attempt itself, or a stop — claims the report.
//! The worker knows ([`Worker::known_attempts`]) every attempt it runs and every attempt whose
//! final report is still on its way, with the number of `RunTask`s it accepted so far: heartbeats
//! carry both, so the driver can tell an attempt the worker never heard of (or forgot: a lost
//! report) from one whose `RunTask` is still in flight.
//!
//! A stop takes effect at once: the attempt leaves the running set, its output is removed, its
//! `Canceled` report goes out, and its future is aborted. An operator that computes for a long time
//! inside one poll (a nested-loop join over a large build side) cannot be interrupted mid-poll; its
//! future is dropped at its next yield, and [`Worker::live_attempts`] counts it until then.

mod attempt;
mod configs;
mod live_filters;
mod streams;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::definition::{RuntimeFilterUpdate, TaskDefinition, TaskState, TaskStatusReport};
use crate::faults::FaultPoints;
use crate::stream_store::{StoreCounts, StreamStore};
use crate::task_runtime::task_runtime;
use crate::transport::{StatusReporter, StreamFetcher};
use datafusion::common::runtime::JoinSet;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};

use crate::object_stores::{ObjectStores, StoreLimits};
use datafusion::prelude::{SessionConfig, SessionContext};
use sluice_planner::{AttemptKey, JobId, WorkerId};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// A test hook: called before each task attempt runs; `Some(message)` makes the attempt fail with a
/// transport error carrying it (an environment failure, so the attempt is retried).
#[cfg(feature = "testing")]
pub type FaultHook = Arc<dyn Fn(&AttemptKey) -> Option<String> + Send + Sync>;

/// Called on `run_task`'s caller right after an attempt is spawned (tests only).
pub type SpawnHook = Arc<dyn Fn(&AttemptKey) + Send + Sync>;

/// How a worker runs.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Task attempts it runs at once.
    pub slots: usize,
    /// How long a read waits for a stream whose task has not started yet.
    pub read_timeout: Duration,
    /// The worker's memory pool, shared by all its tasks and its stream store (a DataFusion
    /// `FairSpillPool`); `None` is unbounded.
    pub memory_limit: Option<usize>,
    /// Where spill files and blocking outputs go (the system's temporary directory if `None`).
    pub work_dir: Option<PathBuf>,
    /// How long an attempt whose `Running` report the driver does not act on runs before it sends
    /// one (`TaskDefinition::announce_running`; default [`attempt::RUNNING_REPORT_GRACE`]).
    pub running_report_grace: Duration,
    /// Fails chosen attempts (tests only).
    #[cfg(feature = "testing")]
    pub fault: Option<FaultHook>,
    /// Runs on the caller of `run_task` right after each attempt is spawned (tests only: a slow
    /// control thread, while the attempt may already be done).
    #[cfg(feature = "testing")]
    pub after_spawn: Option<SpawnHook>,
    /// Named fault points armed in this worker (`crate::faults`).
    pub faults: Option<Arc<FaultPoints>>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            slots: 64,
            read_timeout: Duration::from_secs(60),
            memory_limit: None,
            work_dir: None,
            running_report_grace: attempt::RUNNING_REPORT_GRACE,
            #[cfg(feature = "testing")]
            fault: None,
            #[cfg(feature = "testing")]
            after_spawn: None,
            faults: None,
        }
    }
}

impl fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("slots", &self.slots)
            .field("read_timeout", &self.read_timeout)
            .field("memory_limit", &self.memory_limit)
            .field("work_dir", &self.work_dir)
            .field("running_report_grace", &self.running_report_grace)
            .field("faults", &self.faults)
            .finish()
    }
}

/// What every attempt of a worker shares (attempts hold this, never the `JoinSet` that owns them).
pub(crate) struct WorkerShared {
    name: String,
    address: String,
    id: AtomicU64,
    store: Arc<StreamStore>,
    fetcher: Arc<dyn StreamFetcher>,
    /// Where reports go: none until the worker registered (a report waits for it).
    reporter: watch::Sender<Option<Arc<dyn StatusReporter>>>,
    /// The attempts running (neither finished nor stopped).
    tasks: Mutex<HashMap<AttemptKey, Running>>,
    /// `RunTask`s accepted so far (changed under the `tasks` lock).
    accepted: AtomicU64,
    /// Attempts whose final report is being delivered.
    reporting: Mutex<HashSet<AttemptKey>>,
    template: Arc<TaskContext>,
    /// The session configs built for the settings tasks shipped.
    configs: configs::SessionConfigs,
    /// The runtime filters running tasks get while they run.
    live_filters: live_filters::LiveFilters,
    options: WorkerOptions,
}

/// One running attempt: how to abort it, and who claimed its final report.
struct Running {
    abort: AbortHandle,
    finished: Arc<AtomicBool>,
}

/// A worker; cheap to clone. Dropping the last clone aborts every attempt it runs.
#[derive(Clone)]
pub struct Worker {
    shared: Arc<WorkerShared>,
    attempts: Arc<Mutex<JoinSet<()>>>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.shared.name)
            .field("address", &self.shared.address)
            .finish()
    }
}

impl Worker {
    /// A worker named `name` (errors name it), whose streams others read at `address` through
    /// `fetcher`'s counterpart, and which reads other workers' streams through `fetcher`.
    pub fn new(
        name: impl Into<String>,
        address: impl Into<String>,
        options: WorkerOptions,
        fetcher: Arc<dyn StreamFetcher>,
    ) -> Result<Self> {
        let name = name.into();
        let runtime = worker_runtime(&name, &options)?;
        let template =
            SessionContext::new_with_config_rt(SessionConfig::new(), runtime.clone()).task_ctx();
        let store = Arc::new(StreamStore::new(
            name.clone(),
            runtime,
            options.read_timeout,
        ));
        Ok(Self {
            shared: Arc::new(WorkerShared {
                name,
                address: address.into(),
                id: AtomicU64::new(0),
                store,
                fetcher,
                reporter: watch::Sender::new(None),
                tasks: Mutex::new(HashMap::new()),
                accepted: AtomicU64::new(0),
                reporting: Mutex::new(HashSet::new()),
                template,
                configs: configs::SessionConfigs::default(),
                live_filters: live_filters::LiveFilters::default(),
                options,
            }),
            attempts: Arc::new(Mutex::new(JoinSet::new())),
        })
    }

    /// The worker's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The address its streams are read at.
    pub fn address(&self) -> &str {
        &self.shared.address
    }

    /// Its stream store.
    pub fn store(&self) -> &Arc<StreamStore> {
        &self.shared.store
    }

    /// The context whose function registry decodes plans sent to this worker.
    pub fn function_context(&self) -> &Arc<TaskContext> {
        &self.shared.template
    }

    /// Task slots it offers.
    pub fn slots(&self) -> usize {
        self.shared.options.slots.max(1)
    }

    /// Sets where status reports go and this worker's id at the driver.
    pub fn set_reporter(&self, id: WorkerId, reporter: Arc<dyn StatusReporter>) -> Result<()> {
        self.shared.id.store(id.0, Ordering::Relaxed);
        if let Some(faults) = &self.shared.options.faults {
            faults.set_worker(id.0);
        }
        self.shared.reporter.send_replace(Some(reporter));
        Ok(())
    }

    fn attempts_lock(&self) -> Result<MutexGuard<'_, JoinSet<()>>> {
        self.attempts.lock().map_err(|_| {
            DataFusionError::Internal(format!("{}: attempt set poisoned", self.shared.name))
        })
    }

    /// Starts one task attempt on the task runtime; returns how many `RunTask`s this worker has
    /// accepted, this one included (see [`Self::known_attempts`]).
    pub fn run_task(&self, definition: TaskDefinition) -> Result<u64> {
        let key = definition.attempt;
        let handle = task_runtime()?;
        let finished = Arc::new(AtomicBool::new(false));
        let span = tracing::info_span!(
            target: "sluice::worker",
            "task attempt",
            worker = self.shared.name.as_str(),
            job = key.job.0,
            stage = key.stage.0,
            partition = key.partition,
            attempt = key.attempt,
        );
        // The attempt is spawned while the running set is locked, so its entry holds its abort
        // handle before anyone can take the entry out: neither a stop (which must abort it) nor
        // the attempt's own end (which must not be aborted while it sends its final report) can
        // find the entry without it.
        let mut tasks = self.shared.tasks_lock()?;
        if tasks.contains_key(&key) {
            return Err(DataFusionError::Internal(format!(
                "{}: {key} is already running",
                self.shared.name
            )));
        }
        let attempt = tracing::Instrument::instrument(
            attempt::run_attempt(Arc::clone(&self.shared), definition, Arc::clone(&finished)),
            span,
        );
        let abort = {
            let mut attempts = self.attempts_lock()?;
            // Reap finished attempts so the set holds only live ones.
            while attempts.try_join_next().is_some() {}
            attempts.spawn_on(attempt, &handle)
        };
        #[cfg(feature = "testing")]
        if let Some(hook) = &self.shared.options.after_spawn {
            hook(&key);
        }
        tasks.insert(key, Running { abort, finished });
        Ok(self.shared.accepted.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// The attempts this worker knows (running, or with a final report on its way) and the
    /// `RunTask`s it accepted so far, read together: every attempt accepted by then is in the list
    /// unless its final report was delivered.
    pub fn known_attempts(&self) -> Result<(Vec<AttemptKey>, u64)> {
        let tasks = self.shared.tasks_lock()?;
        let accepted = self.shared.accepted.load(Ordering::SeqCst);
        let mut known: Vec<AttemptKey> = tasks.keys().copied().collect();
        drop(tasks);
        known.extend(self.shared.reporting_lock()?.iter().copied());
        known.sort();
        known.dedup();
        Ok((known, accepted))
    }

    /// The fault points armed in this worker.
    pub fn faults(&self) -> Option<&Arc<FaultPoints>> {
        self.shared.options.faults.as_ref()
    }

    /// Stops one attempt: it leaves the running set, its output is removed, its `Canceled` report
    /// goes out and its future is aborted. `false` when it is not running here.
    pub fn stop_task(&self, key: AttemptKey) -> Result<bool> {
        let running = self.shared.tasks_lock()?.remove(&key);
        let Some(running) = running else {
            return Ok(false);
        };
        self.stop(key, running)?;
        Ok(true)
    }

    fn stop(&self, key: AttemptKey, running: Running) -> Result<()> {
        if running.finished.swap(true, Ordering::SeqCst) {
            return Ok(()); // it finished on its own and reported
        }
        running.abort.abort();
        self.shared.store.remove_attempt(key)?;
        let shared = Arc::clone(&self.shared);
        let report = async move {
            let report = TaskStatusReport {
                worker: shared.worker_id(),
                attempt: key,
                sequence: 2,
                state: TaskState::Canceled,
            };
            shared.report(report).await;
        };
        // The report goes out from the caller's (control) runtime, owned by the attempt set. Every
        // caller runs on one; without it there is nobody to report to.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.attempts_lock()?.spawn_on(report, &runtime);
        }
        Ok(())
    }

    /// A runtime filter's key summary for the running tasks of its target stage (and those this
    /// worker starts later); answers how many running tasks' filters it completed.
    pub fn apply_runtime_filter(&self, update: &RuntimeFilterUpdate) -> Result<usize> {
        self.shared.live_filters.publish(update)
    }

    /// Stops every attempt of `job` and removes its streams.
    pub fn clean_up_job(&self, job: JobId) -> Result<()> {
        self.shared.live_filters.forget_job(job)?;
        let stopped: Vec<(AttemptKey, Running)> = {
            let mut tasks = self.shared.tasks_lock()?;
            let keys: Vec<AttemptKey> = tasks.keys().filter(|k| k.job == job).copied().collect();
            keys.into_iter()
                .filter_map(|key| tasks.remove(&key).map(|running| (key, running)))
                .collect()
        };
        for (key, running) in stopped {
            self.stop(key, running)?;
        }
        self.shared.store.remove_job(job)
    }

    /// Stops every attempt and removes every stream: the driver no longer counts this worker, so
    /// nothing it runs or holds will be read again.
    pub fn clean_up_all(&self) -> Result<()> {
        let mut jobs = self.shared.store.jobs();
        jobs.extend(self.shared.tasks_lock()?.keys().map(|key| key.job));
        for job in jobs {
            self.clean_up_job(job)?;
        }
        Ok(())
    }

    /// Bytes its memory pool has handed out now.
    pub fn memory_used(&self) -> usize {
        self.shared.template.runtime_env().memory_pool.reserved()
    }

    /// Its memory pool's limit (`None`: unlimited).
    pub fn memory_limit(&self) -> Option<usize> {
        match self
            .shared
            .template
            .runtime_env()
            .memory_pool
            .memory_limit()
        {
            datafusion::execution::memory_pool::MemoryLimit::Finite(bytes) => Some(bytes),
            _ => None,
        }
    }

    /// Attempts running (neither finished nor stopped), and what the store holds.
    pub fn counts(&self) -> (usize, StoreCounts) {
        let running = self.shared.tasks_lock().map(|t| t.len()).unwrap_or(0);
        (running, self.shared.store.counts())
    }

    /// Attempt futures still alive: the running ones, and stopped ones whose operator has not
    /// yielded since the stop (see the module docs).
    pub fn live_attempts(&self) -> usize {
        self.attempts_lock()
            .map(|mut attempts| {
                while attempts.try_join_next().is_some() {}
                attempts.len()
            })
            .unwrap_or(0)
    }
}

/// The runtime of a worker: its memory pool (shared by its tasks and its stream store), its disk,
/// and its object stores (built from the worker's own environment, [`crate::object_stores`]).
fn worker_runtime(name: &str, options: &WorkerOptions) -> Result<Arc<RuntimeEnv>> {
    let mut builder = RuntimeEnvBuilder::new()
        .with_object_store_registry(ObjectStores::new(StoreLimits::default()).into_registry());
    if let Some(limit) = options.memory_limit {
        builder = builder.with_memory_pool(Arc::new(FairSpillPool::new(limit)));
    }
    if let Some(dir) = &options.work_dir {
        std::fs::create_dir_all(dir).map_err(|e| {
            DataFusionError::Execution(format!(
                "{name}: cannot create its work directory {}: {e}",
                dir.display()
            ))
        })?;
        builder = builder.with_disk_manager_builder(
            DiskManagerBuilder::default()
                .with_mode(DiskManagerMode::Directories(vec![dir.clone()])),
        );
    }
    builder.build_arc()
}

impl WorkerShared {
    fn tasks_lock(&self) -> Result<MutexGuard<'_, HashMap<AttemptKey, Running>>> {
        self.tasks
            .lock()
            .map_err(|_| DataFusionError::Internal(format!("{}: task table poisoned", self.name)))
    }

    fn reporting_lock(&self) -> Result<MutexGuard<'_, HashSet<AttemptKey>>> {
        self.reporting
            .lock()
            .map_err(|_| DataFusionError::Internal(format!("{}: report set poisoned", self.name)))
    }

    fn worker_id(&self) -> WorkerId {
        WorkerId(self.id.load(Ordering::Relaxed))
    }

    /// Called when an attempt finished on its own: `Some` if it claims the final report (it was
    /// not stopped first), and then it leaves the running set. The claim is returned as the guard that keeps the attempt known as being reported until
    /// dropped; it is taken before the attempt leaves the running set, so a heartbeat read in
    /// between still lists it (else the driver would take it for forgotten and run its region
    /// again).
    fn finish(&self, key: AttemptKey, finished: &AtomicBool) -> Option<Reporting<'_>> {
        if finished.swap(true, Ordering::SeqCst) {
            return None;
        }
        let reporting = Reporting::start(self, key);
        if let Ok(mut tasks) = self.tasks_lock() {
            tasks.remove(&key);
        }
        Some(reporting)
    }

    /// Delivers `report` (a final one is known as being reported until its delivery ended,
    /// however it ended: a delivery that panics forgets it too, so the driver learns the report
    /// is lost). Before the worker has registered there is nowhere to send it: a `RunTask` can
    /// arrive before the reply to the registration does, so the report waits for the reporter
    /// (and goes out under the id the driver gave) instead of being dropped.
    async fn report(&self, mut report: TaskStatusReport) {
        let _reporting = report
            .state
            .is_final()
            .then(|| Reporting::start(self, report.attempt));
        let mut registered = self.reporter.subscribe();
        let reporter = registered
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|reporter| reporter.clone());
        if let Some(reporter) = reporter {
            report.worker = self.worker_id();
            reporter.report(report).await;
        }
    }
}

/// An attempt whose final report is being delivered, until dropped.
struct Reporting<'a> {
    shared: &'a WorkerShared,
    key: AttemptKey,
}

impl<'a> Reporting<'a> {
    fn start(shared: &'a WorkerShared, key: AttemptKey) -> Self {
        if let Ok(mut reporting) = shared.reporting_lock() {
            reporting.insert(key);
        }
        Self { shared, key }
    }
}

impl Drop for Reporting<'_> {
    fn drop(&mut self) {
        if let Ok(mut reporting) = self.shared.reporting_lock() {
            reporting.remove(&self.key);
        }
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests;
