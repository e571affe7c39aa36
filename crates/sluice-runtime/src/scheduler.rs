//! The job scheduler: a pure state machine over jobs, task regions and task attempts. Events go in
//! (a job accepted, a task status report, a task that could not be started, a cancellation, output
//! about to reach the caller, output read to its end or found unreadable), actions come out (run a
//! region, stop tasks, discard a replaced attempt's output, extend the job output, finish the job,
//! clean up). It performs no IO and owns no clock, so every transition is unit-tested; the driver
//! actor is a thin shell that performs the actions.
//!
//! ```text
//!  accept_job ──► RunRegion(regions without dependencies, attempt 0)
//!  status(task, attempt, seq, Running | Succeeded) ──► ExtendOutput (final-stage tasks)
//!  status(.., Succeeded) ──► region done? ──► RunRegion(newly ready)
//!                            every region done and every final output read? ──► JobSucceeded + CleanUpJob
//!  status(.., Failed(error)) ──► retryable, failures left:
//!                                   StopTasks(rest of region) + DiscardOutputs(region's attempt)
//!                                   + RegionRetried + RunRegion(next attempt)
//!                              └► otherwise StopTasks(job) + JobFailed(root cause) + CleanUpJob
//!  outputs_lost(tasks) (their worker is gone) ──► every succeeded region holding one of them whose
//!      output a region still needs, or the job output has not read yet, runs again (lineage), and
//!      the regions reading it wait for it:
//!      StopTasks + DiscardOutputs(readers) + RegionRerun + RunRegion(producers whose inputs exist)
//!  output_read(final attempt) ──► every final output read and every region done? ──► JobSucceeded
//!  output_unreadable(final attempt, error) ──► its region runs again (charged), as a failure would
//! ```
//!
//! Invariants:
//! - a region runs as a unit: all its tasks share the region's attempt number; a retry restarts all
//!   of them and discards every output of the replaced attempt; attempt numbers of a region only
//!   grow (a re-run after lineage takes the next one too), so no two attempts share stream keys;
//! - a region starts only when every region it depends on has succeeded and still holds its
//!   outputs; when outputs are lost with their worker, the producers re-run before any reader;
//! - reports for an attempt other than the region's current one, or with a sequence number not above
//!   the last one seen for that task attempt, change nothing (stale, duplicated or out of order), and
//!   the outcome says so (`accepted: false`), so the shell records nothing from them;
//! - a user error (see [`ErrorKind`]) fails the job at once: retrying a deterministic failure only
//!   repeats it; a region may fail `max_attempts` times; an attempt lost with a worker that was
//!   cut off (silent, unreachable) is not charged to it (the region did nothing wrong), one lost
//!   with a worker process that died is (the task may be what kills it), so a task that kills every
//!   worker it lands on fails its job after `max_attempts`, the failure listing what each attempt
//!   met;
//! - a job accepted with [`RetryPolicy::resources_final`] fails at its first out-of-memory failure
//!   (its front end has a cheaper plan to run instead: `joins = auto`'s sort-merge fallback);
//! - the job fails with the first real failure, never with the cancellations it caused;
//! - once every final-stage task has succeeded, the job's answer is complete (each read its inputs
//!   to their end markers): a later failure or loss of another task stops what still runs instead
//!   of retrying a region whose work (or write) is done; only a final output the job output could
//!   not read runs its region again, resuming after the rows already delivered;
//! - the job succeeds only once the job output read every final task's current attempt to its end:
//!   until then the job is kept, so a final output lost with its worker, or that cannot be read,
//!   makes its region run again instead of failing the job (the job output skips what the caller
//!   already has and proves that the retry reproduced it, `driver::output`);
//! - a region whose output already reached the caller is retried like any other (same proof);
//! - job ids come from here, one sequence per driver; a finished job (succeeded, failed or cancelled)
//!   is forgotten, so scheduler state does not grow.

use std::collections::BTreeSet;
use std::sync::Arc;

use datafusion::common::HashMap;

use sluice_planner::{Dependency, JobGraph, JobId, RegionId, TaskAttempt, TaskId};

use crate::error::{ErrorKind, RemoteError};

/// What a worker reports about a task attempt, as far as scheduling goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskStatus {
    /// Executing.
    Running,
    /// Finished; its output is complete.
    Succeeded,
    /// Failed with this error.
    Failed(RemoteError),
    /// Stopped on its worker.
    Canceled,
}

/// How a job's failures are retried, beyond `max_attempts`; travels with the job's session
/// config as an extension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryPolicy {
    /// An out-of-memory failure fails the job at once instead of running its region again.
    pub resources_final: bool,
}

impl RetryPolicy {
    /// The policy `config` carries (the default when none).
    pub fn of(config: &datafusion::prelude::SessionConfig) -> Self {
        config
            .get_extension::<RetryPolicy>()
            .map(|policy| *policy)
            .unwrap_or_default()
    }

    /// `config` carrying this policy.
    pub fn attach(
        self,
        config: datafusion::prelude::SessionConfig,
    ) -> datafusion::prelude::SessionConfig {
        config.with_extension(Arc::new(self))
    }

    /// Whether a failure of `kind` may run its region again.
    fn retries(self, kind: ErrorKind) -> bool {
        kind.is_retryable() && !(self.resources_final && kind == ErrorKind::ResourcesExhausted)
    }
}

/// Why a job failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFailure {
    /// The failed attempt.
    pub task: TaskAttempt,
    /// Its error.
    pub error: RemoteError,
    /// Attempts its region made.
    pub attempts: usize,
    /// What each failed attempt of its region met, oldest first (the last is `error`):
    /// `attempt N: stage S partition P: <error>`.
    pub history: Vec<String>,
}

/// How a task attempt was lost with its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerLoss {
    /// The worker fell silent or could not be reached (it may be cut off, not dead): not charged.
    CutOff,
    /// The worker's process died: charged to the region, since its task may be the cause.
    ProcessExited,
    /// The worker answers but does not know the attempt (it never ran it, or its final report
    /// was lost): charged, since its task may be what broke the report.
    Forgotten,
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
    /// Drop every output of these attempts (a retried region's previous attempt).
    DiscardOutputs {
        /// The job.
        job: JobId,
        /// The attempts.
        tasks: Vec<TaskAttempt>,
    },
    /// A region failed and runs again.
    RegionRetried {
        /// The job.
        job: JobId,
        /// The region.
        region: RegionId,
        /// The attempt that failed.
        failed: TaskAttempt,
        /// Its error.
        error: RemoteError,
        /// The attempt number that starts now.
        next_attempt: usize,
        /// Failures charged to the region so far (of `max_attempts`).
        failures: usize,
    },
    /// Succeeded regions run again because outputs they made were lost with their worker and a
    /// region still needs them (lineage); `readers` were reset to wait for them.
    RegionsRerun {
        /// The job.
        job: JobId,
        /// The regions whose outputs are made again.
        producers: Vec<RegionId>,
        /// The regions that wait for them again (they were running or will run).
        readers: Vec<RegionId>,
    },
    /// Add a final-stage task attempt's output streams to the job output (said at its `Running`
    /// report and again at its success; the shell adds an attempt once).
    ExtendOutput {
        /// The job.
        job: JobId,
        /// The attempt whose streams to read.
        task: TaskAttempt,
    },
    /// Every region succeeded and the job output read every final task's output: end the job
    /// output stream.
    JobSucceeded {
        /// The job.
        job: JobId,
    },
    /// The job failed.
    JobFailed {
        /// The job.
        job: JobId,
        /// The root cause.
        failure: JobFailure,
    },
    /// Remove the job's streams from every worker.
    CleanUpJob {
        /// The job.
        job: JobId,
    },
}

/// What a status report changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusOutcome {
    /// The report was about a current attempt and newer than any before it.
    pub accepted: bool,
    /// What to do now.
    pub actions: Vec<SchedulerAction>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum RegionState {
    Waiting,
    Running {
        attempt: usize,
        remaining: BTreeSet<TaskId>,
    },
    Succeeded {
        attempt: usize,
    },
}

#[derive(Debug)]
struct Job {
    graph: Arc<JobGraph>,
    policy: RetryPolicy,
    regions: Vec<RegionState>,
    /// Last sequence number seen per task attempt.
    sequences: HashMap<TaskAttempt, u64>,
    /// Per region, the attempt number its next start takes.
    next_attempt: Vec<usize>,
    /// Failures charged to each region (a loss with a cut-off worker is not charged).
    failures: HashMap<RegionId, usize>,
    /// What each failed attempt of a region met, oldest first.
    met: HashMap<RegionId, Vec<String>>,
    /// Per component of the topology, its regions that have not succeeded (kept by `set_region`).
    unfinished: Vec<usize>,
    /// Regions that have succeeded (kept by `set_region`).
    succeeded_regions: usize,
    /// Final-stage tasks whose output the job output read to its end, with the attempt read (it
    /// counts only while it is its region's current attempt).
    read: HashMap<TaskId, usize>,
    /// Final-stage tasks still running whose output the job output could not read: the attempt
    /// and why. Its success runs its region again instead.
    unreadable: HashMap<TaskId, (usize, RemoteError)>,
    /// Succeeded regions whose outputs were lost when nothing needed them: a later re-run of a
    /// region reading them makes them again first.
    gone: BTreeSet<RegionId>,
}

impl Job {
    fn new(graph: Arc<JobGraph>, policy: RetryPolicy) -> Self {
        let topology = graph.topology();
        let regions = topology.regions().len();
        Self {
            policy,
            regions: vec![RegionState::Waiting; regions],
            next_attempt: vec![0; regions],
            unfinished: topology.components().iter().map(|r| r.len()).collect(),
            succeeded_regions: 0,
            graph,
            sequences: HashMap::new(),
            failures: HashMap::new(),
            met: HashMap::new(),
            read: HashMap::new(),
            unreadable: HashMap::new(),
            gone: BTreeSet::new(),
        }
    }

    /// Moves `region` to `state`, keeping the counts of succeeded regions.
    fn set_region(&mut self, region: RegionId, state: RegionState) {
        let Some(slot) = self.regions.get_mut(region.0) else {
            return;
        };
        let was = matches!(slot, RegionState::Succeeded { .. });
        let is = matches!(state, RegionState::Succeeded { .. });
        *slot = state;
        let component = self.graph.topology().component_of(region);
        let unfinished = component.and_then(|c| self.unfinished.get_mut(c.0));
        match (was, is, unfinished) {
            (false, true, Some(unfinished)) => {
                *unfinished = unfinished.saturating_sub(1);
                self.succeeded_regions += 1;
            }
            (true, false, Some(unfinished)) => {
                *unfinished += 1;
                self.succeeded_regions = self.succeeded_regions.saturating_sub(1);
            }
            _ => {}
        }
    }

    fn region_succeeded(&self, region: RegionId) -> bool {
        matches!(
            self.regions.get(region.0),
            Some(RegionState::Succeeded { .. })
        )
    }

    /// Whether `region` waits and everything it depends on has succeeded.
    fn is_ready(&self, region: RegionId) -> bool {
        let topology = self.graph.topology();
        let Some(task_region) = topology.regions().get(region.0) else {
            return false;
        };
        self.regions.get(region.0) == Some(&RegionState::Waiting)
            && task_region.depends_on.iter().all(|d| match d {
                Dependency::Region(r) => self.region_succeeded(*r),
                Dependency::Component(c) => self.unfinished.get(c.0) == Some(&0),
            })
    }

    fn all_succeeded(&self) -> bool {
        self.succeeded_regions == self.regions.len()
    }
    fn region_of(&self, task: TaskId) -> Option<RegionId> {
        self.graph.topology().region_of(task)
    }

    /// The tasks of `region`.
    fn region_tasks(&self, region: RegionId) -> Vec<TaskId> {
        self.graph
            .topology()
            .regions()
            .get(region.0)
            .map(|r| r.tasks.clone())
            .unwrap_or_default()
    }

    fn current_attempt(&self, region: RegionId) -> Option<usize> {
        match self.regions.get(region.0)? {
            RegionState::Running { attempt, .. } | RegionState::Succeeded { attempt } => {
                Some(*attempt)
            }
            RegionState::Waiting => None,
        }
    }

    /// Whether every task of the final stage has succeeded in its region's current attempt. Each
    /// ended only after reading every input to its end marker (or not needing the rest), so the
    /// job's answer is complete whatever the other tasks still do.
    fn final_stage_complete(&self) -> bool {
        self.final_tasks().next().is_some()
            && self.final_tasks().all(|task| {
                match self.region_of(task).and_then(|r| self.regions.get(r.0)) {
                    Some(RegionState::Succeeded { .. }) => true,
                    Some(RegionState::Running { remaining, .. }) => !remaining.contains(&task),
                    _ => false,
                }
            })
    }

    /// The regions to make again for `seeds` (succeeded regions that must run again): the seeds,
    /// and the regions of `lost` (succeeded regions whose outputs went with their workers, with
    /// those lost earlier, `gone`) that a region still needs: one that has not succeeded or is
    /// made again, transitively. The lost regions nobody needs are remembered as `gone`.
    fn lineage(
        &mut self,
        seeds: BTreeSet<RegionId>,
        mut lost: BTreeSet<RegionId>,
    ) -> BTreeSet<RegionId> {
        let graph = Arc::clone(&self.graph);
        let topology = graph.topology();
        lost.extend(
            self.gone
                .iter()
                .copied()
                .filter(|region| self.region_succeeded(*region)),
        );
        let mut producers = seeds;
        loop {
            let needed: Vec<RegionId> = lost
                .iter()
                .copied()
                .filter(|region| !producers.contains(region))
                .filter(|region| {
                    topology
                        .readers(*region)
                        .any(|d| producers.contains(&d) || !self.region_succeeded(d))
                })
                .collect();
            if needed.is_empty() {
                break;
            }
            producers.extend(needed);
        }
        lost.retain(|region| !producers.contains(region));
        self.gone = lost;
        producers
    }

    /// The tasks of the final stage.
    fn final_tasks(&self) -> impl Iterator<Item = TaskId> + '_ {
        let stage = self.graph.final_stage();
        let partitions = self.graph.stage(stage).map_or(0, |s| s.partitions());
        (0..partitions).map(move |partition| TaskId { stage, partition })
    }

    /// Whether the job output read `task`'s output from its region's current attempt.
    fn output_was_read(&self, task: TaskId) -> bool {
        let current = self.region_of(task).and_then(|r| self.current_attempt(r));
        current.is_some() && self.read.get(&task).copied() == current
    }

    /// Whether the job is done: every region succeeded and every final output was read.
    fn is_done(&self) -> bool {
        self.all_succeeded() && self.final_tasks().all(|task| self.output_was_read(task))
    }

    fn running_attempts(&self) -> Vec<TaskAttempt> {
        self.regions
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

    /// Times a region may run.
    pub fn max_attempts(&self) -> usize {
        self.max_attempts
    }

    /// Number of jobs still tracked.
    pub fn active_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Accepts a job: returns its id and the regions to start now.
    pub fn accept_job(&mut self, graph: Arc<JobGraph>) -> (JobId, Vec<SchedulerAction>) {
        self.accept_job_with(graph, RetryPolicy::default())
    }

    /// [`Self::accept_job`] for a job whose failures are retried by `policy`.
    pub fn accept_job_with(
        &mut self,
        graph: Arc<JobGraph>,
        policy: RetryPolicy,
    ) -> (JobId, Vec<SchedulerAction>) {
        let job_id = JobId(self.next_job);
        self.next_job += 1;
        let job = Job::new(graph, policy);
        self.jobs.insert(job_id, job);
        let actions = self.start_ready_regions(job_id);
        (job_id, actions)
    }

    /// Asks whether output of `attempt` may go to the caller now: only while its region runs (or
    /// succeeded with) that very attempt, so a batch of an attempt the scheduler has already
    /// replaced never reaches the caller.
    pub fn approve_output(&self, job: JobId, attempt: TaskAttempt) -> bool {
        let Some(state) = self.jobs.get(&job) else {
            return false;
        };
        let Some(region) = state.region_of(attempt.task) else {
            return false;
        };
        state.current_attempt(region) == Some(attempt.attempt)
    }

    /// The outputs of `tasks` (their latest succeeded attempts) were lost with their worker. Every
    /// succeeded region holding one of them whose output some region still needs, or the job
    /// output has not read yet, runs again, and the regions that read it (running, or about to)
    /// wait for it; the losses are not charged.
    pub fn outputs_lost(&mut self, job: JobId, tasks: &[TaskId]) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let final_stage = state.graph.final_stage();
        let mut lost: BTreeSet<RegionId> = tasks
            .iter()
            .filter_map(|task| state.region_of(*task))
            .filter(|region| state.region_succeeded(*region))
            .collect();
        // Final outputs the job output has not read: a succeeded region holding one is made
        // again; a running one (its other tasks still run) is retried below.
        let mut seeds = BTreeSet::new();
        let mut unread_running = Vec::new();
        for task in tasks.iter().filter(|t| t.stage == final_stage) {
            let Some(region) = state.region_of(*task) else {
                continue;
            };
            if state.output_was_read(*task) {
                continue;
            }
            match &state.regions[region.0] {
                RegionState::Succeeded { .. } => {
                    seeds.insert(region);
                }
                RegionState::Running { attempt, remaining } if !remaining.contains(task) => {
                    unread_running.push((
                        region,
                        TaskAttempt {
                            task: *task,
                            attempt: *attempt,
                        },
                    ));
                }
                _ => {}
            }
        }
        lost.extend(seeds.iter().copied());
        let producers = state.lineage(seeds, lost);
        let mut actions = Vec::new();
        if !producers.is_empty() {
            let (stops, readers) = self.rerun_producers(job, &producers);
            actions.extend(stops);
            actions.push(SchedulerAction::RegionsRerun {
                job,
                producers: producers.into_iter().collect(),
                readers,
            });
            actions.extend(self.start_ready_regions(job));
        }
        for (region, attempt) in unread_running {
            let error = RemoteError::new(
                ErrorKind::Transport,
                "its output was lost with its worker before the job output read it",
            );
            actions.extend(self.retry_or_fail(job, region, attempt, error, false));
        }
        actions
    }

    /// Sets `producers` (succeeded regions made again) waiting: the regions reading them that run
    /// go back to waiting, stopped and their outputs discarded. The actions, and the readers that
    /// now wait for them.
    fn rerun_producers(
        &mut self,
        job: JobId,
        producers: &BTreeSet<RegionId>,
    ) -> (Vec<SchedulerAction>, Vec<RegionId>) {
        let Some(state) = self.jobs.get_mut(&job) else {
            return (Vec::new(), Vec::new());
        };
        let graph = Arc::clone(&state.graph);
        let topology = graph.topology();
        let dependents = |region: RegionId| topology.readers(region);
        let mut actions = Vec::new();
        // Readers: regions depending on a re-run producer that are running now go back to waiting.
        let mut readers = Vec::new();
        for producer in producers {
            for reader in dependents(*producer) {
                if readers.contains(&reader) || producers.contains(&reader) {
                    continue;
                }
                if let RegionState::Running { attempt, remaining } = &state.regions[reader.0] {
                    let attempt = *attempt;
                    if !remaining.is_empty() {
                        actions.push(SchedulerAction::StopTasks {
                            job,
                            tasks: remaining
                                .iter()
                                .map(|task| TaskAttempt {
                                    task: *task,
                                    attempt,
                                })
                                .collect(),
                        });
                    }
                    actions.push(SchedulerAction::DiscardOutputs {
                        job,
                        tasks: state
                            .region_tasks(reader)
                            .into_iter()
                            .map(|task| TaskAttempt { task, attempt })
                            .collect(),
                    });
                    state.set_region(reader, RegionState::Waiting);
                    readers.push(reader);
                } else if state.regions[reader.0] == RegionState::Waiting {
                    readers.push(reader);
                }
            }
        }
        for producer in producers {
            state.set_region(*producer, RegionState::Waiting);
        }
        for producer in producers {
            state.set_region(*producer, RegionState::Waiting);
        }
        (actions, readers)
    }

    /// Cancels a job: stops its running tasks and forgets it.
    pub fn cancel_job(&mut self, job: JobId) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.remove(&job) else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        let running = state.running_attempts();
        if !running.is_empty() {
            actions.push(SchedulerAction::StopTasks {
                job,
                tasks: running,
            });
        }
        actions.push(SchedulerAction::CleanUpJob { job });
        actions
    }

    /// Whether `attempt` is its region's current, unfinished attempt (a report about it would count).
    pub fn is_running(&self, job: JobId, attempt: TaskAttempt) -> bool {
        let Some(state) = self.jobs.get(&job) else {
            return false;
        };
        let Some(region) = state.region_of(attempt.task) else {
            return false;
        };
        matches!(
            &state.regions[region.0],
            RegionState::Running { attempt: current, remaining }
                if *current == attempt.attempt && remaining.contains(&attempt.task)
        )
    }

    /// Whether `attempt` has reported anything about itself.
    pub fn has_reported(&self, job: JobId, attempt: TaskAttempt) -> bool {
        self.jobs
            .get(&job)
            .is_some_and(|state| state.sequences.get(&attempt).is_some_and(|s| *s > 0))
    }

    /// Records a status report; `sequence` increases with every report of one task attempt.
    pub fn task_status(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        sequence: u64,
        status: TaskStatus,
    ) -> StatusOutcome {
        let Some(state) = self.jobs.get_mut(&job) else {
            return StatusOutcome::default(); // a finished or unknown job: late reports are harmless
        };
        let Some(region) = state.region_of(attempt.task) else {
            return StatusOutcome::default();
        };
        if !matches!(&state.regions[region.0],
            RegionState::Running { attempt: current, .. } if *current == attempt.attempt)
        {
            return StatusOutcome::default();
        }
        // Sequence numbers start at 1; 0 is never newer than anything.
        let last = state.sequences.entry(attempt).or_insert(0);
        if sequence <= *last {
            return StatusOutcome::default();
        }
        *last = sequence;
        let final_stage = state.graph.final_stage();
        let actions = match status {
            TaskStatus::Running if attempt.task.stage == final_stage => {
                vec![SchedulerAction::ExtendOutput { job, task: attempt }]
            }
            TaskStatus::Running => Vec::new(),
            TaskStatus::Succeeded if attempt.task.stage == final_stage => {
                let mut actions = vec![SchedulerAction::ExtendOutput { job, task: attempt }];
                actions.extend(self.task_succeeded(job, region, attempt));
                actions
            }
            TaskStatus::Succeeded => self.task_succeeded(job, region, attempt),
            TaskStatus::Failed(error) => self.region_failed(job, region, attempt, error, true),
            // Only stops the scheduler asked for produce an expected Canceled; any other means the
            // worker gave the task up (it is shutting down): another attempt may run elsewhere.
            TaskStatus::Canceled => self.region_failed(
                job,
                region,
                attempt,
                RemoteError::new(ErrorKind::Transport, "the task was cancelled on its worker"),
                true,
            ),
        };
        StatusOutcome {
            accepted: true,
            actions,
        }
    }

    /// The shell could not start `attempt` (its worker refused it, or is unreachable). A task that
    /// already reported about itself is running after all (only the reply was lost): nothing
    /// changes. Otherwise the attempt failed with `error`.
    pub fn task_not_started(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        error: RemoteError,
    ) -> Vec<SchedulerAction> {
        if self.has_reported(job, attempt) {
            return Vec::new();
        }
        self.fail_running(job, attempt, error, true)
    }

    /// `attempt` was lost with its worker: it failed with `error`, whatever it reported before.
    /// The failure is charged to its region only if the worker's process died (see
    /// [`WorkerLoss`]).
    pub fn task_lost(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        error: RemoteError,
        loss: WorkerLoss,
    ) -> Vec<SchedulerAction> {
        self.fail_running(job, attempt, error, loss != WorkerLoss::CutOff)
    }

    /// Fails `attempt` with `error` if it is its region's current, unfinished attempt.
    fn fail_running(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        error: RemoteError,
        charge: bool,
    ) -> Vec<SchedulerAction> {
        if !self.is_running(job, attempt) {
            return Vec::new();
        }
        let Some(region) = self.jobs.get(&job).and_then(|s| s.region_of(attempt.task)) else {
            return Vec::new();
        };
        self.region_failed(job, region, attempt, error, charge)
    }

    /// The job output read every stream of `attempt` (a final-stage task's) to its end. Once every
    /// final task's current attempt was read and every region succeeded, the job succeeds.
    pub fn output_read(&mut self, job: JobId, attempt: TaskAttempt) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let current = state
            .region_of(attempt.task)
            .and_then(|region| state.current_attempt(region));
        if attempt.task.stage != state.graph.final_stage() || current != Some(attempt.attempt) {
            return Vec::new();
        }
        state.read.insert(attempt.task, attempt.attempt);
        self.finish_if_done(job)
    }

    /// The job output could not read `attempt`'s output (a final-stage task's) to its end: once
    /// the attempt succeeded (now, or when it does), its region runs again, charged as a failure
    /// with `error`, instead of the job ending without rows it should have.
    pub fn output_unreadable(
        &mut self,
        job: JobId,
        attempt: TaskAttempt,
        error: RemoteError,
    ) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let Some(region) = state.region_of(attempt.task) else {
            return Vec::new();
        };
        if attempt.task.stage != state.graph.final_stage()
            || state.current_attempt(region) != Some(attempt.attempt)
            || state.output_was_read(attempt.task)
        {
            return Vec::new();
        }
        match &state.regions[region.0] {
            // Its own report may still explain the broken stream (it failed): wait for it.
            RegionState::Running { remaining, .. } if remaining.contains(&attempt.task) => {
                state
                    .unreadable
                    .insert(attempt.task, (attempt.attempt, error));
                Vec::new()
            }
            RegionState::Waiting => Vec::new(),
            _ => self.retry_or_fail(job, region, attempt, error, true),
        }
    }

    fn task_succeeded(
        &mut self,
        job: JobId,
        region: RegionId,
        attempt: TaskAttempt,
    ) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        if let Some((broken, error)) = state.unreadable.remove(&attempt.task)
            && broken == attempt.attempt
        {
            return self.retry_or_fail(job, region, attempt, error, true);
        }
        let done = match &mut state.regions[region.0] {
            RegionState::Running {
                remaining,
                attempt: current,
            } => {
                remaining.remove(&attempt.task);
                remaining.is_empty().then_some(*current)
            }
            _ => None,
        };
        let Some(current) = done else {
            return Vec::new();
        };
        state.set_region(region, RegionState::Succeeded { attempt: current });
        if state.all_succeeded() {
            return self.finish_if_done(job);
        }
        self.start_readers(job, region)
    }

    /// Ends the job as succeeded if it is done (see [`Job::is_done`]).
    fn finish_if_done(&mut self, job: JobId) -> Vec<SchedulerAction> {
        if !self.jobs.get(&job).is_some_and(Job::is_done) {
            return Vec::new();
        }
        self.jobs.remove(&job);
        vec![
            SchedulerAction::JobSucceeded { job },
            SchedulerAction::CleanUpJob { job },
        ]
    }

    fn region_failed(
        &mut self,
        job: JobId,
        region: RegionId,
        failed: TaskAttempt,
        error: RemoteError,
        charge: bool,
    ) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        if !matches!(state.regions[region.0], RegionState::Running { .. }) {
            return Vec::new();
        }
        let waiting = state.regions.contains(&RegionState::Waiting);
        if state.final_stage_complete() && !waiting {
            // The answer is complete: running the region again could only repeat work already
            // done (and a write's side effects). What still runs is stopped, and its region counts
            // as done (its final tasks succeeded; the rest was not needed); the job ends once the
            // output read the final tasks.
            let mut running = state.running_attempts();
            running.retain(|t| *t != failed);
            for index in 0..state.regions.len() {
                if let RegionState::Running { attempt, .. } = state.regions[index] {
                    state.set_region(RegionId(index), RegionState::Succeeded { attempt });
                }
            }
            let mut actions = Vec::new();
            if !running.is_empty() {
                actions.push(SchedulerAction::StopTasks {
                    job,
                    tasks: running,
                });
            }
            actions.extend(self.finish_if_done(job));
            return actions;
        }
        self.retry_or_fail(job, region, failed, error, charge)
    }

    /// `failed` (an attempt of `region`, running or succeeded) failed with `error`: the region
    /// runs again if the error is retryable and failures are left, else the job fails.
    fn retry_or_fail(
        &mut self,
        job: JobId,
        region: RegionId,
        failed: TaskAttempt,
        error: RemoteError,
        charge: bool,
    ) -> Vec<SchedulerAction> {
        let max_attempts = self.max_attempts;
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let (attempt, others): (usize, Vec<TaskAttempt>) = match &state.regions[region.0] {
            RegionState::Running { attempt, remaining } => (
                *attempt,
                remaining
                    .iter()
                    .filter(|t| **t != failed.task)
                    .map(|task| TaskAttempt {
                        task: *task,
                        attempt: *attempt,
                    })
                    .collect(),
            ),
            RegionState::Succeeded { attempt } => (*attempt, Vec::new()),
            RegionState::Waiting => return Vec::new(),
        };
        let failures = state.failures.entry(region).or_insert(0);
        if charge {
            *failures += 1;
        }
        let failures = *failures;
        let first_line = error.message.lines().next().unwrap_or_default().to_string();
        state.met.entry(region).or_default().push(format!(
            "attempt {attempt}: stage {} partition {}: {first_line}",
            failed.task.stage, failed.task.partition
        ));
        let retry = state.policy.retries(error.kind) && failures < max_attempts;
        if retry && others.is_empty() && state.region_succeeded(region) {
            // A succeeded region (its output could not be read) runs again once the inputs it
            // reads that went with their workers are made again.
            let mut actions = vec![
                SchedulerAction::DiscardOutputs {
                    job,
                    tasks: state
                        .region_tasks(region)
                        .into_iter()
                        .map(|task| TaskAttempt { task, attempt })
                        .collect(),
                },
                SchedulerAction::RegionRetried {
                    job,
                    region,
                    failed,
                    error,
                    next_attempt: state.next_attempt[region.0],
                    failures,
                },
            ];
            let producers = state.lineage(BTreeSet::from([region]), BTreeSet::new());
            let (stops, _) = self.rerun_producers(job, &producers);
            actions.extend(stops);
            actions.extend(self.start_ready_regions(job));
            return actions;
        }
        if retry {
            let region_tasks = state.region_tasks(region);
            let mut actions = Vec::new();
            if !others.is_empty() {
                actions.push(SchedulerAction::StopTasks { job, tasks: others });
            }
            actions.push(SchedulerAction::DiscardOutputs {
                job,
                tasks: region_tasks
                    .iter()
                    .map(|task| TaskAttempt {
                        task: *task,
                        attempt,
                    })
                    .collect(),
            });
            let next = start_region(job, state, region);
            actions.push(SchedulerAction::RegionRetried {
                job,
                region,
                failed,
                error,
                next_attempt: state.next_attempt[region.0] - 1,
                failures,
            });
            actions.push(next);
            return actions;
        }
        let mut running = state.running_attempts();
        running.retain(|t| *t != failed);
        let history = state.met.remove(&region).unwrap_or_default();
        self.jobs.remove(&job);
        let mut actions = Vec::new();
        if !running.is_empty() {
            actions.push(SchedulerAction::StopTasks {
                job,
                tasks: running,
            });
        }
        actions.push(SchedulerAction::JobFailed {
            job,
            failure: JobFailure {
                task: failed,
                error,
                attempts: attempt + 1,
                history,
            },
        });
        actions.push(SchedulerAction::CleanUpJob { job });
        actions
    }

    /// Starts every region that is ready (a scan of the job's regions: at its start and after a
    /// lineage re-run, never per report).
    fn start_ready_regions(&mut self, job: JobId) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let ready: Vec<RegionId> = (0..state.regions.len())
            .map(RegionId)
            .filter(|region| state.is_ready(*region))
            .collect();
        ready
            .into_iter()
            .map(|region| start_region(job, state, region))
            .collect()
    }

    /// Starts the readers of `region` (which just succeeded) that are ready now: those waiting
    /// for it alone, and those waiting for its whole component once that finished.
    fn start_readers(&mut self, job: JobId, region: RegionId) -> Vec<SchedulerAction> {
        let Some(state) = self.jobs.get_mut(&job) else {
            return Vec::new();
        };
        let graph = Arc::clone(&state.graph);
        let topology = graph.topology();
        let mut candidates = topology.region_readers(region).to_vec();
        // A component's readers are looked at once, when its last region succeeds: each success
        // costs its own readers, not the width of the next stage.
        if let Some(component) = topology.component_of(region)
            && state.unfinished.get(component.0) == Some(&0)
        {
            candidates.extend_from_slice(topology.component_readers(component));
        }
        let mut actions = Vec::new();
        for reader in candidates {
            if state.is_ready(reader) {
                actions.push(start_region(job, state, reader));
            }
        }
        actions
    }
}

/// Starts `region`'s next attempt.
fn start_region(job: JobId, state: &mut Job, region: RegionId) -> SchedulerAction {
    let attempt = state.next_attempt[region.0];
    state.next_attempt[region.0] += 1;
    let tasks = state.region_tasks(region);
    state.set_region(
        region,
        RegionState::Running {
            attempt,
            remaining: tasks.iter().copied().collect(),
        },
    );
    SchedulerAction::RunRegion {
        job,
        region,
        tasks: tasks
            .into_iter()
            .map(|task| TaskAttempt { task, attempt })
            .collect(),
    }
}

#[cfg(test)]
pub(crate) mod tests;
