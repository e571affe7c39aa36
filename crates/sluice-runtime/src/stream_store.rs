//! The stream store: the output channels of a job's tasks, kept until their readers take them.
//!
//! ```text
//!   task (stage s, partition p) ──ShuffleWriterExec──► channel set of s/p
//!        channels × replicas receivers:  (c0,r0) (c0,r1) (c1,r0) (c1,r1) …
//!                                           │
//!   consumer task t ──ShuffleReaderExec── take(s, InputKey{p, c, r}) ──► stream
//! ```
//!
//! Every output stream of a task exists once per replica (`JobGraph::replicas`), so each reader takes
//! its own copy. Invariants: each (task, channel, replica) stream is taken at most once (a second take
//! is an error naming the stream, never a silently empty read); memory is bounded by the channel sets'
//! `MemoryPool` reservations with spill to disk; dropping the store (or a taken stream) frees
//! everything still buffered.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, SpillMetrics};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::stream;
use sluice_planner::{InputKey, JobGraph, OutputMode, StageId};
use sluice_shuffle::{ChannelReceiver, ChannelSender, channel_set};

/// A job's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Names one output stream of one task attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskStreamKey {
    /// The job.
    pub job: JobId,
    /// The producer stage.
    pub stage: StageId,
    /// The producer partition.
    pub partition: usize,
    /// The task attempt.
    pub attempt: usize,
    /// The output channel.
    pub channel: usize,
}

impl fmt::Display for TaskStreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {} stage {} partition {} attempt {} channel {}",
            self.job, self.stage, self.partition, self.attempt, self.channel
        )
    }
}

/// Batches queued per channel before a producer waits (when every channel is full).
const CHANNEL_CAPACITY: usize = 2;

struct TaskOutput {
    sender: Option<ChannelSender>,
    receivers: Vec<Option<ChannelReceiver>>,
    channels: usize,
    replicas: usize,
}

/// Where a task's readers get their input streams and its writer its output channels: the in-process
/// [`StreamStore`] of a whole job, or a worker's store plus remote reads for one task.
pub trait TaskStreams: fmt::Debug + Send + Sync {
    /// The stream `key` of `stage`'s output; each may be taken once. The returned stream may connect
    /// lazily, on its first poll.
    fn take_stream(&self, stage: StageId, key: InputKey) -> Result<SendableRecordBatchStream>;

    /// The writer side of task (`stage`, `partition`), taken once by the task that runs it.
    fn take_sender(&self, stage: StageId, partition: usize) -> Result<TaskSender>;
}

/// The streams of one job's tasks in this process; see the module docs.
pub struct StreamStore {
    job: JobId,
    outputs: Mutex<HashMap<(StageId, usize), TaskOutput>>,
    schemas: HashMap<StageId, SchemaRef>,
}

impl fmt::Debug for StreamStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamStore")
            .field("job", &self.job)
            .finish()
    }
}

impl StreamStore {
    /// Creates the output channels of every task of `graph` (attempt 0), with memory from `runtime`.
    pub fn for_graph(job: JobId, graph: &JobGraph, runtime: &Arc<RuntimeEnv>) -> Self {
        let mut outputs = HashMap::new();
        let mut schemas = HashMap::new();
        let spill_metrics = ExecutionPlanMetricsSet::new();
        for (id, stage) in graph.stages().iter().enumerate() {
            let stage_id = StageId(id);
            let channels = stage.distribution.channels();
            let replicas = graph.replicas(stage_id);
            // A blocking output is read only after its producer finished: never make it wait.
            let capacity = match stage.mode {
                OutputMode::Pipelined => CHANNEL_CAPACITY,
                OutputMode::Blocking => usize::MAX,
            };
            let schema = stage.plan.schema();
            schemas.insert(stage_id, schema.clone());
            for partition in 0..stage.partitions() {
                let name = format!("job {job} stage {id} partition {partition}");
                let (sender, receivers) = channel_set(
                    &name,
                    channels * replicas,
                    capacity,
                    schema.clone(),
                    runtime.clone(),
                    SpillMetrics::new(&spill_metrics, partition),
                );
                let output = TaskOutput {
                    sender: Some(sender),
                    receivers: receivers.into_iter().map(Some).collect(),
                    channels,
                    replicas,
                };
                outputs.insert((stage_id, partition), output);
            }
        }
        Self {
            job,
            outputs: Mutex::new(outputs),
            schemas,
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, HashMap<(StageId, usize), TaskOutput>>> {
        self.outputs.lock().map_err(|_| {
            DataFusionError::Internal(format!("job {}: stream store poisoned", self.job))
        })
    }

    fn take_sender_inner(&self, stage: StageId, partition: usize) -> Result<TaskSender> {
        let mut outputs = self.lock()?;
        let Some(output) = outputs.get_mut(&(stage, partition)) else {
            return internal_err!(
                "job {}: stage {stage} has no partition {partition}",
                self.job
            );
        };
        match output.sender.take() {
            Some(sender) => Ok(TaskSender {
                sender,
                channels: output.channels,
                replicas: output.replicas,
            }),
            None => internal_err!(
                "job {}: the output of stage {stage} partition {partition} is already being written",
                self.job
            ),
        }
    }

    pub(crate) fn take_stream_inner(
        &self,
        stage: StageId,
        key: InputKey,
    ) -> Result<SendableRecordBatchStream> {
        let stream_key = TaskStreamKey {
            job: self.job,
            stage,
            partition: key.partition,
            attempt: 0,
            channel: key.channel,
        };
        let receiver = {
            let mut outputs = self.lock()?;
            let Some(output) = outputs.get_mut(&(stage, key.partition)) else {
                return internal_err!("no stream {stream_key}: the task does not exist");
            };
            if key.channel >= output.channels || key.replica >= output.replicas {
                return internal_err!(
                    "no stream {stream_key} replica {}: the task writes {} channels in {} replicas",
                    key.replica,
                    output.channels,
                    output.replicas
                );
            }
            let index = key.channel * output.replicas + key.replica;
            match output.receivers.get_mut(index).and_then(Option::take) {
                Some(receiver) => receiver,
                None => {
                    return internal_err!(
                        "stream {stream_key} replica {} was already read; stage streams are read once",
                        key.replica
                    );
                }
            }
        };
        let schema = self
            .schemas
            .get(&stage)
            .cloned()
            .ok_or_else(|| DataFusionError::Internal(format!("no schema for stage {stage}")))?;
        Ok(receiver_stream(schema, receiver))
    }
}

impl TaskStreams for StreamStore {
    fn take_stream(&self, stage: StageId, key: InputKey) -> Result<SendableRecordBatchStream> {
        self.take_stream_inner(stage, key)
    }

    fn take_sender(&self, stage: StageId, partition: usize) -> Result<TaskSender> {
        self.take_sender_inner(stage, partition)
    }
}

/// A channel receiver as a record-batch stream of `schema`.
pub fn receiver_stream(schema: SchemaRef, receiver: ChannelReceiver) -> SendableRecordBatchStream {
    let batches = stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|batch| (batch, receiver))
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, batches))
}

impl StreamStore {
    /// Drops every stream of `stage` that no reader took: its consumers finished without reading it
    /// (a join that skipped its probe side, a satisfied limit), so its producers must not wait for it.
    pub fn release_stage(&self, stage: StageId) -> Result<()> {
        let mut outputs = self.lock()?;
        for ((s, _), output) in outputs.iter_mut() {
            if *s == stage {
                output.receivers.iter_mut().for_each(|r| drop(r.take()));
            }
        }
        Ok(())
    }
}

/// The writer side of one task's output: every batch for a channel goes to each of its replicas.
pub struct TaskSender {
    sender: ChannelSender,
    channels: usize,
    replicas: usize,
}

impl TaskSender {
    /// The writer of a channel set of `channels × replicas` channels (channel `c`, replica `r` at
    /// index `c * replicas + r`).
    pub fn new(sender: ChannelSender, channels: usize, replicas: usize) -> Self {
        Self {
            sender,
            channels,
            replicas,
        }
    }

    /// Number of channels (replicas excluded).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Sends `batch` to every replica of `channel`; `false` when no reader is left.
    pub async fn send(
        &self,
        channel: usize,
        batch: datafusion::arrow::array::RecordBatch,
    ) -> Result<bool> {
        let mut open = false;
        for replica in 0..self.replicas {
            open |= self
                .sender
                .send(channel * self.replicas + replica, batch.clone())
                .await?;
        }
        Ok(open)
    }
}
