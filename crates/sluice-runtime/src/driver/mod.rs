//! The driver: accepts jobs, schedules their tasks on workers, and streams each job's output back.
//! One driver serves every distributed mode; only its transports differ (in-process calls for
//! `local-graph`, tonic gRPC and Arrow Flight for the cluster).
//!
//! ```text
//!   Driver::execute ─ Submit / Cancel ───────────────┐
//!   Driver::register_worker / heartbeat / report ────┼─► events ─► actor (one task, all state)
//!   job output forwarder ─ ApproveOutput / OutputRead┘        │
//!                            JobScheduler (pure) ◄── events ──┤
//!                            actions ─► WorkerClient: RunTask / StopTask / ReleaseOutput /
//!                                       CleanUpJob; output commands
//! ```
//!
//! Modules: `actor` (event handling and the scheduler's actions; `reports`, `membership` and
//! `dispatch` inside it), `registry` (membership, liveness and slots of the workers), `journal`
//! (the one transition hook: counters, notices, records), `job` (per-job state),
//! `definitions` (the pure task-definition builder), `placement` (pure slot assignment), `shipping`
//! (each stage's plan, once per job), `output` (the job output forwarder), `progress`, `label`
//! (who asked for a job).
//!
//! Invariants: all driver state lives in the actor, which handles one event at a time (no locks);
//! handlers and RPC replies only send events; a job's streams are cleaned up on every worker once its
//! output was read, it failed, or its caller went away.

mod actor;
mod attempts;
mod broadcast_switch;
mod definitions;
mod history;
mod job;
mod journal;
mod label;
mod output;
mod placement;
mod progress;
mod reconcile;
mod registry;
mod resume;
mod runtime_filters;
mod shipping;
mod skew_splits;
mod spans;
pub mod telemetry;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::{AttemptKey, JobGraph, JobId, TaskAttempt, WorkerId};
use tokio::sync::{mpsc, oneshot};

use crate::definition::TaskStatusReport;
use crate::error::sluice_error;
use crate::transport::{RunTaskError, StatusReporter, StreamFetcher, WorkerClient};

pub use attempts::{StageSummary, TaskRecord, TaskRecordState, stage_summaries};
pub use history::{HISTORY_LIMIT, JobRecord, JobState};
pub use label::JobLabel;
pub use progress::{JobProgress, StageProgress, progress_line};
pub use reconcile::WorkerBeat;

use output::OutputCommand;
use placement::Location;

/// What the driver changed in a stage's plan or reads while its job ran (a runtime filter, a
/// split skewed partition), or why it did not: for the log and `EXPLAIN ANALYZE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StageNote {
    /// The stage changed.
    pub target: sluice_planner::StageId,
    /// One line, starting with what kind of change it is (`runtime filter: `, `skew split: `).
    pub text: String,
}

/// How the driver schedules.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// Times a task region may fail before its job fails (at least 1). Attempts lost with their
    /// worker do not count: the region's own tasks did nothing wrong.
    pub max_attempts: usize,
    /// A worker that sends no heartbeat for this long is lost: its tasks fail and are retried
    /// elsewhere, its slots leave the pool.
    pub heartbeat_timeout: Duration,
    /// How long a task region that needs more slots than the live workers have waits for workers
    /// to join (or be replaced) before its job fails saying how many it needed and had.
    pub capacity_wait: Duration,
}

/// The default [`DriverOptions::capacity_wait`].
pub const DEFAULT_CAPACITY_WAIT: Duration = Duration::from_secs(60);

impl Default for DriverOptions {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            heartbeat_timeout: Duration::from_secs(3),
            capacity_wait: DEFAULT_CAPACITY_WAIT,
        }
    }
}

/// How the driver knows a worker is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It sends heartbeats; silence longer than the heartbeat timeout means it is lost.
    Heartbeats,
    /// It lives in this process and cannot be lost apart from it.
    InProcess,
}

/// A worker joining the driver.
#[derive(Debug, Clone)]
pub struct WorkerRegistration {
    /// Where its streams are read (and, in a cluster, its control endpoint).
    pub address: String,
    /// Task attempts it runs at once.
    pub slots: usize,
    /// How the driver calls it.
    pub client: Arc<dyn WorkerClient>,
    /// How the driver knows it is alive.
    pub liveness: Liveness,
}

/// The driver's own executor, which runs driver-placed stages.
#[derive(Debug, Clone)]
pub struct ExecutorEndpoint {
    /// Where its streams are read.
    pub address: String,
    /// How the driver calls it.
    pub client: Arc<dyn WorkerClient>,
}

/// The actor's state, for tests and diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverSnapshot {
    /// Jobs the scheduler still tracks.
    pub scheduler_jobs: usize,
    /// Jobs the shell still tracks (including succeeded ones whose output is being read).
    pub jobs: usize,
    /// Task attempts holding a slot.
    pub running_tasks: usize,
    /// The registered workers (lost ones excluded), in id order.
    pub workers: Vec<WorkerSnapshot>,
    /// Regions waiting for slots.
    pub waiting_regions: usize,
    /// Worker slots those regions need at once (their tasks that run on workers).
    pub waiting_slots: usize,
    /// Registrations since the driver started, lost workers' too (a worker that came and went
    /// between two snapshots is counted here).
    pub registrations: u64,
    /// What the jobs did so far (retries, spilled and shuffled bytes).
    pub counters: DriverCounters,
}

impl DriverSnapshot {
    /// Per worker, its task slots in use.
    pub fn busy_slots(&self) -> Vec<usize> {
        self.workers.iter().map(|w| w.busy).collect()
    }

    /// The worker registered at `address`.
    pub fn worker_at(&self, address: &str) -> Option<&WorkerSnapshot> {
        self.workers.iter().find(|w| w.address == address)
    }
}

/// One registered worker, as the driver sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// Its id.
    pub id: WorkerId,
    /// The address it registered.
    pub address: String,
    /// Its task slots.
    pub slots: usize,
    /// Those in use.
    pub busy: usize,
    /// Milliseconds since its last heartbeat.
    pub heartbeat_age_ms: u64,
    /// It drains: no new task goes there.
    pub draining: bool,
    /// A job that is still live placed a task attempt there (its output may still be read).
    pub holds_outputs: bool,
    /// When it registered, in milliseconds since the Unix epoch.
    pub registered_ms: u64,
}

impl WorkerSnapshot {
    /// No attempt runs there, no live job's output may be read there, and it is not draining.
    pub fn is_idle(&self) -> bool {
        !self.draining && self.busy == 0 && !self.holds_outputs
    }

    /// What it does now: `draining`, `busy` (an attempt runs there), `holding` (no attempt runs,
    /// but a live job's output may still be read there) or `idle`.
    pub fn state(&self) -> &'static str {
        if self.draining {
            "draining"
        } else if self.busy > 0 {
            "busy"
        } else if self.holds_outputs {
            "holding"
        } else {
            "idle"
        }
    }
}

/// What the driver's jobs did since it started: recovering from failures, and the work of their
/// accepted task attempts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCounters {
    /// Workers declared lost (a missed heartbeat, an unreachable address, a dropped connection).
    pub workers_lost: usize,
    /// Regions run again: retried after a failure, or re-run because their outputs were lost.
    pub regions_retried: usize,
    /// Task attempts started again (every task of each region above).
    pub tasks_retried: usize,
    /// Task attempts placed (first attempts and retries).
    pub tasks_started: usize,
    /// Bytes spilled to disk by the attempts whose output was used.
    pub spilled_bytes: u64,
    /// Bytes written to shuffle channels by the attempts whose output was used.
    pub shuffled_bytes: u64,
    /// Bytes those attempts read from earlier stages on their own worker.
    pub read_local_bytes: u64,
    /// Bytes those attempts read from earlier stages on other workers (Arrow Flight).
    pub read_remote_bytes: u64,
    /// Bytes those attempts' scans fetched from files and object stores.
    pub scanned_bytes: u64,
}

impl DriverCounters {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &DriverCounters) -> DriverCounters {
        DriverCounters {
            workers_lost: self.workers_lost.saturating_sub(earlier.workers_lost),
            regions_retried: self.regions_retried.saturating_sub(earlier.regions_retried),
            tasks_retried: self.tasks_retried.saturating_sub(earlier.tasks_retried),
            tasks_started: self.tasks_started.saturating_sub(earlier.tasks_started),
            spilled_bytes: self.spilled_bytes.saturating_sub(earlier.spilled_bytes),
            shuffled_bytes: self.shuffled_bytes.saturating_sub(earlier.shuffled_bytes),
            read_local_bytes: self
                .read_local_bytes
                .saturating_sub(earlier.read_local_bytes),
            read_remote_bytes: self
                .read_remote_bytes
                .saturating_sub(earlier.read_remote_bytes),
            scanned_bytes: self.scanned_bytes.saturating_sub(earlier.scanned_bytes),
        }
    }
}

/// What the actor reacts to.
pub(crate) enum DriverEvent {
    RegisterWorker {
        registration: WorkerRegistration,
        reply: oneshot::Sender<WorkerId>,
    },
    Heartbeat {
        worker: WorkerId,
        /// What the worker says of its attempts, when its heartbeats carry that.
        beat: Option<WorkerBeat>,
        /// Answered with whether the driver still counts the worker.
        reply: Option<oneshot::Sender<bool>>,
    },
    /// A worker accepted an attempt's `RunTask`, as its `accepted`-th.
    TaskAccepted {
        key: AttemptKey,
        accepted: u64,
    },
    Deregister(WorkerId),
    /// Evidence from outside the driver that a worker is gone (its process ended).
    Gone {
        worker: WorkerId,
        why: String,
    },
    Drain(WorkerId),
    /// Why workers asked for may not come (a pod that cannot start); `None` clears it.
    CapacityNote(Option<String>),
    TaskStatus(TaskStatusReport),
    Submit(Box<Submission>),
    Cancel(JobId),
    ApproveOutput {
        job: JobId,
        attempt: TaskAttempt,
        reply: oneshot::Sender<bool>,
    },
    /// The job output read every stream of a final-stage attempt to its end.
    OutputRead {
        job: JobId,
        attempt: TaskAttempt,
    },
    /// The job output could not read a final-stage attempt's output.
    OutputUnreadable {
        job: JobId,
        attempt: TaskAttempt,
        error: DataFusionError,
    },
    RunTaskFailed {
        job: JobId,
        attempt: TaskAttempt,
        location: Location,
        error: RunTaskError,
    },
    Snapshot(oneshot::Sender<DriverSnapshot>),
    TakeNotices(oneshot::Sender<Vec<String>>),
    /// A line for the user from outside the actor (the output forwarder).
    Notice(String),
    Progress(oneshot::Sender<Vec<JobProgress>>),
    Jobs(oneshot::Sender<Vec<JobRecord>>),
    /// A cancel on request (not a caller going away): answered with whether the job was running.
    CancelOnRequest {
        job: JobId,
        why: String,
        reply: oneshot::Sender<bool>,
    },
}

/// A job handed to the actor.
pub(crate) struct Submission {
    graph: Arc<JobGraph>,
    context: Arc<TaskContext>,
    output: mpsc::UnboundedSender<OutputCommand>,
    reply: oneshot::Sender<Result<JobId>>,
}

/// A running driver; dropping it stops its actor (and with it every job's output).
pub struct Driver {
    handle: DriverHandle,
    fetcher: Arc<dyn StreamFetcher>,
    _actor: SpawnedTask<()>,
}

/// What a transport needs to feed a driver: registrations, heartbeats, reports. Cheap to clone; it
/// does not keep the driver alive.
#[derive(Clone)]
pub struct DriverHandle {
    events: mpsc::UnboundedSender<DriverEvent>,
    /// This driver instance (see [`DriverHandle::epoch`]).
    epoch: u64,
}

impl std::fmt::Debug for DriverHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverHandle").finish_non_exhaustive()
    }
}

impl DriverHandle {
    /// Adds a worker; returns its id.
    pub async fn register_worker(&self, registration: WorkerRegistration) -> Result<WorkerId> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::RegisterWorker {
            registration,
            reply,
        })?;
        answer.await.map_err(|_| driver_gone())
    }

    /// This driver instance: a number drawn when it started. Workers registered with it carry it
    /// in their heartbeats and reports; a transport refuses those of another instance.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Records a heartbeat of `worker`.
    pub fn heartbeat(&self, worker: WorkerId) -> Result<()> {
        self.send(DriverEvent::Heartbeat {
            worker,
            beat: None,
            reply: None,
        })
    }

    /// Records a heartbeat of `worker`; `false` when the driver no longer counts it (it was declared
    /// lost, or never registered): the worker should stop.
    pub async fn heartbeat_checked(&self, worker: WorkerId) -> Result<bool> {
        self.heartbeat_reporting(worker, None).await
    }

    /// Records a heartbeat of `worker` that lists its attempts (`beat`): the driver fails the
    /// attempts it runs there that the worker does not know, and stops those the worker runs that
    /// it ended (see `reconcile`). `false` when the driver no longer counts the worker.
    pub async fn heartbeat_reporting(
        &self,
        worker: WorkerId,
        beat: Option<WorkerBeat>,
    ) -> Result<bool> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::Heartbeat {
            worker,
            beat,
            reply: Some(reply),
        })?;
        answer.await.map_err(|_| driver_gone())
    }

    /// `worker` drains: no new task is placed on it; what runs there finishes.
    pub fn drain(&self, worker: WorkerId) -> Result<()> {
        self.send(DriverEvent::Drain(worker))
    }

    /// Tells the driver why the workers its cluster manager was asked for may not come (a pod
    /// that cannot pull its image, say): a region that waits for them in vain fails saying so.
    /// `None` clears it.
    pub fn capacity_note(&self, note: Option<String>) -> Result<()> {
        self.send(DriverEvent::CapacityNote(note))
    }

    /// `worker` leaves (it drained): its slots leave the pool; what it still ran fails over.
    pub fn deregister(&self, worker: WorkerId) -> Result<()> {
        self.send(DriverEvent::Deregister(worker))
    }

    /// `worker` is gone, for the reason `why` (e.g. its process ended): it is lost now, without
    /// waiting for its heartbeats to stop.
    pub fn worker_gone(&self, worker: WorkerId, why: impl Into<String>) -> Result<()> {
        self.send(DriverEvent::Gone {
            worker,
            why: why.into(),
        })
    }

    /// Delivers a task status report.
    pub fn report(&self, report: TaskStatusReport) -> Result<()> {
        self.send(DriverEvent::TaskStatus(report))
    }

    /// A reporter that delivers straight to the driver (for workers in this process).
    pub fn reporter(&self) -> Arc<dyn StatusReporter> {
        Arc::new(LocalReporter(self.events.clone()))
    }

    /// The progress of every running job.
    pub async fn progress(&self) -> Result<Vec<JobProgress>> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::Progress(reply))?;
        answer.await.map_err(|_| driver_gone())
    }

    /// Every job the driver runs and the last ended ones ([`HISTORY_LIMIT`]), by id.
    pub async fn jobs(&self) -> Result<Vec<JobRecord>> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::Jobs(reply))?;
        answer.await.map_err(|_| driver_gone())
    }

    /// Cancels running job `job` on request (`why` names who asked): its output ends with a
    /// `Cancelled` error saying so and its tasks stop on every worker. `false` when it is not
    /// running (unknown, ended, or its tasks all done).
    pub async fn cancel_job(&self, job: JobId, why: impl Into<String>) -> Result<bool> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::CancelOnRequest {
            job,
            why: why.into(),
            reply,
        })?;
        answer.await.map_err(|_| driver_gone())
    }

    /// The actor's state, for tests and diagnostics.
    pub async fn snapshot(&self) -> Result<DriverSnapshot> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::Snapshot(reply))?;
        answer.await.map_err(|_| driver_gone())
    }

    /// What happened since the last call that a user should read (lost workers, retried regions),
    /// one line each, oldest first.
    pub async fn take_notices(&self) -> Result<Vec<String>> {
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::TakeNotices(reply))?;
        answer.await.map_err(|_| driver_gone())
    }

    fn send(&self, event: DriverEvent) -> Result<()> {
        self.events.send(event).map_err(|_| driver_gone())
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Driver {
    /// Starts a driver (its actor on the current runtime) whose own executor is `executor` and whose
    /// job output reads streams through `fetcher`.
    pub fn start(
        options: DriverOptions,
        executor: ExecutorEndpoint,
        fetcher: Arc<dyn StreamFetcher>,
    ) -> Self {
        let (events, inbox) = mpsc::unbounded_channel();
        let actor = actor::DriverActor::new(options, executor, events.clone());
        let actor = SpawnedTask::spawn(actor.run(inbox));
        Self {
            handle: DriverHandle {
                events,
                epoch: new_epoch(),
            },
            fetcher,
            _actor: actor,
        }
    }

    /// Runs `graph`; the stream is lazy and cancels the job when dropped.
    pub fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        output::job_output(
            self.handle.events.clone(),
            self.fetcher.clone(),
            graph,
            context,
        )
    }

    /// The handle transports feed.
    pub fn handle(&self) -> &DriverHandle {
        &self.handle
    }

    /// Adds a worker; returns its id.
    pub async fn register_worker(&self, registration: WorkerRegistration) -> Result<WorkerId> {
        self.handle.register_worker(registration).await
    }

    /// A reporter that delivers straight to this driver (for workers in this process).
    pub fn reporter(&self) -> Arc<dyn StatusReporter> {
        self.handle.reporter()
    }

    /// The progress of every running job.
    pub async fn progress(&self) -> Result<Vec<JobProgress>> {
        self.handle.progress().await
    }

    /// The actor's state, for tests and diagnostics.
    pub async fn snapshot(&self) -> Result<DriverSnapshot> {
        self.handle.snapshot().await
    }

    /// Lines for the user since the last call (see [`DriverHandle::take_notices`]).
    pub async fn take_notices(&self) -> Result<Vec<String>> {
        self.handle.take_notices().await
    }
}

/// A number that tells this driver instance from every other: the clock's nanoseconds, the
/// process id and a per-process count, mixed.
fn new_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(nanos);
    hasher.write_u32(std::process::id());
    hasher.write_u64(STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    // 0 is what a worker that never registered sends.
    hasher.finish().max(1)
}

pub(crate) fn driver_gone() -> DataFusionError {
    sluice_error(
        crate::error::ErrorKind::Transport,
        "the Sluice driver stopped",
    )
}

/// Status reports of workers in this process go straight to the actor.
struct LocalReporter(mpsc::UnboundedSender<DriverEvent>);

impl StatusReporter for LocalReporter {
    fn report(&self, report: TaskStatusReport) -> BoxFuture<'static, ()> {
        let _ = self.0.send(DriverEvent::TaskStatus(report));
        async {}.boxed()
    }
}
