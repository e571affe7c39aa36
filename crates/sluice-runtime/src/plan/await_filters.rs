//! `AwaitRuntimeFiltersExec`: holds back a pipelined task whose runtime filters have not arrived
//! (`worker::live_filters`), so that its scans read with them in place, as a blocking task would;
//! it starts its input once every filter is complete or after `sluice.runtime_filter_wait_ms`,
//! whichever comes first.
//!
//! ```text
//!   first poll ─► wait: every DynamicFilterPhysicalExpr complete, or the wait elapsed
//!              ─► execute(input) ─► its batches, unchanged
//! ```
//!
//! Invariants: it changes when its input starts, never what it returns; the input is not executed
//! before the wait ends (scans open their files with the filters they will keep), nor at all if the
//! stream is dropped first (nothing is spawned: dropping it cancels the wait); a filter that never
//! arrives (its source failed, or sent none) costs at most the wait.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use datafusion::common::Result;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::DynamicFilterPhysicalExpr;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::{StreamExt, TryStreamExt};
use sluice_planner::plan::{RECOMPUTE, only_child};

/// Starts its input once `filters` are complete or `wait` elapsed; see the module docs.
#[derive(Debug)]
pub struct AwaitRuntimeFiltersExec {
    input: Arc<dyn ExecutionPlan>,
    filters: Vec<Arc<DynamicFilterPhysicalExpr>>,
    wait: Duration,
    metrics: ExecutionPlanMetricsSet,
}

impl AwaitRuntimeFiltersExec {
    /// `input`, started once `filters` are complete or `wait` elapsed.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        filters: Vec<Arc<DynamicFilterPhysicalExpr>>,
        wait: Duration,
    ) -> Self {
        Self {
            input,
            filters,
            wait,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for AwaitRuntimeFiltersExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "AwaitRuntimeFiltersExec: filters={}, wait={} ms",
            self.filters.len(),
            self.wait.as_millis()
        )
    }
}

impl ExecutionPlan for AwaitRuntimeFiltersExec {
    fn name(&self) -> &str {
        "AwaitRuntimeFiltersExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self::new(
            only_child(self.name(), children)?,
            self.filters.clone(),
            self.wait,
        )))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(children, RECOMPUTE)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let waited = MetricBuilder::new(&self.metrics).subset_time("filter_wait_time", partition);
        let timed_out =
            MetricBuilder::new(&self.metrics).counter("filter_wait_timeouts", partition);
        let input = Arc::clone(&self.input);
        let filters = self.filters.clone();
        let wait = self.wait;
        let started = futures::stream::once(async move {
            let timer = waited.timer();
            let all = futures::future::join_all(filters.iter().map(|f| f.wait_complete()));
            if tokio::time::timeout(wait, all).await.is_err() {
                timed_out.add(1);
            }
            timer.done();
            input.execute(partition, context)
        })
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.input.schema(),
            started.boxed(),
        )))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
    use datafusion::common::runtime::SpawnedTask;
    use datafusion::physical_expr::expressions::{Column, lit};
    use datafusion::physical_plan::test::TestMemoryExec;

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]))
    }

    fn empty_filter() -> Arc<DynamicFilterPhysicalExpr> {
        Arc::new(DynamicFilterPhysicalExpr::new(
            vec![Arc::new(Column::new("k", 0))],
            lit(true),
        ))
    }

    /// An input that counts how often it was executed.
    #[derive(Debug)]
    struct Counted {
        input: Arc<dyn ExecutionPlan>,
        executed: Arc<AtomicUsize>,
    }

    impl DisplayAs for Counted {
        fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "Counted")
        }
    }

    impl ExecutionPlan for Counted {
        fn name(&self) -> &str {
            "Counted"
        }
        fn properties(&self) -> &Arc<PlanProperties> {
            self.input.properties()
        }
        fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
            Vec::new()
        }
        fn apply_expressions(
            &self,
            _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
        ) -> Result<TreeNodeRecursion> {
            Ok(TreeNodeRecursion::Continue)
        }
        fn with_new_children(
            self: Arc<Self>,
            _children: Vec<Arc<dyn ExecutionPlan>>,
        ) -> Result<Arc<dyn ExecutionPlan>> {
            Ok(self)
        }
        fn execute(
            &self,
            partition: usize,
            context: Arc<TaskContext>,
        ) -> Result<SendableRecordBatchStream> {
            self.executed.fetch_add(1, Ordering::SeqCst);
            self.input.execute(partition, context)
        }
    }

    fn waiting(
        filters: Vec<Arc<DynamicFilterPhysicalExpr>>,
    ) -> (AwaitRuntimeFiltersExec, Arc<AtomicUsize>) {
        let batch =
            RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from_iter_values(0..5))])
                .unwrap();
        let executed = Arc::new(AtomicUsize::new(0));
        let input = Arc::new(Counted {
            input: TestMemoryExec::try_new_exec(&[vec![batch]], schema(), None).unwrap(),
            executed: Arc::clone(&executed),
        });
        let exec = AwaitRuntimeFiltersExec::new(input, filters, Duration::from_secs(1));
        (exec, executed)
    }

    async fn rows(stream: SendableRecordBatchStream) -> usize {
        stream
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .iter()
            .map(RecordBatch::num_rows)
            .sum()
    }

    #[tokio::test(start_paused = true)]
    async fn the_input_starts_only_once_every_filter_is_complete() {
        let (first, second) = (empty_filter(), empty_filter());
        let (exec, executed) = waiting(vec![Arc::clone(&first), Arc::clone(&second)]);
        let stream = exec.execute(0, Arc::new(TaskContext::default())).unwrap();
        let reader = SpawnedTask::spawn(rows(stream));
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.mark_complete();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(executed.load(Ordering::SeqCst), 0, "one filter still open");
        let start = tokio::time::Instant::now();
        second.mark_complete();
        assert_eq!(reader.join().await.unwrap(), 5);
        assert_eq!(executed.load(Ordering::SeqCst), 1);
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "no wait once both are complete"
        );
        let metrics = exec.metrics().unwrap();
        assert_eq!(
            metrics
                .sum_by_name("filter_wait_timeouts")
                .unwrap()
                .as_usize(),
            0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_filter_that_never_arrives_holds_the_input_back_for_the_wait_only() {
        let (exec, executed) = waiting(vec![empty_filter()]);
        let start = tokio::time::Instant::now();
        let stream = exec.execute(0, Arc::new(TaskContext::default())).unwrap();
        assert_eq!(rows(stream).await, 5);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert_eq!(executed.load(Ordering::SeqCst), 1);
        let metrics = exec.metrics().unwrap();
        assert_eq!(
            metrics
                .sum_by_name("filter_wait_timeouts")
                .unwrap()
                .as_usize(),
            1
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_stream_while_it_waits_never_starts_the_input() {
        let filter = empty_filter();
        let (exec, executed) = waiting(vec![Arc::clone(&filter)]);
        let mut stream = exec.execute(0, Arc::new(TaskContext::default())).unwrap();
        let polled = tokio::time::timeout(Duration::from_millis(200), stream.next()).await;
        assert!(polled.is_err(), "still waiting after 200 ms");
        drop(stream);
        filter.mark_complete();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(executed.load(Ordering::SeqCst), 0);
    }
}
