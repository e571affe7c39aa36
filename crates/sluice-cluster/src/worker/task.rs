//! One task attempt on a worker: from its definition to its final status report.
//!
//! ```text
//!   TaskDefinition ─► stage plan (decoded, or the driver's in-memory plan)
//!                  ─► inputs: each StageInputExec<usize> reads its locators
//!                        same worker: the local stream store │ other worker: Flight DoGet
//!                  ─► ShuffleWriterExec ─► this worker's store (channels × replicas)
//! ```
//!
//! Invariants: the attempt reports `Running` (sequence 1) before it reads or writes anything, and
//! exactly one of `Succeeded`, `Failed` or `Canceled` (sequence 2) last; a stop drops the task's
//! stream (cancelling its readers and writer) and removes its output. Input streams the task never
//! opens are released by the driver once every task of this stage finished. A succeeded attempt's
//! report carries the rows it wrote, its wall time and its plan rendered with metrics (what the driver
//! shows per stage under `EXPLAIN ANALYZE`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::GreedyMemoryPool;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::SessionConfig;
use futures::{StreamExt, TryStreamExt, stream};
use sluice_planner::{InputKey, StageId, StageInputExec};
use sluice_runtime::analyze::{TaskMetrics, executed_task};
use sluice_runtime::codec::decode_stage_plan;
use sluice_runtime::{TaskInput, TaskSender, TaskStreams, assemble_task, receiver_stream};
use tokio::sync::oneshot;

use super::{LocalPlan, TaskAttemptRef, WorkerShared};
use crate::proto;
use crate::wire::{AttemptKey, StreamId, decode_distribution, input_mode_from_proto};

/// Runs one attempt and reports its status; see the module docs.
pub(super) async fn run_attempt(
    shared: Arc<WorkerShared>,
    definition: proto::TaskDefinition,
    local: Option<LocalPlan>,
    stopped: oneshot::Receiver<()>,
) {
    let key = AttemptKey::of_definition(&definition);
    shared
        .report(report(
            &shared,
            key,
            1,
            proto::TaskState::Running,
            String::new(),
        ))
        .await;
    let started = std::time::Instant::now();
    let outcome = tokio::select! {
        result = execute(&shared, definition, local) => Some(result),
        _ = stopped => None,
    };
    let mut done = TaskMetrics::default();
    let (state, error) = match outcome {
        Some(Ok(executed)) => {
            done = executed;
            (proto::TaskState::Succeeded, String::new())
        }
        Some(Err(error)) => (
            proto::TaskState::Failed,
            format!("{error} (on {})", shared.name),
        ),
        None => {
            let _ = shared.store.remove_attempt(key);
            (proto::TaskState::Canceled, String::new())
        }
    };
    shared.forget_task(key);
    let mut last = report(&shared, key, 2, state, error);
    last.output_rows = done.rows;
    last.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    last.plan_metrics = done.plan;
    shared.report(last).await;
}

fn report(
    shared: &WorkerShared,
    key: AttemptKey,
    sequence: u64,
    state: proto::TaskState,
    error: String,
) -> proto::TaskStatusReport {
    proto::TaskStatusReport {
        worker_id: shared.worker_id.load(Ordering::Relaxed),
        job: key.job.0,
        stage: key.stage.0 as u32,
        partition: key.partition as u32,
        attempt: key.attempt as u32,
        sequence,
        state: state as i32,
        error,
        output_rows: 0,
        elapsed_ms: 0,
        plan_metrics: String::new(),
    }
}

async fn execute(
    shared: &Arc<WorkerShared>,
    definition: proto::TaskDefinition,
    local: Option<LocalPlan>,
) -> Result<TaskMetrics> {
    let key = AttemptKey::of_definition(&definition);
    let with_plan = definition.report_plan_metrics;
    if let Some(fault) = &shared.options.fault {
        let attempt = TaskAttemptRef {
            job: key.job.0,
            stage: key.stage.0,
            partition: key.partition,
            attempt: key.attempt,
        };
        if let Some(message) = fault(&attempt) {
            return Err(DataFusionError::Execution(format!(
                "injected fault in {key}: {message}"
            )));
        }
    }
    let (plan, context) = match local {
        Some(local) => (local.plan, local.context),
        None => {
            let context = task_context(shared, &definition, key)?;
            (decode_stage_plan(&definition.plan, &context)?, context)
        }
    };
    let distribution = decode_distribution(definition.output.as_ref(), &plan.schema(), &context)?;
    let streams = Arc::new(AttemptStreams::try_new(
        shared,
        &definition,
        &plan,
        distribution.channels(),
    )?);
    let inputs = streams.inputs.clone();
    let dyn_streams: Arc<dyn TaskStreams> = streams.clone();
    let task_plan = assemble_task(key.stage, plan, &inputs, distribution, &dyn_streams)?;
    let mut output = task_plan.execute(key.partition, context)?;
    while let Some(batch) = output.next().await {
        batch?;
    }
    // The wall time is measured by the caller, around the whole attempt.
    Ok(executed_task(&task_plan, 0, with_plan))
}

/// The task context of a decoded attempt: the session's settings with the distributed ones on top,
/// and the worker's function registry.
fn task_context(
    shared: &WorkerShared,
    definition: &proto::TaskDefinition,
    key: AttemptKey,
) -> Result<Arc<TaskContext>> {
    let mut config = SessionConfig::from_string_hash_map(&definition.config)?;
    for (name, value) in sluice_planner::DISTRIBUTED_SETTINGS {
        config.options_mut().set(name, value)?;
    }
    let template = &shared.template;
    let worker_runtime = template.runtime_env();
    // The session's memory limit applies to each of its tasks; without one, the worker's pool.
    let runtime = if definition.memory_limit > 0 {
        Arc::new(RuntimeEnv {
            memory_pool: Arc::new(GreedyMemoryPool::new(
                usize::try_from(definition.memory_limit).unwrap_or(usize::MAX),
            )),
            disk_manager: worker_runtime.disk_manager.clone(),
            cache_manager: worker_runtime.cache_manager.clone(),
            object_store_registry: worker_runtime.object_store_registry.clone(),
        })
    } else {
        worker_runtime
    };
    Ok(Arc::new(TaskContext::new(
        Some(key.to_string()),
        format!("job-{}", key.job),
        config,
        template.scalar_functions().clone(),
        template.higher_order_functions().clone(),
        template.aggregate_functions().clone(),
        template.window_functions().clone(),
        runtime,
    )))
}

/// The streams of one attempt: its inputs' locators and its output in this worker's store.
#[derive(Debug)]
struct AttemptStreams {
    key: AttemptKey,
    worker: String,
    own_address: String,
    inputs: Vec<TaskInput>,
    locations: HashMap<(StageId, InputKey), (String, StreamId)>,
    schemas: HashMap<StageId, SchemaRef>,
    channels: usize,
    output_schema: SchemaRef,
    replicas: usize,
    blocking: bool,
    shared_store: Arc<crate::store::WorkerStreamStore>,
    flight: crate::flight::FlightClients,
    read_timeout: std::time::Duration,
}

impl AttemptStreams {
    fn try_new(
        shared: &WorkerShared,
        definition: &proto::TaskDefinition,
        plan: &Arc<dyn ExecutionPlan>,
        channels: usize,
    ) -> Result<Self> {
        let key = AttemptKey::of_definition(definition);
        let mut inputs = Vec::with_capacity(definition.inputs.len());
        let mut locations = HashMap::new();
        for input in &definition.inputs {
            let stage = StageId(input.stage as usize);
            let mode = input_mode_from_proto(input.mode)?;
            let mut keys = Vec::with_capacity(input.partitions.len());
            for partition in &input.partitions {
                let mut partition_keys = Vec::with_capacity(partition.streams.len());
                for locator in &partition.streams {
                    let Some(stream_key) = &locator.key else {
                        return Err(DataFusionError::Plan(format!(
                            "task definition of {key}: a locator of stage {stage} has no key"
                        )));
                    };
                    let id = StreamId::from_proto(stream_key);
                    let input_key = InputKey {
                        partition: id.partition,
                        channel: id.channel,
                        replica: id.replica,
                    };
                    locations.insert((stage, input_key), (locator.address.clone(), id));
                    partition_keys.push(input_key);
                }
                keys.push(partition_keys);
            }
            inputs.push(TaskInput { stage, mode, keys });
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
            channels,
            output_schema: plan.schema(),
            replicas: definition.replicas.max(1) as usize,
            blocking: definition.blocking,
            shared_store: shared.store.clone(),
            flight: shared.flight.clone(),
            read_timeout: shared.options.read_timeout,
        })
    }
}

impl TaskStreams for AttemptStreams {
    fn take_stream(&self, stage: StageId, key: InputKey) -> Result<SendableRecordBatchStream> {
        let Some((address, id)) = self.locations.get(&(stage, key)).cloned() else {
            return Err(DataFusionError::Internal(format!(
                "{}: {} has no locator for stage {stage} {key:?}",
                self.worker, self.key
            )));
        };
        let schema = self.schemas.get(&stage).cloned().ok_or_else(|| {
            DataFusionError::Internal(format!("{}: no schema for stage {stage}", self.key))
        })?;
        if address != self.own_address {
            return Ok(self.flight.read(&address, id, schema));
        }
        // Same worker: read the store directly (no serialization), waiting for the producer.
        let store = self.shared_store.clone();
        let timeout = self.read_timeout;
        let read = async move {
            let (schema, receiver) = store.take(id, timeout).await?;
            Ok::<_, DataFusionError>(receiver_stream(schema, receiver))
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream::once(read).try_flatten(),
        )))
    }

    fn take_sender(&self, stage: StageId, partition: usize) -> Result<TaskSender> {
        if stage != self.key.stage || partition != self.key.partition {
            return Err(DataFusionError::Internal(format!(
                "{}: {} cannot write stage {stage} partition {partition}",
                self.worker, self.key
            )));
        }
        self.shared_store.create_output(
            self.key,
            self.channels,
            self.replicas,
            self.blocking,
            self.output_schema.clone(),
        )
    }
}
