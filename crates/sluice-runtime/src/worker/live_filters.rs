//! Runtime filters a worker's tasks get while they run (`FilterDelivery::WhileRunning`, pipelined
//! exchanges): the target stage's tasks start before the filter's source finished, so each one
//! puts a filter that keeps every row (DataFusion's `DynamicFilterPhysicalExpr`) where the filter
//! goes, and the driver's [`RuntimeFilterUpdate`] later turns it into the predicate of the
//! source's keys.
//!
//! ```text
//!   attempt starts ─► install: FilterExec(DynamicFilter = true) on top of the node at the path,
//!                     pushed down into its scan ─► the board lists it under (job, stage, filter)
//!   driver ─► RuntimeFilterUpdate(job, stage, filter, key summary) ─► publish:
//!             the board keeps the summary; every listed filter becomes its predicate
//!             ─► the FilterExec drops rows from its next batch on, the scan prunes the files
//!                and row groups it has not opened yet
//!   attempt ends ─► its filters leave the board;  clean_up_job ─► the job's summaries too (and
//!                   its updates still on their way are dropped)
//! ```
//!
//! Invariants: a filter only ever drops probe rows whose key the whole build side lacks (the
//! summary covers every row of the source), so whether and when it arrives changes the work, never
//! the answer (a task may wait for its filters before it reads, `plan::await_filters`: the
//! filters it waits for are the ones put in place empty, which a publish completes, with the
//! predicate or, if that cannot be made or decoded, keeping every row; one never published costs
//! the wait); a summary known before the task starts (with its definition, or published to this
//! worker already) goes in as a fixed predicate; install and publish take the board's one lock, so
//! a summary arriving while a task installs its filter reaches it either way; a filter that cannot
//! be put in place or take its predicate keeps every row (a warning says so), never fails the task.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::config::ConfigOptions;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::job_graph::runtime_filters::node_at;
use sluice_planner::{AttemptKey, JobId, StageId};

use crate::definition::{LiveRuntimeFilter, RuntimeFilterUpdate};
use crate::runtime_filter::{KeySummary, filter_at, key_column};

/// How many cleaned-up jobs a worker remembers, to drop their late updates.
const FORGOTTEN_JOBS: usize = 1024;

/// The live runtime filters of one worker; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct LiveFilters {
    board: Mutex<Board>,
}

/// What the lock guards.
#[derive(Debug, Default)]
struct Board {
    stages: HashMap<(JobId, StageId), StageFilters>,
    /// The jobs cleaned up last (at most [`FORGOTTEN_JOBS`]): an update that arrives after its
    /// job's cleanup (another RPC, unordered with it) is dropped, not kept for ever.
    forgotten: VecDeque<JobId>,
}

/// What a worker knows of the live filters of one stage of one job.
#[derive(Debug, Default)]
struct StageFilters {
    /// Per filter, the source's key summary once it arrived.
    summaries: HashMap<usize, bytes::Bytes>,
    /// The filters running attempts installed before their summary was known.
    installed: Vec<Installed>,
}

/// One attempt's filter waiting for its summary.
#[derive(Debug)]
struct Installed {
    attempt: AttemptKey,
    filter: usize,
    /// The probe keys, as columns of `schema`.
    columns: Vec<usize>,
    /// The output schema of the node the filter is on top of: the predicate's columns refer to it.
    schema: SchemaRef,
    /// The filter as made (not a copy pushed down and remapped): its predicate is in terms of
    /// `schema`, and the copies share it.
    expr: Arc<DynamicFilterPhysicalExpr>,
}

/// A plan with one filter put in place, and that filter if it was put in place empty and is
/// waited for.
type Placed = (
    Arc<dyn ExecutionPlan>,
    Option<Arc<DynamicFilterPhysicalExpr>>,
);

/// Takes an attempt's filters off the board when the attempt ends.
pub(crate) struct InstalledFilters<'a> {
    filters: &'a LiveFilters,
    attempt: AttemptKey,
    /// The filters put in place empty, complete once their summary arrived.
    pending: Vec<Arc<DynamicFilterPhysicalExpr>>,
}

impl InstalledFilters<'_> {
    /// The filters put in place before their summary was known (`plan::await_filters` waits for
    /// them).
    pub(crate) fn pending(&self) -> &[Arc<DynamicFilterPhysicalExpr>] {
        &self.pending
    }
}

impl Drop for InstalledFilters<'_> {
    fn drop(&mut self) {
        let Ok(mut board) = self.filters.lock() else {
            return;
        };
        let key = (self.attempt.job, self.attempt.stage);
        if let Some(stage) = board.stages.get_mut(&key) {
            stage.installed.retain(|i| i.attempt != self.attempt);
        }
    }
}

impl LiveFilters {
    fn lock(&self) -> Result<MutexGuard<'_, Board>> {
        self.board
            .lock()
            .map_err(|_| DataFusionError::Internal("the live runtime filters are poisoned".into()))
    }

    /// `plan` (attempt `attempt`'s stage plan) with every filter of `filters` in place: a fixed
    /// predicate where its summary is known, else an empty filter the board lists until the
    /// returned guard is dropped (when the attempt ends). A filter that cannot be put in place is
    /// left out, with a warning: the task then reads those rows, a correct answer.
    pub(crate) fn install(
        &self,
        attempt: AttemptKey,
        mut plan: Arc<dyn ExecutionPlan>,
        filters: &[LiveRuntimeFilter],
        options: &ConfigOptions,
    ) -> (Arc<dyn ExecutionPlan>, InstalledFilters<'_>) {
        let mut guard = InstalledFilters {
            filters: self,
            attempt,
            pending: Vec::new(),
        };
        // Deepest first: a filter put on top of a node does not move the nodes above it.
        let mut filters: Vec<&LiveRuntimeFilter> = filters.iter().collect();
        filters.sort_by_key(|f| std::cmp::Reverse(f.path.len()));
        for filter in filters {
            match self.install_one(attempt, Arc::clone(&plan), filter, options) {
                Ok((filtered, pending)) => {
                    plan = filtered;
                    guard.pending.extend(pending);
                }
                Err(e) => tracing::warn!(
                    target: "sluice::runtime_filter",
                    "{attempt} runs without runtime filter {}: {e}",
                    filter.filter
                ),
            }
        }
        (plan, guard)
    }

    fn install_one(
        &self,
        attempt: AttemptKey,
        plan: Arc<dyn ExecutionPlan>,
        filter: &LiveRuntimeFilter,
        options: &ConfigOptions,
    ) -> Result<Placed> {
        let schema = node_at(&plan, &filter.path)?.schema();
        let mut pending = None;
        let predicate = {
            let mut board = self.lock()?;
            let stage = board
                .stages
                .entry((attempt.job, attempt.stage))
                .or_default();
            let known = filter
                .summary
                .as_ref()
                .or_else(|| stage.summaries.get(&filter.filter));
            match known {
                // Released: no filter could be built; nothing to put in or wait for.
                Some(bytes) if bytes.is_empty() => return Ok((plan, None)),
                Some(bytes) => KeySummary::decode(bytes)?.predicate(&schema, &filter.columns)?,
                None => {
                    let expr = Arc::new(empty_filter(&schema, &filter.columns)?);
                    stage.installed.push(Installed {
                        attempt,
                        filter: filter.filter,
                        columns: filter.columns.clone(),
                        schema,
                        expr: Arc::clone(&expr),
                    });
                    if filter.wait {
                        pending = Some(Arc::clone(&expr));
                    }
                    expr as Arc<dyn PhysicalExpr>
                }
            }
        };
        // Should this fail, the empty filter listed above stays on the board, unused, until the
        // attempt ends.
        Ok((filter_at(plan, &filter.path, &predicate, options)?, pending))
    }

    /// Keeps `update`'s summary for the stage's later attempts on this worker and makes it the
    /// predicate of every filter its running attempts wait with; answers how many.
    pub(crate) fn publish(&self, update: &RuntimeFilterUpdate) -> Result<usize> {
        if update.summary.is_empty() {
            // No filter could be built: the tasks waiting for it go on, keeping every row, and
            // one of the stage's attempts installed after this (its `RunTask` overtaken by the
            // update) runs without it.
            let mut board = self.lock()?;
            if board.forgotten.contains(&update.job) {
                return Ok(0);
            }
            let stage = board.stages.entry((update.job, update.stage)).or_default();
            stage.summaries.insert(update.filter, bytes::Bytes::new());
            let mut released = 0;
            for installed in stage.installed.iter().filter(|i| i.filter == update.filter) {
                installed.expr.mark_complete();
                released += 1;
            }
            return Ok(released);
        }
        let summary = match KeySummary::decode(&update.summary) {
            Ok(summary) => summary,
            Err(e) => {
                // Its waiting tasks go on, keeping every row.
                if let Ok(board) = self.lock()
                    && let Some(stage) = board.stages.get(&(update.job, update.stage))
                {
                    for installed in stage.installed.iter().filter(|i| i.filter == update.filter) {
                        installed.expr.mark_complete();
                    }
                }
                return Err(e.context(format!(
                    "the key summary of runtime filter {} for job {} stage {}",
                    update.filter, update.job, update.stage
                )));
            }
        };
        let mut board = self.lock()?;
        if board.forgotten.contains(&update.job) {
            return Ok(0);
        }
        let stage = board.stages.entry((update.job, update.stage)).or_default();
        stage
            .summaries
            .insert(update.filter, update.summary.clone());
        let mut updated = 0;
        for installed in stage.installed.iter().filter(|i| i.filter == update.filter) {
            // A filter that cannot take the predicate keeps every row; the others still take it.
            let made = summary
                .predicate(&installed.schema, &installed.columns)
                .and_then(|predicate| installed.expr.update(predicate));
            match made {
                Ok(()) => {
                    installed.expr.mark_complete();
                    updated += 1;
                }
                Err(e) => {
                    // Complete, keeping every row: nothing waits for it any longer.
                    installed.expr.mark_complete();
                    tracing::warn!(
                        target: "sluice::runtime_filter",
                        "{} keeps reading every row past runtime filter {}: {e}",
                        installed.attempt,
                        update.filter
                    )
                }
            }
        }
        Ok(updated)
    }

    /// Forgets everything about `job`, and drops its updates still to come.
    pub(crate) fn forget_job(&self, job: JobId) -> Result<()> {
        let mut board = self.lock()?;
        board.stages.retain(|(j, _), _| *j != job);
        if !board.forgotten.contains(&job) {
            if board.forgotten.len() == FORGOTTEN_JOBS {
                board.forgotten.pop_front();
            }
            board.forgotten.push_back(job);
        }
        Ok(())
    }
}

/// A filter over `columns` of `schema` that keeps every row until it is updated.
fn empty_filter(schema: &SchemaRef, columns: &[usize]) -> Result<DynamicFilterPhysicalExpr> {
    let children = columns
        .iter()
        .map(|&index| key_column(schema, index).map(|(_, column)| column))
        .collect::<Result<Vec<_>>>()?;
    Ok(DynamicFilterPhysicalExpr::new(children, lit(true)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::collections::BTreeMap;
    use std::time::Duration;

    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::ScalarValue;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::execution::TaskContext;
    use datafusion::physical_plan::displayable;
    use futures::StreamExt;

    use super::*;

    /// Rows per batch: a filter hands on a batch this large as soon as it has it.
    const BATCH: usize = 8192;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]))
    }

    /// One partition of `batches` batches whose rows hold the keys 1, 2, 3 in turn.
    fn scan(batches: usize) -> Arc<dyn ExecutionPlan> {
        let keys: Vec<i64> = (0..BATCH as i64).map(|i| i % 3 + 1).collect();
        let batch = RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from(keys))]).unwrap();
        MemorySourceConfig::try_new_exec(&[vec![batch; batches]], schema(), None).unwrap()
    }

    /// How many rows of a batch of `scan` hold `key`.
    fn per_batch(key: i64) -> usize {
        (0..BATCH as i64).filter(|i| i % 3 + 1 == key).count()
    }

    fn attempt(stage: usize, attempt: usize) -> AttemptKey {
        AttemptKey {
            job: JobId(1),
            stage: StageId(stage),
            partition: 0,
            attempt,
        }
    }

    /// Filter 0 on the key column, on top of the plan, waited for; `summary` as the definition
    /// carries it.
    fn on_top(summary: Option<bytes::Bytes>) -> Vec<LiveRuntimeFilter> {
        vec![LiveRuntimeFilter {
            filter: 0,
            path: Vec::new(),
            columns: vec![0],
            summary,
            wait: true,
        }]
    }

    /// The encoded summary of a build side whose only key is `key`.
    fn only_key(key: i64) -> bytes::Bytes {
        let value = ScalarValue::Int64(Some(key));
        let summary = KeySummary {
            bounds: vec![Some((value.clone(), value.clone()))],
            keys: Some(vec![vec![value]]),
            bloom: None,
        };
        bytes::Bytes::from(summary.encode().unwrap())
    }

    fn update(stage: usize, summary: bytes::Bytes) -> RuntimeFilterUpdate {
        RuntimeFilterUpdate {
            job: JobId(1),
            stage: StageId(stage),
            filter: 0,
            summary,
        }
    }

    /// Rows per key.
    fn counts(batches: &[RecordBatch]) -> BTreeMap<i64, usize> {
        let mut counts = BTreeMap::new();
        for batch in batches {
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            for key in column.values() {
                *counts.entry(*key).or_default() += 1;
            }
        }
        counts
    }

    async fn run(plan: Arc<dyn ExecutionPlan>) -> BTreeMap<i64, usize> {
        let batches = datafusion::physical_plan::collect(plan, Arc::new(TaskContext::default()))
            .await
            .unwrap();
        counts(&batches)
    }

    fn text(plan: &Arc<dyn ExecutionPlan>) -> String {
        displayable(plan.as_ref()).indent(false).to_string()
    }

    /// `plan` holds an empty filter: one that keeps every row until its summary comes.
    fn assert_waits_for_its_summary(plan: &Arc<dyn ExecutionPlan>) {
        assert!(
            text(plan).contains("DynamicFilter [ empty ]"),
            "{}",
            text(plan)
        );
    }

    #[tokio::test]
    async fn a_summary_published_while_the_task_runs_filters_the_rows_it_reads_after() {
        let filters = LiveFilters::default();
        let (plan, installed) = filters.install(
            attempt(2, 0),
            scan(3),
            &on_top(None),
            &ConfigOptions::default(),
        );
        assert_waits_for_its_summary(&plan);
        // The task's wait (`plan::await_filters`) holds the filter put in place empty, open until
        // its summary arrives.
        let [pending] = installed.pending() else {
            panic!("one pending filter: {:?}", installed.pending());
        };
        let pending = Arc::clone(pending);
        let mut stream = plan.execute(0, Arc::new(TaskContext::default())).unwrap();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(
            counts(&[first]),
            BTreeMap::from([(1, per_batch(1)), (2, per_batch(2)), (3, per_batch(3))]),
            "no summary yet: the first batch whole"
        );

        // Another stage's update reaches nothing; this stage's reaches the running task.
        assert_eq!(filters.publish(&update(5, only_key(2))).unwrap(), 0);
        let waited = tokio::time::timeout(Duration::from_millis(50), pending.wait_complete());
        assert!(waited.await.is_err(), "not complete before its update");
        assert_eq!(filters.publish(&update(2, only_key(2))).unwrap(), 1);
        let waited = tokio::time::timeout(Duration::from_millis(50), pending.wait_complete());
        assert!(waited.await.is_ok(), "complete once updated");
        let rest: Vec<RecordBatch> = stream.map(|b| b.unwrap()).collect().await;
        assert_eq!(
            counts(&rest),
            BTreeMap::from([(2, 2 * per_batch(2))]),
            "the two batches read after it: key 2 only"
        );
    }

    #[tokio::test]
    async fn a_summary_known_before_the_task_starts_goes_in_as_a_fixed_predicate() {
        // With the definition.
        let filters = LiveFilters::default();
        let (plan, installed) = filters.install(
            attempt(2, 0),
            scan(2),
            &on_top(Some(only_key(3))),
            &ConfigOptions::default(),
        );
        assert!(!text(&plan).contains("DynamicFilter"), "{}", text(&plan));
        assert!(installed.pending().is_empty(), "nothing to wait for");
        // A filter not waited for (its target reads its source) is put in place empty, and the
        // task starts at once.
        let unwaited = vec![LiveRuntimeFilter {
            wait: false,
            ..on_top(None).remove(0)
        }];
        let (empty, unwaited) =
            filters.install(attempt(3, 0), scan(2), &unwaited, &ConfigOptions::default());
        assert_waits_for_its_summary(&empty);
        assert!(unwaited.pending().is_empty(), "nothing to wait for");
        assert_eq!(run(plan).await, BTreeMap::from([(3, 2 * per_batch(3))]));

        // Published to the worker before a later attempt of the stage starts there.
        assert_eq!(filters.publish(&update(2, only_key(1))).unwrap(), 0);
        let (plan, _installed) = filters.install(
            attempt(2, 1),
            scan(2),
            &on_top(None),
            &ConfigOptions::default(),
        );
        assert_eq!(run(plan).await, BTreeMap::from([(1, 2 * per_batch(1))]));
    }

    #[tokio::test]
    async fn an_ended_attempt_leaves_the_board_and_a_cleaned_up_job_forgets_its_summaries() {
        let filters = LiveFilters::default();
        let (_plan, installed) = filters.install(
            attempt(2, 0),
            scan(1),
            &on_top(None),
            &ConfigOptions::default(),
        );
        drop(installed);
        assert_eq!(filters.publish(&update(2, only_key(2))).unwrap(), 0);
        filters.forget_job(JobId(1)).unwrap();
        let (plan, _installed) = filters.install(
            attempt(2, 1),
            scan(1),
            &on_top(None),
            &ConfigOptions::default(),
        );
        assert_waits_for_its_summary(&plan);
    }

    #[tokio::test]
    async fn an_update_arriving_after_its_jobs_cleanup_is_dropped() {
        let filters = LiveFilters::default();
        filters.forget_job(JobId(1)).unwrap();
        assert_eq!(filters.publish(&update(2, only_key(2))).unwrap(), 0);
        assert!(filters.lock().unwrap().stages.is_empty());
    }

    /// A Parquet scan that reads `k` as its second column (its projection puts `v` first) takes
    /// the filter pushed down to it, over its own columns: once the summary is published, the
    /// file it opens skips the row groups whose `k` bounds rule the key out, and the rows left
    /// are exactly those with that key.
    #[tokio::test]
    async fn a_filter_pushed_into_a_parquet_scan_through_its_projection_prunes_row_groups() {
        use datafusion::parquet::arrow::ArrowWriter;
        use datafusion::parquet::file::properties::WriterProperties;
        use datafusion::physical_plan::display::DisplayableExecutionPlan;
        use datafusion::prelude::{ParquetReadOptions, SessionContext};

        let dir = tempfile::tempdir().unwrap();
        let file_schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
        ]));
        let keys: Vec<i64> = (0..4000).collect();
        let values: Vec<i64> = keys.iter().map(|k| k * 10).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&file_schema),
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(Int64Array::from(values)),
            ],
        )
        .unwrap();
        let path = dir.path().join("t.parquet");
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(1000))
            .build();
        let mut writer = ArrowWriter::try_new(
            std::fs::File::create(&path).unwrap(),
            file_schema,
            Some(properties),
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();

        let ctx = SessionContext::new();
        ctx.register_parquet("t", path.to_str().unwrap(), ParquetReadOptions::default())
            .await
            .unwrap();
        let plan = ctx
            .sql("select v, k from t")
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let filters = LiveFilters::default();
        let on_k = vec![LiveRuntimeFilter {
            filter: 0,
            path: Vec::new(),
            columns: vec![1],
            summary: None,
            wait: false,
        }];
        let (plan, _installed) =
            filters.install(attempt(2, 0), plan, &on_k, ctx.state().config().options());
        assert!(
            text(&plan).contains("predicate=DynamicFilter [ empty ]"),
            "{}",
            text(&plan)
        );
        assert_eq!(filters.publish(&update(2, only_key(2500))).unwrap(), 1);

        let batches = datafusion::physical_plan::collect(Arc::clone(&plan), ctx.task_ctx())
            .await
            .unwrap();
        let rows: Vec<(i64, i64)> = batches
            .iter()
            .flat_map(|b| {
                let column = |i: usize| {
                    b.column(i)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .unwrap()
                        .values()
                        .to_vec()
                };
                column(0).into_iter().zip(column(1))
            })
            .collect();
        assert_eq!(rows, [(25_000, 2500)]);
        let analyzed = DisplayableExecutionPlan::with_metrics(plan.as_ref())
            .indent(false)
            .to_string();
        assert!(
            analyzed.contains("row_groups_pruned_statistics=4 total → 1 matched"),
            "{analyzed}"
        );
    }

    #[test]
    fn a_summary_that_does_not_decode_is_an_error_and_changes_nothing() {
        let filters = LiveFilters::default();
        let error = filters
            .publish(&update(2, bytes::Bytes::from_static(b"not a summary")))
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("the key summary of runtime filter 0 for job 1 stage 2"),
            "{error}"
        );
        let board = filters.lock().unwrap();
        assert!(board.stages.is_empty(), "{board:?}");
    }

    #[tokio::test]
    async fn a_summary_that_does_not_decode_lets_its_waiting_task_read_every_row() {
        let filters = LiveFilters::default();
        let (plan, installed) = filters.install(
            attempt(2, 0),
            scan(2),
            &on_top(None),
            &ConfigOptions::default(),
        );
        let [pending] = installed.pending() else {
            panic!("one pending filter: {:?}", installed.pending());
        };
        let pending = Arc::clone(pending);
        let bad = update(2, bytes::Bytes::from_static(b"not a summary"));
        assert!(filters.publish(&bad).is_err());
        let waited = tokio::time::timeout(Duration::from_millis(50), pending.wait_complete());
        assert!(waited.await.is_ok(), "complete: its task goes on");
        assert_eq!(
            run(plan).await,
            BTreeMap::from([
                (1, 2 * per_batch(1)),
                (2, 2 * per_batch(2)),
                (3, 2 * per_batch(3))
            ])
        );
    }

    #[tokio::test]
    async fn an_empty_summary_releases_the_waiting_tasks_which_read_every_row() {
        let filters = LiveFilters::default();
        let (plan, installed) = filters.install(
            attempt(2, 0),
            scan(2),
            &on_top(None),
            &ConfigOptions::default(),
        );
        let [pending] = installed.pending() else {
            panic!("one pending filter: {:?}", installed.pending());
        };
        let pending = Arc::clone(pending);
        // Another stage's release reaches nothing; this stage's releases its one task.
        assert_eq!(filters.publish(&update(5, bytes::Bytes::new())).unwrap(), 0);
        let waited = tokio::time::timeout(Duration::from_millis(50), pending.wait_complete());
        assert!(waited.await.is_err(), "still waiting before its release");
        assert_eq!(filters.publish(&update(2, bytes::Bytes::new())).unwrap(), 1);
        let waited = tokio::time::timeout(Duration::from_millis(50), pending.wait_complete());
        assert!(waited.await.is_ok(), "complete: its task goes on");
        assert_eq!(
            run(plan).await,
            BTreeMap::from([
                (1, 2 * per_batch(1)),
                (2, 2 * per_batch(2)),
                (3, 2 * per_batch(3))
            ])
        );
        // An attempt of the stage installed after the release (its `RunTask` overtaken by the
        // update) runs without the filter and does not wait.
        let (later, installed) = filters.install(
            attempt(2, 1),
            scan(2),
            &on_top(None),
            &ConfigOptions::default(),
        );
        assert!(installed.pending().is_empty(), "nothing to wait for");
        assert!(!text(&later).contains("DynamicFilter"), "{}", text(&later));
    }
}
