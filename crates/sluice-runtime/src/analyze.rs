//! What a task attempt measured ([`TaskMetrics`], structured, travelling in its final report) and
//! `EXPLAIN ANALYZE` across stages: the final stage's `AnalyzeExec` only sees its own stage, so the
//! driver (in every distributed mode) adds one row per earlier stage, built from what its tasks
//! reported, and a `Job` row of totals over every stage.
//!
//! ```text
//!  task reports (metrics, plan with metrics) ─► per stage: rows and time per task (min / median /
//!                                               max, skew = max / median), totals, the slowest
//!                                               task's plan with its metrics
//!  AnalyzeExec rows ("Plan with Metrics", …) ─► then "Stage 0", "Stage 1", …, "Job", same columns
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

use crate::plan::shuffle_reader::ShuffleReaderExec;

/// What a succeeded task attempt reports: structured metrics (they travel as fields of the final
/// status report, never as rendered text), and for `EXPLAIN ANALYZE` its plan with metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskMetrics {
    /// Rows its shuffle writer sent to its output channels (0 without one).
    pub rows: u64,
    /// Batches its shuffle writer sent.
    pub batches: u64,
    /// Bytes of data its shuffle writer sent (the rows' buffers, see `batch_data_bytes`).
    pub shuffled_bytes: u64,
    /// Rows it read from earlier stages' outputs.
    pub input_rows: u64,
    /// Batches it read from earlier stages' outputs.
    pub input_batches: u64,
    /// Bytes of those it read from its own worker's stream store.
    pub read_local_bytes: u64,
    /// Bytes of those it read from other workers (Arrow Flight).
    pub read_remote_bytes: u64,
    /// Rows its table scans produced.
    pub scanned_rows: u64,
    /// Bytes its table scans fetched (the byte ranges Parquet scans read from files or object
    /// stores; DataFusion's `bytes_scanned`).
    pub scanned_bytes: u64,
    /// Wall time of the attempt.
    pub elapsed_ms: u64,
    /// CPU time its operators measured (`elapsed_compute`, summed over the plan).
    pub compute_ms: u64,
    /// Times its operators (and its output channels) spilled to disk.
    pub spill_count: u64,
    /// Bytes they spilled.
    pub spilled_bytes: u64,
    /// The most memory its operators held at once (reserved in the worker's pool).
    pub peak_memory_bytes: u64,
    /// The task's plan rendered with its metrics (empty unless asked for, see [`executed_task`]).
    pub plan: String,
    /// Reads from other workers that failed before they reached them and were made again.
    pub fetch_retries: u64,
    /// The last failure that made one of them try again (empty without retries).
    pub fetch_retried: String,
    /// The summary of the output columns its definition asked for (`summarise_columns`), Arrow
    /// IPC as `runtime_filter::KeySummary::encode` writes it; empty when none was asked for or
    /// the output was not written to its end. Not summed.
    pub key_summary: Vec<u8>,
    /// Rows its shuffle writer sent to each output channel, by channel (empty without a writer):
    /// what the driver splits a skewed join partition by. Not summed.
    pub channel_rows: Vec<u64>,
}

/// Reads one counter of [`TaskMetrics`].
pub type MetricOf = fn(&TaskMetrics) -> u64;

/// Every counter of [`TaskMetrics`] by the name the REST API and the `sluice.tasks` /
/// `sluice.stages` tables give it, in the order they show them (`task_ms` is the wall time).
pub const TASK_METRICS: &[(&str, MetricOf)] = &[
    ("rows", |m| m.rows),
    ("batches", |m| m.batches),
    ("shuffled_bytes", |m| m.shuffled_bytes),
    ("input_rows", |m| m.input_rows),
    ("input_batches", |m| m.input_batches),
    ("read_local_bytes", |m| m.read_local_bytes),
    ("read_remote_bytes", |m| m.read_remote_bytes),
    ("scanned_rows", |m| m.scanned_rows),
    ("scanned_bytes", |m| m.scanned_bytes),
    ("task_ms", |m| m.elapsed_ms),
    ("compute_ms", |m| m.compute_ms),
    ("spill_count", |m| m.spill_count),
    ("spilled_bytes", |m| m.spilled_bytes),
    ("peak_memory_bytes", |m| m.peak_memory_bytes),
];

impl TaskMetrics {
    /// Adds `other`'s counts and times to these (the peak memory is the larger of the two; the
    /// plan stays), as a stage's or job's totals sum its tasks.
    pub fn add(&mut self, other: &TaskMetrics) {
        // Saturating: the values come from workers over the wire.
        let sum = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        sum(&mut self.rows, other.rows);
        sum(&mut self.batches, other.batches);
        sum(&mut self.shuffled_bytes, other.shuffled_bytes);
        sum(&mut self.input_rows, other.input_rows);
        sum(&mut self.input_batches, other.input_batches);
        sum(&mut self.read_local_bytes, other.read_local_bytes);
        sum(&mut self.read_remote_bytes, other.read_remote_bytes);
        sum(&mut self.scanned_rows, other.scanned_rows);
        sum(&mut self.scanned_bytes, other.scanned_bytes);
        sum(&mut self.elapsed_ms, other.elapsed_ms);
        sum(&mut self.compute_ms, other.compute_ms);
        sum(&mut self.spill_count, other.spill_count);
        sum(&mut self.spilled_bytes, other.spilled_bytes);
        self.peak_memory_bytes = self.peak_memory_bytes.max(other.peak_memory_bytes);
        sum(&mut self.fetch_retries, other.fetch_retries);
    }
}

/// The totals of many tasks' metrics ([`TaskMetrics::add`] over them).
impl<'a> std::iter::Sum<&'a TaskMetrics> for TaskMetrics {
    fn sum<I: Iterator<Item = &'a TaskMetrics>>(metrics: I) -> Self {
        metrics.fold(TaskMetrics::default(), |mut sum, m| {
            sum.add(m);
            sum
        })
    }
}

/// One `EXPLAIN ANALYZE` row for a stage other than the final one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageReport {
    /// `Stage N`.
    pub title: String,
    /// The summary line and the slowest task's plan with metrics.
    pub text: String,
}

/// What an executed task plan says of itself: its writer's rows, batches and bytes, its scans'
/// rows, its operators' compute time and spills. Reads, wall time and peak memory are measured
/// around the plan by whoever ran it. Rendering the plan costs a pass over it and a few KiB per
/// report, so it happens only when `with_plan` (the job is an `EXPLAIN ANALYZE`).
pub fn executed_task(plan: &Arc<dyn ExecutionPlan>, with_plan: bool) -> TaskMetrics {
    let root = |name: &str| {
        plan.metrics()
            .and_then(|metrics| metrics.sum_by_name(name))
            .map_or(0, |value| value.as_usize() as u64)
    };
    let mut totals = PlanTotals::default();
    totals.add(plan);
    let rendered = if with_plan {
        DisplayableExecutionPlan::with_metrics(plan.as_ref())
            .indent(true)
            .to_string()
    } else {
        String::new()
    };
    TaskMetrics {
        rows: root("channel_rows"),
        batches: root("channel_batches"),
        shuffled_bytes: root("channel_bytes"),
        scanned_rows: totals.scanned_rows,
        scanned_bytes: totals.scanned_bytes,
        compute_ms: totals.compute_ns / 1_000_000,
        spill_count: totals.spill_count,
        spilled_bytes: totals.spilled_bytes,
        plan: rendered,
        channel_rows: channel_rows(plan),
        ..TaskMetrics::default()
    }
}

/// The rows the writer at the root of `plan` sent to each channel (its `channel_rows` counters,
/// labelled by channel).
fn channel_rows(plan: &Arc<dyn ExecutionPlan>) -> Vec<u64> {
    let Some(metrics) = plan.metrics() else {
        return Vec::new();
    };
    let mut rows: Vec<u64> = Vec::new();
    for metric in metrics.iter() {
        if metric.value().name() != "channel_rows" {
            continue;
        }
        let channel = metric
            .labels()
            .iter()
            .find(|label| label.name() == "channel")
            .and_then(|label| label.value().parse::<usize>().ok());
        if let Some(channel) = channel {
            if rows.len() <= channel {
                rows.resize(channel + 1, 0);
            }
            rows[channel] = rows[channel].saturating_add(metric.value().as_usize() as u64);
        }
    }
    rows
}

/// Sums over every node of a task plan.
#[derive(Debug, Default)]
struct PlanTotals {
    scanned_rows: u64,
    scanned_bytes: u64,
    compute_ns: u64,
    spill_count: u64,
    spilled_bytes: u64,
}

impl PlanTotals {
    fn add(&mut self, plan: &Arc<dyn ExecutionPlan>) {
        if let Some(metrics) = plan.metrics() {
            let value = |v: Option<usize>| v.map_or(0, |v| v as u64);
            self.compute_ns += value(metrics.elapsed_compute());
            self.spill_count += value(metrics.spill_count());
            self.spilled_bytes += value(metrics.spilled_bytes());
            // A leaf that is not a stage input reader scans a table (files, memory, a row).
            if plan.children().is_empty() && plan.downcast_ref::<ShuffleReaderExec>().is_none() {
                self.scanned_rows += value(metrics.output_rows());
                self.scanned_bytes +=
                    value(metrics.sum_by_name("bytes_scanned").map(|v| v.as_usize()));
            }
        }
        for child in plan.children() {
            self.add(child);
        }
    }
}

/// Whether the job is an `EXPLAIN ANALYZE` (its final stage's root is `AnalyzeExec`).
pub fn is_analyze(graph: &JobGraph) -> bool {
    graph
        .stage(graph.final_stage())
        .is_some_and(|stage| stage.plan.downcast_ref::<AnalyzeExec>().is_some())
}

/// A report for every stage but the final one, in stage order, then one for the whole job; each
/// names the runtime filters its plan got (`filters`; the final stage's in the job's report).
pub(crate) fn stage_reports(
    graph: &JobGraph,
    metrics: &HashMap<TaskId, TaskMetrics>,
    notes: &[crate::driver::StageNote],
) -> Vec<StageReport> {
    let last = graph.final_stage();
    let note_lines = |stage: StageId| -> String {
        notes
            .iter()
            .filter(|note| note.target == stage)
            .map(|note| format!("{}\n", note.text))
            .collect()
    };
    let mut reports: Vec<StageReport> = graph
        .stages()
        .iter()
        .enumerate()
        .filter(|(index, _)| StageId(*index) != last)
        .map(|(index, stage)| {
            let id = StageId(index);
            stage_report(id, stage.partitions(), metrics, &note_lines(id))
        })
        .collect();
    let job: TaskMetrics = metrics.values().sum();
    reports.push(StageReport {
        title: "Job".to_string(),
        text: format!(
            "{} stages (the final one included), {} tasks\n{}{}\n",
            graph.stages().len(),
            metrics.len(),
            note_lines(last),
            totals_text(&job)
        ),
    });
    reports
}

/// The report of `stage` (`partitions` tasks): how rows and time spread over its tasks, the
/// notes on what the driver changed in it (`note_lines`: runtime filters, skew splits), its totals, and the slowest task's plan with its
/// metrics.
fn stage_report(
    stage: StageId,
    partitions: usize,
    metrics: &HashMap<TaskId, TaskMetrics>,
    note_lines: &str,
) -> StageReport {
    let tasks: Vec<(usize, &TaskMetrics)> = (0..partitions)
        .filter_map(|partition| {
            metrics
                .get(&TaskId { stage, partition })
                .map(|m| (partition, m))
        })
        .collect();
    let totals: TaskMetrics = tasks.iter().map(|(_, m)| *m).sum();
    let mut times: Vec<(u64, usize)> = tasks.iter().map(|(p, m)| (m.elapsed_ms, *p)).collect();
    times.sort_unstable();
    let mut rows: Vec<u64> = tasks.iter().map(|(_, m)| m.rows).collect();
    rows.sort_unstable();
    let sorted_times: Vec<u64> = times.iter().map(|(ms, _)| *ms).collect();
    let mut summary = format!("{partitions} tasks");
    if let Some((rows, skew)) = spread(&rows, "") {
        summary.push_str(&format!("; rows per task {rows}"));
        if let Some(skew) = skew {
            summary.push_str(&format!(" (skew {skew})"));
        }
    }
    let slowest = times.last().map(|(_, partition)| *partition);
    if let (Some((time, skew)), Some(slowest)) = (spread(&sorted_times, " ms"), slowest) {
        let skew = skew.map_or(String::new(), |s| format!("time skew {s}; "));
        summary.push_str(&format!(
            "; time per task {time} ({skew}partition {slowest} shown below)"
        ));
    }
    let plan = slowest
        .and_then(|partition| metrics.get(&TaskId { stage, partition }))
        .map_or("", |m| m.plan.as_str());
    StageReport {
        title: format!("Stage {stage}"),
        text: format!("{summary}\n{note_lines}{}\n{plan}", totals_text(&totals)),
    }
}

/// How `sorted` (ascending, one value per task, shown with `unit`) spreads: "min 1, median 2.5,
/// max 9", and the skew, the largest over the median ("3.60"; 1.00 is even). `None` for no task;
/// the value alone for one task; no skew for one task or a median of 0.
fn spread(sorted: &[u64], unit: &str) -> Option<(String, Option<String>)> {
    let (least, most) = (*sorted.first()?, *sorted.last()?);
    if sorted.len() < 2 {
        return Some((format!("{most}{unit}"), None));
    }
    // The exact median: the mean of the middle two of an even count.
    let upper = *sorted.get(sorted.len() / 2)? as f64;
    let middle = if sorted.len() % 2 == 1 {
        upper
    } else {
        (*sorted.get(sorted.len() / 2 - 1)? as f64 + upper) / 2.0
    };
    let skew = (middle > 0.0).then(|| format!("{:.2}", most as f64 / middle));
    let text = format!("min {least}{unit}, median {middle}{unit}, max {most}{unit}");
    Some((text, skew))
}

/// The median of `sorted` (ascending; the mean of the middle two of an even count).
pub fn median(sorted: &[u64]) -> Option<u64> {
    let upper = *sorted.get(sorted.len() / 2)?;
    if sorted.len() % 2 == 1 {
        return Some(upper);
    }
    let lower = *sorted.get(sorted.len() / 2 - 1)?;
    Some(lower + (upper - lower) / 2)
}

/// A stage's or job's totals as two lines: the data it moved, then its time, spills and memory.
fn totals_text(t: &TaskMetrics) -> String {
    format!(
        "written: {} rows, {} batches, {}; read: {} rows, {} batches ({} local, {} over \
         Flight); scanned: {} rows, {} fetched\ntask time {} ms, compute {} ms; spilled {} times, {}; peak \
         memory {} (largest task)",
        t.rows,
        t.batches,
        human_bytes(t.shuffled_bytes),
        t.input_rows,
        t.input_batches,
        human_bytes(t.read_local_bytes),
        human_bytes(t.read_remote_bytes),
        t.scanned_rows,
        human_bytes(t.scanned_bytes),
        t.elapsed_ms,
        t.compute_ms,
        t.spill_count,
        human_bytes(t.spilled_bytes),
        human_bytes(t.peak_memory_bytes),
    )
}

/// `bytes` with a binary unit: `812 B`, `1.5 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
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
    fn spread_names_min_median_max_and_the_skew_over_the_median() {
        let spread_of = |values: &[u64]| spread(values, "");
        let pair =
            |text: &str, skew: Option<&str>| Some((text.to_string(), skew.map(String::from)));
        assert_eq!(spread_of(&[]), None);
        assert_eq!(spread_of(&[25]), pair("25", None));
        assert_eq!(
            spread_of(&[3, 3]),
            pair("min 3, median 3, max 3", Some("1.00"))
        );
        assert_eq!(
            spread_of(&[1, 2, 2, 9]),
            pair("min 1, median 2, max 9", Some("4.50"))
        );
        // The median of an even count is exact: (1 + 4) / 2.
        assert_eq!(
            spread_of(&[1, 4]),
            pair("min 1, median 2.5, max 4", Some("1.60"))
        );
        assert_eq!(
            spread_of(&[0, 1]),
            pair("min 0, median 0.5, max 1", Some("2.00"))
        );
        // No skew over a median of 0.
        assert_eq!(spread_of(&[0, 0, 5]), pair("min 0, median 0, max 5", None));
        assert_eq!(
            spread(&[10, 30, 45], " ms"),
            pair("min 10 ms, median 30 ms, max 45 ms", Some("1.50"))
        );
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[7]), Some(7));
        assert_eq!(median(&[0, 5]), Some(2));
        assert_eq!(median(&[1, 2, 4, 9]), Some(3));
        assert_eq!(median(&[1, 2, 9]), Some(2));
    }

    #[test]
    fn bytes_read_with_a_binary_unit() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn totals_add_counts_and_times_and_keep_the_largest_peak() {
        let a = TaskMetrics {
            rows: 1,
            read_remote_bytes: 10,
            scanned_bytes: 1000,
            compute_ms: 5,
            spill_count: 1,
            peak_memory_bytes: 300,
            plan: "A".into(),
            ..TaskMetrics::default()
        };
        let b = TaskMetrics {
            rows: 2,
            read_remote_bytes: 20,
            scanned_bytes: 24,
            compute_ms: 7,
            peak_memory_bytes: 200,
            ..TaskMetrics::default()
        };
        let mut sum = TaskMetrics::default();
        sum.add(&a);
        sum.add(&b);
        assert_eq!(
            sum,
            TaskMetrics {
                rows: 3,
                read_remote_bytes: 30,
                scanned_bytes: 1024,
                compute_ms: 12,
                spill_count: 1,
                peak_memory_bytes: 300,
                ..TaskMetrics::default()
            }
        );
        // Every counter is named once for the REST API and the tables.
        let names: std::collections::HashSet<&str> = TASK_METRICS.iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), TASK_METRICS.len());
        assert_eq!(TASK_METRICS.len(), 14);
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
