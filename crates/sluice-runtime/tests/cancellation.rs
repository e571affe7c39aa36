//! Cancellation through the driver, the shuffle writer and the shuffle reader: dropping the job
//! output stops every task and drops every input stream; a consumer that stops early (a limit)
//! stops its producers. The endless source has no wire form, so the tests register it as a
//! driver-placed node (the `DistributedExec` extension point): it runs on the driver's executor and
//! the in-process worker reads it like any other stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use datafusion::arrow::array::{Int64Array, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::Result;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, expressions::col,
};
use futures::StreamExt;
use sluice_planner::{
    DistributedExec, DistributionRules, JobGraph, JobGraphOptions, NodeDistribution,
};
use sluice_runtime::runner::{LocalGraph, LocalGraphOptions};

/// Counts its live output streams.
struct Live(Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A leaf whose partitions produce batches forever.
#[derive(Debug)]
struct EndlessExec {
    live: Arc<AtomicUsize>,
    properties: Arc<PlanProperties>,
}

impl EndlessExec {
    fn new(partitions: usize, live: Arc<AtomicUsize>) -> Self {
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema()),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Self {
            live,
            properties: Arc::new(properties),
        }
    }
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]))
}

impl DisplayAs for EndlessExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "EndlessExec")
    }
}

impl ExecutionPlan for EndlessExec {
    fn name(&self) -> &str {
        "EndlessExec"
    }
    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
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
        _ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        self.live.fetch_add(1, Ordering::SeqCst);
        let guard = Live(self.live.clone());
        let batches = futures::stream::unfold((guard, 0i64), move |(guard, n)| async move {
            tokio::task::yield_now().await;
            let values: Int64Array = (0..64).map(|i| n * 64 + i + partition as i64).collect();
            let batch = RecordBatch::try_new(schema(), vec![Arc::new(values)]).unwrap();
            Some((Ok(batch), (guard, n + 1)))
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema(), batches)))
    }
}

impl DistributedExec for EndlessExec {
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: true,
        }
    }
}

fn job_graph(plan: Arc<dyn ExecutionPlan>) -> JobGraph {
    let mut rules = DistributionRules::default();
    rules.register::<EndlessExec>();
    let options = JobGraphOptions {
        rules,
        ..JobGraphOptions::default()
    };
    JobGraph::try_new_with(plan, &options).unwrap()
}

async fn run(graph: JobGraph) -> (LocalGraph, SendableRecordBatchStream) {
    let local = LocalGraph::start(LocalGraphOptions::default())
        .await
        .unwrap();
    let output = local
        .driver()
        .execute(graph, Arc::new(TaskContext::default()));
    (local, output)
}

/// Waits until no task runs and no stream is held anywhere.
async fn wait_until_idle(local: &LocalGraph) {
    let start = Instant::now();
    loop {
        let (driver, workers) = local.snapshot().await.unwrap();
        let idle = driver.jobs == 0
            && driver.running_tasks == 0
            && workers
                .iter()
                .all(|(tasks, store)| *tasks == 0 && store.outputs == 0);
        if idle {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "still busy 2 s after cancellation: {driver:?} {workers:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_until_none_live(live: &AtomicUsize) {
    let start = Instant::now();
    while live.load(Ordering::SeqCst) > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{} input streams still live 2 s after cancellation",
            live.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn hash_shuffled(live: &Arc<AtomicUsize>) -> Arc<dyn ExecutionPlan> {
    let source: Arc<dyn ExecutionPlan> = Arc::new(EndlessExec::new(2, live.clone()));
    let key = col("x", &schema()).unwrap();
    Arc::new(RepartitionExec::try_new(source, Partitioning::Hash(vec![key], 3)).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_job_output_stops_every_task() {
    let live = Arc::new(AtomicUsize::new(0));
    let graph = job_graph(hash_shuffled(&live));
    assert_eq!(graph.stages().len(), 3);
    let (local, mut output) = run(graph).await;
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "nothing runs before the first poll"
    );
    for _ in 0..20 {
        output.next().await.unwrap().unwrap();
    }
    assert_eq!(live.load(Ordering::SeqCst), 2);
    drop(output);
    wait_until_none_live(&live).await;
    wait_until_idle(&local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_satisfied_limit_stops_its_producers_and_the_job_ends() {
    let live = Arc::new(AtomicUsize::new(0));
    let coalesced = Arc::new(CoalescePartitionsExec::new(hash_shuffled(&live)));
    let limit = Arc::new(GlobalLimitExec::new(coalesced, 10, Some(100)));
    let (local, output) = run(job_graph(limit)).await;
    let rows: usize = tokio::time::timeout(Duration::from_secs(10), output.collect::<Vec<_>>())
        .await
        .expect("the job did not end after its limit was reached")
        .into_iter()
        .map(|b| b.unwrap().num_rows())
        .sum();
    assert_eq!(rows, 100);
    wait_until_none_live(&live).await;
    wait_until_idle(&local).await;
}
