//! The driver actor: the thin shell that feeds events to the pure [`JobScheduler`] and performs its
//! actions — placing regions on task slots, sending task definitions, stopping tasks, releasing and
//! discarding outputs, feeding the job output, cleaning up workers, and noticing lost workers.
//!
//! Invariants:
//! - a task attempt holds one slot of its worker from the moment it is placed until exactly one of:
//!   its final report, a `RunTask` its worker refused or that never reported back, its worker being
//!   lost; the release is keyed by attempt, so it happens once;
//! - a region waits, first in first out, until all its tasks fit;
//! - what a report carries (metrics) is recorded only if the scheduler accepted the report;
//! - output of a task attempt reaches the caller only if the scheduler approves it;
//! - a worker silent for longer than the heartbeat timeout is lost: its running attempts fail with a
//!   transport error naming it, and their regions are retried on the other workers; only a worker
//!   whose process ended charges its attempts to their regions;
//! - a region needing more slots than the live workers have waits up to the capacity wait for
//!   workers to join, then fails its job saying how many it needed and had.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use datafusion::common::DataFusionError;
use datafusion::common::runtime::JoinSet;
use datafusion::execution::memory_pool::MemoryLimit;
use sluice_planner::{
    AttemptKey, InputMode, JobId, RegionId, TaskAttempt, TaskId, TaskPlacement, WorkerId,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::attempts::{AttemptLog, TaskRecordState};
use super::definitions::task_definition;
use super::history::JobHistory;
use super::job::{JobEntry, JobPhase};
use super::output::{FinishedJob, OutputCommand};
use super::placement::{Location, Placement, PlacementView, Slots, next_region, place};
use super::reconcile::{Reconciled, WorkerBeat, reconcile};
use super::shipping::ship_stages;
use super::{
    DriverCounters, DriverEvent, DriverOptions, DriverSnapshot, ExecutorEndpoint, JobProgress,
    JobRecord, JobState, Liveness, StageProgress, Submission, WorkerRegistration,
};
use crate::analyze::{is_analyze, stage_reports};
use crate::definition::{TaskState, TaskStatusReport};
use crate::error::{ErrorKind, RemoteError};
use crate::scheduler::{JobFailure, JobScheduler, SchedulerAction, TaskStatus, WorkerLoss};
use crate::transport::{RunTaskError, WorkerClient};

/// A registered worker.
struct WorkerEntry {
    registration: WorkerRegistration,
    busy: usize,
    last_heartbeat: Instant,
    /// It is draining: no new task goes there.
    draining: bool,
}

pub(crate) struct DriverActor {
    options: DriverOptions,
    scheduler: JobScheduler,
    executor: ExecutorEndpoint,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    /// Addresses of every worker ever registered (lost ones too: locators may still name them).
    addresses: HashMap<WorkerId, String>,
    counters: DriverCounters,
    next_worker: u64,
    jobs: HashMap<JobId, JobEntry>,
    running: HashMap<AttemptKey, Location>,
    waiting: VecDeque<(JobId, RegionId, Vec<TaskAttempt>)>,
    /// Waiting regions that need more slots than the live workers have, since when.
    short_of_capacity: HashMap<(JobId, RegionId), Instant>,
    /// Of the running attempts, the acceptance number their worker answered to `RunTask`.
    accepted: HashMap<AttemptKey, u64>,
    history: JobHistory,
    events: mpsc::UnboundedSender<DriverEvent>,
    rpcs: JoinSet<()>,
    /// Lines for the user, oldest first (bounded).
    notices: VecDeque<String>,
}

/// Notices kept for a caller that does not collect them.
const NOTICES_KEPT: usize = 256;

impl DriverActor {
    pub fn new(
        options: DriverOptions,
        executor: ExecutorEndpoint,
        events: mpsc::UnboundedSender<DriverEvent>,
    ) -> Self {
        Self {
            scheduler: JobScheduler::new(options.max_attempts),
            options,
            executor,
            workers: BTreeMap::new(),
            addresses: HashMap::new(),
            counters: DriverCounters::default(),
            next_worker: 1,
            jobs: HashMap::new(),
            running: HashMap::new(),
            waiting: VecDeque::new(),
            short_of_capacity: HashMap::new(),
            accepted: HashMap::new(),
            history: JobHistory::default(),
            events,
            rpcs: JoinSet::new(),
            notices: VecDeque::new(),
        }
    }

    fn notice(&mut self, line: String) {
        if self.notices.len() == NOTICES_KEPT {
            self.notices.pop_front();
        }
        self.notices.push_back(line);
    }

    pub async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<DriverEvent>) {
        let period = (self.options.heartbeat_timeout / 4).max(std::time::Duration::from_millis(10));
        let mut liveness = tokio::time::interval(period);
        liveness.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = inbox.recv() => match event {
                    Some(event) => self.handle(event),
                    None => break,
                },
                Some(_) = self.rpcs.join_next(), if !self.rpcs.is_empty() => {}
                _ = liveness.tick() => self.check_liveness(),
            }
        }
    }

    fn handle(&mut self, event: DriverEvent) {
        match event {
            DriverEvent::RegisterWorker {
                registration,
                reply,
            } => {
                let id = self.register_worker(registration);
                let _ = reply.send(id);
                self.place_waiting();
            }
            DriverEvent::Heartbeat {
                worker,
                beat,
                reply,
            } => {
                let known = match self.workers.get_mut(&worker) {
                    Some(entry) => {
                        entry.last_heartbeat = Instant::now();
                        true
                    }
                    None => false,
                };
                if let Some(reply) = reply {
                    let _ = reply.send(known);
                }
                if known && let Some(beat) = beat {
                    self.reconcile(worker, &beat);
                }
            }
            DriverEvent::TaskAccepted { key, accepted } => {
                if self.running.contains_key(&key) {
                    self.accepted.insert(key, accepted);
                }
            }
            DriverEvent::Deregister(worker) => {
                self.worker_lost(worker, "it drained and left", WorkerLoss::CutOff)
            }
            DriverEvent::Gone { worker, why } => {
                self.worker_lost(worker, &why, WorkerLoss::ProcessExited)
            }
            DriverEvent::Drain(worker) => {
                if let Some(entry) = self.workers.get_mut(&worker) {
                    entry.draining = true;
                    let address = entry.registration.address.clone();
                    self.notice(format!("{worker} ({address}) is draining"));
                }
            }
            DriverEvent::TaskStatus(report) => self.task_status(report),
            DriverEvent::Submit(submission) => self.submit(*submission),
            DriverEvent::Jobs(reply) => {
                let _ = reply.send(self.job_records());
            }
            DriverEvent::CancelOnRequest { job, why, reply } => {
                let _ = reply.send(self.cancel_on_request(job, &why));
            }
            DriverEvent::Cancel(job) => {
                if let Some(entry) = self.jobs.get_mut(&job)
                    && entry.phase == JobPhase::Running
                {
                    entry.record.end(JobState::Cancelled, None);
                }
                self.cancel_job(job);
            }
            DriverEvent::ApproveOutput {
                job,
                attempt,
                reply,
            } => {
                let approved = self.scheduler.approve_output(job, attempt)
                    || self.jobs.get(&job).is_some_and(|entry| {
                        matches!(entry.phase, JobPhase::Succeeded { .. })
                            && entry.announced.get(&attempt.task) == Some(&attempt.attempt)
                    });
                let _ = reply.send(approved);
            }
            DriverEvent::OutputDone(job) => {
                let clean = match self.jobs.get_mut(&job) {
                    Some(entry) => match &mut entry.phase {
                        JobPhase::Succeeded {
                            output_done,
                            cleanup_pending,
                        } => {
                            *output_done = true;
                            *cleanup_pending
                        }
                        JobPhase::Running => false,
                    },
                    None => false,
                };
                if clean {
                    self.clean_up(job);
                }
            }
            DriverEvent::RunTaskFailed {
                job,
                attempt,
                location,
                error,
            } => self.run_task_failed(job, attempt, location, error),
            DriverEvent::Notice(line) => self.notice(line),
            DriverEvent::TakeNotices(reply) => {
                let _ = reply.send(self.notices.drain(..).collect());
            }
            DriverEvent::Progress(reply) => {
                let _ = reply.send(self.progress());
            }
            DriverEvent::Snapshot(reply) => {
                let _ = reply.send(DriverSnapshot {
                    scheduler_jobs: self.scheduler.active_jobs(),
                    jobs: self.jobs.len(),
                    running_tasks: self.running.len(),
                    workers: self.workers.len(),
                    busy_slots: self.workers.values().map(|w| w.busy).collect(),
                    worker_addresses: self
                        .workers
                        .values()
                        .map(|w| w.registration.address.clone())
                        .collect(),
                    worker_slots: self
                        .workers
                        .values()
                        .map(|w| w.registration.slots)
                        .collect(),
                    worker_heartbeat_age_ms: self
                        .workers
                        .values()
                        .map(|w| {
                            u64::try_from(w.last_heartbeat.elapsed().as_millis())
                                .unwrap_or(u64::MAX)
                        })
                        .collect(),
                    waiting_regions: self.waiting.len(),
                    counters: self.counters,
                });
            }
        }
    }

    fn register_worker(&mut self, registration: WorkerRegistration) -> WorkerId {
        let id = WorkerId(self.next_worker);
        self.next_worker += 1;
        self.addresses.insert(id, registration.address.clone());
        self.workers.insert(
            id,
            WorkerEntry {
                registration,
                busy: 0,
                last_heartbeat: Instant::now(),
                draining: false,
            },
        );
        id
    }

    fn progress(&self) -> Vec<JobProgress> {
        let mut jobs: Vec<JobProgress> = self
            .jobs
            .iter()
            .filter(|(_, entry)| entry.phase == JobPhase::Running)
            .map(|(job, entry)| {
                let rows = entry.succeeded_metrics();
                let stages = entry
                    .graph
                    .stages()
                    .iter()
                    .enumerate()
                    .map(|(id, stage)| {
                        let of_stage = |t: &TaskId| t.stage.0 == id;
                        StageProgress {
                            total: stage.partitions(),
                            running: self
                                .running
                                .keys()
                                .filter(|k| k.job == *job && of_stage(&k.task()))
                                .count(),
                            done: entry.succeeded.keys().filter(|t| of_stage(t)).count(),
                            rows: rows
                                .iter()
                                .filter(|(t, _)| of_stage(t))
                                .map(|(_, m)| m.rows)
                                .sum(),
                        }
                    })
                    .collect();
                JobProgress {
                    job: job.0,
                    stages,
                    retries: entry.retries,
                    label: entry.label.clone(),
                }
            })
            .collect();
        jobs.sort_by_key(|j| j.job);
        jobs
    }

    /// Cancels running job `job` because `why` asked: its output ends with a `Cancelled` error,
    /// then it is cancelled as when its caller goes away. Whether it was running.
    fn cancel_on_request(&mut self, job: JobId, why: &str) -> bool {
        let Some(entry) = self
            .jobs
            .get_mut(&job)
            .filter(|entry| entry.phase == JobPhase::Running)
        else {
            return false;
        };
        let message = format!("job {job} was cancelled ({why})");
        entry.record.end(JobState::Cancelled, Some(message.clone()));
        let error = crate::error::sluice_error(ErrorKind::Cancelled, message);
        let _ = entry.output.send(OutputCommand::Finish(Err(error)));
        self.cancel_job(job);
        true
    }

    /// Drops `job`'s waiting regions and stops its tasks (cleaned up at once when none run).
    fn cancel_job(&mut self, job: JobId) {
        self.waiting.retain(|(j, _, _)| *j != job);
        let actions = self.scheduler.cancel_job(job);
        if actions.is_empty() {
            self.clean_up(job);
        } else {
            self.perform(actions);
        }
    }

    /// Every live job's record and the remembered ended ones, by id.
    fn job_records(&self) -> Vec<JobRecord> {
        let mut records: Vec<JobRecord> = self.history.records().cloned().collect();
        records.extend(self.jobs.values().map(|entry| {
            let mut record = entry.record.clone();
            record.retries = entry.retries;
            record.tasks_done = entry.succeeded.len();
            record.attempts = Arc::new(entry.attempts.records().to_vec());
            record
        }));
        records.sort_by_key(|record| record.job);
        records
    }

    fn submit(&mut self, submission: Submission) {
        let Submission {
            graph,
            context,
            output,
            reply,
        } = submission;
        let plans = match ship_stages(&graph, &context) {
            Ok(plans) => plans,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let config = context
            .session_config()
            .options()
            .entries()
            .into_iter()
            .filter_map(|entry| entry.value.map(|value| (entry.key, value)))
            .collect();
        let memory_limit = match context.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => u64::try_from(bytes).ok(),
            _ => None,
        };
        let analyze = is_analyze(&graph);
        let label = super::JobLabel::of(&context);
        let (job, actions) = self.scheduler.accept_job(graph.clone());
        let record = JobRecord::of_graph(job.0, label.clone(), &graph);
        self.jobs.insert(
            job,
            JobEntry {
                graph,
                plans,
                config: Arc::new(config),
                memory_limit,
                analyze,
                placed: HashMap::new(),
                latest: HashMap::new(),
                succeeded: HashMap::new(),
                metrics: HashMap::new(),
                announced: HashMap::new(),
                retries: 0,
                reruns: 0,
                output,
                phase: JobPhase::Running,
                label,
                attempts: AttemptLog::new(job, record.label.as_deref()),
                record,
            },
        );
        let _ = reply.send(Ok(job));
        self.perform(actions);
    }

    fn task_status(&mut self, report: TaskStatusReport) {
        if let TaskState::Failed(error) = &report.state
            && let Some(peer) = &error.peer
        {
            self.unreachable_peer(&report, peer, &error.message);
        }
        let key = report.attempt;
        let attempt = key.task_attempt();
        let terminal = report.state.is_final();
        if terminal {
            self.free_slot(key);
        }
        let (status, metrics, ending) = match report.state {
            TaskState::Running => (TaskStatus::Running, None, None),
            TaskState::Succeeded(metrics) => (
                TaskStatus::Succeeded,
                Some(metrics),
                Some((TaskRecordState::Succeeded, None)),
            ),
            TaskState::Failed(error) => {
                let state = if error.kind == ErrorKind::Cancelled {
                    TaskRecordState::Cancelled
                } else {
                    TaskRecordState::Failed
                };
                let text = error.message.clone();
                (TaskStatus::Failed(error), None, Some((state, Some(text))))
            }
            TaskState::Canceled => (
                TaskStatus::Canceled,
                None,
                Some((
                    TaskRecordState::Cancelled,
                    Some("its worker gave it up".to_string()),
                )),
            ),
        };
        let outcome = self
            .scheduler
            .task_status(key.job, attempt, report.sequence, status);
        let accepted = if outcome.accepted { metrics } else { None };
        if let Some((mut state, error)) = ending
            && let Some(entry) = self.jobs.get_mut(&key.job)
        {
            // A report the scheduler did not take is that of an attempt it had already stopped or
            // replaced (its region was retried): whatever it says, its work was not used. One it
            // took that says the attempt was given up is a failure of the attempt (the scheduler
            // retries or fails for it).
            if !outcome.accepted {
                state = TaskRecordState::Cancelled;
            } else if state == TaskRecordState::Cancelled {
                state = TaskRecordState::Failed;
            }
            entry
                .attempts
                .ended(attempt, state, accepted.clone(), error);
        }
        if let Some(metrics) = accepted {
            if metrics.fetch_retries > 0 {
                self.notice(format!(
                    "{key} on {}: {} read(s) from other workers failed before reaching them and \
                     succeeded when made again (the last failure: {})",
                    report.worker, metrics.fetch_retries, metrics.fetch_retried
                ));
            }
            self.task_succeeded(key.job, attempt, metrics);
        }
        self.perform(outcome.actions);
        if terminal {
            self.place_waiting();
        }
    }

    /// A read of `report`'s attempt from the worker at `peer` failed at the connection (after the
    /// reader's own retries). A peer whose heartbeats stopped is lost; acting on it first makes
    /// the read's failure a consequence of the loss, not a charge to its region. A peer that
    /// still heartbeats is only cut off from the reader (a partition, not a death): it keeps its
    /// slots and its outputs, and the reader's failure is retried as any other.
    fn unreachable_peer(&mut self, report: &TaskStatusReport, peer: &str, message: &str) {
        let silent_after = self.options.heartbeat_timeout / 2;
        let Some((worker, beats)) = self
            .workers
            .iter()
            .find(|(id, w)| w.registration.address == *peer && **id != report.worker)
            .map(|(id, w)| {
                let beats = w.registration.liveness == Liveness::Heartbeats
                    && w.last_heartbeat.elapsed() <= silent_after;
                (*id, beats)
            })
        else {
            return;
        };
        let message = message.replace('\n', " ");
        if beats {
            let reader = self
                .workers
                .get(&report.worker)
                .map(|w| format!("{} ({})", report.worker, w.registration.address))
                .unwrap_or_else(|| report.worker.to_string());
            self.notice(format!(
                "{} on {reader} could not read from {worker} ({peer}), which still sends \
                 heartbeats: {worker} is kept, the attempt is retried ({message})",
                report.attempt
            ));
            return;
        }
        let why = format!("{} could not read from it: {message}", report.attempt);
        self.worker_lost(worker, &why, WorkerLoss::CutOff);
    }

    /// Records a succeeded attempt; once every task of its stage succeeded, what the stage's
    /// producers still hold is released (no consumer will read it), so they stop waiting.
    fn task_succeeded(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        metrics: crate::analyze::TaskMetrics,
    ) {
        let Some(entry) = self.jobs.get_mut(&job) else {
            return;
        };
        self.counters.spilled_bytes += metrics.spilled_bytes;
        self.counters.shuffled_bytes += metrics.shuffled_bytes;
        self.counters.read_local_bytes += metrics.read_local_bytes;
        self.counters.read_remote_bytes += metrics.read_remote_bytes;
        entry.metrics.insert(attempt, metrics);
        entry.succeeded.insert(attempt.task, attempt.attempt);
        let stage_id = attempt.task.stage;
        if !entry.stage_complete(stage_id) {
            return;
        }
        entry.attempts.stage_done(stage_id);
        let Some(stage) = entry.graph.stage(stage_id) else {
            return;
        };
        let mut releases = Vec::new();
        for input in &stage.inputs {
            let Some(producer) = entry.graph.stage(input.stage) else {
                continue;
            };
            // Blocking outputs stay until the job ends: a re-run (lineage) may need them again.
            if producer.mode == sluice_planner::OutputMode::Blocking {
                continue;
            }
            for partition in 0..producer.partitions() {
                let task = TaskId {
                    stage: input.stage,
                    partition,
                };
                if let Some((location, producer_attempt)) = entry.location_of(task) {
                    let key = TaskAttempt {
                        task,
                        attempt: producer_attempt,
                    }
                    .of_job(job);
                    releases.push((location, key));
                }
            }
        }
        for (location, key) in releases {
            self.release_output(location, key);
        }
    }

    fn run_task_failed(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        location: Location,
        error: RunTaskError,
    ) {
        let key = attempt.of_job(job);
        if self.scheduler.has_reported(job, attempt) {
            // Only the reply was lost: the task runs and its reports free its slot.
            return;
        }
        if !error.refused {
            // No answer: evidence that the worker is gone. What it ran is lost with it (this
            // attempt included) and its slots leave the pool; the request may still have arrived,
            // so the attempt is also told to stop.
            self.stop_at(location, key);
            if let Location::Worker(worker) = location
                && self.workers.contains_key(&worker)
            {
                let why = format!("RunTask got no answer ({})", error.error.message);
                self.worker_lost(worker, &why, WorkerLoss::CutOff);
                self.place_waiting();
                return;
            }
        }
        self.free_slot(key);
        if let Some(entry) = self.jobs.get_mut(&job) {
            let text = format!("it never started: {}", error.error.message);
            entry
                .attempts
                .ended(attempt, TaskRecordState::Failed, None, Some(text));
        }
        let actions = self.scheduler.task_not_started(job, attempt, error.error);
        self.perform(actions);
        self.place_waiting();
    }

    fn check_liveness(&mut self) {
        let timeout = self.options.heartbeat_timeout;
        let silent: Vec<(WorkerId, f64)> = self
            .workers
            .iter()
            .filter(|(_, w)| w.registration.liveness == Liveness::Heartbeats)
            .filter_map(|(id, w)| {
                let silence = w.last_heartbeat.elapsed();
                (silence > timeout).then_some((*id, silence.as_secs_f64()))
            })
            .collect();
        for (worker, silence) in silent {
            self.worker_lost(
                worker,
                &format!("no heartbeat for {silence:.1} s"),
                WorkerLoss::CutOff,
            );
        }
        // A region short of capacity fails once its wait is over, joins or not.
        if !self.short_of_capacity.is_empty() {
            self.place_waiting();
        }
    }

    /// `worker` is gone: its slots leave the pool and its running attempts fail (charged to their
    /// regions when its process died, see [`WorkerLoss`]).
    fn worker_lost(&mut self, worker: WorkerId, why: &str, loss: WorkerLoss) {
        let Some(entry) = self.workers.remove(&worker) else {
            return;
        };
        self.counters.workers_lost += 1;
        let address = entry.registration.address;
        let mut lost: Vec<AttemptKey> = self
            .running
            .iter()
            .filter(|(_, location)| **location == Location::Worker(worker))
            .map(|(key, _)| *key)
            .collect();
        lost.sort();
        let during = match lost.first() {
            Some(first) => {
                let mut stages: Vec<String> = lost
                    .iter()
                    .filter(|k| k.job == first.job)
                    .map(|k| k.stage.to_string())
                    .collect();
                stages.dedup();
                format!(" during job {} stage {}", first.job, stages.join(", "))
            }
            None => String::new(),
        };
        self.notice(format!("{worker} ({address}) lost{during}: {why}"));
        // Lineage first: the regions that read outputs held there wait for them to be made again,
        // so the retries below do not start readers of streams that are gone.
        let mut jobs: Vec<JobId> = self.jobs.keys().copied().collect();
        jobs.sort();
        for job in jobs {
            let Some(entry) = self.jobs.get_mut(&job) else {
                continue;
            };
            let mut outputs: Vec<TaskId> = entry
                .succeeded
                .iter()
                .filter(|(task, attempt)| {
                    let attempt = TaskAttempt {
                        task: **task,
                        attempt: **attempt,
                    };
                    entry.placed.get(&attempt) == Some(&Location::Worker(worker))
                })
                .map(|(task, _)| *task)
                .collect();
            if outputs.is_empty() {
                continue;
            }
            outputs.sort();
            for task in &outputs {
                entry.succeeded.remove(task);
            }
            let actions = self.scheduler.outputs_lost(job, &outputs);
            self.perform(actions);
        }
        for key in lost {
            self.running.remove(&key);
            self.accepted.remove(&key);
            let error = RemoteError::new(
                ErrorKind::Transport,
                format!("{worker} ({address}) was lost: {why}"),
            );
            self.attempt_lost(key, error, loss);
        }
        self.place_waiting();
    }

    /// Running attempt `key` (its slot already freed) was lost with its worker, or forgotten by
    /// it: its record ends `lost` and the scheduler retries or fails its region.
    fn attempt_lost(&mut self, key: AttemptKey, error: RemoteError, loss: WorkerLoss) {
        if let Some(entry) = self.jobs.get_mut(&key.job) {
            entry.attempts.ended(
                key.task_attempt(),
                TaskRecordState::Lost,
                None,
                Some(error.message.clone()),
            );
        }
        let actions = self
            .scheduler
            .task_lost(key.job, key.task_attempt(), error, loss);
        self.perform(actions);
    }

    /// Applies what `worker`'s heartbeat says of its attempts (see `reconcile`): attempts it
    /// does not know fail, charged to their regions; attempts it runs that ended here are stopped.
    fn reconcile(&mut self, worker: WorkerId, beat: &WorkerBeat) {
        let here = Location::Worker(worker);
        let running = self
            .running
            .iter()
            .filter(|(_, location)| **location == here)
            .map(|(key, _)| (*key, self.accepted.get(key).copied()));
        let Reconciled { forgotten, orphans } = reconcile(running, beat);
        for key in orphans {
            self.stop_at(here, key);
        }
        if forgotten.is_empty() {
            return;
        }
        let address = self.addresses.get(&worker).cloned().unwrap_or_default();
        for key in forgotten {
            self.free_slot(key);
            let error = RemoteError::new(
                ErrorKind::Transport,
                format!(
                    "{worker} ({address}) does not know {key}: it never ran it, or its final \
                     report was lost"
                ),
            );
            self.attempt_lost(key, error, WorkerLoss::Forgotten);
        }
        self.place_waiting();
    }

    fn free_slot(&mut self, key: AttemptKey) {
        self.accepted.remove(&key);
        if let Some(Location::Worker(w)) = self.running.remove(&key)
            && let Some(worker) = self.workers.get_mut(&w)
        {
            worker.busy = worker.busy.saturating_sub(1);
        }
    }

    fn perform(&mut self, actions: Vec<SchedulerAction>) {
        for action in actions {
            match action {
                SchedulerAction::RunRegion { job, region, tasks } => {
                    self.waiting.push_back((job, region, tasks));
                    self.place_waiting();
                }
                SchedulerAction::StopTasks { job, tasks } => {
                    for attempt in tasks {
                        let key = attempt.of_job(job);
                        if let Some(location) = self.running.get(&key).copied() {
                            self.stop_at(location, key);
                        }
                    }
                }
                SchedulerAction::DiscardOutputs { job, tasks } => {
                    let Some(entry) = self.jobs.get(&job) else {
                        continue;
                    };
                    let discards: Vec<(Location, AttemptKey)> = tasks
                        .iter()
                        .filter_map(|a| entry.placed.get(a).map(|l| (*l, a.of_job(job))))
                        .collect();
                    for (location, key) in discards {
                        self.release_output(location, key);
                    }
                }
                SchedulerAction::RegionRetried {
                    job,
                    region,
                    failed,
                    error,
                    failures,
                    next_attempt,
                } => {
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        entry.retries += 1;
                    }
                    self.counters.regions_retried += 1;
                    let place = self.place_of(job, failed);
                    let text = error.to_string().replace('\n', " ");
                    self.notice(format!(
                        "job {job}: retrying region {region} (attempt {}; {failures} of {} \
                         failures allowed so far): {} failed on {place}: {text}",
                        next_attempt + 1,
                        self.scheduler.max_attempts(),
                        failed.task
                    ));
                }
                SchedulerAction::RegionsRerun {
                    job,
                    producers,
                    readers,
                } => {
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        entry.reruns += producers.len();
                    }
                    self.counters.regions_retried += producers.len();
                    let list = |regions: &[RegionId]| {
                        regions
                            .iter()
                            .map(|r| format!("region {r}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    let mut line = format!(
                        "job {job}: outputs of {} were lost with their worker; running {} again",
                        list(&producers),
                        if producers.len() == 1 { "it" } else { "them" }
                    );
                    if !readers.is_empty() {
                        line.push_str(&format!(" before {}", list(&readers)));
                    }
                    self.notice(line);
                }
                SchedulerAction::ExtendOutput { job, task } => self.extend_output(job, task),
                SchedulerAction::JobSucceeded { job } => {
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        entry.phase = JobPhase::Succeeded {
                            output_done: false,
                            cleanup_pending: false,
                        };
                        let reports = if entry.analyze {
                            stage_reports(&entry.graph, &entry.succeeded_metrics())
                        } else {
                            Vec::new()
                        };
                        let last = entry.graph.stages().len().saturating_sub(1);
                        entry.record.rows = entry
                            .succeeded_metrics()
                            .iter()
                            .filter(|(task, _)| task.stage.0 == last)
                            .map(|(_, metrics)| metrics.rows)
                            .sum();
                        entry.record.end(JobState::Succeeded, None);
                        let finished = FinishedJob {
                            reports,
                            attempts: entry.announced.clone(),
                        };
                        let _ = entry.output.send(OutputCommand::Finish(Ok(finished)));
                    }
                }
                SchedulerAction::JobFailed { job, failure } => {
                    let error = self.job_error(job, &failure);
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        entry.record.end(JobState::Failed, Some(error.to_string()));
                        let _ = entry.output.send(OutputCommand::Finish(Err(error)));
                    }
                }
                SchedulerAction::CleanUpJob { job } => {
                    let deferred =
                        self.jobs
                            .get_mut(&job)
                            .is_some_and(|entry| match &mut entry.phase {
                                JobPhase::Succeeded {
                                    output_done: false,
                                    cleanup_pending,
                                } => {
                                    *cleanup_pending = true;
                                    true
                                }
                                _ => false,
                            });
                    if !deferred {
                        self.clean_up(job);
                    }
                }
            }
        }
    }

    /// The error the job output ends with. A user error reads exactly as it was raised (as local
    /// mode shows it); any other failure says which task failed where, and how often it was tried.
    fn job_error(&self, job: JobId, failure: &JobFailure) -> DataFusionError {
        let error = failure.error.to_error();
        if failure.error.kind == ErrorKind::User {
            return error;
        }
        let place = self.place_of(job, failure.task);
        let mut what = format!("job {job}: {} failed on {place}", failure.task.task);
        if failure.attempts > 1 {
            what.push_str(&format!(" after {} attempts", failure.attempts));
        } else if failure.error.kind.is_retryable() && self.scheduler.max_attempts() == 1 {
            what.push_str(" (retries are off)");
        }
        if failure.history.len() > 1 {
            what.push_str(&format!(" ({})", failure.history.join("; ")));
        }
        error.context(what)
    }

    /// Where `attempt` of `job` ran, as a notice or an error names it.
    fn place_of(&self, job: JobId, attempt: TaskAttempt) -> String {
        let location = self
            .jobs
            .get(&job)
            .and_then(|entry| entry.placed.get(&attempt).copied());
        match location {
            Some(Location::Driver) => "the driver".to_string(),
            Some(Location::Worker(w)) => match self.addresses.get(&w) {
                Some(address) => format!("{w} ({address})"),
                None => w.to_string(),
            },
            None => "no worker (it never started)".to_string(),
        }
    }

    /// The worker at `location`'s client.
    fn client(&self, location: Location) -> Option<Arc<dyn WorkerClient>> {
        match location {
            Location::Driver => Some(Arc::clone(&self.executor.client)),
            Location::Worker(w) => self
                .workers
                .get(&w)
                .map(|w| Arc::clone(&w.registration.client)),
        }
    }

    fn address_of(&self, location: Location) -> Option<String> {
        match location {
            Location::Driver => Some(self.executor.address.clone()),
            Location::Worker(w) => self.addresses.get(&w).cloned(),
        }
    }

    fn stop_at(&mut self, location: Location, key: AttemptKey) {
        if let Some(client) = self.client(location) {
            // A worker that cannot be reached has no task to stop.
            let stop = client.stop_task(key);
            self.rpcs.spawn(async move {
                let _ = stop.await;
            });
        }
    }

    fn release_output(&mut self, location: Location, key: AttemptKey) {
        if let Some(client) = self.client(location) {
            // A producer that cannot be reached has nothing left to release.
            let release = client.release_output(key);
            self.rpcs.spawn(async move {
                let _ = release.await;
            });
        }
    }

    /// Worker slots each job's running attempts hold.
    fn slots_held(&self) -> HashMap<JobId, usize> {
        let mut held = HashMap::new();
        for (key, location) in &self.running {
            if matches!(location, Location::Worker(_)) {
                *held.entry(key.job).or_insert(0) += 1;
            }
        }
        held
    }

    /// Places waiting regions while they fit, the job holding fewest slots first (see
    /// [`next_region`]).
    fn place_waiting(&mut self) {
        loop {
            let jobs: Vec<JobId> = self.waiting.iter().map(|(job, _, _)| *job).collect();
            let held = self.slots_held();
            let Some(index) = next_region(&jobs, |job| held.get(&job).copied().unwrap_or(0)) else {
                return;
            };
            let Some((job, region, tasks)) = self.waiting.remove(index) else {
                return;
            };
            // A region reset or retried while it waited has a newer entry (or none yet).
            if !self.jobs.contains_key(&job)
                || !tasks.iter().all(|t| self.scheduler.is_running(job, *t))
            {
                continue;
            }
            let ids: Vec<TaskId> = tasks.iter().map(|t| t.task).collect();
            let slots: Vec<Slots> = self
                .workers
                .iter()
                .filter(|(_, w)| !w.draining)
                .map(|(id, w)| Slots {
                    worker: *id,
                    free: w.registration.slots.saturating_sub(w.busy),
                    total: w.registration.slots,
                })
                .collect();
            let placement = match self.jobs.get(&job) {
                Some(entry) => place(&ids, &JobView(entry), &slots),
                None => continue,
            };
            match placement {
                Placement::Placed(locations) => {
                    self.short_of_capacity.remove(&(job, region));
                    self.launch(job, &tasks, &locations);
                }
                Placement::Wait => {
                    let index = index.min(self.waiting.len());
                    self.waiting.insert(index, (job, region, tasks));
                    return;
                }
                Placement::Short(shortfall) => {
                    // Workers may still join (or be replaced): wait up to the capacity wait.
                    let since = *self
                        .short_of_capacity
                        .entry((job, region))
                        .or_insert_with(Instant::now);
                    let waited = since.elapsed();
                    if waited < self.options.capacity_wait {
                        let index = index.min(self.waiting.len());
                        self.waiting.insert(index, (job, region, tasks));
                        return;
                    }
                    self.short_of_capacity.remove(&(job, region));
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        let error = crate::error::sluice_error(
                            ErrorKind::ResourcesExhausted,
                            format!(
                                "job {job}: {shortfall} after waiting {:.1} s for workers to \
                                 join (capacity_wait); add workers or task slots, or lower \
                                 datafusion.execution.target_partitions",
                                waited.as_secs_f64()
                            ),
                        );
                        entry.record.end(JobState::Failed, Some(error.to_string()));
                        let _ = entry.output.send(OutputCommand::Finish(Err(error)));
                    }
                    let actions = self.scheduler.cancel_job(job);
                    self.perform(actions);
                }
            }
        }
    }

    fn launch(&mut self, job: JobId, tasks: &[TaskAttempt], locations: &[Location]) {
        let addresses: Vec<String> = locations
            .iter()
            .map(|l| self.address_of(*l).unwrap_or_default())
            .collect();
        let Some(entry) = self.jobs.get_mut(&job) else {
            return;
        };
        for ((attempt, location), address) in tasks.iter().zip(locations).zip(addresses) {
            self.counters.tasks_started += 1;
            if attempt.attempt > 0 {
                self.counters.tasks_retried += 1;
            }
            entry.place(*attempt, *location);
            let worker = match location {
                Location::Worker(w) => Some(*w),
                Location::Driver => None,
            };
            entry.attempts.placed(*attempt, worker, address);
            self.running.insert(attempt.of_job(job), *location);
            if let Location::Worker(w) = location
                && let Some(worker) = self.workers.get_mut(w)
            {
                worker.busy += 1;
            }
        }
        for (attempt, location) in tasks.iter().zip(locations) {
            self.start(job, *attempt, *location);
        }
    }

    fn start(&mut self, job: JobId, attempt: TaskAttempt, location: Location) {
        let definition = match self.jobs.get(&job) {
            Some(entry) => task_definition(job, entry, attempt, &|l| self.address_of(l)),
            None => return,
        };
        let client = self.client(location);
        let events = self.events.clone();
        let failed = move |error: RunTaskError| {
            let _ = events.send(DriverEvent::RunTaskFailed {
                job,
                attempt,
                location,
                error,
            });
        };
        let (definition, client) = match (definition, client) {
            (Ok(definition), Some(client)) => (definition, client),
            (Err(error), _) => {
                return failed(RunTaskError {
                    refused: true,
                    error: RemoteError::new(ErrorKind::Internal, error.to_string()),
                });
            }
            (_, None) => {
                return failed(crate::transport::unreachable(format!(
                    "{location:?} is no longer registered"
                )));
            }
        };
        let run = client.run_task(definition);
        let accepted_events = self.events.clone();
        let key = attempt.of_job(job);
        self.rpcs.spawn(async move {
            match run.await {
                Ok(accepted) => {
                    let _ = accepted_events.send(DriverEvent::TaskAccepted { key, accepted });
                }
                Err(error) => failed(error),
            }
        });
    }

    fn extend_output(&mut self, job: JobId, attempt: TaskAttempt) {
        let Some(entry) = self.jobs.get(&job) else {
            return;
        };
        let Some(location) = entry.placed.get(&attempt).copied() else {
            return;
        };
        let channels = entry
            .graph
            .stage(attempt.task.stage)
            .map_or(1, |s| s.distribution.channels());
        let key = attempt.of_job(job);
        let streams = (0..channels)
            .map(|channel| key.stream(channel).replica(0))
            .collect();
        let Some(address) = self.address_of(location) else {
            return;
        };
        if let Some(entry) = self.jobs.get_mut(&job) {
            entry.announced.insert(attempt.task, attempt.attempt);
            let _ = entry.output.send(OutputCommand::Add {
                attempt,
                address,
                streams,
            });
        }
    }

    /// Removes the job's streams everywhere and forgets it.
    fn clean_up(&mut self, job: JobId) {
        self.short_of_capacity.retain(|(j, _), _| *j != job);
        if let Some(mut entry) = self.jobs.remove(&job) {
            entry.attempts.cancel_running();
            entry
                .attempts
                .job_ended(entry.record.state.name(), entry.record.error.as_deref());
            let mut record = entry.record;
            record.retries = entry.retries;
            record.tasks_done = entry.succeeded.len();
            record.attempts = Arc::new(entry.attempts.into_records());
            self.history.remember(record);
        }
        let clients: Vec<Arc<dyn WorkerClient>> =
            std::iter::once(Arc::clone(&self.executor.client))
                .chain(
                    self.workers
                        .values()
                        .map(|w| Arc::clone(&w.registration.client)),
                )
                .collect();
        for client in clients {
            let clean = client.clean_up_job(job);
            self.rpcs.spawn(async move {
                let _ = clean.await;
            });
        }
    }
}

/// Placement's view of one job.
struct JobView<'a>(&'a JobEntry);

impl PlacementView for JobView<'_> {
    fn on_driver(&self, task: TaskId) -> bool {
        self.0
            .graph
            .stage(task.stage)
            .is_some_and(|s| s.placement == TaskPlacement::Driver)
    }

    fn forward_producer(&self, task: TaskId) -> Option<TaskId> {
        let stage = self.0.graph.stage(task.stage)?;
        stage
            .inputs
            .iter()
            .find(|input| input.mode == InputMode::Forward)
            .map(|input| TaskId {
                stage: input.stage,
                partition: task.partition,
            })
    }

    fn placed(&self, task: TaskId) -> Option<Location> {
        self.0.location_of(task).map(|(location, _)| location)
    }
}
