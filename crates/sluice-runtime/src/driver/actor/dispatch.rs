//! The actor's calls to workers: placing waiting regions on free slots (or failing them after the
//! capacity wait), starting the placed attempts with their task definitions, stopping attempts,
//! releasing outputs, sending runtime filters to running tasks, and cleaning a job up everywhere. Every call runs on the actor's `JoinSet`;
//! its outcome comes back as an event.

use std::sync::Arc;

use sluice_planner::{AttemptKey, InputMode, JobId, TaskAttempt, TaskId, TaskPlacement};
use tokio::time::Instant;

use super::DriverActor;
use crate::definition::RuntimeFilterUpdate;
use crate::driver::definitions::task_definition;
use crate::driver::job::JobEntry;
use crate::driver::journal::Transition;
use crate::driver::placement::{Location, Placement, PlacementView, next_region, place};
use crate::driver::{DriverEvent, JobState};
use crate::error::{ErrorKind, RemoteError};
use crate::transport::RunTaskError;

impl DriverActor {
    pub(super) fn stop_at(&mut self, location: Location, key: AttemptKey) {
        if let Some(client) = self.registry.client(location) {
            // A worker that cannot be reached has no task to stop.
            let stop = client.stop_task(key);
            self.rpcs.spawn(async move {
                let _ = stop.await;
            });
        }
    }

    pub(super) fn send_filter(&mut self, location: Location, update: RuntimeFilterUpdate) {
        if let Some(client) = self.registry.client(location) {
            // A filter that does not arrive leaves its tasks reading every row: a correct answer.
            let send = client.apply_runtime_filter(update);
            self.rpcs.spawn(async move {
                if let Err(e) = send.await {
                    tracing::debug!(target: "sluice::runtime_filter", "a runtime filter was not delivered: {e}");
                }
            });
        }
    }

    pub(super) fn release_output(&mut self, location: Location, key: AttemptKey) {
        if let Some(client) = self.registry.client(location) {
            // A producer that cannot be reached has nothing left to release.
            let release = client.release_output(key);
            self.rpcs.spawn(async move {
                let _ = release.await;
            });
        }
    }

    /// Places waiting regions while they fit, the job holding fewest slots first (see
    /// [`next_region`]).
    pub(super) fn place_waiting(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        // The workers' slots, read once and kept up to date with what this call places (nothing
        // else changes them until it returns): placing many small regions costs each one its
        // tasks, not a walk over every worker.
        let mut slots = self.registry.slots();
        let slot_index: std::collections::HashMap<_, usize> = slots
            .iter()
            .enumerate()
            .map(|(index, s)| (s.worker, index))
            .collect();
        loop {
            if self.waiting.is_empty() {
                return;
            }
            let jobs: Vec<JobId> = self.waiting.iter().map(|(job, _, _)| *job).collect();
            let held = self.registry.slots_held();
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
            let placement = match self.jobs.get(&job) {
                Some(entry) => place(&ids, &JobView(entry), &slots),
                None => continue,
            };
            match placement {
                Placement::Placed(locations) => {
                    for location in &locations {
                        if let Location::Worker(worker) = location
                            && let Some(s) = slot_index.get(worker).and_then(|i| slots.get_mut(*i))
                        {
                            s.free = s.free.saturating_sub(1);
                        }
                    }
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
                    if self.jobs.contains_key(&job) {
                        let error = crate::error::sluice_error(
                            ErrorKind::ResourcesExhausted,
                            format!(
                                "job {job}: {shortfall} after waiting {:.1} s for workers to \
                                 join (capacity_wait){}; add workers or task slots, or lower \
                                 datafusion.execution.target_partitions",
                                waited.as_secs_f64(),
                                self.capacity_note
                                    .as_ref()
                                    .map(|note| format!("; the cluster manager says: {note}"))
                                    .unwrap_or_default()
                            ),
                        );
                        self.end_job(job, JobState::Failed, error);
                    }
                    let actions = self.scheduler.cancel_job(job);
                    self.perform(actions);
                    // What the failed job held (and whatever `perform` did) changed the slots:
                    // go on from a fresh reading of them.
                    return self.place_waiting();
                }
            }
        }
    }

    /// Worker slots the waiting regions need at once: their tasks whose stages run on workers.
    pub(super) fn waiting_slots(&self) -> usize {
        self.waiting
            .iter()
            .filter_map(|(job, _, tasks)| {
                let view = JobView(self.jobs.get(job)?);
                Some(tasks.iter().filter(|t| !view.on_driver(t.task)).count())
            })
            .sum()
    }

    pub(super) fn launch(&mut self, job: JobId, tasks: &[TaskAttempt], locations: &[Location]) {
        if !self.jobs.contains_key(&job) {
            return;
        }
        for (attempt, location) in tasks.iter().zip(locations) {
            let address = self.registry.address_of(*location).unwrap_or_default();
            if let Some(entry) = self.jobs.get_mut(&job) {
                entry.place(*attempt, *location);
            }
            let worker = match location {
                Location::Worker(w) => Some(*w),
                Location::Driver => None,
            };
            self.record(Transition::Placed {
                job,
                attempt: *attempt,
                worker,
                address,
            });
            self.registry.hold(attempt.of_job(job), *location);
        }
        for (attempt, location) in tasks.iter().zip(locations) {
            self.start(job, *attempt, *location);
        }
    }

    pub(super) fn start(&mut self, job: JobId, attempt: TaskAttempt, location: Location) {
        let definition = match self.jobs.get(&job) {
            Some(entry) => task_definition(job, entry, attempt, &|l| self.registry.address_of(l)),
            None => return,
        };
        let client = self.registry.client(location);
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

    /// Removes the job's streams everywhere and forgets it.
    pub(super) fn clean_up(&mut self, job: JobId) {
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
        for client in self.registry.all_clients() {
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
