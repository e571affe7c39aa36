//! The driver's journal: the one hook every state transition goes through to be told. From a
//! [`Transition`] it updates the counters, the user's notices, and the job's records (its
//! `JobRecord` and task attempt records, which also emit the tracing spans). The actor decides and
//! acts; the journal only writes down what happened, so what `sluice.jobs`, the REST API, the
//! spans, the counters and the notices say cannot drift apart.
//!
//! Invariants: a transition of a job the driver no longer tracks still counts and notices (its
//! records are gone); notices are bounded ([`NOTICES_KEPT`], oldest dropped first).

use std::collections::{HashMap, VecDeque};

use sluice_planner::{AttemptKey, JobId, RegionId, TaskAttempt, TaskId, WorkerId};

use super::attempts::TaskRecordState;
use super::job::JobEntry;
use super::{DriverCounters, JobState};
use crate::analyze::TaskMetrics;

/// Notices kept for a caller that does not collect them.
pub(crate) const NOTICES_KEPT: usize = 256;

/// Something that happened to the driver's workers or jobs.
pub(crate) enum Transition<'a> {
    /// A line for the user from outside the actor.
    Notice(String),
    /// An attempt was placed (at a worker, or on the driver when `worker` is `None`).
    Placed {
        job: JobId,
        attempt: TaskAttempt,
        worker: Option<WorkerId>,
        address: String,
    },
    /// An attempt ended: its record's state, the metrics of an accepted success, its error.
    AttemptEnded {
        job: JobId,
        attempt: TaskAttempt,
        state: TaskRecordState,
        metrics: Option<TaskMetrics>,
        error: Option<String>,
    },
    /// An accepted attempt succeeded on `worker`.
    Succeeded {
        key: AttemptKey,
        worker: WorkerId,
        metrics: &'a TaskMetrics,
    },
    /// A worker is draining.
    Draining { worker: WorkerId, address: String },
    /// A worker was lost with the attempts that ran there (sorted); `left`: it drained and left on
    /// request (with no attempt lost, a departure, not a loss).
    WorkerLost {
        worker: WorkerId,
        address: &'a str,
        attempts: &'a [AttemptKey],
        why: &'a str,
        left: bool,
    },
    /// A read of `reader` from `peer` failed at the connection, but `peer` still beats: kept.
    PeerKept {
        reader: AttemptKey,
        reader_worker: String,
        peer: String,
        message: &'a str,
    },
    /// A region is retried after `failed` failed at `place`.
    RegionRetried {
        job: JobId,
        region: RegionId,
        failed: TaskId,
        place: String,
        error: String,
        failures: usize,
        max_attempts: usize,
        next_attempt: usize,
    },
    /// Regions whose outputs were lost run again before their readers.
    RegionsRerun {
        job: JobId,
        producers: &'a [RegionId],
        readers: &'a [RegionId],
    },
    /// A job ended (its output may still be read).
    JobEnded {
        job: JobId,
        state: JobState,
        error: Option<String>,
    },
}

/// Counters and notices; see the module docs.
#[derive(Default)]
pub(crate) struct Journal {
    counters: DriverCounters,
    notices: VecDeque<String>,
}

impl Journal {
    /// What the driver's jobs did so far.
    pub fn counters(&self) -> DriverCounters {
        self.counters
    }

    /// The notices since the last call, oldest first.
    pub fn take_notices(&mut self) -> Vec<String> {
        self.notices.drain(..).collect()
    }

    fn notice(&mut self, line: String) {
        if self.notices.len() == NOTICES_KEPT {
            self.notices.pop_front();
        }
        self.notices.push_back(line);
    }

    /// Writes `transition` down (see the module docs).
    pub fn record(&mut self, transition: Transition<'_>, jobs: &mut HashMap<JobId, JobEntry>) {
        match transition {
            Transition::Notice(line) => self.notice(line),
            Transition::Placed {
                job,
                attempt,
                worker,
                address,
            } => {
                self.counters.tasks_started += 1;
                if attempt.attempt > 0 {
                    self.counters.tasks_retried += 1;
                }
                if let Some(entry) = jobs.get_mut(&job) {
                    entry.attempts.placed(attempt, worker, address);
                }
            }
            Transition::AttemptEnded {
                job,
                attempt,
                state,
                metrics,
                error,
            } => {
                if let Some(entry) = jobs.get_mut(&job) {
                    entry.attempts.ended(attempt, state, metrics, error);
                }
            }
            Transition::Succeeded {
                key,
                worker,
                metrics,
            } => {
                self.counters.spilled_bytes += metrics.spilled_bytes;
                self.counters.shuffled_bytes += metrics.shuffled_bytes;
                self.counters.read_local_bytes += metrics.read_local_bytes;
                self.counters.read_remote_bytes += metrics.read_remote_bytes;
                self.counters.scanned_bytes += metrics.scanned_bytes;
                if metrics.fetch_retries > 0 {
                    self.notice(format!(
                        "{key} on {worker}: {} read(s) from other workers failed before reaching \
                         them and succeeded when made again (the last failure: {})",
                        metrics.fetch_retries, metrics.fetch_retried
                    ));
                }
            }
            // Workers come and go with the load: their departures go to the log, not to notices.
            Transition::Draining { worker, address } => {
                tracing::info!(
                    target: "sluice::cluster",
                    worker = worker.0,
                    %address,
                    "{worker} ({address}) is draining"
                );
            }
            Transition::WorkerLost {
                worker,
                address,
                attempts: [],
                why,
                left: true,
            } => {
                tracing::info!(
                    target: "sluice::cluster",
                    worker = worker.0,
                    %address,
                    "{worker} ({address}) left: {why}"
                );
            }
            Transition::WorkerLost {
                worker,
                address,
                attempts,
                why,
                ..
            } => {
                self.counters.workers_lost += 1;
                let during = match attempts.first() {
                    Some(first) => {
                        let mut stages: Vec<String> = attempts
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
            }
            Transition::PeerKept {
                reader,
                reader_worker,
                peer,
                message,
            } => {
                self.notice(format!(
                    "{reader} on {reader_worker} could not read from {peer}, which still sends \
                     heartbeats: it is kept, the attempt is retried ({message})"
                ));
            }
            Transition::RegionRetried {
                job,
                region,
                failed,
                place,
                error,
                failures,
                max_attempts,
                next_attempt,
            } => {
                if let Some(entry) = jobs.get_mut(&job) {
                    entry.retries += 1;
                }
                self.counters.regions_retried += 1;
                self.notice(format!(
                    "job {job}: retrying region {region} (attempt {}; {failures} of \
                     {max_attempts} failures allowed so far): {failed} failed on {place}: {error}",
                    next_attempt + 1,
                ));
            }
            Transition::RegionsRerun {
                job,
                producers,
                readers,
            } => {
                if let Some(entry) = jobs.get_mut(&job) {
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
                    list(producers),
                    if producers.len() == 1 { "it" } else { "them" }
                );
                if !readers.is_empty() {
                    line.push_str(&format!(" before {}", list(readers)));
                }
                self.notice(line);
            }
            Transition::JobEnded { job, state, error } => {
                if let Some(entry) = jobs.get_mut(&job) {
                    if state == JobState::Succeeded {
                        let last = entry.graph.stages().len().saturating_sub(1);
                        entry.record.rows = entry
                            .succeeded_metrics()
                            .iter()
                            .filter(|(task, _)| task.stage.0 == last)
                            .map(|(_, metrics)| metrics.rows)
                            .sum();
                    }
                    entry.record.end(state, error);
                }
            }
        }
    }
}
