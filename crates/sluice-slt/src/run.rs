//! Running `.slt` files record by record and counting the outcome.
//!
//! Every `statement` and `query` record counts once: passed, failed, or skipped (EXPLAIN records, whose
//! plans differ by design between modes, and records whose `skipif`/`onlyif` conditions exclude the
//! `Datafusion` label). A file whose DataFusion test context registers extra tables or functions that
//! Sluice does not provide fails as a whole with a message saying so, instead of failing record by
//! record with confusing errors.

use std::path::{Path, PathBuf};
use std::time::Instant;

use std::sync::Arc;

use sluice_engine::SluiceConfig;
use sluice_runtime::JobRunner;
use sqllogictest::{Record, RecordOutput, Runner, strict_column_validator};

use crate::db::SltDb;
use crate::format::{SltColumnType, rows_match};

/// The label DataFusion's files use in `skipif` / `onlyif`.
pub const LABEL: &str = "Datafusion";

/// Files whose DataFusion runner registers test-only tables, functions or planners first.
const NEEDS_TEST_CONTEXT: &[(&str, &str)] = &[
    ("cte.slt", "a strict schema provider"),
    ("information_schema_table_types.slt", "a temporary table"),
    ("information_schema_columns.slt", "a table with many types"),
    ("map.slt", "a table with a map column"),
    ("avro.slt", "Avro tables"),
    ("dynamic_file.slt", "URL tables"),
    ("joins.slt", "partitioned tables and an example UDF"),
    ("range_partitioning.slt", "a range-partitioned table"),
    ("metadata.slt", "tables with field metadata"),
    ("arrow_field.slt", "tables with field metadata"),
    ("union_function.slt", "a table with a union column"),
    ("aggregate.slt", "a table with a union column"),
    (
        "dictionary_struct.slt",
        "a table with a dictionary-encoded struct column",
    ),
    ("async_udf.slt", "an async UDF"),
    ("cast_extension_type_metadata.slt", "a custom type planner"),
];

/// Files that exercise a DataFusion cargo feature Sluice is built without.
const NEEDS_FEATURE: &[(&str, &str)] = &[("encrypted_parquet.slt", "parquet_encryption")];

/// Options of a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct SltOptions {
    /// Stop at the first failed record.
    pub fail_fast: bool,
}

/// One failed record.
#[derive(Debug, Clone)]
pub struct SltFailure {
    /// `file:line`, the SQL, expected and actual output, as sqllogictest words it.
    pub message: String,
}

/// The outcome of one file.
#[derive(Debug, Clone, Default)]
pub struct FileReport {
    /// The file.
    pub path: PathBuf,
    /// Records that passed.
    pub passed: usize,
    /// Records that failed (a file that cannot run at all counts one).
    pub failed: usize,
    /// Records skipped.
    pub skipped: usize,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// What failed.
    pub failures: Vec<SltFailure>,
}

/// Progress while a file runs.
#[derive(Debug, Clone, Copy)]
pub enum SltEvent {
    /// The file has this many records to count.
    Started {
        /// Statement and query records.
        records: usize,
    },
    /// One record finished.
    Record,
}

/// Why a file cannot run here, if it is one that needs DataFusion's test context.
pub fn missing_setup(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    if path.components().any(|c| c.as_os_str() == "spark") {
        return Some(format!(
            "{} is a Spark-dialect test; it needs DataFusion's Spark test context, which Sluice does not provide",
            path.display()
        ));
    }
    if let Some((_, feature)) = NEEDS_FEATURE.iter().find(|(file, _)| *file == name) {
        return Some(format!(
            "{} needs DataFusion's `{feature}` feature, which Sluice is built without",
            path.display()
        ));
    }
    NEEDS_TEST_CONTEXT
        .iter()
        .find(|(file, _)| *file == name)
        .map(|(_, what)| {
            format!(
                "{} needs DataFusion's sqllogictest context to register {what}, which Sluice does not provide",
                path.display()
            )
        })
}

// The signature is sqllogictest's `Normalizer` type.
#[allow(clippy::ptr_arg)]
fn trim_end(text: &String) -> String {
    text.trim_end().to_string()
}

fn validate(_: sqllogictest::Normalizer, actual: &[Vec<String>], expected: &[String]) -> bool {
    rows_match(actual, expected)
}

fn is_explain(sql: &str) -> bool {
    sql.trim_start()
        .get(..7)
        .is_some_and(|word| word.eq_ignore_ascii_case("explain"))
}

fn failed_file(path: &Path, message: String, start: Instant) -> FileReport {
    FileReport {
        path: path.to_path_buf(),
        failed: 1,
        seconds: start.elapsed().as_secs_f64(),
        failures: vec![SltFailure { message }],
        ..Default::default()
    }
}

/// Builds the job runner of each fresh session (the front end's choice of mode).
pub type RunnerFactory = dyn Fn(&SluiceConfig) -> Arc<dyn JobRunner> + Send + Sync;

/// Where each file's fresh session lives.
#[derive(Clone)]
pub enum SltTarget {
    /// In this process, with the runner the factory builds (the front end's mode).
    Local(Arc<RunnerFactory>),
    /// On the `sluice server` at this `grpc://` address.
    Remote(String),
}

/// Runs one file with a fresh session of `config` at `target`.
pub async fn run_file(
    path: &Path,
    config: &SluiceConfig,
    target: &SltTarget,
    options: SltOptions,
    progress: &mut (dyn FnMut(SltEvent) + Send),
) -> FileReport {
    let start = Instant::now();
    if let Some(message) = missing_setup(path) {
        return failed_file(path, message, start);
    }
    let records = match sqllogictest::parse_file::<SltColumnType>(path) {
        Ok(records) => records,
        Err(error) => {
            return failed_file(
                path,
                format!("{}: cannot parse: {error}", path.display()),
                start,
            );
        }
    };
    let countable = records
        .iter()
        .filter(|r| matches!(r, Record::Statement { .. } | Record::Query { .. }))
        .count();
    progress(SltEvent::Started { records: countable });

    let connection_config = config.clone();
    let target = target.clone();
    let mut runner = Runner::new(move || {
        let config = connection_config.clone();
        let target = target.clone();
        async move {
            match target {
                SltTarget::Local(runners) => SltDb::new(&config, runners(&config)),
                SltTarget::Remote(url) => SltDb::connect(&url, &config).await,
            }
        }
    });
    runner.add_label(LABEL);
    runner.with_column_validator(strict_column_validator);
    runner.with_normalizer(trim_end);
    runner.with_validator(validate);

    let mut report = FileReport {
        path: path.to_path_buf(),
        ..Default::default()
    };
    for record in records {
        let counted = match &record {
            Record::Halt { .. } => break,
            Record::Statement { sql, .. } | Record::Query { sql, .. } => {
                if is_explain(sql) {
                    report.skipped += 1;
                    progress(SltEvent::Record);
                    continue;
                }
                true
            }
            _ => false,
        };
        let outcome = runner.run_async(record).await;
        if counted {
            progress(SltEvent::Record);
        }
        match outcome {
            Ok(RecordOutput::Nothing) if counted => report.skipped += 1,
            Ok(_) if counted => report.passed += 1,
            Ok(_) => {}
            Err(error) => {
                report.failed += 1;
                report.failures.push(SltFailure {
                    message: error.display(false).to_string(),
                });
                if options.fail_fast {
                    break;
                }
            }
        }
    }
    runner.shutdown_async().await;
    report.seconds = start.elapsed().as_secs_f64();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explain_detection() {
        assert!(is_explain("  EXPLAIN select 1"));
        assert!(is_explain("explain analyze select 1"));
        assert!(!is_explain("select 'explain'"));
        assert!(!is_explain("ex"));
    }

    #[test]
    fn files_needing_datafusion_test_setup_are_named() {
        let message = missing_setup(Path::new("x/joins.slt")).unwrap();
        assert!(message.contains("joins.slt") && message.contains("does not provide"));
        assert!(missing_setup(Path::new("x/misc.slt")).is_none());
        assert!(missing_setup(Path::new("spark/math/abs.slt")).is_some());
        let feature = missing_setup(Path::new("x/encrypted_parquet.slt")).unwrap();
        assert!(feature.contains("parquet_encryption"), "{feature}");
    }

    fn write_slt(text: &str) -> tempfile::NamedTempFile {
        use std::io::Write;
        let mut file = tempfile::Builder::new().suffix(".slt").tempfile().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    fn config() -> SluiceConfig {
        crate::slt_config(&SluiceConfig::default()).unwrap()
    }

    fn local() -> SltTarget {
        SltTarget::Local(Arc::new(|_: &SluiceConfig| {
            Arc::new(sluice_runtime::LocalRunner) as Arc<dyn JobRunner>
        }))
    }

    #[tokio::test]
    async fn counts_passes_failures_and_skips() {
        let file = write_slt(
            "statement ok\ncreate table t as values (1, 'a'), (2, '')\n\n\
             query IT rowsort\nselect * from t\n----\n1 a\n2 (empty)\n\n\
             query I\nselect 1 + 1\n----\n3\n\n\
             query TT\nexplain select 1\n----\nx y\n\n\
             skipif Datafusion\nquery I\nselect 1\n----\n1\n\n\
             statement error DataFusion error: Error during planning: .*nope.*\nselect * from nope\n",
        );
        let report = run_file(
            file.path(),
            &config(),
            &local(),
            SltOptions::default(),
            &mut |_| {},
        )
        .await;
        assert_eq!(
            (report.passed, report.failed, report.skipped),
            (3, 1, 2),
            "{:?}",
            report.failures
        );
        assert!(report.failures[0].message.contains("select 1 + 1"));
    }

    #[tokio::test]
    async fn fail_fast_stops_at_the_first_failure() {
        let file = write_slt("query I\nselect 1\n----\n2\n\nquery I\nselect 2\n----\n3\n");
        let options = SltOptions { fail_fast: true };
        let report = run_file(file.path(), &config(), &local(), options, &mut |_| {}).await;
        assert_eq!(report.failed, 1);
    }
}
