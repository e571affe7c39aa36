//! The `sluice` schema: the driver's jobs, stages, task attempts and workers as tables, queryable by
//! SQL from every front end (`select * from sluice.tasks where job_id = 7`).
//!
//! ```text
//!  sluice.jobs     one row per job (running ones and the driver's last ended ones)
//!  sluice.stages   one row per stage of those jobs: tasks, attempts, its succeeded tasks' metrics
//!                  summed (peak memory: the largest task's), task time and rows (median and max:
//!                  the skew)
//!  sluice.tasks    one row per task attempt: where it ran, when, how it ended, what it did (every
//!                  counter of `TASK_METRICS`: rows, batches and bytes written and read, local and
//!                  remote; rows scanned; wall and compute time; spills; peak memory)
//!  sluice.workers  one row per registered worker and one for the driver's own executor (address
//!                  `driver`, no id): id, state (busy, holding a live job's output, idle,
//!                  draining), when it registered, running tasks, live attempts, stream outputs,
//!                  memory in use and its limit (NULL: unlimited)
//! ```
//!
//! A session whose user is not an admin ([`crate::access`]) sees only the jobs (and their stages
//! and tasks) submitted under its user's name.
//!
//! Each scan reads the session's runner at planning time (one snapshot per scan) and plans a memory
//! scan of it. Modes without a driver (`local`), and a cluster before its first query, have empty
//! tables. Numbers are `BIGINT`, times milliseconds since the Unix epoch, as the REST API shows them.
//!
//! Invariant: every table's schema is the schema of the batch its rows are built into (both come
//! from one function), so a scan never disagrees with the table it scans.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{SchemaProvider, Session, TableProvider};
use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::TableType;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use sluice_runtime::analyze::{TASK_METRICS, TaskMetrics};
use sluice_runtime::{JobRecord, JobRunner, stage_summaries};

use crate::access::{AccessSlot, Role};

/// The schema's name.
pub const SYSTEM_SCHEMA: &str = "sluice";

/// The tables of the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SystemTable {
    Jobs,
    Stages,
    Tasks,
    Workers,
}

impl SystemTable {
    const ALL: [SystemTable; 4] = [Self::Jobs, Self::Stages, Self::Tasks, Self::Workers];

    fn name(self) -> &'static str {
        match self {
            Self::Jobs => "jobs",
            Self::Stages => "stages",
            Self::Tasks => "tasks",
            Self::Workers => "workers",
        }
    }
}

/// Registers (or replaces) the `sluice` schema of `ctx`'s default catalog over `runner`.
pub fn register_system_tables(
    ctx: &SessionContext,
    runner: Arc<dyn JobRunner>,
    access: AccessSlot,
) -> Result<()> {
    let catalog_name = ctx.state().config_options().catalog.default_catalog.clone();
    let catalog = ctx.catalog(&catalog_name).ok_or_else(|| {
        DataFusionError::Plan(format!("the default catalog {catalog_name} does not exist"))
    })?;
    catalog.register_schema(SYSTEM_SCHEMA, Arc::new(SystemSchema { runner, access }))?;
    Ok(())
}

#[derive(Debug)]
struct SystemSchema {
    runner: Arc<dyn JobRunner>,
    /// The session's access: a user who is not an admin sees only their own jobs.
    access: AccessSlot,
}

#[async_trait]
impl SchemaProvider for SystemSchema {
    fn table_names(&self) -> Vec<String> {
        SystemTable::ALL
            .iter()
            .map(|t| t.name().to_string())
            .collect()
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        Ok(SystemTable::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .map(|table| {
                Arc::new(SystemTableProvider {
                    table,
                    runner: Arc::clone(&self.runner),
                    access: self.access.clone(),
                }) as Arc<dyn TableProvider>
            }))
    }

    fn table_exist(&self, name: &str) -> bool {
        SystemTable::ALL.iter().any(|t| t.name() == name)
    }
}

#[derive(Debug)]
struct SystemTableProvider {
    table: SystemTable,
    runner: Arc<dyn JobRunner>,
    access: AccessSlot,
}

impl SystemTableProvider {
    async fn rows(&self) -> Result<RecordBatch> {
        let mut jobs = match self.runner.driver() {
            Some(driver) if self.table != SystemTable::Workers => driver.jobs().await?,
            _ => Vec::new(),
        };
        if let Some(access) = self.access.get()
            && access.role() != Role::Admin
        {
            jobs.retain(|job| {
                job.label
                    .as_deref()
                    .is_some_and(|label| label.user == access.user())
            });
        }
        match self.table {
            SystemTable::Jobs => jobs_batch(&jobs),
            SystemTable::Stages => stages_batch(&jobs),
            SystemTable::Tasks => tasks_batch(&jobs),
            SystemTable::Workers => {
                let workers = match self.runner.cluster_state().await? {
                    Some(state) => state.workers,
                    None => Vec::new(),
                };
                workers_batch(&workers)
            }
        }
    }
}

#[async_trait]
impl TableProvider for SystemTableProvider {
    fn schema(&self) -> SchemaRef {
        let empty = match self.table {
            SystemTable::Jobs => jobs_batch(&[]),
            SystemTable::Stages => stages_batch(&[]),
            SystemTable::Tasks => tasks_batch(&[]),
            SystemTable::Workers => workers_batch(&[]),
        };
        match empty {
            Ok(batch) => batch.schema(),
            // Built from empty columns of fixed types: it cannot fail, and an empty schema would
            // only make every column unknown.
            Err(_) => Arc::new(datafusion::arrow::datatypes::Schema::empty()),
        }
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let batch = self.rows().await?;
        let schema = batch.schema();
        Ok(MemorySourceConfig::try_new_exec(
            &[vec![batch]],
            schema,
            projection.cloned(),
        )?)
    }
}

/// A `BIGINT` from a count or a byte total (saturating: no count reaches it).
fn big(value: impl TryInto<i64>) -> Option<i64> {
    Some(value.try_into().unwrap_or(i64::MAX))
}

/// Columns in order: name, values, nullable.
type Columns = Vec<(&'static str, ArrayRef, bool)>;

fn ints(values: impl IntoIterator<Item = Option<i64>>) -> ArrayRef {
    Arc::new(values.into_iter().collect::<Int64Array>())
}

fn texts<S: AsRef<str>>(values: impl IntoIterator<Item = Option<S>>) -> ArrayRef {
    Arc::new(values.into_iter().collect::<StringArray>())
}

fn batch(columns: Columns) -> Result<RecordBatch> {
    Ok(RecordBatch::try_from_iter_with_nullable(columns)?)
}

fn jobs_batch(jobs: &[JobRecord]) -> Result<RecordBatch> {
    let label = |f: fn(&sluice_runtime::JobLabel) -> &str| -> ArrayRef {
        texts(jobs.iter().map(|j| j.label.as_deref().map(f)))
    };
    batch(vec![
        ("job_id", ints(jobs.iter().map(|j| big(j.job))), false),
        (
            "state",
            texts(jobs.iter().map(|j| Some(j.state.name()))),
            false,
        ),
        ("sql", label(|l| l.sql.as_str()), true),
        ("user", label(|l| l.user.as_str()), true),
        ("tag", label(|l| l.tag.as_str()), true),
        (
            "submitted_ms",
            ints(jobs.iter().map(|j| big(j.submitted_ms))),
            false,
        ),
        (
            "ended_ms",
            ints(jobs.iter().map(|j| j.ended_ms.and_then(big))),
            true,
        ),
        (
            "elapsed_ms",
            ints(jobs.iter().map(|j| big(j.elapsed_ms()))),
            false,
        ),
        ("stages", ints(jobs.iter().map(|j| big(j.stages()))), false),
        ("tasks", ints(jobs.iter().map(|j| big(j.tasks()))), false),
        ("rows", ints(jobs.iter().map(|j| big(j.rows))), false),
        ("retries", ints(jobs.iter().map(|j| big(j.retries))), false),
        (
            "error",
            texts(jobs.iter().map(|j| j.error.as_deref())),
            true,
        ),
    ])
}

fn stages_batch(jobs: &[JobRecord]) -> Result<RecordBatch> {
    let rows: Vec<(u64, usize, sluice_runtime::StageSummary)> = jobs
        .iter()
        .flat_map(|job| {
            stage_summaries(&job.stage_tasks, &job.attempts)
                .into_iter()
                .enumerate()
                .map(move |(stage, summary)| (job.job, stage, summary))
        })
        .collect();
    let col =
        |f: fn(&sluice_runtime::StageSummary) -> Option<i64>| ints(rows.iter().map(|r| f(&r.2)));
    let mut columns: Columns = vec![
        ("job_id", ints(rows.iter().map(|r| big(r.0))), false),
        ("stage", ints(rows.iter().map(|r| big(r.1))), false),
        ("tasks", col(|s| big(s.tasks)), false),
        ("attempts", col(|s| big(s.attempts)), false),
        ("succeeded", col(|s| big(s.succeeded)), false),
        ("running", col(|s| big(s.running)), false),
    ];
    columns.extend(metric_columns(rows.iter().map(|r| &r.2.totals)));
    columns.extend([
        (
            "task_ms_median",
            col(|s| s.task_ms.and_then(|t| big(t.0))),
            true,
        ),
        (
            "task_ms_max",
            col(|s| s.task_ms.and_then(|t| big(t.1))),
            true,
        ),
        (
            "task_rows_median",
            col(|s| s.task_rows.and_then(|t| big(t.0))),
            true,
        ),
        (
            "task_rows_max",
            col(|s| s.task_rows.and_then(|t| big(t.1))),
            true,
        ),
    ]);
    batch(columns)
}

/// A column per [`TASK_METRICS`] counter of `metrics` (one per row).
fn metric_columns<'a>(metrics: impl Iterator<Item = &'a TaskMetrics> + Clone) -> Columns {
    TASK_METRICS
        .iter()
        .map(|(name, value)| {
            let values = ints(metrics.clone().map(|m| big(value(m))));
            (*name, values, false)
        })
        .collect()
}

fn tasks_batch(jobs: &[JobRecord]) -> Result<RecordBatch> {
    let rows: Vec<(u64, &sluice_runtime::TaskRecord)> = jobs
        .iter()
        .flat_map(|job| job.attempts.iter().map(move |a| (job.job, a)))
        .collect();
    let col = |f: fn(&sluice_runtime::TaskRecord) -> Option<i64>| ints(rows.iter().map(|r| f(r.1)));
    let mut columns: Columns = vec![
        ("job_id", ints(rows.iter().map(|r| big(r.0))), false),
        ("stage", col(|a| big(a.attempt.task.stage.0)), false),
        ("partition", col(|a| big(a.attempt.task.partition)), false),
        ("attempt", col(|a| big(a.attempt.attempt)), false),
        ("worker_id", col(|a| a.worker.and_then(|w| big(w.0))), true),
        (
            "address",
            texts(rows.iter().map(|r| Some(r.1.address.as_str()))),
            false,
        ),
        (
            "state",
            texts(rows.iter().map(|r| Some(r.1.state.name()))),
            false,
        ),
        ("started_ms", col(|a| big(a.started_ms)), false),
        ("ended_ms", col(|a| a.ended_ms.and_then(big)), true),
        ("elapsed_ms", col(|a| big(a.elapsed_ms())), false),
    ];
    columns.extend(metric_columns(rows.iter().map(|r| &r.1.metrics)));
    columns.push((
        "error",
        texts(rows.iter().map(|r| r.1.error.as_deref())),
        true,
    ));
    batch(columns)
}

fn workers_batch(workers: &[sluice_runtime::runner::WorkerState]) -> Result<RecordBatch> {
    let col =
        |f: fn(&sluice_runtime::runner::WorkerState) -> Option<i64>| ints(workers.iter().map(f));
    batch(vec![
        (
            "worker_id",
            col(|w| w.id.and_then(|id| i64::try_from(id.0).ok())),
            true,
        ),
        (
            "address",
            texts(workers.iter().map(|w| Some(w.address.as_str()))),
            false,
        ),
        (
            "state",
            texts(workers.iter().map(|w| Some(w.state.as_str()))),
            false,
        ),
        ("started_ms", col(|w| w.started_ms.and_then(big)), true),
        ("running_tasks", col(|w| big(w.running_tasks)), false),
        ("live_attempts", col(|w| big(w.live_attempts)), false),
        ("stream_outputs", col(|w| big(w.stream_outputs)), false),
        ("memory_used_bytes", col(|w| big(w.memory_used)), false),
        (
            "memory_limit_bytes",
            col(|w| w.memory_limit.and_then(big)),
            true,
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_table_has_its_columns_even_when_empty() {
        let names = |batch: Result<RecordBatch>| -> Vec<String> {
            batch
                .unwrap()
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect()
        };
        assert_eq!(
            names(jobs_batch(&[])),
            [
                "job_id",
                "state",
                "sql",
                "user",
                "tag",
                "submitted_ms",
                "ended_ms",
                "elapsed_ms",
                "stages",
                "tasks",
                "rows",
                "retries",
                "error"
            ]
        );
        // Ten about the attempt, every task metric, its error.
        assert_eq!(names(tasks_batch(&[])).len(), 10 + TASK_METRICS.len() + 1);
        // Six about the stage, every task metric summed, median and max task time and rows.
        assert_eq!(names(stages_batch(&[])).len(), 6 + TASK_METRICS.len() + 4);
        assert_eq!(
            names(workers_batch(&[])),
            [
                "worker_id",
                "address",
                "state",
                "started_ms",
                "running_tasks",
                "live_attempts",
                "stream_outputs",
                "memory_used_bytes",
                "memory_limit_bytes"
            ]
        );
    }
}
