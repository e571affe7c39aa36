//! `ShuffleReaderExec`: what a task puts in place of each `StageInputExec<usize>`. Executing input
//! partition `i` reads the producer streams the input-key expansion assigned to `i` for this task,
//! interleaved as they arrive.
//!
//! Invariant: it declares exactly the placeholder's plan properties. That is sound because the writer
//! routes rows exactly as the cut `RepartitionExec` would have, and when the placeholder declares an
//! ordering (an order-preserving repartition) the streams of one input partition, each sorted, are
//! merged in that order instead of interleaved.
//!
//! A placeholder marked `replay` (a nested-loop join's build side, which the join re-reads when it
//! falls back to spilling) keeps what it has read, so executing the same partition again yields the
//! same rows: first those already read, then the rest of the streams.

use std::fmt;
use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{Result, internal_err};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use std::collections::HashMap;
use std::sync::Mutex;

use datafusion::arrow::array::RecordBatch;
use datafusion::common::DataFusionError;
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::sorts::streaming_merge::StreamingMergeBuilder;
use futures::{StreamExt, stream};
use sluice_planner::plan::{RECOMPUTE, no_children};
use sluice_planner::{InputKey, InputMode, StageId};

use crate::stream_store::TaskStreams;

/// Reads one stage input of one task from the stream store.
#[derive(Debug)]
pub struct ShuffleReaderExec {
    stage: StageId,
    mode: InputMode,
    keys: Vec<Vec<InputKey>>,
    /// The input partition `keys[0]` belongs to.
    first: usize,
    store: Arc<dyn TaskStreams>,
    properties: Arc<PlanProperties>,
    replay: bool,
    replays: Mutex<HashMap<usize, Arc<tokio::sync::Mutex<Replay>>>>,
    metrics: ExecutionPlanMetricsSet,
}

/// What a replayable input partition has read so far, and the rest of its streams.
struct Replay {
    seen: Vec<RecordBatch>,
    rest: SendableRecordBatchStream,
    done: bool,
    failed: Option<Arc<DataFusionError>>,
}

impl fmt::Debug for Replay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Replay({} batches, done={})", self.seen.len(), self.done)
    }
}

impl ShuffleReaderExec {
    /// A reader of `stage` in `mode`; `keys[i]` are the streams of input partition `i`.
    pub fn new(
        stage: StageId,
        mode: InputMode,
        keys: Vec<Vec<InputKey>>,
        store: Arc<dyn TaskStreams>,
        properties: Arc<PlanProperties>,
    ) -> Self {
        Self {
            stage,
            mode,
            keys,
            first: 0,
            store,
            properties,
            replay: false,
            replays: Mutex::new(HashMap::new()),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// `keys` list input partitions `first..` only: the task reads no other (see
    /// `sluice_planner::input_reads`), and executing another fails.
    pub fn with_first_partition(mut self, first: usize) -> Self {
        self.first = first;
        self
    }

    /// Lets each partition be executed more than once (see the module docs).
    pub fn with_replay(mut self, replay: bool) -> Self {
        self.replay = replay;
        self
    }

    /// The streams of input `partition`, merged in the declared order if there is one.
    fn open(&self, partition: usize, context: &TaskContext) -> Result<SendableRecordBatchStream> {
        let Some(keys) = partition
            .checked_sub(self.first)
            .and_then(|index| self.keys.get(index))
        else {
            return internal_err!(
                "ShuffleReaderExec of stage {}: partition {partition} was not given to this task \
                 (it reads partitions {}..{} of {})",
                self.stage,
                self.first,
                self.first + self.keys.len(),
                self.properties.partitioning.partition_count()
            );
        };
        let mut streams = keys
            .iter()
            .map(|key| self.store.take_stream(self.stage, *key))
            .collect::<Result<Vec<_>>>()?;
        let schema = self.properties.eq_properties.schema().clone();
        match self.properties.output_ordering() {
            Some(ordering) if streams.len() > 1 => {
                let reservation = MemoryConsumer::new(format!(
                    "ShuffleReaderExec[stage {} partition {partition}]",
                    self.stage
                ))
                .register(context.memory_pool());
                StreamingMergeBuilder::new()
                    .with_streams(streams)
                    .with_schema(schema)
                    .with_expressions(ordering)
                    .with_metrics(BaselineMetrics::new(&self.metrics, partition))
                    .with_batch_size(context.session_config().batch_size())
                    .with_reservation(reservation)
                    .build()
            }
            _ if streams.len() == 1 => streams
                .pop()
                .ok_or_else(|| DataFusionError::Internal("no stream".into())),
            _ => Ok(Box::pin(RecordBatchStreamAdapter::new(
                schema,
                stream::select_all(streams),
            ))),
        }
    }

    /// A read of `partition` that replays what earlier reads of it saw, then continues.
    fn replayed(
        &self,
        partition: usize,
        context: &TaskContext,
    ) -> Result<SendableRecordBatchStream> {
        let state = {
            let mut replays = self
                .replays
                .lock()
                .map_err(|_| DataFusionError::Internal("replay state poisoned".into()))?;
            match replays.get(&partition) {
                Some(state) => Arc::clone(state),
                None => {
                    let state = Arc::new(tokio::sync::Mutex::new(Replay {
                        seen: Vec::new(),
                        rest: self.open(partition, context)?,
                        done: false,
                        failed: None,
                    }));
                    replays.insert(partition, Arc::clone(&state));
                    state
                }
            }
        };
        let batches = stream::unfold((state, 0usize), |(state, position)| async move {
            if position == usize::MAX {
                return None;
            }
            let mut replay = state.lock().await;
            if let Some(batch) = replay.seen.get(position).cloned() {
                drop(replay);
                return Some((Ok(batch), (state, position + 1)));
            }
            if let Some(error) = &replay.failed {
                let error = DataFusionError::Shared(Arc::clone(error));
                drop(replay);
                return Some((Err(error), (state, usize::MAX)));
            }
            if replay.done {
                return None;
            }
            match replay.rest.next().await {
                Some(Ok(batch)) => {
                    replay.seen.push(batch.clone());
                    drop(replay);
                    Some((Ok(batch), (state, position + 1)))
                }
                Some(Err(error)) => {
                    let error = Arc::new(error);
                    replay.failed = Some(Arc::clone(&error));
                    drop(replay);
                    Some((Err(DataFusionError::Shared(error)), (state, usize::MAX)))
                }
                None => {
                    replay.done = true;
                    None
                }
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.properties.eq_properties.schema().clone(),
            batches,
        )))
    }
}

impl DisplayAs for ShuffleReaderExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ShuffleReaderExec: stage={}, mode={}, partitions={}",
            self.stage,
            self.mode.name(),
            self.properties.partitioning.partition_count()
        )
    }
}

impl ExecutionPlan for ShuffleReaderExec {
    fn name(&self) -> &str {
        "ShuffleReaderExec"
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

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        no_children(self.name(), &children)?;
        Ok(self)
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
        if self.replay {
            self.replayed(partition, &context)
        } else {
            self.open(partition, &context)
        }
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
    use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
    use futures::TryStreamExt;

    use super::*;
    use crate::stream_store::TaskSender;

    /// Serves every stream as one row holding its producer partition.
    #[derive(Debug)]
    struct OneRowPerStream(Arc<Schema>);

    impl TaskStreams for OneRowPerStream {
        fn take_stream(&self, _stage: StageId, key: InputKey) -> Result<SendableRecordBatchStream> {
            let batch = RecordBatch::try_new(
                Arc::clone(&self.0),
                vec![Arc::new(Int64Array::from(vec![key.partition as i64]))],
            )?;
            Ok(Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&self.0),
                stream::iter([Ok(batch)]),
            )))
        }

        fn take_sender(&self, _stage: StageId, partition: usize) -> Result<TaskSender> {
            internal_err!("no output for partition {partition} here")
        }
    }

    #[tokio::test]
    async fn a_reader_given_one_partition_reads_it_and_fails_on_any_other_rather_than_read_nothing()
    {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(4),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        let key = |partition| InputKey {
            partition,
            channel: 0,
            replica: 0,
        };
        let reader = ShuffleReaderExec::new(
            StageId(0),
            InputMode::Forward,
            vec![vec![key(2)]],
            Arc::new(OneRowPerStream(schema)),
            properties,
        )
        .with_first_partition(2);
        let context = Arc::new(TaskContext::default());
        let batches: Vec<RecordBatch> = reader
            .execute(2, Arc::clone(&context))
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let values = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(values.values(), &[2]);
        for other in [0, 1, 3] {
            let error = reader.execute(other, Arc::clone(&context)).err().unwrap();
            assert!(
                error.to_string().contains(&format!(
                    "partition {other} was not given to this task (it reads partitions 2..3 of 4)"
                )),
                "{error}"
            );
        }
    }
}
