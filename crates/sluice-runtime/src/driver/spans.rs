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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::span::{Attributes, Id, Record};
    use tracing::subscriber::with_default;
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::registry::LookupSpan;

    use super::*;
    use crate::scheduler::tests::attempt;

    /// A span as it closed: its name, its fields (`stage`, `attempt`, `state`) and its parent's name.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Closed {
        name: String,
        fields: Vec<(String, String)>,
        parent: Option<String>,
    }

    #[derive(Default)]
    struct Fields(Vec<(String, String)>);

    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if ["stage", "attempt", "state"].contains(&field.name()) {
                self.0
                    .push((field.name().to_string(), format!("{value:?}")));
            }
        }
    }

    /// Records every span's fields and, when it closes, what it was.
    struct Recorder(Arc<Mutex<Vec<Closed>>>);

    impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
        fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
            let mut fields = Fields::default();
            attrs.record(&mut fields);
            if let Some(span) = ctx.span(id) {
                span.extensions_mut().insert(fields);
            }
        }

        fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
            if let Some(span) = ctx.span(id)
                && let Some(fields) = span.extensions_mut().get_mut::<Fields>()
            {
                values.record(fields);
            }
        }

        fn on_close(&self, id: Id, ctx: Context<'_, S>) {
            let Some(span) = ctx.span(&id) else { return };
            let fields = span
                .extensions()
                .get::<Fields>()
                .map(|f| f.0.clone())
                .unwrap_or_default();
            let closed = Closed {
                name: span.name().to_string(),
                fields,
                parent: span.parent().map(|p| p.name().to_string()),
            };
            if let Ok(mut all) = self.0.lock() {
                all.push(closed);
            }
        }
    }

    fn closed(name: &str, fields: &[(&str, &str)], parent: Option<&str>) -> Closed {
        Closed {
            name: name.to_string(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            parent: parent.map(str::to_string),
        }
    }

    #[test]
    fn a_replaced_attempt_closes_cancelled_and_a_rerun_stage_opens_a_new_span() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Recorder(Arc::clone(&seen)));
        with_default(subscriber, || {
            let mut spans = JobSpans::new(JobId(7), None);
            spans.placed(attempt(0, 0, 0), "w1:1");
            // Placed again under the same key (a re-placement): the first span ends cancelled.
            spans.placed(attempt(0, 0, 0), "w2:2");
            spans.ended(attempt(0, 0, 0), "succeeded", None);
            spans.ended(attempt(0, 0, 0), "failed", Some("late"));
            spans.stage_done(StageId(0));
            // Its output was lost: the stage runs again under a new span.
            spans.placed(attempt(0, 0, 1), "w2:2");
            spans.ended(attempt(0, 0, 1), "succeeded", None);
            spans.stage_done(StageId(0));
            spans.placed(attempt(1, 0, 0), "w1:1");
            spans.ended(attempt(1, 0, 0), "lost", Some("worker 1 (w1:1) was lost"));
            spans.job_ended("failed", Some("worker 1 was lost"));
        });
        let seen = seen.lock().unwrap().clone();
        let task = |stage: &str, attempt: &str, state: &str| {
            closed(
                "task",
                &[
                    ("stage", stage),
                    ("attempt", attempt),
                    ("state", &format!("{state:?}")),
                ],
                Some("stage"),
            )
        };
        let stage = |stage: &str| closed("stage", &[("stage", stage)], Some("job"));
        assert_eq!(
            seen,
            vec![
                task("0", "0", "cancelled"),
                task("0", "0", "succeeded"),
                stage("0"),
                task("0", "1", "succeeded"),
                stage("0"),
                task("1", "0", "lost"),
                stage("1"),
                closed("job", &[("state", "\"failed\"")], None),
            ]
        );
    }
}
