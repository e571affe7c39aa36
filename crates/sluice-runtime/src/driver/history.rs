//! [`JobRecord`]: what the driver tells about each job it ran or runs (state, who asked, when,
//! stages, tasks and their attempts, rows, retries, error) for the REST API, the system tables and
//! the Prometheus metrics; [`JobHistory`] keeps the last [`HISTORY_LIMIT`] ended jobs.
//!
//! Invariants: a record's state changes only from `running`, once, to `succeeded`, `failed` or
//! `cancelled`, and an ended record has its end time; the history forgets the oldest ended job
//! first and never a running one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::JobLabel;
use super::attempts::TaskRecord;
use super::telemetry;

/// Ended jobs the driver remembers.
pub const HISTORY_LIMIT: usize = 1000;

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    /// Its tasks run or wait, or its output is still being read.
    Running,
    /// Every task succeeded and its output read every final task.
    Succeeded,
    /// It failed (the record's `error` says why).
    Failed,
    /// Its caller went away, or it was cancelled on request.
    Cancelled,
}

impl JobState {
    /// The state's name, as the REST API spells it.
    pub fn name(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// One job, as the driver tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// The job id.
    pub job: u64,
    /// Where it is.
    pub state: JobState,
    /// Who asked for it, when its front end said.
    pub label: Option<Arc<JobLabel>>,
    /// When it was submitted (ms since the Unix epoch).
    pub submitted_ms: u64,
    /// When it ended, once it did.
    pub ended_ms: Option<u64>,
    /// Per stage of its job graph, its tasks (one per partition).
    pub stage_tasks: Vec<usize>,
    /// Per stage, the stages it reads and how (`InputMode` names): the job graph's edges.
    pub stage_inputs: Vec<Vec<(usize, &'static str)>>,
    /// Per stage, the name of its plan's root operator.
    pub stage_roots: Vec<String>,
    /// Tasks whose latest attempt succeeded (as of the read, for a running job).
    pub tasks_done: usize,
    /// Its task attempts in the order they were placed (those of a running job as of the read).
    pub attempts: Arc<Vec<TaskRecord>>,
    /// Rows its final stage wrote (once it succeeded).
    pub rows: u64,
    /// Task regions retried.
    pub retries: usize,
    /// Why it failed.
    pub error: Option<String>,
}

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

impl JobRecord {
    /// A job submitted now.
    pub(crate) fn submitted(
        job: u64,
        label: Option<Arc<JobLabel>>,
        stage_tasks: Vec<usize>,
    ) -> Self {
        Self {
            stage_inputs: vec![Vec::new(); stage_tasks.len()],
            stage_roots: vec![String::new(); stage_tasks.len()],
            job,
            state: JobState::Running,
            label,
            submitted_ms: now_ms(),
            ended_ms: None,
            stage_tasks,
            tasks_done: 0,
            attempts: Arc::default(),
            rows: 0,
            retries: 0,
            error: None,
        }
    }

    /// A job of `graph` submitted now.
    pub(crate) fn of_graph(
        job: u64,
        label: Option<Arc<JobLabel>>,
        graph: &sluice_planner::JobGraph,
    ) -> Self {
        let stages = graph.stages();
        let tasks = stages.iter().map(|s| s.partitions()).collect();
        let mut record = Self::submitted(job, label, tasks);
        record.stage_inputs = stages
            .iter()
            .map(|s| {
                s.inputs
                    .iter()
                    .map(|i| (i.stage.0, i.mode.name()))
                    .collect()
            })
            .collect();
        record.stage_roots = stages.iter().map(|s| s.plan.name().to_string()).collect();
        record
    }

    /// Stages of its job graph.
    pub fn stages(&self) -> usize {
        self.stage_tasks.len()
    }

    /// Tasks of its job graph (one per stage partition).
    pub fn tasks(&self) -> usize {
        self.stage_tasks.iter().sum()
    }

    /// Milliseconds from submission to its end, or to now while it runs.
    pub fn elapsed_ms(&self) -> u64 {
        self.ended_ms
            .unwrap_or_else(now_ms)
            .saturating_sub(self.submitted_ms)
    }

    /// Ends a running job in `state` (an ended job keeps its first ending, counted once in the
    /// telemetry).
    pub(crate) fn end(&mut self, state: JobState, error: Option<String>) {
        if self.state != JobState::Running {
            return;
        }
        self.state = state;
        self.error = error;
        self.ended_ms = Some(now_ms());
        telemetry::job_ended(self);
    }
}

/// The last ended jobs, oldest first.
#[derive(Debug, Default)]
pub(crate) struct JobHistory {
    ended: VecDeque<JobRecord>,
}

impl JobHistory {
    /// Remembers `record` (a job that left the driver); one still marked running was dropped by
    /// its caller, so it counts as cancelled.
    pub fn remember(&mut self, mut record: JobRecord) {
        record.end(JobState::Cancelled, None);
        if self.ended.len() == HISTORY_LIMIT {
            self.ended.pop_front();
        }
        self.ended.push_back(record);
    }

    /// The remembered jobs, oldest first.
    pub fn records(&self) -> impl Iterator<Item = &JobRecord> {
        self.ended.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_ends_once_and_the_history_forgets_the_oldest_first() {
        let mut record = JobRecord::submitted(1, None, vec![2, 3]);
        assert_eq!((record.state, record.ended_ms), (JobState::Running, None));
        record.end(JobState::Failed, Some("division by zero".into()));
        let ended = record.ended_ms;
        assert!(ended.is_some());
        record.end(JobState::Succeeded, None);
        assert_eq!(
            record.state,
            JobState::Failed,
            "an ended job keeps its first ending"
        );
        assert_eq!(record.error.as_deref(), Some("division by zero"));

        let mut history = JobHistory::default();
        for job in 0..(HISTORY_LIMIT as u64 + 2) {
            history.remember(JobRecord::submitted(job, None, vec![1]));
        }
        let jobs: Vec<u64> = history.records().map(|r| r.job).collect();
        assert_eq!(jobs.len(), HISTORY_LIMIT);
        assert_eq!(jobs.first(), Some(&2));
        assert!(
            history
                .records()
                .all(|r| r.state == JobState::Cancelled && r.ended_ms.is_some()),
            "a job that left while running was dropped by its caller"
        );
    }
}
