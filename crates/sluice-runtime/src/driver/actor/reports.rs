//! What the actor does with a task attempt's reports: the status a worker sent (a read that could
//! not reach its peer first), a `RunTask` that failed, a succeeded attempt's releases, and the
//! final stage's streams announced to the job output (or found unreadable).

use sluice_planner::{AttemptKey, JobId, TaskAttempt, TaskId, WorkerId};

use super::DriverActor;
use crate::definition::{TaskState, TaskStatusReport};
use crate::driver::attempts::TaskRecordState;
use crate::driver::journal::Transition;
use crate::driver::output::OutputCommand;
use crate::driver::placement::Location;
use crate::error::{ErrorKind, RemoteError};
use crate::scheduler::{TaskStatus, WorkerLoss};
use crate::transport::RunTaskError;

/// Logs each of `notes` (the driver's notes on a job's stages) at `level` under `target`, and keeps
/// it in the job's entry for `EXPLAIN ANALYZE`.
macro_rules! keep_notes {
    ($level:ident, $target:literal, $job:expr, $entry:expr, $notes:expr) => {
        for note in $notes {
            tracing::$level!(
                target: $target,
                job = $job.0,
                stage = note.target.0,
                "stage {}: {}",
                note.target,
                note.text
            );
            $entry.stage_notes.push(note);
        }
    };
}

impl DriverActor {
    pub(super) fn task_status(&mut self, report: TaskStatusReport) {
        if let TaskState::Failed(error) = &report.state
            && let Some(peer) = &error.peer
        {
            self.unreachable_peer(report.attempt, Some(report.worker), peer, &error.message);
        }
        let key = report.attempt;
        let attempt = key.task_attempt();
        let terminal = report.state.is_final();
        if terminal {
            self.registry.free(key);
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
            && self.jobs.contains_key(&key.job)
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
            // The records keep the counters, not a runtime filter's key summary nor the rows
            // per channel (what the driver decides by while the job runs).
            let recorded = accepted.clone().map(|mut m| {
                m.key_summary = Vec::new();
                m.channel_rows = Vec::new();
                m
            });
            self.record(Transition::AttemptEnded {
                job: key.job,
                attempt,
                state,
                metrics: recorded,
                error,
            });
        }
        let mut escaped = None;
        if let Some(metrics) = accepted {
            self.record(Transition::Succeeded {
                key,
                worker: report.worker,
                metrics: &metrics,
            });
            escaped = self.task_succeeded(key.job, attempt, metrics);
        }
        self.perform(outcome.actions);
        if let Some(why) = escaped {
            self.fail_running_job(key.job, &why);
        }
        if terminal {
            self.place_waiting();
        }
    }

    /// A read of `reader` (an attempt on `reader_worker`, or the job output on the driver: `None`)
    /// from the worker at `peer` failed at the connection (after the reader's own retries). A peer without heartbeats to go by (in-process) is lost; acting on
    /// it first makes the read's failure a consequence of the loss, not a charge to its region. A
    /// peer that beat within the heartbeat timeout is only cut off from the reader (a partition,
    /// not a death): it keeps its slots and its outputs, and the reader's failure is retried as
    /// any other. (A silent one is given up by the liveness check, well within the read's own
    /// retry window.)
    pub(super) fn unreachable_peer(
        &mut self,
        reader: AttemptKey,
        reader_worker: Option<WorkerId>,
        peer: &str,
        message: &str,
    ) {
        let recent = self.options.heartbeat_timeout;
        let Some((worker, beats)) = self.registry.at_address(peer, reader_worker, recent) else {
            return;
        };
        let message = message.replace('\n', " ");
        if beats {
            let reader_worker = match reader_worker {
                Some(worker) => self.registry.name(worker),
                None => "the driver".to_string(),
            };
            self.record(Transition::PeerKept {
                reader,
                reader_worker,
                peer: self.registry.name(worker),
                message: &message,
            });
            return;
        }
        let why = format!("{reader} could not read from it: {message}");
        self.worker_lost(worker, &why, WorkerLoss::CutOff);
    }

    /// Records a succeeded attempt; once every task of its stage succeeded, the runtime filters
    /// waiting for it are applied, then the broadcast switches now decidable and the skew splits
    /// of joins reading it decided, and what the stage's producers still hold is released (no
    /// consumer will read it), so they stop waiting. Says why the job must fail if the attempt
    /// re-ran a runtime filter's source and saw keys that filter dropped.
    pub(super) fn task_succeeded(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        mut metrics: crate::analyze::TaskMetrics,
    ) -> Option<String> {
        let entry = self.jobs.get_mut(&job)?;
        if !crate::driver::skew_splits::needs_channel_rows(&entry.graph, attempt.task.stage) {
            metrics.channel_rows = Vec::new();
        }
        entry.metrics.insert(attempt, metrics);
        entry.task_succeeded(attempt);
        let escaped = crate::driver::runtime_filters::rerun_escapes_filter(entry, attempt);
        let stage_id = attempt.task.stage;
        if !entry.stage_complete(stage_id) {
            return escaped;
        }
        entry.attempts.stage_done(stage_id);
        // Runtime filter predicates hold key values: debug. A broadcast switch not made (a probe
        // side that started first is common): debug.
        let applied = crate::driver::runtime_filters::apply_ready(entry, job, stage_id);
        let filtered = applied.notes;
        keep_notes!(debug, "sluice::runtime_filter", job, entry, filtered);
        let filter_updates = applied.updates;
        // Each update goes to every worker running a task of its target that has not succeeded
        // (a task placed from now on gets the summary with its definition); its note says to how
        // many.
        let mut updates = Vec::new();
        let mut sent_notes = Vec::new();
        for (update, mut note) in filter_updates {
            let mut locations: Vec<Location> = Vec::new();
            for (attempt, location) in &entry.placed {
                if attempt.task.stage == update.stage
                    && entry.latest.get(&attempt.task) == Some(&attempt.attempt)
                    && !entry.succeeded.contains_key(&attempt.task)
                    && !locations.contains(location)
                {
                    locations.push(*location);
                }
            }
            note.text = match (update.summary.is_empty(), locations.len()) {
                (true, 0) => note.text,
                (true, 1) => format!("{}; the 1 worker running its tasks told so", note.text),
                (true, n) => format!("{}; the {n} workers running its tasks told so", note.text),
                (false, 0) => format!("{}, not sent: no task of the stage still ran", note.text),
                (false, 1) => format!("{}, sent to the 1 worker running its tasks", note.text),
                (false, n) => format!("{}, sent to the {n} workers running its tasks", note.text),
            };
            sent_notes.push(note);
            updates.extend(locations.into_iter().map(|l| (l, update.clone())));
        }
        keep_notes!(debug, "sluice::runtime_filter", job, entry, sent_notes);
        let (not_switched, switched): (Vec<_>, Vec<_>) =
            crate::driver::broadcast_switch::decide_ready(entry)
                .into_iter()
                .partition(|note| {
                    note.text
                        .starts_with(crate::driver::broadcast_switch::NO_SWITCH)
                });
        keep_notes!(info, "sluice::broadcast_switch", job, entry, switched);
        keep_notes!(debug, "sluice::broadcast_switch", job, entry, not_switched);
        let split = crate::driver::skew_splits::decide_ready(entry, stage_id);
        keep_notes!(info, "sluice::skew_split", job, entry, split);
        for (location, update) in updates {
            self.send_filter(location, update);
        }
        let Some(entry) = self.jobs.get_mut(&job) else {
            return escaped;
        };
        let Some(stage) = entry.graph.stage(stage_id) else {
            return escaped;
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
        escaped
    }

    pub(super) fn run_task_failed(
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
                && self.registry.contains(worker)
            {
                let why = format!("RunTask got no answer ({})", error.error.message);
                self.worker_lost(worker, &why, WorkerLoss::CutOff);
                self.place_waiting();
                return;
            }
        }
        self.registry.free(key);
        self.record(Transition::AttemptEnded {
            job,
            attempt,
            state: TaskRecordState::Failed,
            metrics: None,
            error: Some(format!("it never started: {}", error.error.message)),
        });
        let actions = self.scheduler.task_not_started(job, attempt, error.error);
        self.perform(actions);
        self.place_waiting();
    }

    /// Adds final-stage attempt `attempt`'s streams to the job output (once: it is said at the
    /// attempt's `Running` report and again at its success). An attempt whose worker has no address
    /// any more cannot be read: the scheduler runs its region again.
    pub(super) fn extend_output(&mut self, job: JobId, attempt: TaskAttempt) {
        let Some(entry) = self.jobs.get(&job) else {
            return;
        };
        if entry.announced.get(&attempt.task) == Some(&attempt.attempt) {
            return;
        }
        let channels = entry
            .graph
            .stage(attempt.task.stage)
            .map_or(1, |s| s.distribution.channels());
        let address = entry
            .placed
            .get(&attempt)
            .and_then(|location| self.registry.address_of(*location));
        let Some(address) = address else {
            self.output_unreadable(job, attempt, "its worker is gone");
            return;
        };
        let key = attempt.of_job(job);
        let streams = (0..channels)
            .map(|channel| key.stream(channel).replica(0))
            .collect();
        if let Some(entry) = self.jobs.get_mut(&job) {
            entry.announced.insert(attempt.task, attempt.attempt);
            let _ = entry.output.send(OutputCommand::Add {
                attempt,
                address,
                streams,
            });
        }
    }

    /// The job output cannot read final-stage attempt `attempt`'s output (`why`): the scheduler
    /// runs its region again once the attempt succeeded (charged as a failure).
    pub(super) fn output_unreadable(&mut self, job: JobId, attempt: TaskAttempt, why: &str) {
        let error = RemoteError::new(
            ErrorKind::Transport,
            format!("the job output could not read its output: {why}"),
        );
        let actions = self.scheduler.output_unreadable(job, attempt, error);
        self.perform(actions);
    }
}
