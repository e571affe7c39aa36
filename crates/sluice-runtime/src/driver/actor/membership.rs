//! What the actor does when workers come and go: silent workers are lost, a lost worker's
//! attempts fail (charged by [`WorkerLoss`]) and the outputs it held are made again (lineage), and
//! a heartbeat's attempt list is reconciled with the attempts placed there.

use sluice_planner::{AttemptKey, JobId, TaskAttempt, TaskId, WorkerId};

use super::DriverActor;
use crate::driver::attempts::TaskRecordState;
use crate::driver::journal::Transition;
use crate::driver::placement::Location;
use crate::driver::reconcile::{Reconciled, WorkerBeat, reconcile};
use crate::error::{ErrorKind, RemoteError};
use crate::scheduler::WorkerLoss;

impl DriverActor {
    pub(super) fn check_liveness(&mut self) {
        let silent = self.registry.silent(self.options.heartbeat_timeout);
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
    pub(super) fn worker_lost(&mut self, worker: WorkerId, why: &str, loss: WorkerLoss) {
        self.remove_worker(worker, why, loss, false);
    }

    /// `worker` drained and deregistered: gone on request (a departure when nothing ran there).
    pub(super) fn worker_left(&mut self, worker: WorkerId) {
        self.remove_worker(worker, "it drained and left", WorkerLoss::CutOff, true);
    }

    fn remove_worker(&mut self, worker: WorkerId, why: &str, loss: WorkerLoss, left: bool) {
        let Some((address, lost)) = self.registry.remove(worker) else {
            return;
        };
        self.record(Transition::WorkerLost {
            worker,
            address: &address,
            attempts: &lost,
            why,
            left,
        });
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
                entry.forget_success(*task);
            }
            let actions = self.scheduler.outputs_lost(job, &outputs);
            self.perform(actions);
        }
        for key in lost {
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
    pub(super) fn attempt_lost(&mut self, key: AttemptKey, error: RemoteError, loss: WorkerLoss) {
        self.record(Transition::AttemptEnded {
            job: key.job,
            attempt: key.task_attempt(),
            state: TaskRecordState::Lost,
            metrics: None,
            error: Some(error.message.clone()),
        });
        let actions = self
            .scheduler
            .task_lost(key.job, key.task_attempt(), error, loss);
        self.perform(actions);
    }

    /// Applies what `worker`'s heartbeat says of its attempts (see `reconcile`): attempts it
    /// does not know fail, charged to their regions; attempts it runs that ended here are stopped.
    pub(super) fn reconcile(&mut self, worker: WorkerId, beat: &WorkerBeat) {
        let here = Location::Worker(worker);
        let running = self.registry.running_on(worker);
        let Reconciled { forgotten, orphans } = reconcile(running, beat);
        for key in orphans {
            self.stop_at(here, key);
        }
        if forgotten.is_empty() {
            return;
        }
        let name = self.registry.name(worker);
        for key in forgotten {
            self.registry.free(key);
            let error = RemoteError::new(
                ErrorKind::Transport,
                format!(
                    "{name} does not know {key}: it never ran it, or its final report was lost"
                ),
            );
            self.attempt_lost(key, error, WorkerLoss::Forgotten);
        }
        self.place_waiting();
    }
}
