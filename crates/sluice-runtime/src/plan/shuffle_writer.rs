//! `ShuffleWriterExec`: the root of every task plan. It runs its input partition through the shuffle
//! kernel and writes each completed batch to the task's output channels.
//!
//! ```text
//!   input.execute(p) ──batches──► ShuffleKernel (route by Hash / RoundRobin, coalesce per channel)
//!                                       │ (channel, batch)
//!                                       ▼
//!                         TaskSender: every replica of that channel
//! ```
//!
//! Executing it returns a stream that yields no batches: polling it does the work, errors arrive in
//! it, and dropping it stops the work (nothing is spawned). It spends tokio's cooperative budget per
//! input batch, so a task whose input is always ready still yields its thread regularly. It stops early, successfully, when every
//! reader of the output is gone.

use std::fmt;
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{StreamExt, TryStreamExt, stream};
use sluice_planner::plan::{RECOMPUTE, only_child};
use sluice_planner::{OutputDistribution, StageId};
use sluice_shuffle::{KernelOptions, RoutingScheme, ShuffleKernel, ShuffleMetrics};

use crate::stream_store::{TaskSender, TaskStreams};

/// Writes its input's partitions into the stream store's channels of `stage`.
#[derive(Debug)]
pub struct ShuffleWriterExec {
    input: Arc<dyn ExecutionPlan>,
    stage: StageId,
    distribution: OutputDistribution,
    store: Arc<dyn TaskStreams>,
    metrics: ExecutionPlanMetricsSet,
}

impl ShuffleWriterExec {
    /// A writer of `input` as the output of `stage`.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        stage: StageId,
        distribution: OutputDistribution,
        store: Arc<dyn TaskStreams>,
    ) -> Self {
        Self {
            input,
            stage,
            distribution,
            store,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for ShuffleWriterExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ShuffleWriterExec: stage={}, {}({})",
            self.stage,
            self.distribution.kind(),
            self.distribution.channels()
        )
    }
}

async fn write_all(
    mut input: SendableRecordBatchStream,
    mut kernel: ShuffleKernel,
    sender: TaskSender,
) -> Result<()> {
    while let Some(batch) = input.next().await {
        // Input that is always ready (in-memory joins, local reads) must not hold the thread: the
        // runtime also serves the worker's control and data endpoints.
        tokio::task::consume_budget().await;
        kernel.push(&batch?)?;
        while let Some((channel, batch)) = kernel.next_completed() {
            if !sender.send(channel, batch).await? {
                return Ok(());
            }
        }
    }
    kernel.finish()?;
    while let Some((channel, batch)) = kernel.next_completed() {
        if !sender.send(channel, batch).await? {
            return Ok(());
        }
    }
    Ok(())
}

impl ExecutionPlan for ShuffleWriterExec {
    fn name(&self) -> &str {
        "ShuffleWriterExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        if let OutputDistribution::Hash { keys, .. } = &self.distribution {
            for key in keys {
                if f(key)? == TreeNodeRecursion::Stop {
                    return Ok(TreeNodeRecursion::Stop);
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self::new(
            only_child(self.name(), children)?,
            self.stage,
            self.distribution.clone(),
            self.store.clone(),
        )))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(children, RECOMPUTE)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let schema = self.input.schema();
        let input = self.input.execute(partition, context.clone())?;
        let sender = self.store.take_sender(self.stage, partition)?;
        let scheme = match &self.distribution {
            OutputDistribution::Hash { keys, channels } => RoutingScheme::Hash {
                keys: keys.clone(),
                channels: *channels,
            },
            OutputDistribution::RoundRobin { channels } => RoutingScheme::RoundRobin {
                channels: *channels,
            },
        };
        let options = KernelOptions {
            target_rows: context.session_config().batch_size(),
            limit: None,
            input_partition: partition,
            num_inputs: self.input.output_partitioning().partition_count(),
        };
        let metrics = ShuffleMetrics::new(&self.metrics, partition, sender.channels());
        let kernel = ShuffleKernel::try_new(scheme, schema.clone(), &options, metrics)?;
        let work = stream::once(write_all(input, kernel, sender))
            .map_ok(|()| stream::empty())
            .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, work)))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}
