//! [`TaskRecord`]: one task attempt as the driver tells it (where it ran, when, how it ended, what it
//! did) for the REST API and the `sluice.tasks` system table; [`AttemptLog`] keeps a job's records
//! in the order the attempts were placed.
//!
//! ```text
//!  launch ─► running ─┬─ accepted final report ─► succeeded (with its metrics) / failed
//!                     ├─ a report not accepted (a replaced or stopped attempt) ─► cancelled
//!                     ├─ RunTask refused or unanswered ─► failed (never started)
//!                     ├─ its worker lost ─► lost
//!                     └─ job ended with it still running ─► cancelled
//! ```
//!
//! Invariants: a record leaves `running` once and keeps its first ending (a stale report after a
//! loss changes nothing); metrics are only those of a report the scheduler accepted; every ending is
//! counted once in the driver's telemetry.

use std::collections::HashMap;

use sluice_planner::{JobId, TaskAttempt, WorkerId};

use super::JobLabel;
use super::history::now_ms;
use super::spans::JobSpans;
use super::telemetry;
use crate::analyze::{TaskMetrics, median};

/// Where a task attempt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskRecordState {
    /// Placed and not ended.
    Running,
    /// It ran to its end.
    Succeeded,
    /// It failed (the record's `error` says why), or its worker refused or never answered it.
    Failed,
    /// It was stopped: its job ended, was cancelled, or no longer needed it.
    Cancelled,
    /// Its worker was lost while it ran.
    Lost,
}

impl TaskRecordState {
    /// The state's name, as the REST API and `sluice.tasks` spell it.
    pub fn name(self) -> &'static str {
        match self {
            TaskRecordState::Running => "running",
            TaskRecordState::Succeeded => "succeeded",
            TaskRecordState::Failed => "failed",
            TaskRecordState::Cancelled => "cancelled",
            TaskRecordState::Lost => "lost",
        }
    }
}

/// One task attempt, as the driver tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRecord {
    /// Which task and attempt.
    pub attempt: TaskAttempt,
    /// The worker it was placed on (`None`: the driver's own executor).
    pub worker: Option<WorkerId>,
    /// That worker's address.
    pub address: String,
    /// Where it is.
    pub state: TaskRecordState,
    /// When it was placed (ms since the Unix epoch).
    pub started_ms: u64,
    /// When it ended, once it did.
    pub ended_ms: Option<u64>,
    /// What its accepted final report said (zero until it succeeded).
    pub metrics: TaskMetrics,
    /// Why it failed or was lost.
    pub error: Option<String>,
}

impl TaskRecord {
    /// Milliseconds from placement to its end, or to now while it runs.
    pub fn elapsed_ms(&self) -> u64 {
        self.ended_ms
            .unwrap_or_else(now_ms)
            .saturating_sub(self.started_ms)
    }
}

/// One stage of a job, summed over its tasks' succeeded attempts (a task that succeeded more than
/// once, re-run after its output was lost, counts with its last).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageSummary {
    /// The stage's tasks (one per partition).
    pub tasks: usize,
    /// Its attempts so far (retries and re-runs included).
    pub attempts: usize,
    /// Tasks that succeeded.
    pub succeeded: usize,
    /// Attempts running now.
    pub running: usize,
    /// Its succeeded tasks' metrics summed (`elapsed_ms`: task time summed; `peak_memory_bytes`:
    /// the largest task's peak; no plan).
    pub totals: TaskMetrics,
    /// Median and largest task time (ms), once a task succeeded.
    pub task_ms: Option<(u64, u64)>,
    /// Median and largest rows per task, once a task succeeded (skew: max / median).
    pub task_rows: Option<(u64, u64)>,
}

/// Per stage (`stage_tasks[i]` tasks in stage `i`), what `attempts` did.
pub fn stage_summaries(stage_tasks: &[usize], attempts: &[TaskRecord]) -> Vec<StageSummary> {
    stage_tasks
        .iter()
        .enumerate()
        .map(|(stage, &tasks)| {
            let of_stage: Vec<&TaskRecord> = attempts
                .iter()
                .filter(|a| a.attempt.task.stage.0 == stage)
                .collect();
            let mut last: HashMap<usize, &TaskMetrics> = HashMap::new();
            for a in of_stage
                .iter()
                .filter(|a| a.state == TaskRecordState::Succeeded)
            {
                last.insert(a.attempt.task.partition, &a.metrics);
            }
            let spread = |value: fn(&TaskMetrics) -> u64| {
                let mut values: Vec<u64> = last.values().map(|m| value(m)).collect();
                values.sort_unstable();
                Some((median(&values)?, *values.last()?))
            };
            StageSummary {
                tasks,
                attempts: of_stage.len(),
                succeeded: last.len(),
                running: of_stage
                    .iter()
                    .filter(|a| a.state == TaskRecordState::Running)
                    .count(),
                totals: last.values().copied().sum(),
                task_ms: spread(|m| m.elapsed_ms),
                task_rows: spread(|m| m.rows),
            }
        })
        .collect()
}

/// A job's task attempts, in the order they were placed, and their tracing spans.
#[derive(Debug, Default)]
pub(crate) struct AttemptLog {
    records: Vec<TaskRecord>,
    index: HashMap<TaskAttempt, usize>,
    spans: JobSpans,
}

impl AttemptLog {
    /// The log of `job`, opening its span.
    pub fn new(job: JobId, label: Option<&JobLabel>) -> Self {
        Self {
            spans: JobSpans::new(job, label),
            ..Self::default()
        }
    }

    /// Every task of `stage` succeeded: its span closes.
    pub fn stage_done(&mut self, stage: sluice_planner::StageId) {
        self.spans.stage_done(stage);
    }

    /// The job ended in `state`: its spans close (its attempts ended before).
    pub fn job_ended(&mut self, state: &str, error: Option<&str>) {
        self.spans.job_ended(state, error);
    }

    /// `attempt` was placed now on `worker` at `address`.
    pub fn placed(&mut self, attempt: TaskAttempt, worker: Option<WorkerId>, address: String) {
        self.spans.placed(attempt, &address);
        let record = TaskRecord {
            attempt,
            worker,
            address,
            state: TaskRecordState::Running,
            started_ms: now_ms(),
            ended_ms: None,
            metrics: TaskMetrics::default(),
            error: None,
        };
        match self.index.get(&attempt) {
            Some(&at) => self.records[at] = record,
            None => {
                self.index.insert(attempt, self.records.len());
                self.records.push(record);
            }
        }
    }

    /// `attempt` ended in `state` (a record that already ended keeps its first ending).
    pub fn ended(
        &mut self,
        attempt: TaskAttempt,
        state: TaskRecordState,
        metrics: Option<TaskMetrics>,
        error: Option<String>,
    ) {
        let Some(record) = self
            .index
            .get(&attempt)
            .and_then(|&at| self.records.get_mut(at))
        else {
            return;
        };
        if record.state != TaskRecordState::Running {
            return;
        }
        record.state = state;
        record.ended_ms = Some(now_ms());
        record.error = error;
        if let Some(metrics) = metrics {
            record.metrics = metrics;
        }
        telemetry::task_ended(record);
        self.spans
            .ended(attempt, state.name(), record.error.as_deref());
    }

    /// Every attempt still running ends `cancelled` (its job ended).
    pub fn cancel_running(&mut self) {
        let running: Vec<TaskAttempt> = self
            .records
            .iter()
            .filter(|r| r.state == TaskRecordState::Running)
            .map(|r| r.attempt)
            .collect();
        for attempt in running {
            self.ended(attempt, TaskRecordState::Cancelled, None, None);
        }
    }

    /// The records, in placement order.
    pub fn records(&self) -> &[TaskRecord] {
        &self.records
    }

    /// The records, handed over when the job leaves the driver.
    pub fn into_records(self) -> Vec<TaskRecord> {
        self.records
    }
}

#[cfg(test)]
mod tests {
    use sluice_planner::{StageId, TaskId};

    use super::*;

    fn attempt(partition: usize, attempt: usize) -> TaskAttempt {
        TaskAttempt {
            task: TaskId {
                stage: StageId(0),
                partition,
            },
            attempt,
        }
    }

    #[test]
    fn an_attempt_keeps_its_first_ending_and_running_ones_are_cancelled_with_the_job() {
        let mut log = AttemptLog::default();
        log.placed(attempt(0, 0), Some(WorkerId(1)), "a:1".into());
        log.placed(attempt(1, 0), Some(WorkerId(2)), "b:2".into());
        log.placed(attempt(0, 1), None, "driver:3".into());
        log.ended(
            attempt(0, 0),
            TaskRecordState::Lost,
            None,
            Some("worker 1 (a:1) was lost".into()),
        );
        let metrics = TaskMetrics {
            rows: 7,
            ..TaskMetrics::default()
        };
        log.ended(
            attempt(0, 0),
            TaskRecordState::Succeeded,
            Some(metrics.clone()),
            None,
        );
        log.ended(
            attempt(0, 1),
            TaskRecordState::Succeeded,
            Some(metrics),
            None,
        );
        log.cancel_running();
        let seen: Vec<(usize, usize, &str, u64, Option<&str>)> = log
            .records()
            .iter()
            .map(|r| {
                (
                    r.attempt.task.partition,
                    r.attempt.attempt,
                    r.state.name(),
                    r.metrics.rows,
                    r.error.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                (0, 0, "lost", 0, Some("worker 1 (a:1) was lost")),
                (1, 0, "cancelled", 0, None),
                (0, 1, "succeeded", 7, None),
            ]
        );
        assert!(log.records().iter().all(|r| r.ended_ms.is_some()));
    }

    #[test]
    fn a_stage_sums_each_tasks_last_success_and_shows_its_spread() {
        let mut log = AttemptLog::default();
        let done = |rows: u64, elapsed_ms: u64| TaskMetrics {
            rows,
            elapsed_ms,
            shuffled_bytes: rows * 10,
            input_rows: rows * 2,
            read_remote_bytes: 1,
            spill_count: u64::from(rows > 4),
            peak_memory_bytes: elapsed_ms * 100,
            ..TaskMetrics::default()
        };
        for (partition, try_, rows, ms) in
            [(0, 0, 5, 40), (0, 1, 4, 30), (1, 0, 1, 10), (2, 0, 9, 90)]
        {
            log.placed(attempt(partition, try_), Some(WorkerId(1)), "a:1".into());
            log.ended(
                attempt(partition, try_),
                TaskRecordState::Succeeded,
                Some(done(rows, ms)),
                None,
            );
        }
        log.placed(attempt(3, 0), Some(WorkerId(1)), "a:1".into());
        let summaries = stage_summaries(&[4, 2], log.records());
        assert_eq!(
            summaries,
            vec![
                StageSummary {
                    tasks: 4,
                    attempts: 5,
                    succeeded: 3,
                    running: 1,
                    // Partition 0's last success (4 rows in 30 ms), 1 and 2; peak: the largest.
                    totals: TaskMetrics {
                        rows: 14,
                        shuffled_bytes: 140,
                        input_rows: 28,
                        read_remote_bytes: 3,
                        spill_count: 1,
                        elapsed_ms: 130,
                        peak_memory_bytes: 9000,
                        ..TaskMetrics::default()
                    },
                    task_ms: Some((30, 90)),
                    task_rows: Some((4, 9)),
                },
                StageSummary {
                    tasks: 2,
                    ..StageSummary::default()
                },
            ]
        );
    }
}
