//! The TPC-H timing harness behind `sluice tpch run` and `sluice demo`.
//!
//! Each query runs `iterations` times through the session's job runner; the report keeps every timing
//! plus min and median, the row count, and (with `verify`) whether the last result matched the official
//! answer. A query that fails is reported and the run goes on, so one bad query does not hide the rest.

use std::path::Path;
use std::time::Instant;

use arrow::array::RecordBatch;
use futures::future::BoxFuture;
use serde::Serialize;
use sluice_runtime::DriverCounters;

use crate::answers::{ANSWER_SCALE_FACTOR, compare, format_rows, official_answer};
use crate::datagen::{MANIFEST, TPCH_TABLES, check_scale_factor, parse_manifest, read_manifest};
use crate::queries::{TpchQuery, tpch_query};
use sluice_engine::catalog::discover_tables_at;
use sluice_engine::remote_tables::read_object_text;
use sluice_engine::session::{SluiceSession, collect_stream};
use sluice_engine::{Result, SluiceError};
use sluice_runtime::object_stores::is_remote;

/// Where the benchmark runs its statements: a session of this process, or (for the CLI's
/// `--connect`) a session on a `sluice server`.
pub trait QueryTarget: Sync {
    /// Runs one SQL statement and collects its rows.
    fn run_statement<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<Vec<RecordBatch>>>;
    /// What the target's driver counted so far (zero when it cannot tell).
    fn counters(&self) -> BoxFuture<'_, DriverCounters>;
    /// The mode the report names.
    fn mode_name(&self) -> String;
    /// The target's `datafusion.execution.target_partitions`, as the report names it.
    fn target_partitions(&self) -> usize;
}

impl QueryTarget for SluiceSession {
    fn run_statement<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<Vec<RecordBatch>>> {
        Box::pin(async move {
            let mut batches = Vec::new();
            for statement in self.parse_sql(sql)? {
                batches = collect_stream(self.execute_statement(statement).await?)
                    .await?
                    .batches;
            }
            Ok(batches)
        })
    }

    fn counters(&self) -> BoxFuture<'_, DriverCounters> {
        self.runner().counters()
    }

    fn mode_name(&self) -> String {
        self.runner().mode_name().to_string()
    }

    fn target_partitions(&self) -> usize {
        self.context().state().config().target_partitions()
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Query numbers, in order.
    pub queries: Vec<u8>,
    /// Runs per query (at least 1).
    pub iterations: usize,
    /// Compare each result with the official answer (scale factor 1 only).
    pub verify: bool,
    /// Compare each result with the answer in this directory (`q01.tbl` … `q22.tbl`, the official
    /// answers' `|`-separated form, by the same rules), at any scale factor.
    pub answers: Option<std::path::PathBuf>,
    /// Write each result to this directory as `qNN.tbl`, in the form `answers` reads, so that a
    /// later run (another mode, another copy of the data) can be compared with it.
    pub save_answers: Option<std::path::PathBuf>,
    /// The data's scale factor.
    pub scale_factor: f64,
}

/// The outcome of one query.
#[derive(Debug, Clone, Serialize)]
pub struct QueryReport {
    /// Query number.
    pub query: u8,
    /// Rows in the result (0 if it failed).
    pub rows: usize,
    /// Wall-clock seconds of each iteration.
    pub seconds: Vec<f64>,
    /// Fastest iteration.
    pub min: f64,
    /// Median iteration.
    pub median: f64,
    /// `Some(true)` when verified against the official answer (or `--answers`).
    pub verified: Option<bool>,
    /// `Some(true)` when compared with local mode's result and equal.
    pub matches_local: Option<bool>,
    /// Why it failed, if it did (an error or a verification mismatch).
    pub error: Option<String>,
    /// Workers lost while it ran (every iteration).
    pub workers_lost: usize,
    /// Task regions run again while it ran.
    pub regions_retried: usize,
    /// Task attempts started again while it ran.
    pub tasks_retried: usize,
    /// Task attempts run for it, retries included (every iteration; 0 in local mode).
    pub tasks: usize,
    /// Bytes spilled to disk, summed over the job's tasks (every iteration; 0 in local mode,
    /// which has no driver to count them).
    pub spilled_bytes: u64,
    /// Bytes written to shuffle channels, summed over the job's tasks (every iteration).
    pub shuffled_bytes: u64,
    /// Bytes its scans fetched from files and object stores (every iteration).
    pub scanned_bytes: u64,
}

impl QueryReport {
    /// Whether the query ran and (if checked) verified.
    pub fn passed(&self) -> bool {
        self.error.is_none() && self.verified != Some(false) && self.matches_local != Some(false)
    }
}

/// The whole run, as written by `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Execution mode.
    pub mode: String,
    /// Data scale factor.
    pub scale_factor: f64,
    /// DataFusion's target partitions.
    pub target_partitions: usize,
    /// Runs per query.
    pub iterations: usize,
    /// Per-query results in run order.
    pub queries: Vec<QueryReport>,
    /// Sum of per-query minimums.
    pub total_min: f64,
    /// Sum of per-query medians.
    pub total_median: f64,
}

impl BenchReport {
    /// (passed, failed) counts.
    pub fn counts(&self) -> (usize, usize) {
        let passed = self.queries.iter().filter(|q| q.passed()).count();
        (passed, self.queries.len() - passed)
    }
}

/// Progress notifications.
#[derive(Debug, Clone)]
pub enum BenchEvent<'a> {
    /// Iteration `iteration` (1-based) of `query` starts.
    Running {
        /// Query number.
        query: u8,
        /// Iteration, from 1.
        iteration: usize,
    },
    /// A query finished all iterations.
    Finished(&'a QueryReport),
}

/// Registers the TPC-H tables in `dir` and works out the scale factor (from `tpch.json` unless given).
pub async fn open_tpch_data(
    session: &mut SluiceSession,
    dir: &Path,
    scale_factor: Option<f64>,
) -> Result<f64> {
    let location = dir.to_string_lossy();
    for source in discover_tables_at(session.context(), &location).await? {
        session.register_table(source).await?;
    }
    let missing: Vec<_> = TPCH_TABLES
        .iter()
        .filter(|t| !session.tables().contains_key(**t))
        .collect();
    if !missing.is_empty() {
        return Err(SluiceError::invalid(format!(
            "{}: missing TPC-H tables {missing:?} (generate them with `sluice tpch gen --out {}`)",
            dir.display(),
            dir.display()
        )));
    }
    let manifest = if is_remote(&location) {
        let url = format!("{}/{MANIFEST}", location.trim_end_matches('/'));
        match read_object_text(session.context(), &url).await? {
            Some(text) => Some(parse_manifest(&text, &url)?),
            None => None,
        }
    } else {
        read_manifest(dir)?
    };
    let scale_factor = match (scale_factor, manifest) {
        (Some(given), _) => given,
        (None, Some(manifest)) => manifest.scale_factor,
        (None, None) => {
            return Err(SluiceError::invalid(format!(
                "{}: cannot tell the scale factor (no tpch.json); pass --scale",
                dir.display()
            )));
        }
    };
    check_scale_factor(scale_factor)?;
    Ok(scale_factor)
}

/// Runs every statement of `query`, returning the result statement's batches.
pub async fn run_tpch_query(
    target: &dyn QueryTarget,
    query: &TpchQuery,
) -> Result<Vec<RecordBatch>> {
    let mut result = Vec::new();
    for (index, sql) in query.statements.iter().enumerate() {
        let batches = target.run_statement(sql).await?;
        if index == query.result_statement {
            result = batches;
        }
    }
    Ok(result)
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

async fn run_one(
    session: &dyn QueryTarget,
    reference: Option<&SluiceSession>,
    number: u8,
    options: &BenchOptions,
    progress: &mut dyn FnMut(BenchEvent<'_>),
) -> QueryReport {
    let mut report = QueryReport {
        query: number,
        rows: 0,
        seconds: Vec::new(),
        min: 0.0,
        median: 0.0,
        verified: None,
        matches_local: None,
        error: None,
        workers_lost: 0,
        regions_retried: 0,
        tasks_retried: 0,
        tasks: 0,
        spilled_bytes: 0,
        shuffled_bytes: 0,
        scanned_bytes: 0,
    };
    let query = match tpch_query(number, options.scale_factor) {
        Ok(query) => query,
        Err(error) => {
            report.error = Some(error.to_string());
            return report;
        }
    };
    let before = session.counters().await;
    let outcome = run_iterations(session, &query, number, options, progress, &mut report).await;
    let counters = session.counters().await.since(&before);
    report.workers_lost = counters.workers_lost;
    report.regions_retried = counters.regions_retried;
    report.tasks_retried = counters.tasks_retried;
    report.tasks = counters.tasks_started;
    report.spilled_bytes = counters.spilled_bytes;
    report.shuffled_bytes = counters.shuffled_bytes;
    report.scanned_bytes = counters.scanned_bytes;
    let Some(last) = outcome else {
        return report;
    };
    report.rows = last.iter().map(RecordBatch::num_rows).sum();
    if let Some(dir) = &options.save_answers
        && let Err(error) = save_answer(dir, number, &last)
    {
        report.error = Some(error.to_string());
        return report;
    }
    report.min = report.seconds.iter().copied().fold(f64::INFINITY, f64::min);
    report.median = median(&report.seconds);
    let expected = match (&options.answers, options.verify) {
        (Some(dir), _) => Some(answer_in(dir, number)),
        (None, true) => Some(official_answer(number)),
        (None, false) => None,
    };
    if let Some(expected) = expected {
        let outcome = expected
            .and_then(|answer| Ok((answer, format_rows(&last)?)))
            .map_err(|e| e.to_string())
            .and_then(|(answer, rows)| compare(&answer, &rows));
        report.verified = Some(outcome.is_ok());
        report.error = outcome.err().map(|why| format!("wrong answer: {why}"));
    }
    if let Some(reference) = reference {
        let outcome = compare_with(reference, &query, &last).await;
        report.matches_local = Some(outcome.is_ok());
        if let Err(why) = outcome {
            report
                .error
                .get_or_insert(format!("differs from local mode: {why}"));
        }
    }
    report
}

/// The answer of query `number` in `dir` (`qNN.tbl`).
fn answer_in(dir: &std::path::Path, number: u8) -> Result<crate::answers::Answer> {
    let path = dir.join(format!("q{number:02}.tbl"));
    let text = std::fs::read_to_string(&path).map_err(|e| {
        SluiceError::invalid(format!("--answers: cannot read {}: {e}", path.display()))
    })?;
    let mut answer = crate::answers::parse_answer(&text);
    answer.order_keys = Some(crate::answers::order_keys(number));
    Ok(answer)
}

/// Writes the result of query `number` to `dir/qNN.tbl`: a `|`-separated header line, then one
/// line per row, as [`answer_in`] reads it. A cell holding `|` or a line break could not be read
/// back as written, so it is refused.
fn save_answer(dir: &std::path::Path, number: u8, batches: &[RecordBatch]) -> Result<()> {
    let path = dir.join(format!("q{number:02}.tbl"));
    let mut text = String::new();
    if let Some(batch) = batches.first() {
        let names: Vec<&str> = batch
            .schema_ref()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        text.push_str(&names.join("|"));
        text.push('\n');
    }
    for row in format_rows(batches)? {
        if let Some(cell) = row.iter().find(|c| c.contains(['|', '\n', '\r'])) {
            return Err(SluiceError::invalid(format!(
                "--save-answers: q{number} has a cell that cannot be written as `|`-separated text: {cell:?}"
            )));
        }
        text.push_str(&row.join("|"));
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(|e| {
        SluiceError::invalid(format!(
            "--save-answers: cannot write {}: {e}",
            path.display()
        ))
    })
}

/// Runs every iteration of `query`, recording their times; `None` (with the error recorded) when
/// one fails, else the last iteration's batches.
async fn run_iterations(
    session: &dyn QueryTarget,
    query: &TpchQuery,
    number: u8,
    options: &BenchOptions,
    progress: &mut dyn FnMut(BenchEvent<'_>),
    report: &mut QueryReport,
) -> Option<Vec<RecordBatch>> {
    let mut last = Vec::new();
    for iteration in 1..=options.iterations.max(1) {
        progress(BenchEvent::Running {
            query: number,
            iteration,
        });
        let start = Instant::now();
        match run_tpch_query(session, query).await {
            Ok(batches) => {
                report.seconds.push(start.elapsed().as_secs_f64());
                last = batches;
            }
            Err(error) => {
                report.error = Some(error.to_string());
                return None;
            }
        }
    }
    Some(last)
}

/// Runs `query` in `reference` (local mode) and compares its rows, in order, with `actual`.
async fn compare_with(
    reference: &SluiceSession,
    query: &TpchQuery,
    actual: &[RecordBatch],
) -> std::result::Result<(), String> {
    let expected = run_tpch_query(reference, query)
        .await
        .map_err(|e| format!("local mode failed: {e}"))?;
    let expected = format_rows(&expected).map_err(|e| e.to_string())?;
    let actual = format_rows(actual).map_err(|e| e.to_string())?;
    if expected.len() != actual.len() {
        return Err(format!(
            "{} rows, local mode {}",
            actual.len(),
            expected.len()
        ));
    }
    match expected.iter().zip(&actual).position(|(e, a)| e != a) {
        Some(row) => Err(format!(
            "row {row}: {:?}, local mode {:?}",
            actual[row], expected[row]
        )),
        None => Ok(()),
    }
}

/// Runs the queries and returns the report; `progress` sees each iteration start and each query end.
/// With `reference`, every result is also compared with that (local-mode) session's.
pub async fn run_benchmark(
    session: &dyn QueryTarget,
    reference: Option<&SluiceSession>,
    options: &BenchOptions,
    progress: &mut dyn FnMut(BenchEvent<'_>),
) -> Result<BenchReport> {
    if options.verify && options.scale_factor != ANSWER_SCALE_FACTOR {
        return Err(SluiceError::invalid(format!(
            "--verify: the official TPC-H answers exist only for scale factor 1, and this data is scale {}",
            options.scale_factor
        )));
    }
    if let Some(dir) = &options.save_answers {
        std::fs::create_dir_all(dir).map_err(|e| {
            SluiceError::invalid(format!(
                "--save-answers: cannot create {}: {e}",
                dir.display()
            ))
        })?;
    }
    let mut queries = Vec::new();
    for &number in &options.queries {
        let report = run_one(session, reference, number, options, progress).await;
        progress(BenchEvent::Finished(&report));
        queries.push(report);
    }
    Ok(BenchReport {
        mode: session.mode_name(),
        scale_factor: options.scale_factor,
        target_partitions: session.target_partitions(),
        iterations: options.iterations.max(1),
        total_min: queries.iter().map(|q| q.min).sum(),
        total_median: queries.iter().map(|q| q.median).sum(),
        queries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    fn batch(names: &[&str]) -> RecordBatch {
        use arrow::array::{ArrayRef, Decimal128Array, StringArray};
        let prices = Decimal128Array::from(vec![Some(123_456), None])
            .with_precision_and_scale(15, 2)
            .unwrap();
        RecordBatch::try_from_iter([
            (
                "l_returnflag",
                std::sync::Arc::new(StringArray::from(names.to_vec())) as ArrayRef,
            ),
            ("sum_price", std::sync::Arc::new(prices) as ArrayRef),
        ])
        .unwrap()
    }

    #[test]
    fn a_saved_answer_reads_back_cell_for_cell_and_a_cell_with_a_bar_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        save_answer(dir.path(), 3, &[batch(&["A", "N"])]).unwrap();
        let text = std::fs::read_to_string(dir.path().join("q03.tbl")).unwrap();
        assert_eq!(text, "l_returnflag|sum_price\nA|1234.56\nN|NULL\n");
        let answer = answer_in(dir.path(), 3).unwrap();
        assert_eq!(answer.columns, ["l_returnflag", "sum_price"]);
        let rows = format_rows(&[batch(&["A", "N"])]).unwrap();
        assert_eq!(compare(&answer, &rows), Ok(()));
        let error = save_answer(dir.path(), 4, &[batch(&["A|B", "N"])])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("q4 has a cell that cannot be written as `|`-separated text: \"A|B\""),
            "{error}"
        );
        assert!(!dir.path().join("q04.tbl").exists());
    }
}
