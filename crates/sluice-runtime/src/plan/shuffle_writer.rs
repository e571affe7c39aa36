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
//! reader of the output is gone. It ends its output explicitly: finished after the last batch,
//! failed with the error that stopped it; if its stream is dropped first (a stopped or panicked
//! attempt) the output is abandoned, so no reader ever takes a partial output for a whole one.

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

use crate::faults::{FaultPoint, FaultPoints};
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

/// Writes every batch of `input` and then ends the output: finished, or failed with the error.
async fn write_all(
    input: SendableRecordBatchStream,
    kernel: ShuffleKernel,
    sender: TaskSender,
    mut faults: Option<WriterFaults>,
) -> Result<()> {
    match route_all(input, kernel, &sender, faults.as_mut()).await {
        Ok(()) => {
            sender.finish();
            Ok(())
        }
        Err(error) => {
            sender.fail(&error);
            Err(error)
        }
    }
}

async fn route_all(
    mut input: SendableRecordBatchStream,
    mut kernel: ShuffleKernel,
    sender: &TaskSender,
    mut faults: Option<&mut WriterFaults>,
) -> Result<()> {
    while let Some(batch) = input.next().await {
        // Input that is always ready (in-memory joins, local reads) must not hold the thread: the
        // runtime also serves the worker's control and data endpoints.
        tokio::task::consume_budget().await;
        if let Some(faults) = faults.as_deref_mut() {
            faults.after_input_batch().await?;
        }
        kernel.push(&batch?)?;
        while let Some((channel, batch)) = kernel.next_completed() {
            if !sender.send(channel, batch).await? {
                return Ok(());
            }
            if let Some(faults) = faults.as_deref_mut() {
                faults.after_output_batch().await?;
            }
        }
    }
    if let Some(faults) = faults {
        faults.after_output_batch().await?;
    }
    kernel.finish()?;
    while let Some((channel, batch)) = kernel.next_completed() {
        if !sender.send(channel, batch).await? {
            return Ok(());
        }
    }
    Ok(())
}

/// The fault points a writer fires (`crate::faults`): `producer_mid_stream` once its output has
/// rows (or at the end of its input if it has none), and `spill_write` at the first input batch
/// after its plan's operators spilled (the output's own spills fire it in the `TaskSender`).
struct WriterFaults {
    faults: Arc<FaultPoints>,
    /// The writer's input plan, whose operators' spill counts are watched.
    plan: Arc<dyn ExecutionPlan>,
    mid_stream_due: bool,
    spills_seen: usize,
}

impl WriterFaults {
    fn new(faults: Arc<FaultPoints>, plan: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            faults,
            plan,
            mid_stream_due: true,
            spills_seen: 0,
        }
    }

    async fn after_output_batch(&mut self) -> Result<()> {
        if std::mem::take(&mut self.mid_stream_due) {
            self.faults.fire(FaultPoint::ProducerMidStream).await?;
        }
        Ok(())
    }

    async fn after_input_batch(&mut self) -> Result<()> {
        if !self.faults.is_armed(FaultPoint::SpillWrite) {
            return Ok(());
        }
        let spills = operator_spills(&self.plan);
        if spills > self.spills_seen {
            self.spills_seen = spills;
            self.faults.fire(FaultPoint::SpillWrite).await?;
        }
        Ok(())
    }
}

/// Spill files the operators of `plan` wrote so far.
fn operator_spills(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let own = plan
        .metrics()
        .and_then(|metrics| metrics.spill_count())
        .unwrap_or(0);
    own + plan
        .children()
        .into_iter()
        .map(operator_spills)
        .sum::<usize>()
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
        let faults = context
            .session_config()
            .get_extension::<FaultPoints>()
            .map(|faults| WriterFaults::new(faults, Arc::clone(&self.input)));
        let work = stream::once(write_all(input, kernel, sender, faults))
            .map_ok(|()| stream::empty())
            .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, work)))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}
