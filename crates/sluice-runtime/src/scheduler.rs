//! The job scheduler: a pure state machine over jobs, task regions and task attempts. Events go in
//! (a job accepted, a task status report, a cancellation, output delivered), actions come out (run a
//! region, stop tasks, extend the job output, finish the job, clean up). It performs no IO and owns
//! no clock, so every transition is unit-tested; the driver actor is a thin shell that performs the
//! actions.
//!
//! ```text
//!  accept_job ──► RunRegion(regions without dependencies, attempt 0)
//!  status(task, attempt, seq, Running)   ──► ExtendOutput (final-stage tasks)
//!  status(.., Succeeded) ──► region done? ──► RunRegion(newly ready) │ JobSucceeded + CleanUpJob
//!  status(.., Failed)    ──► StopTasks(region) + RunRegion(attempt + 1)  (attempts < max_attempts)
//!                          └► StopTasks(job) + JobFailed(root cause) + CleanUpJob
//! ```
//!
//! Invariants:
//! - a region runs as a unit: all its tasks share the region's attempt number; a retry restarts all;
//! - reports for an attempt other than the region's current one, or with a sequence number not above
//!   the last one seen for that task attempt, change nothing (stale, duplicated or out of order);
//! - the job fails with the first real failure's message, never with the cancellations it caused;
//! - a region whose tasks' output already reached the caller is not retried (that could duplicate
//!   rows): the job fails, saying so;
//! - a finished job (succeeded, failed or cancelled) is forgotten: driver state does not grow.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use datafusion::common::Result;
use sluice_planner::{JobGraph, JobTopology, RegionId, TaskId};

use crate::stream_store::JobId;

/// One attempt of one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskAttempt {
    /// The task.
    pub task: TaskId,
    /// The attempt (the region's attempt when it was started).
    pub attempt: usize,
}

/// What a worker reports about a task attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskStatus {
    /// Executing.
    Running,
    /// Finished; its output is complete.
    Succeeded,
    /// Failed with this message.
    Failed(String),
    /// Stopped on request.
    Canceled,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedulerAction {
    /// Start every task of a region (placed together, or the region waits).
    RunRegion {
        /// The job.
        job: JobId,
        /// The region.
        region: RegionId,
        /// The task attempts to start.
        tasks: Vec<TaskAttempt>,
    },
    /// Stop these task attempts (their output is discarded).
    StopTasks {
        /// The job.
        job: JobId,
        /// The attempts.
        tasks: Vec<TaskAttempt>,
    },
    /// Add a final-stage task attempt's output streams to the job output.
    ExtendOutput {
        /// The job.
        job: JobId,
        /// The attempt whose streams to read.
        task: TaskAttempt,
    },
    /// Every task succeeded: end the job output stream.
    JobSucceeded {
        /// The job.
        job: JobId,
    },
    /// The job failed; `error` is the root cause.
    JobFailed {
        /// The job.
        job: JobId,
        /// The first real failure, naming stage and partition.
        error: String,
    },
    /// Remove the job's streams from every worker.
    CleanUpJob {
        /// The job.
        job: JobId,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum RegionState {
    Waiting,
    Running {
        attempt: usize,
        remaining: BTreeSet<TaskId>,
    },
    Succeeded,
}

#[derive(Debug)]
struct Job {
    graph: Arc<JobGraph>,
    topology: JobTopology,
    regions: Vec<RegionState>,
    /// Last sequence number seen per task attempt.
    sequences: HashMap<TaskAttempt, u64>,
    /// Regions whose output reached the caller (not retried).
    delivered: BTreeSet<RegionId>,
    /// The attempt each succeeded region succeeded with.
    succeeded: HashMap<RegionId, usize>,
}

/// The scheduler; see the module docs.
#[derive(Debug)]
pub struct JobScheduler {
    jobs: HashMap<JobId, Job>,
    next_job: u64,
    max_attempts: usize,
}

impl JobScheduler {
    /// A scheduler that runs each region at most `max_attempts` times (at least once).
    pub fn new(max_attempts: usize) -> Self {
        Self {
            jobs: HashMap::new(),
            next_job: 1,
            max_attempts: max_attempts.max(1),
        }
    }

    /// Number of jobs still tracked.
    pub fn active_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Accepts a job: returns its id and the regions to start now.
    pub fn accept_job(&mut self, graph: Arc<JobGraph>) -> Result<(JobId, Vec<SchedulerAction>)> {
        let topology = JobTopology::try_new(&graph)?;
        let job_id = JobId(self.next_job);
        self.next_job += 1;
        let job = Job {
            regions: vec![RegionState::Waiting; topology.regions().len()],
            graph,
            topology,
            sequences: HashMap::new(),
            delivered: BTreeSet::new(),
            succeeded: HashMap::new(),
        };
        self.jobs.insert(job_id, job);
        let actions = self.start_ready_regions(job_id);
        Ok((job_id, actions))
    }

    /// The shell delivered output of `task`'s region to the caller: that region is no longer retried.
    pub fn output_delivered(&mut self, job: JobId, task: TaskId) {
        if let Some(state) = self.jobs.get_mut(&job)
            && let Some(region) = state.topology.region_of(task)
        {
            state.delivered.insert(region);
        }
    }

    /// Asks whether output of `attempt` may go to the caller now: only while its region runs that very
    /// attempt. A yes also marks the region delivered (it is no longer retried), so a batch of an
    /// attempt the scheduler has already replaced never reaches the caller, and a delivered region
    /// never runs twice.
    pub fn approve_output(&mut self, job: JobId, attempt: TaskAttempt) -> bool {
        let Some(state) = self.jobs.get_mut(&job) else {
            return false;
        };
        let Some(region) = state.topology.region_of(attempt.task) else {
            return false;
        };
        let current = match &state.regions[region.0] {
            RegionState::Running { attempt, .. } => Some(*attempt),
            RegionState::Succeeded => state.succeeded.get(&region).copied(),
            RegionState::Waiting => None,
        };
        if current != Some(attempt.attempt) {
            return false;
        }
        state.delivered.insert(region);
        true
    }

    /// Cancels a job: stops its running tasks and forgets it.
    pub fn cancel_job(&mut self, job: JobId) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.remove(&job) else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        let running = running_attempts(&state);
        if !running.is_empty() {
            actions.push(SchedulerAction::StopTasks {
                job,
                tasks: running,
            });
        }
        actions.push(SchedulerAction::CleanUpJob { job });
        actions
    }

    /// Records a status report; `sequence` increases with every report of one task attempt.
    pub fn task_status(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        sequence: u64,
        status: TaskStatus,
    ) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new(); // a finished or unknown job: late reports are harmless
        };
        let Some(region) = state.topology.region_of(attempt.task) else {
            return Vec::new();
        };
        let current = match &state.regions[region.0] {
            RegionState::Running { attempt, .. } => *attempt,
            _ => return Vec::new(),
        };
        if attempt.attempt != current {
            return Vec::new();
        }
        // Sequence numbers start at 1; 0 is never newer than anything.
        let last = state.sequences.entry(attempt).or_insert(0);
        if sequence <= *last {
            return Vec::new();
        }
        *last = sequence;
        match status {
            TaskStatus::Running => {
                if attempt.task.stage == state.graph.final_stage() {
                    vec![SchedulerAction::ExtendOutput { job, task: attempt }]
                } else {
                    Vec::new()
                }
            }
            TaskStatus::Succeeded => self.task_succeeded(job, region, attempt.task),
            TaskStatus::Failed(error) => self.region_failed(job, region, attempt, error),
            // Only stops the scheduler asked for produce Canceled; anything else is a failure.
            TaskStatus::Canceled => self.region_failed(
                job,
                region,
                attempt,
                "the task was cancelled on its worker".to_string(),
            ),
        }
    }

    fn task_succeeded(
        &mut self,
        job: JobId,
        region: RegionId,
        task: TaskId,
    ) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let done = match &mut state.regions[region.0] {
            RegionState::Running { remaining, attempt } => {
                remaining.remove(&task);
                remaining.is_empty().then_some(*attempt)
            }
            _ => None,
        };
        let Some(attempt) = done else {
            return Vec::new();
        };
        state.succeeded.insert(region, attempt);
        state.regions[region.0] = RegionState::Succeeded;
        if state.regions.iter().all(|r| *r == RegionState::Succeeded) {
            self.jobs.remove(&job);
            return vec![
                SchedulerAction::JobSucceeded { job },
                SchedulerAction::CleanUpJob { job },
            ];
        }
        self.start_ready_regions(job)
    }

    fn region_failed(
        &mut self,
        job: JobId,
        region: RegionId,
        failed: TaskAttempt,
        error: String,
    ) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let RegionState::Running { attempt, remaining } = &state.regions[region.0] else {
            return Vec::new();
        };
        let attempt = *attempt;
        let to_stop: Vec<TaskAttempt> = remaining
            .iter()
            .filter(|t| **t != failed.task)
            .map(|task| TaskAttempt {
                task: *task,
                attempt,
            })
            .collect();
        let message = format!(
            "stage {} partition {} (attempt {}): {error}",
            failed.task.stage,
            failed.task.partition,
            attempt + 1
        );
        let retry = attempt + 1 < self.max_attempts && !state.delivered.contains(&region);
        if retry {
            let mut actions = Vec::new();
            if !to_stop.is_empty() {
                actions.push(SchedulerAction::StopTasks {
                    job,
                    tasks: to_stop,
                });
            }
            actions.push(start_region(job, state, region, attempt + 1));
            return actions;
        }
        let mut error = message;
        if state.delivered.contains(&region) {
            error.push_str(
                "; not retried because part of its output already reached the caller (a retry could duplicate rows)",
            );
        } else if self.max_attempts > 1 {
            error.push_str(&format!(" (after {} attempts)", attempt + 1));
        }
        let mut running = running_attempts(state);
        running.retain(|t| *t != failed);
        self.jobs.remove(&job);
        let mut actions = Vec::new();
        if !running.is_empty() {
            actions.push(SchedulerAction::StopTasks {
                job,
                tasks: running,
            });
        }
        actions.push(SchedulerAction::JobFailed { job, error });
        actions.push(SchedulerAction::CleanUpJob { job });
        actions
    }

    fn start_ready_regions(&mut self, job: JobId) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let ready: Vec<RegionId> = state
            .topology
            .regions()
            .iter()
            .enumerate()
            .filter(|(id, region)| {
                state.regions[*id] == RegionState::Waiting
                    && region
                        .depends_on
                        .iter()
                        .all(|d| state.regions[d.0] == RegionState::Succeeded)
            })
            .map(|(id, _)| RegionId(id))
            .collect();
        ready
            .into_iter()
            .map(|region| start_region(job, state, region, 0))
            .collect()
    }
}

fn start_region(job: JobId, state: &mut Job, region: RegionId, attempt: usize) -> SchedulerAction {
    let tasks: Vec<TaskId> = state
        .topology
        .regions()
        .get(region.0)
        .map(|r| r.tasks.clone())
        .unwrap_or_default();
    state.regions[region.0] = RegionState::Running {
        attempt,
        remaining: tasks.iter().copied().collect(),
    };
    SchedulerAction::RunRegion {
        job,
        region,
        tasks: tasks
            .into_iter()
            .map(|task| TaskAttempt { task, attempt })
            .collect(),
    }
}

fn running_attempts(state: &Job) -> Vec<TaskAttempt> {
    state
        .regions
        .iter()
        .flat_map(|r| match r {
            RegionState::Running { attempt, remaining } => remaining
                .iter()
                .map(|task| TaskAttempt {
                    task: *task,
                    attempt: *attempt,
                })
                .collect::<Vec<_>>(),
            _ => Vec::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::Schema;
    use datafusion::physical_plan::empty::EmptyExec;
    use sluice_planner::{
        InputMode, OutputDistribution, OutputMode, Stage, StageId, StageInput, TaskPlacement,
    };

    use super::*;

    fn stage(inputs: &[(usize, InputMode)], partitions: usize, mode: OutputMode) -> Stage {
        let schema = Arc::new(Schema::empty());
        Stage {
            inputs: inputs
                .iter()
                .map(|(s, m)| StageInput {
                    stage: StageId(*s),
                    mode: *m,
                })
                .collect(),
            plan: Arc::new(EmptyExec::new(schema).with_partitions(partitions)),
            mode,
            distribution: OutputDistribution::RoundRobin { channels: 1 },
            placement: TaskPlacement::Worker,
        }
    }

    fn graph(stages: Vec<Stage>) -> Arc<JobGraph> {
        Arc::new(JobGraph::from_stages(stages, Arc::new(Schema::empty())).unwrap())
    }

    /// Stage 0 (2 partitions, blocking) → stage 1 (1 partition, final): regions 0, 1 then 2.
    fn blocking_job() -> Arc<JobGraph> {
        graph(vec![
            stage(&[], 2, OutputMode::Blocking),
            stage(&[(0, InputMode::Shuffle)], 1, OutputMode::Pipelined),
        ])
    }

    /// Stage 0 (2 partitions) → stage 1 (2 partitions, final), pipelined: one region of 4 tasks.
    fn pipelined_job() -> Arc<JobGraph> {
        graph(vec![
            stage(&[], 2, OutputMode::Pipelined),
            stage(&[(0, InputMode::Shuffle)], 2, OutputMode::Pipelined),
        ])
    }

    fn attempt(stage: usize, partition: usize, attempt: usize) -> TaskAttempt {
        TaskAttempt {
            task: TaskId {
                stage: StageId(stage),
                partition,
            },
            attempt,
        }
    }

    fn started(actions: &[SchedulerAction]) -> Vec<Vec<TaskAttempt>> {
        actions
            .iter()
            .filter_map(|a| match a {
                SchedulerAction::RunRegion { tasks, .. } => Some(tasks.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_job_runs_region_by_region_and_is_forgotten_when_done() {
        let mut scheduler = JobScheduler::new(3);
        let (job, actions) = scheduler.accept_job(blocking_job()).unwrap();
        assert_eq!(
            started(&actions),
            [vec![attempt(0, 0, 0)], vec![attempt(0, 1, 0)]]
        );
        assert!(
            scheduler
                .task_status(job, attempt(0, 0, 0), 1, TaskStatus::Running)
                .is_empty()
        );
        assert!(
            scheduler
                .task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded)
                .is_empty()
        );
        let actions = scheduler.task_status(job, attempt(0, 1, 0), 1, TaskStatus::Succeeded);
        assert_eq!(started(&actions), [vec![attempt(1, 0, 0)]]);
        let actions = scheduler.task_status(job, attempt(1, 0, 0), 1, TaskStatus::Running);
        assert_eq!(
            actions,
            [SchedulerAction::ExtendOutput {
                job,
                task: attempt(1, 0, 0)
            }]
        );
        let actions = scheduler.task_status(job, attempt(1, 0, 0), 2, TaskStatus::Succeeded);
        assert_eq!(
            actions,
            [
                SchedulerAction::JobSucceeded { job },
                SchedulerAction::CleanUpJob { job }
            ]
        );
        assert_eq!(scheduler.active_jobs(), 0);
        // Late reports about a forgotten job change nothing.
        assert!(
            scheduler
                .task_status(job, attempt(1, 0, 0), 3, TaskStatus::Succeeded)
                .is_empty()
        );
    }

    #[test]
    fn output_is_approved_only_for_the_current_attempt_and_stops_retries() {
        let mut scheduler = JobScheduler::new(3);
        let (job, _) = scheduler.accept_job(pipelined_job()).unwrap();
        // A region retried before any output: the old attempt's output is refused, the new one's
        // approved.
        scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Failed("x".into()));
        assert!(!scheduler.approve_output(job, attempt(1, 0, 0)));
        assert!(scheduler.approve_output(job, attempt(1, 0, 1)));
        // Once output reached the caller, a failure fails the job instead of retrying.
        let actions = scheduler.task_status(
            job,
            attempt(0, 1, 1),
            1,
            TaskStatus::Failed("disk full".into()),
        );
        let failed = actions.iter().find_map(|a| match a {
            SchedulerAction::JobFailed { error, .. } => Some(error.clone()),
            _ => None,
        });
        let error = failed.expect("the job should fail");
        assert!(
            error.contains("disk full") && error.contains("duplicate"),
            "{error}"
        );
        assert!(!scheduler.approve_output(job, attempt(1, 0, 1)));
    }

    #[test]
    fn a_succeeded_region_keeps_approving_its_last_attempt() {
        let mut scheduler = JobScheduler::new(3);
        let (job, _) = scheduler.accept_job(blocking_job()).unwrap();
        scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Failed("x".into()));
        scheduler.task_status(job, attempt(0, 0, 1), 1, TaskStatus::Succeeded);
        assert!(scheduler.approve_output(job, attempt(0, 0, 1)));
        assert!(!scheduler.approve_output(job, attempt(0, 0, 0)));
        // A region that has not started approves nothing.
        assert!(!scheduler.approve_output(job, attempt(1, 0, 0)));
    }

    #[test]
    fn a_failure_in_the_middle_of_a_region_restarts_the_whole_region() {
        let mut scheduler = JobScheduler::new(3);
        let (job, actions) = scheduler.accept_job(pipelined_job()).unwrap();
        assert_eq!(started(&actions)[0].len(), 4);
        scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Succeeded);
        let actions = scheduler.task_status(
            job,
            attempt(1, 1, 0),
            1,
            TaskStatus::Failed("disk full".into()),
        );
        assert_eq!(
            actions[0],
            SchedulerAction::StopTasks {
                job,
                tasks: vec![attempt(0, 1, 0), attempt(1, 0, 0)]
            }
        );
        assert_eq!(
            started(&actions),
            [vec![
                attempt(0, 0, 1),
                attempt(0, 1, 1),
                attempt(1, 0, 1),
                attempt(1, 1, 1)
            ]]
        );
        // The stopped attempts' cancellations are stale: no action, no failure.
        assert!(
            scheduler
                .task_status(job, attempt(0, 1, 0), 1, TaskStatus::Canceled)
                .is_empty()
        );
        for (s, p) in [(0, 0), (0, 1), (1, 0)] {
            assert!(
                scheduler
                    .task_status(job, attempt(s, p, 1), 1, TaskStatus::Succeeded)
                    .is_empty()
            );
        }
        let actions = scheduler.task_status(job, attempt(1, 1, 1), 1, TaskStatus::Succeeded);
        assert!(actions.contains(&SchedulerAction::JobSucceeded { job }));
    }

    #[test]
    fn duplicated_and_out_of_order_reports_are_harmless() {
        let mut scheduler = JobScheduler::new(3);
        let (job, _) = scheduler.accept_job(blocking_job()).unwrap();
        assert!(
            scheduler
                .task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded)
                .is_empty()
        );
        // An older report arriving late, and the same report twice.
        assert!(
            scheduler
                .task_status(job, attempt(0, 0, 0), 1, TaskStatus::Running)
                .is_empty()
        );
        assert!(
            scheduler
                .task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded)
                .is_empty()
        );
        // A report for an attempt that never ran.
        assert!(
            scheduler
                .task_status(job, attempt(0, 1, 7), 1, TaskStatus::Failed("x".into()))
                .is_empty()
        );
        let actions = scheduler.task_status(job, attempt(0, 1, 0), 1, TaskStatus::Succeeded);
        assert_eq!(started(&actions), [vec![attempt(1, 0, 0)]]);
    }

    #[test]
    fn a_job_whose_final_attempt_fails_fails_with_the_root_cause() {
        let mut scheduler = JobScheduler::new(2);
        let (job, _) = scheduler.accept_job(pipelined_job()).unwrap();
        let first =
            scheduler.task_status(job, attempt(0, 1, 0), 1, TaskStatus::Failed("boom".into()));
        assert_eq!(started(&first).len(), 1);
        let last =
            scheduler.task_status(job, attempt(0, 1, 1), 1, TaskStatus::Failed("boom".into()));
        let error = last
            .iter()
            .find_map(|a| match a {
                SchedulerAction::JobFailed { error, .. } => Some(error.clone()),
                _ => None,
            })
            .unwrap();
        assert!(
            error.contains("stage 0 partition 1") && error.contains("boom"),
            "{error}"
        );
        assert!(error.contains("after 2 attempts"), "{error}");
        assert!(last.contains(&SchedulerAction::CleanUpJob { job }));
        assert!(matches!(&last[0], SchedulerAction::StopTasks { tasks, .. } if tasks.len() == 3));
        assert_eq!(scheduler.active_jobs(), 0);
        // The cancellations of the stopped tasks come later and change nothing.
        assert!(
            scheduler
                .task_status(job, attempt(1, 0, 1), 1, TaskStatus::Canceled)
                .is_empty()
        );
    }

    #[test]
    fn a_region_whose_output_reached_the_caller_is_not_retried() {
        let mut scheduler = JobScheduler::new(3);
        let (job, _) = scheduler.accept_job(pipelined_job()).unwrap();
        scheduler.task_status(job, attempt(1, 0, 0), 1, TaskStatus::Running);
        scheduler.output_delivered(job, attempt(1, 0, 0).task);
        let actions =
            scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Failed("lost".into()));
        assert!(started(&actions).is_empty());
        assert!(actions.iter().any(|a| matches!(a,
            SchedulerAction::JobFailed { error, .. } if error.contains("duplicate rows"))));
    }

    #[test]
    fn cancelling_a_job_stops_its_tasks_and_forgets_it() {
        let mut scheduler = JobScheduler::new(3);
        let (job, _) = scheduler.accept_job(blocking_job()).unwrap();
        scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Succeeded);
        let actions = scheduler.cancel_job(job);
        assert_eq!(
            actions,
            [
                SchedulerAction::StopTasks {
                    job,
                    tasks: vec![attempt(0, 1, 0)]
                },
                SchedulerAction::CleanUpJob { job }
            ]
        );
        assert_eq!(scheduler.active_jobs(), 0);
        assert!(scheduler.cancel_job(job).is_empty());
    }
}
