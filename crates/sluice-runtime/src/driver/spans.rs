//! The driver's tracing spans of a job: one `job` span from submission to its end, a `stage` span
//! from a stage's first placed attempt until all its tasks succeeded, and a `task` span per attempt
//! from placement to its end, each carrying the ids (and, when it ends, the state) that errors and
//! the REST API use.
//!
//! ```text
//!  job (job, tag, user, state) ──┬── stage (job, stage) ──┬── task (job, stage, partition,
//!                                │                        │        attempt, worker, state)
//!                                │                        └── task …
//!                                └── stage …   (a stage span closes when its stage is complete; a
//!                                               stage re-run for lost outputs opens a new one)
//! ```
//!
//! Whatever subscriber the process installed sees them: the CLI's log lines (`--log-format`), an
//! OTLP exporter, a test's in-memory exporter. Without a subscriber they cost a disabled check.
//! Invariant: a span is closed by dropping it, so an attempt's span closes exactly once, when its
//! record leaves `running`; the job's span closes after every one of its children.

use std::collections::HashMap;

use sluice_planner::{JobId, StageId, TaskAttempt};
use tracing::Span;
use tracing::field::Empty;

use super::JobLabel;

/// The open spans of one job; see the module docs.
#[derive(Debug)]
pub(crate) struct JobSpans {
    job: JobId,
    span: Span,
    /// Per stage not complete yet, its span.
    stages: HashMap<StageId, Span>,
    attempts: HashMap<TaskAttempt, Span>,
}

impl Default for JobSpans {
    /// Spans of no job (tests of the attempt log): children are root spans.
    fn default() -> Self {
        Self {
            job: JobId(0),
            span: Span::none(),
            stages: HashMap::new(),
            attempts: HashMap::new(),
        }
    }
}

impl JobSpans {
    /// Opens the span of `job`.
    pub fn new(job: JobId, label: Option<&JobLabel>) -> Self {
        let span = tracing::info_span!(
            target: "sluice::driver",
            "job",
            job = job.0,
            tag = label.map(|l| l.tag.as_str()),
            user = label.map(|l| l.user.as_str()),
            state = Empty,
        );
        tracing::info!(target: "sluice::driver", parent: &span, "job submitted");
        Self {
            job,
            span,
            stages: HashMap::new(),
            attempts: HashMap::new(),
        }
    }

    /// `attempt` was placed on `worker` (an address).
    pub fn placed(&mut self, attempt: TaskAttempt, worker: &str) {
        let stage = attempt.task.stage;
        let stage_span = self.stages.entry(stage).or_insert_with(|| {
            tracing::info_span!(
                target: "sluice::driver",
                parent: &self.span,
                "stage",
                job = self.job.0,
                stage = stage.0,
            )
        });
        let span = tracing::info_span!(
            target: "sluice::driver",
            parent: &*stage_span,
            "task",
            job = self.job.0,
            stage = stage.0,
            partition = attempt.task.partition,
            attempt = attempt.attempt,
            worker = worker,
            state = Empty,
        );
        if let Some(replaced) = self.attempts.insert(attempt, span) {
            close_attempt(replaced, "cancelled", None);
        }
    }

    /// `attempt` ended in `state` (a name of `TaskRecordState`).
    pub fn ended(&mut self, attempt: TaskAttempt, state: &str, error: Option<&str>) {
        if let Some(span) = self.attempts.remove(&attempt) {
            close_attempt(span, state, error);
        }
    }

    /// Every task of `stage` succeeded: its span closes (once attempts still running under it end).
    pub fn stage_done(&mut self, stage: StageId) {
        self.stages.remove(&stage);
    }

    /// The job ended in `state` (a name of `JobState`): its attempts' spans (already ended by
    /// then), its stages' and its own close.
    pub fn job_ended(&mut self, state: &str, error: Option<&str>) {
        self.attempts.clear();
        self.stages.clear();
        self.span.record("state", state);
        match error {
            Some(error) => {
                tracing::info!(target: "sluice::driver", parent: &self.span, error, "job {state}")
            }
            None => tracing::info!(target: "sluice::driver", parent: &self.span, "job {state}"),
        }
        self.span = Span::none();
    }
}

/// Records `state` on an attempt's span, logs its end, and closes it (by dropping it).
fn close_attempt(span: Span, state: &str, error: Option<&str>) {
    span.record("state", state);
    match error {
        Some(error) => {
            tracing::info!(target: "sluice::driver", parent: &span, error, "task attempt {state}")
        }
        None => tracing::debug!(target: "sluice::driver", parent: &span, "task attempt {state}"),
    }
}
