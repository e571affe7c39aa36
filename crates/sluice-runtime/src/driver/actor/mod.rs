//! The driver actor: the thin shell that feeds events to the pure [`JobScheduler`] and performs its
//! actions — placing regions on task slots, sending task definitions, stopping tasks, releasing and
//! discarding outputs, feeding the job output, cleaning up workers, and noticing lost workers.
//! Task state has one owner, the scheduler; membership, liveness and slots another, the
//! [`WorkerRegistry`]; every transition is written down by the [`Journal`] (counters, notices,
//! records, spans). The actor holds what joins them: jobs' placements and the waiting regions.
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

mod dispatch;
mod membership;
mod reports;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use datafusion::common::DataFusionError;
use datafusion::common::runtime::JoinSet;
use datafusion::execution::memory_pool::MemoryLimit;
use sluice_planner::{AttemptKey, JobId, RegionId, TaskAttempt, WorkerId};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::history::JobHistory;
use super::job::JobEntry;
use super::journal::{Journal, Transition};
use super::output::OutputCommand;
use super::placement::Location;
use super::registry::WorkerRegistry;
use super::shipping::{ship_stages, shipped_settings};
use super::{
    DriverEvent, DriverOptions, DriverSnapshot, ExecutorEndpoint, JobProgress, JobRecord, JobState,
    Submission,
};
use crate::analyze::stage_reports;
use crate::error::ErrorKind;
use crate::scheduler::{JobFailure, JobScheduler, SchedulerAction, WorkerLoss};

pub(crate) struct DriverActor {
    options: DriverOptions,
    scheduler: JobScheduler,
    /// Membership, liveness and task slots of the workers.
    registry: WorkerRegistry,
    /// Counters, notices and records: every transition is written down there.
    journal: Journal,
    jobs: HashMap<JobId, JobEntry>,
    waiting: VecDeque<(JobId, RegionId, Vec<TaskAttempt>)>,
    /// Waiting regions that need more slots than the live workers have, since when.
    short_of_capacity: HashMap<(JobId, RegionId), Instant>,
    /// Why the workers the cluster manager was asked for may not come (its latest word).
    capacity_note: Option<String>,
    history: JobHistory,
    events: mpsc::UnboundedSender<DriverEvent>,
    rpcs: JoinSet<()>,
}

impl DriverActor {
    pub fn new(
        options: DriverOptions,
        executor: ExecutorEndpoint,
        events: mpsc::UnboundedSender<DriverEvent>,
    ) -> Self {
        Self {
            scheduler: JobScheduler::new(options.max_attempts),
            options,
            registry: WorkerRegistry::new(executor),
            journal: Journal::default(),
            jobs: HashMap::new(),
            waiting: VecDeque::new(),
            short_of_capacity: HashMap::new(),
            capacity_note: None,
            history: JobHistory::default(),
            events,
            rpcs: JoinSet::new(),
        }
    }

    /// Writes `transition` down (counters, notices, records).
    fn record(&mut self, transition: Transition<'_>) {
        self.journal.record(transition, &mut self.jobs);
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
                let address = registration.address.clone();
                let slots = registration.slots;
                let id = self.registry.register(registration);
                tracing::info!(
                    target: "sluice::cluster",
                    worker = id.0,
                    %address,
                    slots,
                    "{id} ({address}, {slots} slots) joined"
                );
                let _ = reply.send(id);
                self.place_waiting();
            }
            DriverEvent::Heartbeat {
                worker,
                beat,
                reply,
            } => {
                let known = self.registry.heartbeat(worker);
                if let Some(reply) = reply {
                    let _ = reply.send(known);
                }
                if known && let Some(beat) = beat {
                    self.reconcile(worker, &beat);
                }
            }
            DriverEvent::TaskAccepted { key, accepted } => {
                self.registry.accepted(key, accepted);
                // A stop sent while this `RunTask` was in flight could find nothing to stop (a
                // worker lists an attempt only once it decoded its plan) and the attempt would
                // run on, unseen. The answer comes after the worker listed it, so a stop sent now
                // finds it; an attempt whose final report came first holds no slot any more.
                if !self.scheduler.is_running(key.job, key.task_attempt())
                    && let Some(location) = self.registry.location(&key)
                {
                    self.stop_at(location, key);
                }
            }
            DriverEvent::Deregister(worker) => self.worker_left(worker),
            DriverEvent::Gone { worker, why } => {
                self.worker_lost(worker, &why, WorkerLoss::ProcessExited)
            }
            DriverEvent::CapacityNote(note) => self.capacity_note = note,
            DriverEvent::Drain(worker) => {
                if let Some(address) = self.registry.drain(worker) {
                    self.record(Transition::Draining { worker, address });
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
                if self.jobs.contains_key(&job) {
                    self.record(Transition::JobEnded {
                        job,
                        state: JobState::Cancelled,
                        error: None,
                    });
                }
                self.cancel_job(job);
            }
            DriverEvent::ApproveOutput {
                job,
                attempt,
                reply,
            } => {
                let _ = reply.send(self.scheduler.approve_output(job, attempt));
            }
            DriverEvent::OutputRead { job, attempt } => {
                let actions = self.scheduler.output_read(job, attempt);
                self.perform(actions);
            }
            DriverEvent::OutputUnreadable {
                job,
                attempt,
                error,
            } => {
                // A worker that cannot be reached and gives no sign of life is lost first: its
                // unread final outputs are then made again uncharged, as its other outputs are.
                let error = crate::error::RemoteError::of(&error);
                if let Some(peer) = error.peer.as_deref() {
                    self.unreachable_peer(attempt.of_job(job), None, peer, &error.message);
                }
                self.output_unreadable(job, attempt, &error.message);
            }
            DriverEvent::RunTaskFailed {
                job,
                attempt,
                location,
                error,
            } => self.run_task_failed(job, attempt, location, error),
            DriverEvent::Notice(line) => self.record(Transition::Notice(line)),
            DriverEvent::TakeNotices(reply) => {
                let _ = reply.send(self.journal.take_notices());
            }
            DriverEvent::Progress(reply) => {
                let _ = reply.send(self.progress());
            }
            DriverEvent::Snapshot(reply) => {
                let _ = reply.send(self.snapshot());
            }
        }
    }

    /// The state as [`DriverSnapshot`] shows it.
    fn snapshot(&self) -> DriverSnapshot {
        let holding: std::collections::HashSet<WorkerId> = self
            .jobs
            .values()
            .flat_map(|entry| entry.placed.values())
            .filter_map(|location| match location {
                Location::Worker(worker) => Some(*worker),
                Location::Driver => None,
            })
            .collect();
        DriverSnapshot {
            scheduler_jobs: self.scheduler.active_jobs(),
            jobs: self.jobs.len(),
            running_tasks: self.registry.running_count(),
            workers: self.registry.snapshots(|worker| holding.contains(&worker)),
            waiting_regions: self.waiting.len(),
            waiting_slots: self.waiting_slots(),
            registrations: self.registry.registrations(),
            counters: self.journal.counters(),
        }
    }

    fn progress(&self) -> Vec<JobProgress> {
        let mut jobs: Vec<JobProgress> = self
            .jobs
            .iter()
            .map(|(job, entry)| {
                entry.progress(*job, |stage| {
                    self.registry
                        .running()
                        .filter(|(k, _)| k.job == *job && k.stage == stage)
                        .count()
                })
            })
            .collect();
        jobs.sort_by_key(|j| j.job);
        jobs
    }

    /// Cancels running job `job` because `why` asked: its output ends with a `Cancelled` error,
    /// then it is cancelled as when its caller goes away. Whether it was running.
    fn cancel_on_request(&mut self, job: JobId, why: &str) -> bool {
        let Some(entry) = self.jobs.get(&job) else {
            return false;
        };
        let message = format!("job {job} was cancelled ({why})");
        let error = crate::error::sluice_error(ErrorKind::Cancelled, message.clone());
        let _ = entry.output.send(OutputCommand::Finish(Err(error)));
        self.record(Transition::JobEnded {
            job,
            state: JobState::Cancelled,
            error: Some(message),
        });
        self.cancel_job(job);
        true
    }

    /// Fails running job `job` for `why` (an internal error naming the job), then stops it as a
    /// cancel does.
    pub(super) fn fail_running_job(&mut self, job: JobId, why: &str) {
        if !self.jobs.contains_key(&job) {
            return;
        }
        let error = DataFusionError::Internal(format!("job {job}: {why}"));
        self.end_job(job, JobState::Failed, error);
        self.cancel_job(job);
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
        records.extend(self.jobs.values().map(JobEntry::current_record));
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
        let shipped = ship_stages(&graph, &context)
            .and_then(|plans| Ok((plans, crate::task::StageShape::of_graph(&graph)?)));
        let shipped = match shipped {
            Ok(shipped) => shipped,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let config = shipped_settings(context.session_config());
        let memory_limit = match context.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => u64::try_from(bytes).ok(),
            _ => None,
        };
        let label = super::JobLabel::of(&context);
        let policy = crate::scheduler::RetryPolicy::of(context.session_config());
        let (job, actions) = self.scheduler.accept_job_with(graph.clone(), policy);
        let entry = JobEntry::new(
            job,
            graph,
            shipped,
            Arc::new(config),
            memory_limit,
            label,
            output,
        );
        self.jobs.insert(job, entry);
        let _ = reply.send(Ok(job));
        self.perform(actions);
    }

    fn perform(&mut self, actions: Vec<SchedulerAction>) {
        // Regions started together (a stage of single-task regions ready at once) are placed in
        // one pass over the workers' slots, after the other actions.
        let mut started = false;
        for action in actions {
            match action {
                SchedulerAction::RunRegion { job, region, tasks } => {
                    self.waiting.push_back((job, region, tasks));
                    started = true;
                }
                SchedulerAction::StopTasks { job, tasks } => {
                    for attempt in tasks {
                        let key = attempt.of_job(job);
                        if let Some(location) = self.registry.location(&key) {
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
                        let withdrawn =
                            crate::driver::runtime_filters::withdraw_for_retry(entry, region);
                        for note in withdrawn {
                            tracing::debug!(
                                target: "sluice::runtime_filter",
                                job = job.0,
                                stage = note.target.0,
                                "stage {}: {}",
                                note.target,
                                note.text
                            );
                            entry.stage_notes.push(note);
                        }
                    }
                    let place = self.place_of(job, failed);
                    self.record(Transition::RegionRetried {
                        job,
                        region,
                        failed: failed.task,
                        place,
                        error: error.to_string().replace('\n', " "),
                        failures,
                        max_attempts: self.scheduler.max_attempts(),
                        next_attempt,
                    });
                }
                SchedulerAction::RegionsRerun {
                    job,
                    producers,
                    readers,
                } => self.record(Transition::RegionsRerun {
                    job,
                    producers: &producers,
                    readers: &readers,
                }),
                SchedulerAction::ExtendOutput { job, task } => self.extend_output(job, task),
                SchedulerAction::JobSucceeded { job } => {
                    self.record(Transition::JobEnded {
                        job,
                        state: JobState::Succeeded,
                        error: None,
                    });
                    if let Some(entry) = self.jobs.get(&job) {
                        let reports = if entry.analyze {
                            stage_reports(
                                &entry.graph,
                                &entry.succeeded_metrics(),
                                &entry.stage_notes,
                            )
                        } else {
                            Vec::new()
                        };
                        let _ = entry.output.send(OutputCommand::Finish(Ok(reports)));
                    }
                }
                SchedulerAction::JobFailed { job, failure } => {
                    let error = self.job_error(job, &failure);
                    self.end_job(job, JobState::Failed, error);
                }
                // The scheduler ends a job only once its output was read (or it failed).
                SchedulerAction::CleanUpJob { job } => self.clean_up(job),
            }
        }
        if started {
            self.place_waiting();
        }
    }

    /// Ends running job `job` in `state` with `error`: its record says so and its output ends with
    /// the error.
    fn end_job(&mut self, job: JobId, state: JobState, error: DataFusionError) {
        self.record(Transition::JobEnded {
            job,
            state,
            error: Some(error.to_string()),
        });
        if let Some(entry) = self.jobs.get(&job) {
            let _ = entry.output.send(OutputCommand::Finish(Err(error)));
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
            Some(Location::Worker(w)) => self.registry.name(w),
            None => "no worker (it never started)".to_string(),
        }
    }
}
