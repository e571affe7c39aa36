//! The streams of one task attempt: its inputs' locators, read from this worker's store when the
//! stream is here (no serialization) and through the worker's `StreamFetcher` otherwise, and its
//! output in this worker's store. Every input stream is counted on its way in ([`ReadCounters`]:
//! batches, rows, and data bytes read locally or remotely) for the attempt's report.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::Count;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::StreamExt;
use sluice_planner::{AttemptKey, InputKey, OutputMode, StageId, StageInputExec};
use sluice_shuffle::batch_data_bytes;

use super::WorkerShared;
use crate::analyze::TaskMetrics;
use crate::definition::{StreamLocator, TaskDefinition};
use crate::faults::FaultPoints;
use crate::stream_store::{StreamStore, TaskSender, TaskStreams};
use crate::task::TaskInput;
use crate::transport::{FetchRetries, StreamFetcher};

/// The streams of one attempt; see the module docs.
pub(super) struct AttemptStreams {
    key: AttemptKey,
    worker: String,
    own_address: String,
    inputs: Vec<TaskInput>,
    locations: HashMap<(StageId, InputKey), StreamLocator>,
    schemas: HashMap<StageId, SchemaRef>,
    channels: usize,
    output_schema: SchemaRef,
    replicas: usize,
    mode: OutputMode,
    store: Arc<StreamStore>,
    fetcher: Arc<dyn StreamFetcher>,
    /// What the store spilled of this attempt's output, once the writer took its sender.
    output_spilled: std::sync::Mutex<Option<(Count, Count)>>,
    /// What its inputs delivered so far.
    read: Arc<ReadCounters>,
    /// The worker's fault points.
    faults: Option<Arc<FaultPoints>>,
}

/// What an attempt's input streams delivered.
#[derive(Debug, Default)]
pub(super) struct ReadCounters {
    batches: AtomicU64,
    rows: AtomicU64,
    local_bytes: AtomicU64,
    remote_bytes: AtomicU64,
    /// Reads from other workers made again after a failed call.
    retries: Arc<FetchRetries>,
}

impl ReadCounters {
    fn count(&self, batch: &datafusion::arrow::array::RecordBatch, remote: bool) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.rows
            .fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
        let bytes = if remote {
            &self.remote_bytes
        } else {
            &self.local_bytes
        };
        bytes.fetch_add(batch_data_bytes(batch) as u64, Ordering::Relaxed);
    }

    /// Adds what was read to `metrics`.
    pub(super) fn add_to(&self, metrics: &mut TaskMetrics) {
        metrics.input_batches += self.batches.load(Ordering::Relaxed);
        metrics.input_rows += self.rows.load(Ordering::Relaxed);
        metrics.read_local_bytes += self.local_bytes.load(Ordering::Relaxed);
        metrics.read_remote_bytes += self.remote_bytes.load(Ordering::Relaxed);
        metrics.fetch_retries += self.retries.count();
        if let Some(last) = self.retries.last() {
            metrics.fetch_retried = last;
        }
    }
}

/// `stream`, counting each batch it delivers into `counters`.
fn counted(
    stream: SendableRecordBatchStream,
    counters: &Arc<ReadCounters>,
    remote: bool,
) -> SendableRecordBatchStream {
    let counters = Arc::clone(counters);
    let schema = stream.schema();
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        stream.inspect(move |batch| {
            if let Ok(batch) = batch {
                counters.count(batch, remote);
            }
        }),
    ))
}

impl std::fmt::Debug for AttemptStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttemptStreams")
            .field("key", &self.key)
            .field("worker", &self.worker)
            .finish()
    }
}

impl AttemptStreams {
    /// Spill files and bytes the store wrote of this attempt's output (0 before it was created).
    pub fn output_spills(&self) -> (u64, u64) {
        self.output_spilled
            .lock()
            .ok()
            .and_then(|spilled| {
                spilled
                    .as_ref()
                    .map(|(files, bytes)| (files.value() as u64, bytes.value() as u64))
            })
            .unwrap_or((0, 0))
    }

    pub fn try_new(
        shared: &WorkerShared,
        definition: &TaskDefinition,
        plan: &Arc<dyn ExecutionPlan>,
    ) -> Result<Self> {
        let key = definition.attempt;
        let mut inputs = Vec::with_capacity(definition.inputs.len());
        let mut locations = HashMap::new();
        for input in &definition.inputs {
            let keys = input
                .partitions
                .iter()
                .map(|streams| {
                    streams
                        .iter()
                        .map(|locator| {
                            let input_key = locator.input_key();
                            locations.insert((input.stage, input_key), locator.clone());
                            input_key
                        })
                        .collect()
                })
                .collect();
            inputs.push(TaskInput {
                stage: input.stage,
                mode: input.mode,
                keys,
                first: input.first,
            });
        }
        let mut schemas = HashMap::new();
        plan.apply(|node| {
            if let Some(placeholder) = node.downcast_ref::<StageInputExec<usize>>()
                && let Some(input) = inputs.get(*placeholder.input())
            {
                schemas.insert(input.stage, placeholder.schema());
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        Ok(Self {
            key,
            worker: shared.name.clone(),
            own_address: shared.address.clone(),
            inputs,
            locations,
            schemas,
            channels: definition.output.channels(),
            output_schema: plan.schema(),
            replicas: definition.replicas,
            mode: definition.output_mode,
            store: Arc::clone(&shared.store),
            fetcher: Arc::clone(&shared.fetcher),
            output_spilled: std::sync::Mutex::new(None),
            read: Arc::default(),
            faults: shared.options.faults.clone(),
        })
    }

    /// What its inputs delivered so far.
    pub fn read(&self) -> &ReadCounters {
        &self.read
    }

    /// What each stage input reads, by input index.
    pub fn inputs(&self) -> &[TaskInput] {
        &self.inputs
    }
}

impl TaskStreams for AttemptStreams {
    fn take_stream(&self, stage: StageId, key: InputKey) -> Result<SendableRecordBatchStream> {
        let Some(locator) = self.locations.get(&(stage, key)) else {
            return Err(DataFusionError::Internal(format!(
                "{}: {} has no locator for stage {stage} {key:?}",
                self.worker, self.key
            )));
        };
        let schema = self.schemas.get(&stage).cloned().ok_or_else(|| {
            DataFusionError::Internal(format!("{}: no schema for stage {stage}", self.key))
        })?;
        if locator.address == self.own_address {
            let stream = self.store.take_stream(locator.stream, schema);
            return Ok(counted(stream, &self.read, false));
        }
        let stream = self.fetcher.fetch_counted(
            &locator.address,
            locator.stream,
            schema,
            Arc::clone(&self.read.retries),
        );
        Ok(counted(stream, &self.read, true))
    }

    fn take_sender(&self, stage: StageId, partition: usize) -> Result<TaskSender> {
        if stage != self.key.stage || partition != self.key.partition {
            return Err(DataFusionError::Internal(format!(
                "{}: {} cannot write stage {stage} partition {partition}",
                self.worker, self.key
            )));
        }
        let sender = self.store.create_output(
            self.key,
            self.channels,
            self.replicas,
            self.mode,
            self.output_schema.clone(),
        )?;
        if let Ok(mut spilled) = self.output_spilled.lock() {
            *spilled = Some((sender.spill_files(), sender.spilled_bytes()));
        }
        Ok(sender.with_faults(self.faults.clone()))
    }
}
