//! `EXPLAIN ANALYZE` across stages: the final stage's `AnalyzeExec` only sees its own stage, so the
//! driver (in every distributed mode) adds one row per earlier stage, built from what
//! its tasks reported.
//!
//! ```text
//!  task reports (rows, wall time, plan with metrics) ─► per stage: tasks, rows, median / max time,
//!                                                        the slowest task's plan with its metrics
//!  AnalyzeExec rows ("Plan with Metrics", …) ─► then "Stage 0", "Stage 1", … rows, same two columns
//! ```
//!
//! Pure code: whoever runs the tasks collects their reports; whoever forwards the job output appends
//! the batch after the final stage's.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::analyze::AnalyzeExec;
use datafusion::physical_plan::display::DisplayableExecutionPlan;
use sluice_planner::{JobGraph, StageId, TaskId};

/// What a succeeded task attempt reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskMetrics {
    /// Rows its shuffle writer sent (0 without one).
    pub rows: u64,
    /// Wall time of the attempt.
    pub elapsed_ms: u64,
    /// Bytes its operators spilled to disk.
    pub spilled_bytes: u64,
    /// Bytes its shuffle writer sent to its output channels (0 without one).
    pub shuffled_bytes: u64,
    /// The task's plan rendered with its metrics (empty unless asked for, see [`executed_task`]).
    pub plan: String,
}

/// One `EXPLAIN ANALYZE` row for a stage other than the final one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageReport {
    /// `Stage N`.
    pub title: String,
    /// The summary line and the slowest task's plan with metrics.
    pub text: String,
}

/// What an executed task plan reports. Rendering the plan costs a pass over it and a few KiB per
/// report, so it happens only when `with_plan` (the job is an `EXPLAIN ANALYZE`).
pub fn executed_task(
    plan: &Arc<dyn ExecutionPlan>,
    elapsed_ms: u64,
    with_plan: bool,
) -> TaskMetrics {
    let root = |name: &str| {
        plan.metrics()
            .and_then(|metrics| metrics.sum_by_name(name))
            .map_or(0, |value| value.as_usize() as u64)
    };
    let (rows, shuffled_bytes) = (root("channel_rows"), root("channel_bytes"));
    let spilled_bytes = tree_sum(plan, "spilled_bytes");
    let plan = if with_plan {
        DisplayableExecutionPlan::with_metrics(plan.as_ref())
            .indent(true)
            .to_string()
    } else {
        String::new()
    };
    TaskMetrics {
        rows,
        elapsed_ms,
        spilled_bytes,
        shuffled_bytes,
        plan,
    }
}

/// The metric `name` summed over every node of `plan`.
fn tree_sum(plan: &Arc<dyn ExecutionPlan>, name: &str) -> u64 {
    let own = plan
        .metrics()
        .and_then(|metrics| metrics.sum_by_name(name))
        .map_or(0, |value| value.as_usize() as u64);
    own + plan
        .children()
        .into_iter()
        .map(|child| tree_sum(child, name))
        .sum::<u64>()
}

/// Whether the job is an `EXPLAIN ANALYZE` (its final stage's root is `AnalyzeExec`).
pub fn is_analyze(graph: &JobGraph) -> bool {
    graph
        .stage(graph.final_stage())
        .is_some_and(|stage| stage.plan.downcast_ref::<AnalyzeExec>().is_some())
}

/// A report for every stage but the final one, in stage order.
pub fn stage_reports(graph: &JobGraph, metrics: &HashMap<TaskId, TaskMetrics>) -> Vec<StageReport> {
    let last = graph.final_stage();
    graph
        .stages()
        .iter()
        .enumerate()
        .filter(|(index, _)| StageId(*index) != last)
        .map(|(index, stage)| {
            let tasks: Vec<TaskId> = (0..stage.partitions())
                .map(|partition| TaskId {
                    stage: StageId(index),
                    partition,
                })
                .collect();
            let written: u64 = tasks
                .iter()
                .filter_map(|task| metrics.get(task))
                .map(|m| m.rows)
                .sum();
            let mut times: Vec<(u64, usize)> = tasks
                .iter()
                .filter_map(|task| metrics.get(task).map(|m| (m.elapsed_ms, task.partition)))
                .collect();
            times.sort_unstable();
            let mut rows: Vec<u64> = tasks
                .iter()
                .filter_map(|task| metrics.get(task).map(|m| m.rows))
                .collect();
            rows.sort_unstable();
            let spread = row_spread(&rows);
            let summary = match (times.get(times.len() / 2), times.last()) {
                (Some((median, _)), Some((max, slowest))) => format!(
                    "{} tasks, {written} rows written{spread}; task time median {median} ms, \
                     max {max} ms (partition {slowest}, shown below)",
                    tasks.len()
                ),
                _ => format!("{} tasks, {written} rows written{spread}", tasks.len()),
            };
            let plan = times
                .last()
                .and_then(|(_, partition)| {
                    metrics.get(&TaskId {
                        stage: StageId(index),
                        partition: *partition,
                    })
                })
                .map_or("", |m| m.plan.as_str());
            StageReport {
                title: format!("Stage {index}"),
                text: format!("{summary}\n{plan}"),
            }
        })
        .collect()
}

/// How rows spread over a stage's tasks (`sorted` ascending): " (per task 2 to 9, skew 1.80)", the
/// skew being the largest over the mean (1.00: even; the number of tasks: one task has them all).
/// Empty for fewer than two tasks; no skew when no task wrote a row.
fn row_spread(sorted: &[u64]) -> String {
    let (Some(least), Some(most)) = (sorted.first(), sorted.last()) else {
        return String::new();
    };
    if sorted.len() < 2 {
        return String::new();
    }
    let total: u64 = sorted.iter().sum();
    let skew = if total > 0 {
        let mean = total as f64 / sorted.len() as f64;
        format!(", skew {:.2}", *most as f64 / mean)
    } else {
        String::new()
    };
    format!(" (per task {least} to {most}{skew})")
}

/// The reports as a batch of `schema` (`AnalyzeExec`'s two string columns), or `None` if the schema
/// is not that.
pub fn report_batch(schema: &SchemaRef, reports: &[StageReport]) -> Option<RecordBatch> {
    let strings = schema.fields().len() == 2
        && schema
            .fields()
            .iter()
            .all(|f| f.data_type() == &DataType::Utf8);
    if reports.is_empty() || !strings {
        return None;
    }
    let titles: ArrayRef = Arc::new(StringArray::from_iter_values(
        reports.iter().map(|r| r.title.as_str()),
    ));
    let texts: ArrayRef = Arc::new(StringArray::from_iter_values(
        reports.iter().map(|r| r.text.as_str()),
    ));
    RecordBatch::try_new(schema.clone(), vec![titles, texts]).ok()
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::{Field, Schema};

    use super::*;

    #[test]
    fn row_spread_names_the_range_and_the_skew_over_the_mean() {
        assert_eq!(row_spread(&[]), "");
        assert_eq!(row_spread(&[25]), "");
        assert_eq!(row_spread(&[3, 3]), " (per task 3 to 3, skew 1.00)");
        assert_eq!(row_spread(&[0, 5]), " (per task 0 to 5, skew 2.00)");
        assert_eq!(row_spread(&[1, 2, 2, 9]), " (per task 1 to 9, skew 2.57)");
        assert_eq!(row_spread(&[0, 0]), " (per task 0 to 0)");
    }

    #[test]
    fn a_batch_only_for_two_string_columns() {
        let reports = vec![StageReport {
            title: "Stage 0".into(),
            text: "2 tasks".into(),
        }];
        let analyze = Arc::new(Schema::new(vec![
            Field::new("plan_type", DataType::Utf8, false),
            Field::new("plan", DataType::Utf8, false),
        ]));
        let batch = report_batch(&(analyze.clone() as SchemaRef), &reports).unwrap();
        assert_eq!(batch.num_rows(), 1);
        assert!(report_batch(&(analyze as SchemaRef), &[]).is_none());
        let other: SchemaRef = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]));
        assert!(report_batch(&other, &reports).is_none());
    }
}
