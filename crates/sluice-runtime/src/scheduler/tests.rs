//! The scheduler's transitions, one behaviour per test, on small synthetic graphs.

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
        wire_form: None,
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

/// Attempt `attempt` of `stage`'s task `partition` (also used by other modules' tests).
pub(crate) fn attempt(stage: usize, partition: usize, attempt: usize) -> TaskAttempt {
    TaskAttempt {
        task: TaskId {
            stage: StageId(stage),
            partition,
        },
        attempt,
    }
}

fn transport(message: &str) -> TaskStatus {
    TaskStatus::Failed(RemoteError::new(ErrorKind::Transport, message))
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

/// The job output read every stream of each of `attempts`.
fn read(
    scheduler: &mut JobScheduler,
    job: JobId,
    attempts: &[TaskAttempt],
) -> Vec<SchedulerAction> {
    attempts
        .iter()
        .flat_map(|a| scheduler.output_read(job, *a))
        .collect()
}

fn job_done(job: JobId) -> [SchedulerAction; 2] {
    [
        SchedulerAction::JobSucceeded { job },
        SchedulerAction::CleanUpJob { job },
    ]
}

fn failure(actions: &[SchedulerAction]) -> Option<JobFailure> {
    actions.iter().find_map(|a| match a {
        SchedulerAction::JobFailed { failure, .. } => Some(failure.clone()),
        _ => None,
    })
}

#[test]
fn a_job_runs_region_by_region_and_is_forgotten_once_its_output_was_read() {
    let mut scheduler = JobScheduler::new(3);
    let (job, actions) = scheduler.accept_job(blocking_job());
    assert_eq!(job, JobId(1));
    assert_eq!(
        started(&actions),
        [vec![attempt(0, 0, 0)], vec![attempt(0, 1, 0)]]
    );
    let running = scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Running);
    assert_eq!(
        running,
        StatusOutcome {
            accepted: true,
            actions: vec![]
        }
    );
    let done = scheduler.task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded);
    assert!(done.accepted && done.actions.is_empty());
    let actions = scheduler
        .task_status(job, attempt(0, 1, 0), 1, TaskStatus::Succeeded)
        .actions;
    assert_eq!(started(&actions), [vec![attempt(1, 0, 0)]]);
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 1, TaskStatus::Running)
        .actions;
    assert_eq!(
        actions,
        [SchedulerAction::ExtendOutput {
            job,
            task: attempt(1, 0, 0)
        }]
    );
    // Its success is said to the output again (it adds an attempt once); the job waits for the
    // output to read it.
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 2, TaskStatus::Succeeded)
        .actions;
    assert_eq!(
        actions,
        [SchedulerAction::ExtendOutput {
            job,
            task: attempt(1, 0, 0)
        }]
    );
    assert_eq!(scheduler.active_jobs(), 1);
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 0)]),
        job_done(job)
    );
    assert_eq!(scheduler.active_jobs(), 0);
    // Late reports about a forgotten job change nothing and are not accepted.
    let late = scheduler.task_status(job, attempt(1, 0, 0), 3, TaskStatus::Succeeded);
    assert_eq!(late, StatusOutcome::default());
    // The next job gets the next id.
    assert_eq!(scheduler.accept_job(blocking_job()).0, JobId(2));
}

#[test]
fn output_is_approved_only_for_the_current_attempt_and_a_delivering_region_is_still_retried() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    // A region retried before any output: the old attempt's output is refused, the new one's
    // approved.
    scheduler.task_status(job, attempt(0, 0, 0), 1, transport("x"));
    assert!(!scheduler.approve_output(job, attempt(1, 0, 0)));
    assert!(scheduler.approve_output(job, attempt(1, 0, 1)));
    // Output reached the caller; a failure still retries (the job output resumes the streams).
    let actions = scheduler
        .task_status(job, attempt(0, 1, 1), 1, transport("disk full"))
        .actions;
    assert_eq!(failure(&actions), None);
    assert_eq!(
        started(&actions),
        [vec![
            attempt(0, 0, 2),
            attempt(0, 1, 2),
            attempt(1, 0, 2),
            attempt(1, 1, 2)
        ]]
    );
    assert!(!scheduler.approve_output(job, attempt(1, 0, 1)));
    assert!(scheduler.approve_output(job, attempt(1, 0, 2)));
    // The third charged failure ends it.
    let actions = scheduler
        .task_status(job, attempt(1, 1, 2), 1, transport("disk full"))
        .actions;
    assert_eq!(
        failure(&actions),
        Some(JobFailure {
            task: attempt(1, 1, 2),
            error: RemoteError::new(ErrorKind::Transport, "disk full"),
            attempts: 3,
            history: vec![
                "attempt 0: stage 0 partition 0: x".to_string(),
                "attempt 1: stage 0 partition 1: disk full".to_string(),
                "attempt 2: stage 1 partition 1: disk full".to_string(),
            ],
        })
    );
}

#[test]
fn a_succeeded_region_keeps_approving_its_last_attempt() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(blocking_job());
    scheduler.task_status(job, attempt(0, 0, 0), 1, transport("x"));
    scheduler.task_status(job, attempt(0, 0, 1), 1, TaskStatus::Succeeded);
    assert!(scheduler.approve_output(job, attempt(0, 0, 1)));
    assert!(!scheduler.approve_output(job, attempt(0, 0, 0)));
    // A region that has not started approves nothing.
    assert!(!scheduler.approve_output(job, attempt(1, 0, 0)));
}

#[test]
fn a_failure_in_the_middle_of_a_region_restarts_it_and_discards_the_old_outputs() {
    let mut scheduler = JobScheduler::new(3);
    let (job, actions) = scheduler.accept_job(pipelined_job());
    assert_eq!(started(&actions)[0].len(), 4);
    scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Succeeded);
    let actions = scheduler
        .task_status(job, attempt(1, 1, 0), 1, transport("connection reset"))
        .actions;
    assert_eq!(
        actions[0],
        SchedulerAction::StopTasks {
            job,
            tasks: vec![attempt(0, 1, 0), attempt(1, 0, 0)]
        }
    );
    // Every output of the replaced attempt goes, the succeeded task's included.
    assert_eq!(
        actions[1],
        SchedulerAction::DiscardOutputs {
            job,
            tasks: vec![
                attempt(0, 0, 0),
                attempt(0, 1, 0),
                attempt(1, 0, 0),
                attempt(1, 1, 0)
            ]
        }
    );
    assert!(matches!(
        &actions[2],
        SchedulerAction::RegionRetried { next_attempt: 1, failed, .. } if *failed == attempt(1, 1, 0)
    ));
    assert_eq!(
        started(&actions),
        [vec![
            attempt(0, 0, 1),
            attempt(0, 1, 1),
            attempt(1, 0, 1),
            attempt(1, 1, 1)
        ]]
    );
    // The stopped attempts' cancellations are stale: not accepted, no action, no failure.
    let stale = scheduler.task_status(job, attempt(0, 1, 0), 2, TaskStatus::Canceled);
    assert_eq!(stale, StatusOutcome::default());
    for (s, p) in [(0, 0), (0, 1), (1, 0)] {
        let outcome = scheduler.task_status(job, attempt(s, p, 1), 1, TaskStatus::Succeeded);
        let extend = SchedulerAction::ExtendOutput {
            job,
            task: attempt(s, p, 1),
        };
        let expected = if s == 1 { vec![extend] } else { vec![] };
        assert!(outcome.accepted);
        assert_eq!(outcome.actions, expected);
    }
    let actions = scheduler
        .task_status(job, attempt(1, 1, 1), 1, TaskStatus::Succeeded)
        .actions;
    assert!(!actions.contains(&SchedulerAction::JobSucceeded { job }));
    // A read of the replaced attempt arriving late does not undo the new attempt's read.
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 1), attempt(1, 0, 0)]),
        []
    );
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 1, 1)]),
        job_done(job)
    );
}

#[test]
fn duplicated_and_out_of_order_reports_are_not_accepted() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(blocking_job());
    assert!(
        scheduler
            .task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded)
            .accepted
    );
    // An older report arriving late, and the same report twice.
    let older = scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Running);
    assert_eq!(older, StatusOutcome::default());
    let twice = scheduler.task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded);
    assert_eq!(twice, StatusOutcome::default());
    // A report for an attempt that never ran.
    let never = scheduler.task_status(job, attempt(0, 1, 7), 1, transport("x"));
    assert_eq!(never, StatusOutcome::default());
    let actions = scheduler
        .task_status(job, attempt(0, 1, 0), 1, TaskStatus::Succeeded)
        .actions;
    assert_eq!(started(&actions), [vec![attempt(1, 0, 0)]]);
}

#[test]
fn a_job_whose_final_attempt_fails_fails_with_the_root_cause() {
    let mut scheduler = JobScheduler::new(2);
    let (job, _) = scheduler.accept_job(pipelined_job());
    let first = scheduler.task_status(job, attempt(0, 1, 0), 1, transport("boom"));
    assert_eq!(started(&first.actions).len(), 1);
    let last = scheduler
        .task_status(job, attempt(0, 1, 1), 1, transport("boom"))
        .actions;
    let failure = failure(&last).unwrap();
    assert_eq!(failure.task, attempt(0, 1, 1));
    assert_eq!(failure.attempts, 2);
    assert_eq!(failure.error.message, "boom");
    assert!(last.contains(&SchedulerAction::CleanUpJob { job }));
    assert!(matches!(&last[0], SchedulerAction::StopTasks { tasks, .. } if tasks.len() == 3));
    assert_eq!(scheduler.active_jobs(), 0);
    // The cancellations of the stopped tasks come later and change nothing.
    let late = scheduler.task_status(job, attempt(1, 0, 1), 2, TaskStatus::Canceled);
    assert_eq!(late, StatusOutcome::default());
}

#[test]
fn a_user_error_fails_the_job_at_once_without_retries() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    let divide = RemoteError::of(&datafusion::common::DataFusionError::ArrowError(
        Box::new(datafusion::arrow::error::ArrowError::DivideByZero),
        None,
    ));
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 2, TaskStatus::Failed(divide.clone()))
        .actions;
    assert!(started(&actions).is_empty(), "{actions:?}");
    let failure = failure(&actions).unwrap();
    assert_eq!(failure.attempts, 1);
    assert_eq!(failure.error, divide);
    assert_eq!(scheduler.active_jobs(), 0);
}

#[test]
fn out_of_memory_retries_its_region_unless_the_job_treats_it_as_final() {
    let oom = || {
        TaskStatus::Failed(RemoteError::new(
            ErrorKind::ResourcesExhausted,
            "Resources exhausted: hash join build side",
        ))
    };
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 2, oom())
        .actions;
    assert_eq!(started(&actions).len(), 1, "{actions:?}");
    assert_eq!(failure(&actions), None);

    let policy = RetryPolicy {
        resources_final: true,
    };
    let (job, _) = scheduler.accept_job_with(pipelined_job(), policy);
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 2, oom())
        .actions;
    assert!(started(&actions).is_empty(), "{actions:?}");
    let failure = failure(&actions).unwrap();
    assert_eq!(failure.attempts, 1);
    assert_eq!(failure.error.kind, ErrorKind::ResourcesExhausted);
    // Other retryable failures still retry under that policy.
    let (job, _) = scheduler.accept_job_with(pipelined_job(), policy);
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 2, transport("cut"))
        .actions;
    assert_eq!(started(&actions).len(), 1, "{actions:?}");
}

#[test]
fn a_task_not_started_fails_its_attempt_unless_it_reported_already() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    // The RunTask reply was lost, but the task runs: it already reported, so nothing changes.
    scheduler.task_status(job, attempt(0, 0, 0), 1, TaskStatus::Running);
    let lost_reply = scheduler.task_not_started(
        job,
        attempt(0, 0, 0),
        RemoteError::new(ErrorKind::Transport, "deadline exceeded"),
    );
    assert!(lost_reply.is_empty(), "{lost_reply:?}");
    // Its later reports still count.
    assert!(
        scheduler
            .task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded)
            .accepted
    );
    // A task that never reported and could not be started: the region is retried.
    let refused = scheduler.task_not_started(
        job,
        attempt(0, 1, 0),
        RemoteError::new(ErrorKind::Transport, "worker 2 refused the task"),
    );
    assert_eq!(started(&refused).len(), 1);
    assert_eq!(started(&refused)[0][0], attempt(0, 0, 1));
    // If it does report later (it ran after all), the report is stale.
    let stale = scheduler.task_status(job, attempt(0, 1, 0), 1, TaskStatus::Running);
    assert_eq!(stale, StatusOutcome::default());
}

#[test]
fn a_lost_task_fails_its_region_even_after_reporting() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    scheduler.task_status(job, attempt(1, 0, 0), 1, TaskStatus::Running);
    let actions = scheduler.task_lost(
        job,
        attempt(1, 0, 0),
        RemoteError::new(ErrorKind::Transport, "worker 1 lost"),
        WorkerLoss::CutOff,
    );
    assert_eq!(started(&actions).len(), 1);
    // Losses to a cut-off worker are not charged: a region may lose more attempts than
    // `max_attempts` and still run.
    let mut attempt_no = 1;
    for _ in 0..5 {
        let actions = scheduler.task_lost(
            job,
            attempt(1, 0, attempt_no),
            RemoteError::new(ErrorKind::Transport, "another worker lost"),
            WorkerLoss::CutOff,
        );
        attempt_no += 1;
        assert_eq!(started(&actions)[0][0].attempt, attempt_no, "{actions:?}");
    }
    // Losing an attempt that is no longer current changes nothing.
    assert!(
        scheduler
            .task_lost(
                job,
                attempt(1, 0, 0),
                RemoteError::new(ErrorKind::Transport, "again"),
                WorkerLoss::CutOff,
            )
            .is_empty()
    );
}

#[test]
fn attempts_lost_with_a_dead_worker_process_are_charged_until_the_job_fails() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    for attempt_no in 0..2 {
        let actions = scheduler.task_lost(
            job,
            attempt(1, 0, attempt_no),
            RemoteError::new(
                ErrorKind::Transport,
                format!("worker {} was lost: its process ended", attempt_no + 1),
            ),
            WorkerLoss::ProcessExited,
        );
        assert_eq!(failure(&actions), None);
        assert_eq!(started(&actions)[0][0].attempt, attempt_no + 1);
    }
    // A loss to a cut-off worker in between is not charged.
    let actions = scheduler.task_lost(
        job,
        attempt(1, 0, 2),
        RemoteError::new(ErrorKind::Transport, "worker 3 was lost: no heartbeat"),
        WorkerLoss::CutOff,
    );
    assert_eq!(failure(&actions), None);
    let actions = scheduler.task_lost(
        job,
        attempt(1, 0, 3),
        RemoteError::new(ErrorKind::Transport, "worker 4 was lost: its process ended"),
        WorkerLoss::ProcessExited,
    );
    assert_eq!(
        failure(&actions),
        Some(JobFailure {
            task: attempt(1, 0, 3),
            error: RemoteError::new(ErrorKind::Transport, "worker 4 was lost: its process ended"),
            attempts: 4,
            history: vec![
                "attempt 0: stage 1 partition 0: worker 1 was lost: its process ended".to_string(),
                "attempt 1: stage 1 partition 0: worker 2 was lost: its process ended".to_string(),
                "attempt 2: stage 1 partition 0: worker 3 was lost: no heartbeat".to_string(),
                "attempt 3: stage 1 partition 0: worker 4 was lost: its process ended".to_string(),
            ],
        })
    );
    assert_eq!(scheduler.active_jobs(), 0);
}

#[test]
fn cancelling_a_job_stops_its_tasks_and_forgets_it() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(blocking_job());
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

/// Stage 0 (2 partitions, blocking) → stage 1 (2 partitions, blocking) → stage 2 (final):
/// regions 0, 1 (stage 0), 2, 3 (stage 1), then 4.
fn two_blocking_stages() -> Arc<JobGraph> {
    graph(vec![
        stage(&[], 2, OutputMode::Blocking),
        stage(&[(0, InputMode::Shuffle)], 2, OutputMode::Blocking),
        stage(&[(1, InputMode::Shuffle)], 1, OutputMode::Pipelined),
    ])
}

fn task(stage: usize, partition: usize) -> TaskId {
    TaskId {
        stage: StageId(stage),
        partition,
    }
}

fn succeed(
    scheduler: &mut JobScheduler,
    job: JobId,
    attempts: &[TaskAttempt],
) -> Vec<SchedulerAction> {
    attempts
        .iter()
        .flat_map(|a| {
            scheduler
                .task_status(job, *a, 1, TaskStatus::Succeeded)
                .actions
        })
        .collect()
}

#[test]
fn lost_outputs_a_running_region_needs_are_made_again_before_it_runs_again() {
    let mut scheduler = JobScheduler::new(2);
    let (job, _) = scheduler.accept_job(blocking_job());
    let ready = succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    assert_eq!(started(&ready), [vec![attempt(1, 0, 0)]]);
    // The worker holding stage 0 partition 1's output dies while stage 1 reads it.
    let actions = scheduler.outputs_lost(job, &[task(0, 1)]);
    assert_eq!(
        actions,
        [
            SchedulerAction::StopTasks {
                job,
                tasks: vec![attempt(1, 0, 0)]
            },
            SchedulerAction::DiscardOutputs {
                job,
                tasks: vec![attempt(1, 0, 0)]
            },
            SchedulerAction::RegionsRerun {
                job,
                producers: vec![RegionId(1)],
                readers: vec![RegionId(2)],
            },
            SchedulerAction::RunRegion {
                job,
                region: RegionId(1),
                tasks: vec![attempt(0, 1, 1)],
            },
        ]
    );
    // The reader's failure (it lost its input) is stale now and charges nothing.
    let stale = scheduler.task_status(job, attempt(1, 0, 0), 1, transport("read failed"));
    assert!(!stale.accepted);
    // Once the producer is made again, the reader runs its next attempt; the job completes.
    let ready = succeed(&mut scheduler, job, &[attempt(0, 1, 1)]);
    assert_eq!(started(&ready), [vec![attempt(1, 0, 1)]]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 1)]);
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 1)]),
        job_done(job)
    );
}

#[test]
fn lineage_reaches_back_through_every_lost_stage_and_skips_outputs_nobody_needs() {
    let mut scheduler = JobScheduler::new(2);
    let (job, _) = scheduler.accept_job(two_blocking_stages());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    let ready = succeed(&mut scheduler, job, &[attempt(1, 0, 0), attempt(1, 1, 0)]);
    assert_eq!(started(&ready), [vec![attempt(2, 0, 0)]]);
    // One worker held stage 0 partition 0 and stage 1 partition 1; stage 2 runs.
    let actions = scheduler.outputs_lost(job, &[task(0, 0), task(1, 1)]);
    let rerun = actions.iter().find_map(|a| match a {
        SchedulerAction::RegionsRerun {
            producers, readers, ..
        } => Some((producers.clone(), readers.clone())),
        _ => None,
    });
    // Stage 1 partition 1 must be made again, and it reads stage 0 partition 0: both run again;
    // stage 1 partition 0's output survived and is kept.
    assert_eq!(
        rerun,
        Some((vec![RegionId(0), RegionId(3)], vec![RegionId(4)]))
    );
    // Only the stage-0 region can start now: the stage-1 one waits for it.
    assert_eq!(started(&actions), [vec![attempt(0, 0, 1)]]);
    let ready = succeed(&mut scheduler, job, &[attempt(0, 0, 1)]);
    assert_eq!(started(&ready), [vec![attempt(1, 1, 1)]]);
    let ready = succeed(&mut scheduler, job, &[attempt(1, 1, 1)]);
    assert_eq!(started(&ready), [vec![attempt(2, 0, 1)]]);
}

#[test]
fn outputs_lost_after_every_reader_finished_change_nothing() {
    let mut scheduler = JobScheduler::new(2);
    let (job, _) = scheduler.accept_job(two_blocking_stages());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 0), attempt(1, 1, 0)]);
    // Stage 0's readers (stage 1) all succeeded: its lost output is needed by nobody.
    assert_eq!(scheduler.outputs_lost(job, &[task(0, 1)]), []);
    assert_eq!(scheduler.outputs_lost(JobId(99), &[task(0, 1)]), []);
}

#[test]
fn a_failure_after_every_final_task_succeeded_ends_the_job_as_succeeded_without_a_retry() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    for partition in 0..2 {
        scheduler.task_status(job, attempt(1, partition, 0), 2, TaskStatus::Succeeded);
    }
    scheduler.task_status(job, attempt(0, 0, 0), 2, TaskStatus::Succeeded);
    assert_eq!(read(&mut scheduler, job, &[attempt(1, 0, 0)]), []);
    // Producer 0/1's final report is lost after both readers read its end marker: the answer
    // (and any write the final stage made) is complete, so nothing runs again; the job ends
    // once the output read the other final task.
    let actions = scheduler.task_lost(
        job,
        attempt(0, 1, 0),
        RemoteError::new(ErrorKind::Transport, "worker 2 does not know it"),
        WorkerLoss::Forgotten,
    );
    assert_eq!(actions, []);
    assert_eq!(scheduler.active_jobs(), 1);
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 1, 0)]),
        job_done(job)
    );
    assert_eq!(scheduler.active_jobs(), 0);
}

#[test]
fn a_failure_while_one_final_task_still_runs_retries_the_region_and_stops_the_rest() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    scheduler.task_status(job, attempt(1, 0, 0), 2, TaskStatus::Succeeded);
    let actions = scheduler
        .task_status(job, attempt(0, 1, 0), 2, transport("peer gone"))
        .actions;
    assert_eq!(
        started(&actions),
        [vec![
            attempt(0, 0, 1),
            attempt(0, 1, 1),
            attempt(1, 0, 1),
            attempt(1, 1, 1)
        ]]
    );
    assert!(actions.contains(&SchedulerAction::StopTasks {
        job,
        tasks: vec![attempt(0, 0, 0), attempt(1, 1, 0)]
    }));
}

#[test]
fn a_failure_after_the_final_tasks_succeeded_stops_the_attempts_still_running() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(pipelined_job());
    for partition in 0..2 {
        scheduler.task_status(job, attempt(1, partition, 0), 2, TaskStatus::Succeeded);
    }
    let actions = scheduler
        .task_status(job, attempt(0, 0, 0), 2, transport("report lost"))
        .actions;
    assert_eq!(
        actions,
        [SchedulerAction::StopTasks {
            job,
            tasks: vec![attempt(0, 1, 0)]
        }]
    );
    // The stopped attempt's cancellation changes nothing; the reads end the job.
    let stale = scheduler.task_status(job, attempt(0, 1, 0), 3, TaskStatus::Canceled);
    assert_eq!(stale, StatusOutcome::default());
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 0), attempt(1, 1, 0)]),
        job_done(job)
    );
}

#[test]
fn a_final_output_lost_before_it_was_read_is_made_again_with_the_inputs_it_lost_before() {
    let mut scheduler = JobScheduler::new(2);
    let (job, _) = scheduler.accept_job(blocking_job());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 0)]);
    // A worker holding stage 0 partition 1's output dies: nobody needs it any more.
    assert_eq!(scheduler.outputs_lost(job, &[task(0, 1)]), []);
    // The worker holding the final task's unread output dies: it is made again, after the
    // input it reads that went earlier, uncharged.
    let actions = scheduler.outputs_lost(job, &[task(1, 0)]);
    assert_eq!(
        actions,
        [
            SchedulerAction::RegionsRerun {
                job,
                producers: vec![RegionId(1), RegionId(2)],
                readers: vec![],
            },
            SchedulerAction::RunRegion {
                job,
                region: RegionId(1),
                tasks: vec![attempt(0, 1, 1)],
            },
        ]
    );
    let ready = succeed(&mut scheduler, job, &[attempt(0, 1, 1)]);
    assert_eq!(started(&ready), [vec![attempt(1, 0, 1)]]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 1)]);
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 1)]),
        job_done(job)
    );
}

#[test]
fn a_lost_final_output_of_a_running_region_retries_it_unless_it_was_read() {
    let mut scheduler = JobScheduler::new(1);
    let (job, _) = scheduler.accept_job(pipelined_job());
    succeed(&mut scheduler, job, &[attempt(1, 0, 0), attempt(1, 1, 0)]);
    assert_eq!(read(&mut scheduler, job, &[attempt(1, 0, 0)]), []);
    // Read already: losing it changes nothing.
    assert_eq!(scheduler.outputs_lost(job, &[task(1, 0)]), []);
    // Not read yet while its producers still run: the region runs again, uncharged (one attempt
    // allowed, yet no failure).
    let actions = scheduler.outputs_lost(job, &[task(1, 1)]);
    assert_eq!(failure(&actions), None);
    assert!(matches!(
        &actions[1],
        SchedulerAction::DiscardOutputs { tasks, .. } if tasks.len() == 4
    ));
    assert!(matches!(
        &actions[2],
        SchedulerAction::RegionRetried { failures: 0, next_attempt: 1, failed, .. }
            if *failed == attempt(1, 1, 0)
    ));
    assert_eq!(
        started(&actions),
        [vec![
            attempt(0, 0, 1),
            attempt(0, 1, 1),
            attempt(1, 0, 1),
            attempt(1, 1, 1)
        ]]
    );
}

#[test]
fn an_unreadable_final_output_runs_its_region_again_until_the_job_fails() {
    let mut scheduler = JobScheduler::new(2);
    let (job, _) = scheduler.accept_job(blocking_job());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    // A broken read of a running final task waits for its report: it could still fail.
    let broken = || RemoteError::new(ErrorKind::Transport, "tcp connect error");
    assert_eq!(
        scheduler.output_unreadable(job, attempt(1, 0, 0), broken()),
        []
    );
    // It succeeds: its region runs again, charged, its output discarded.
    let actions = succeed(&mut scheduler, job, &[attempt(1, 0, 0)]);
    assert_eq!(
        actions[1],
        SchedulerAction::DiscardOutputs {
            job,
            tasks: vec![attempt(1, 0, 0)]
        }
    );
    assert!(matches!(
        &actions[2],
        SchedulerAction::RegionRetried {
            failures: 1,
            next_attempt: 1,
            ..
        }
    ));
    assert_eq!(started(&actions), [vec![attempt(1, 0, 1)]]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 1)]);
    // A broken read of the replaced attempt, arriving late, changes nothing.
    assert_eq!(
        scheduler.output_unreadable(job, attempt(1, 0, 0), broken()),
        []
    );
    // The succeeded attempt cannot be read either: two failures, the job fails.
    let actions = scheduler.output_unreadable(job, attempt(1, 0, 1), broken());
    let failure = failure(&actions).expect("the job fails");
    assert_eq!(failure.task, attempt(1, 0, 1));
    assert_eq!(failure.attempts, 2);
    assert_eq!(
        failure.history,
        [
            "attempt 0: stage 1 partition 0: tcp connect error",
            "attempt 1: stage 1 partition 0: tcp connect error"
        ]
    );
    assert_eq!(scheduler.active_jobs(), 0);
}

#[test]
fn a_read_of_an_attempt_not_started_yet_does_not_count_once_it_runs() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(blocking_job());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    assert_eq!(read(&mut scheduler, job, &[attempt(1, 0, 1)]), []);
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 1, transport("disk gone"))
        .actions;
    assert_eq!(started(&actions), [vec![attempt(1, 0, 1)]]);
    let actions = succeed(&mut scheduler, job, &[attempt(1, 0, 1)]);
    assert_eq!(
        actions,
        [SchedulerAction::ExtendOutput {
            job,
            task: attempt(1, 0, 1)
        }]
    );
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 1)]),
        job_done(job)
    );
}

#[test]
fn a_broken_read_of_a_task_that_then_fails_with_a_user_error_fails_the_job_with_it() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(blocking_job());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    let broken = RemoteError::new(ErrorKind::Transport, "stream broke");
    assert_eq!(
        scheduler.output_unreadable(job, attempt(1, 0, 0), broken),
        []
    );
    let user = RemoteError::new(ErrorKind::User, "Divide by zero error");
    let actions = scheduler
        .task_status(job, attempt(1, 0, 0), 1, TaskStatus::Failed(user.clone()))
        .actions;
    let failure = failure(&actions).expect("the job fails");
    assert_eq!((failure.task, failure.error), (attempt(1, 0, 0), user));
    assert_eq!(started(&actions), Vec::<Vec<TaskAttempt>>::new());
}

#[test]
fn an_unreadable_final_output_waits_for_the_inputs_it_lost_earlier() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(blocking_job());
    succeed(&mut scheduler, job, &[attempt(0, 0, 0), attempt(0, 1, 0)]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 0)]);
    // Stage 0 partition 0's output goes while nothing needs it.
    assert_eq!(scheduler.outputs_lost(job, &[task(0, 0)]), []);
    // The final output cannot be read: charged, and its region waits for stage 0 partition 0,
    // made again first.
    let error = RemoteError::new(ErrorKind::Transport, "stream broke");
    let actions = scheduler.output_unreadable(job, attempt(1, 0, 0), error);
    assert!(matches!(
        &actions[1],
        SchedulerAction::RegionRetried {
            region: RegionId(2),
            failures: 1,
            next_attempt: 1,
            ..
        }
    ));
    assert_eq!(started(&actions), [vec![attempt(0, 0, 1)]]);
    let ready = succeed(&mut scheduler, job, &[attempt(0, 0, 1)]);
    assert_eq!(started(&ready), [vec![attempt(1, 0, 1)]]);
    succeed(&mut scheduler, job, &[attempt(1, 0, 1)]);
    assert_eq!(
        read(&mut scheduler, job, &[attempt(1, 0, 1)]),
        job_done(job)
    );
}

#[test]
fn a_job_without_final_tasks_ends_when_its_regions_succeed_and_retries_a_failure() {
    let mut scheduler = JobScheduler::new(3);
    let (job, _) = scheduler.accept_job(graph(vec![
        stage(&[], 1, OutputMode::Blocking),
        stage(&[(0, InputMode::Shuffle)], 0, OutputMode::Pipelined),
    ]));
    let actions = scheduler
        .task_status(job, attempt(0, 0, 0), 1, transport("disk gone"))
        .actions;
    assert_eq!(started(&actions), [vec![attempt(0, 0, 1)]]);
    assert_eq!(
        succeed(&mut scheduler, job, &[attempt(0, 0, 1)]),
        job_done(job)
    );
}
