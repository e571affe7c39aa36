//! The stream store: the output channels of the task attempts a worker runs (or ran), kept until their
//! readers take them, they are released, or their job is cleaned up. One store per worker (and one
//! for the driver's executor); the in-process transport reads it directly, the cluster serves it over
//! Arrow Flight.
//!
//! ```text
//!   task attempt (job, stage s, partition p, attempt a) ── create_output ──► output of that attempt
//!      pipelined: channels × replicas channel receivers, each taken once, backpressure, spill
//!      blocking:  one replayable buffer per channel, read by any number of readers, spill
//!   reader ── take(StreamId {stream (…, channel c), replica r}) ──► record-batch stream
//! ```
//!
//! Invariants:
//! - outputs are keyed by attempt, so a retried task's streams never mix with its earlier attempts';
//! - a pipelined stream (channel, replica) is read at most once: a take lends its receiver, and a
//!   receiver given back before it delivered anything (its reader's connection died before the
//!   first batch: the reader tries again) returns to its slot for the next take, which waits for
//!   a lent receiver up to [`LENT_WAIT`]; once a receiver delivered a batch, an error or its end,
//!   a further take is a retryable error naming the stream. A blocking stream is replayable:
//!   every replica and every retried reader reads it all again;
//! - a take that arrives before its task created the output waits (bounded by the read timeout, then
//!   a clear error); a take for a job already cleaned up, or an output released, fails at once;
//! - a release (no consumer will read the rest) drops what the attempt's output still holds, now or,
//!   if the output does not exist yet, when it is created, so a producer never waits for a reader
//!   that will not come;
//! - memory is bounded by `MemoryPool` reservations with spill to disk; removing a job drops every
//!   buffered batch and spill file it still had here;
//! - a stream ends cleanly only after its writer's [`TaskSender::finish`]: a writer that failed
//!   ([`TaskSender::fail`]) or went away (a stopped or panicked attempt) fails every reader, naming
//!   the producing attempt, with a retryable kind (a user error keeps its kind and text).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, SpillMetrics};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{TryStreamExt, stream};
use sluice_planner::{AttemptKey, InputKey, JobId, OutputMode, StageId, StreamId};
use sluice_shuffle::{
    ChannelReceiver, ChannelSender, ReplayReader, ReplayableOutput, Residence, channel_set,
};

use tokio::sync::Notify;

use crate::error::{ErrorKind, RemoteError, sluice_error, transport_error};
use crate::faults::{FaultPoint, FaultPoints};
use crate::memory::blocking_outputs_pool;

/// Batches queued per pipelined channel before a producer waits (when every channel is full).
const CHANNEL_CAPACITY: usize = 2;

/// Jobs remembered as cleaned up, so late reads fail at once instead of waiting.
const CLEANED_JOBS_KEPT: usize = 4096;

/// How long a take of a pipelined stream that an earlier reader holds without having received
/// anything waits for it to be given back: longer than a server needs to see that the earlier
/// reader's connection died (its HTTP/2 pings go unanswered for 2 + 3 s).
pub const LENT_WAIT: Duration = Duration::from_secs(8);

/// Where a task's readers get their input streams and its writer its output channels.
pub trait TaskStreams: fmt::Debug + Send + Sync {
    /// The stream `key` of `stage`'s output. The returned stream may connect lazily, on its first
    /// poll.
    fn take_stream(&self, stage: StageId, key: InputKey) -> Result<SendableRecordBatchStream>;

    /// The writer side of task (`stage`, `partition`), taken once by the task that runs it.
    fn take_sender(&self, stage: StageId, partition: usize) -> Result<TaskSender>;
}

/// One pipelined stream's place in its output.
enum Slot {
    /// Not taken yet, or given back undelivered.
    Ready(ChannelReceiver),
    /// Taken by a reader that has not received anything yet.
    Lent,
    /// Delivered to a reader: never taken again.
    Read,
}

enum Output {
    Pipelined {
        receivers: Vec<Slot>,
        replicas: usize,
        schema: SchemaRef,
    },
    Blocking {
        output: Arc<ReplayableOutput>,
        replicas: usize,
        schema: SchemaRef,
    },
}

impl Output {
    fn untaken(&self) -> usize {
        match self {
            Output::Pipelined { receivers, .. } => receivers
                .iter()
                .filter(|slot| matches!(slot, Slot::Ready(_)))
                .count(),
            Output::Blocking {
                output, replicas, ..
            } => output.channels() * replicas,
        }
    }
}

#[derive(Default)]
struct State {
    outputs: HashMap<AttemptKey, Output>,
    released: HashSet<AttemptKey>,
    cleaned: BTreeSet<JobId>,
}

/// What a store holds, for tests and diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounts {
    /// Task attempt outputs present.
    pub outputs: usize,
    /// Streams a reader could still take.
    pub untaken_streams: usize,
}

/// The stream store of one worker; see the module docs.
pub struct StreamStore {
    name: String,
    state: Mutex<State>,
    changed: Notify,
    runtime: Arc<RuntimeEnv>,
    /// The runtime of blocking outputs: at most half of a limited pool, then files.
    blocking_runtime: Arc<RuntimeEnv>,
    read_timeout: Duration,
}

impl fmt::Debug for StreamStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamStore")
            .field("name", &self.name)
            .finish()
    }
}

/// One taken stream's receiving side.
pub enum StreamReceiver {
    /// A pipelined channel, lent by its store until it delivers.
    Pipelined(LentReceiver),
    /// A reader of a replayable blocking channel.
    Blocking(ReplayReader),
}

impl StreamReceiver {
    /// The next batch, `None` at the end.
    pub async fn recv(&mut self) -> Option<Result<RecordBatch>> {
        match self {
            StreamReceiver::Pipelined(receiver) => receiver.recv().await,
            StreamReceiver::Blocking(reader) => reader.recv().await,
        }
    }
}

/// A pipelined channel's receiver lent to one reader: dropped before it delivered anything, it goes
/// back to its slot in the store (a reader whose connection died before its first batch reads the
/// stream again); once it delivered, its slot is marked read.
pub struct LentReceiver {
    receiver: Option<ChannelReceiver>,
    delivered: bool,
    store: Weak<StreamStore>,
    key: AttemptKey,
    slot: usize,
}

impl LentReceiver {
    async fn recv(&mut self) -> Option<Result<RecordBatch>> {
        let item = match self.receiver.as_mut() {
            Some(receiver) => receiver.recv().await,
            None => None,
        };
        if !self.delivered {
            self.delivered = true;
            if let Some(store) = self.store.upgrade() {
                store.set_slot(self.key, self.slot, Slot::Read);
            }
        }
        item
    }
}

impl Drop for LentReceiver {
    fn drop(&mut self) {
        if self.delivered {
            return;
        }
        if let (Some(store), Some(receiver)) = (self.store.upgrade(), self.receiver.take()) {
            store.set_slot(self.key, self.slot, Slot::Ready(receiver));
        }
    }
}

/// What a take found.
enum Taken {
    Found(SchemaRef, StreamReceiver),
    /// The output does not exist (yet).
    Absent,
    /// The stream is lent to a reader that has not received anything yet.
    Lent,
}

/// A receiver as a record-batch stream of `schema`.
pub fn receiver_stream(schema: SchemaRef, receiver: StreamReceiver) -> SendableRecordBatchStream {
    let batches = stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|batch| (batch, receiver))
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, batches))
}

impl StreamStore {
    /// An empty store named `name` (it names the worker in errors), with memory from `runtime` and
    /// reads waiting at most `read_timeout` for an output to appear.
    pub fn new(name: impl Into<String>, runtime: Arc<RuntimeEnv>, read_timeout: Duration) -> Self {
        Self {
            name: name.into(),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            blocking_runtime: blocking_outputs_pool(&runtime),
            runtime,
            read_timeout,
        }
    }

    /// The runtime whose memory pool and disk the store's buffers use.
    pub fn runtime(&self) -> &Arc<RuntimeEnv> {
        &self.runtime
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| DataFusionError::Internal(format!("{}: stream store poisoned", self.name)))
    }

    /// Creates the output channels of a task attempt and returns their writer.
    pub fn create_output(
        &self,
        key: AttemptKey,
        channels: usize,
        replicas: usize,
        mode: OutputMode,
        schema: SchemaRef,
    ) -> Result<TaskSender> {
        let name = format!("{} {key}", self.name);
        let spill = SpillMetrics::new(&ExecutionPlanMetricsSet::new(), key.partition);
        let spilled_bytes = spill.spilled_bytes.clone();
        let spill_files = spill.spill_file_count.clone();
        let replicas = replicas.max(1);
        let (output, sender) = match mode {
            OutputMode::Pipelined => {
                let (sender, receivers) = channel_set(
                    &name,
                    channels * replicas,
                    CHANNEL_CAPACITY,
                    schema.clone(),
                    self.runtime.clone(),
                    spill,
                );
                let output = Output::Pipelined {
                    receivers: receivers.into_iter().map(Slot::Ready).collect(),
                    replicas,
                    schema,
                };
                (output, SenderKind::Pipelined { sender, replicas })
            }
            OutputMode::Blocking => {
                // Kept for the whole job (lineage, retried readers): in memory within their share
                // of the worker's pool, in files of its work dir beyond it, so they never take
                // the operators' memory.
                let buffer = ReplayableOutput::new(
                    &name,
                    channels,
                    schema.clone(),
                    self.blocking_runtime.clone(),
                    spill,
                    Residence::Memory,
                );
                let output = Output::Blocking {
                    output: Arc::clone(&buffer),
                    replicas,
                    schema,
                };
                (output, SenderKind::Blocking(BlockingWriter(Some(buffer))))
            }
        };
        {
            let mut state = self.lock()?;
            if state.cleaned.contains(&key.job) {
                return Err(transport_error(format!(
                    "{}: job {} was already cleaned up",
                    self.name, key.job
                )));
            }
            if state.outputs.contains_key(&key) {
                return Err(DataFusionError::Internal(format!(
                    "{}: the output of {key} already exists",
                    self.name
                )));
            }
            // Released before it existed: its consumers are done; keep nothing.
            if !state.released.contains(&key) {
                state.outputs.insert(key, output);
            }
        }
        self.changed.notify_waiters();
        Ok(TaskSender {
            kind: sender,
            faults: None,
            name,
            channels,
            spilled_bytes,
            spill_files,
        })
    }

    /// Takes stream `id`, waiting up to the read timeout for its task to create it (and up to
    /// [`LENT_WAIT`] for an undelivered earlier reader to give it back).
    pub async fn take(self: &Arc<Self>, id: StreamId) -> Result<(SchemaRef, StreamReceiver)> {
        let deadline = tokio::time::Instant::now() + self.read_timeout;
        let mut lent_deadline = None;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait_until = match self.try_take(id)? {
                Taken::Found(schema, receiver) => return Ok((schema, receiver)),
                Taken::Absent => deadline,
                Taken::Lent => {
                    *lent_deadline.get_or_insert_with(|| tokio::time::Instant::now() + LENT_WAIT)
                }
            };
            if tokio::time::timeout_at(wait_until, notified).await.is_err() {
                if self.lent(id) {
                    return Err(transport_error(format!(
                        "{}: {id} is held by an earlier reader that received nothing and did not \
                         give it back within {} s; a pipelined task stream is read once",
                        self.name,
                        LENT_WAIT.as_secs_f64()
                    )));
                }
                if tokio::time::Instant::now() < deadline {
                    continue;
                }
                return Err(transport_error(format!(
                    "{}: {id} did not appear within {} s (its task never started here)",
                    self.name,
                    self.read_timeout.as_secs_f64()
                )));
            }
        }
    }

    /// Whether stream `id` is lent to a reader that has not received anything yet.
    fn lent(&self, id: StreamId) -> bool {
        let Ok(state) = self.lock() else {
            return false;
        };
        match state.outputs.get(&id.attempt_key()) {
            Some(Output::Pipelined {
                receivers,
                replicas,
                ..
            }) => matches!(
                receivers.get(id.stream.channel * *replicas + id.replica),
                Some(Slot::Lent)
            ),
            _ => false,
        }
    }

    /// Puts `slot` of `key`'s pipelined output in `to`, if the output still exists and the slot is
    /// lent; wakes waiting takes.
    fn set_slot(&self, key: AttemptKey, slot: usize, to: Slot) {
        let replaced = {
            let Ok(mut state) = self.lock() else {
                return;
            };
            match state.outputs.get_mut(&key) {
                Some(Output::Pipelined { receivers, .. }) => match receivers.get_mut(slot) {
                    Some(place @ Slot::Lent) => {
                        *place = to;
                        None
                    }
                    _ => Some(to),
                },
                _ => Some(to),
            }
        };
        // A receiver that has no place any more (its output was released or removed) is dropped
        // outside the lock.
        drop(replaced);
        self.changed.notify_waiters();
    }

    /// Stream `id` as a lazy record-batch stream of `schema`: the take happens on its first poll.
    pub fn take_stream(
        self: &Arc<Self>,
        id: StreamId,
        schema: SchemaRef,
    ) -> SendableRecordBatchStream {
        let store = Arc::clone(self);
        let read = async move {
            let (schema, receiver) = store.take(id).await?;
            Ok::<_, DataFusionError>(receiver_stream(schema, receiver))
        };
        Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream::once(read).try_flatten(),
        ))
    }

    fn try_take(self: &Arc<Self>, id: StreamId) -> Result<Taken> {
        let mut state = self.lock()?;
        if state.cleaned.contains(&id.stream.job) {
            return Err(transport_error(format!(
                "{}: {id} is gone: job {} was cleaned up",
                self.name, id.stream.job
            )));
        }
        if state.released.contains(&id.attempt_key()) {
            return Err(transport_error(format!(
                "{}: {id} was released: every consumer of its task finished",
                self.name
            )));
        }
        let Some(output) = state.outputs.get_mut(&id.attempt_key()) else {
            return Ok(Taken::Absent);
        };
        let channel = id.stream.channel;
        match output {
            Output::Pipelined {
                receivers,
                replicas,
                schema,
            } => {
                let channels = receivers.len() / (*replicas).max(1);
                if channel >= channels || id.replica >= *replicas {
                    return Err(DataFusionError::Internal(format!(
                        "{}: no {id}: the task writes {channels} channels in {replicas} replicas",
                        self.name
                    )));
                }
                let slot = channel * *replicas + id.replica;
                let Some(place) = receivers.get_mut(slot) else {
                    return Ok(Taken::Absent);
                };
                match std::mem::replace(place, Slot::Lent) {
                    Slot::Ready(receiver) => {
                        let lent = LentReceiver {
                            receiver: Some(receiver),
                            delivered: false,
                            store: Arc::downgrade(self),
                            key: id.attempt_key(),
                            slot,
                        };
                        Ok(Taken::Found(
                            schema.clone(),
                            StreamReceiver::Pipelined(lent),
                        ))
                    }
                    Slot::Lent => Ok(Taken::Lent),
                    Slot::Read => {
                        *place = Slot::Read;
                        Err(transport_error(format!(
                            "{}: {id} was already read; a pipelined task stream is read once",
                            self.name
                        )))
                    }
                }
            }
            Output::Blocking {
                output,
                replicas,
                schema,
            } => {
                if id.replica >= *replicas {
                    return Err(DataFusionError::Internal(format!(
                        "{}: no {id}: the task writes {replicas} replicas",
                        self.name
                    )));
                }
                let reader = output.reader(channel)?;
                Ok(Taken::Found(
                    schema.clone(),
                    StreamReceiver::Blocking(reader),
                ))
            }
        }
    }

    /// No consumer will read more of attempt `key`'s output: drops what the store still holds of it,
    /// now or when the attempt creates it.
    pub fn release(&self, key: AttemptKey) -> Result<()> {
        let removed = {
            let mut state = self.lock()?;
            if state.cleaned.contains(&key.job) {
                return Ok(());
            }
            state.released.insert(key);
            state.outputs.remove(&key)
        };
        drop(removed);
        Ok(())
    }

    /// Removes one attempt's output (a stopped or replaced attempt).
    pub fn remove_attempt(&self, key: AttemptKey) -> Result<()> {
        let removed = self.lock()?.outputs.remove(&key);
        drop(removed);
        Ok(())
    }

    /// Removes everything of `job` and fails later reads of it at once.
    pub fn remove_job(&self, job: JobId) -> Result<()> {
        let removed: Vec<Output> = {
            let mut state = self.lock()?;
            state.released.retain(|key| key.job != job);
            state.cleaned.insert(job);
            while state.cleaned.len() > CLEANED_JOBS_KEPT {
                state.cleaned.pop_first();
            }
            let keys: Vec<AttemptKey> = state
                .outputs
                .keys()
                .filter(|k| k.job == job)
                .copied()
                .collect();
            keys.iter()
                .filter_map(|k| state.outputs.remove(k))
                .collect()
        };
        drop(removed);
        self.changed.notify_waiters();
        Ok(())
    }

    /// The jobs whose outputs the store holds now.
    pub fn jobs(&self) -> BTreeSet<JobId> {
        self.lock()
            .map(|state| state.outputs.keys().map(|key| key.job).collect())
            .unwrap_or_default()
    }

    /// What the store holds now.
    pub fn counts(&self) -> StoreCounts {
        let Ok(state) = self.lock() else {
            return StoreCounts::default();
        };
        StoreCounts {
            outputs: state.outputs.len(),
            untaken_streams: state.outputs.values().map(Output::untaken).sum(),
        }
    }
}

/// A blocking output's writer: finishing or failing ends the output that way; going away without
/// either (a stopped or panicked attempt) abandons it, which fails its readers.
struct BlockingWriter(Option<Arc<ReplayableOutput>>);

impl Drop for BlockingWriter {
    fn drop(&mut self) {
        if let Some(output) = self.0.take() {
            output.abandon();
        }
    }
}

enum SenderKind {
    Pipelined {
        sender: ChannelSender,
        replicas: usize,
    },
    Blocking(BlockingWriter),
}

/// The writer side of one task attempt's output. Its readers see a clean end only after
/// [`finish`](Self::finish); dropping it without finishing fails them.
pub struct TaskSender {
    kind: SenderKind,
    /// The writing worker's fault points (`spill_write` fires after a spill of this output).
    faults: Option<Arc<FaultPoints>>,
    /// The output's name in errors: the worker and the attempt.
    name: String,
    channels: usize,
    spilled_bytes: Count,
    spill_files: Count,
}

impl TaskSender {
    /// Spill files the store wrote of this output so far (keeps counting after the sender is gone).
    pub fn spill_files(&self) -> Count {
        self.spill_files.clone()
    }

    /// Bytes the store spilled of this output so far (its buffers, when the pool was full); the
    /// counter keeps counting after the sender is gone.
    pub fn spilled_bytes(&self) -> Count {
        self.spilled_bytes.clone()
    }

    /// Number of channels (replicas excluded).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Arms `faults` (the writing worker's) on this output.
    pub fn with_faults(mut self, faults: Option<Arc<FaultPoints>>) -> Self {
        self.faults = faults;
        self
    }

    /// Sends `batch` to `channel` (every replica of it); `false` when no reader is left.
    pub async fn send(&self, channel: usize, batch: RecordBatch) -> Result<bool> {
        let Some(faults) = &self.faults else {
            return self.send_batch(channel, batch).await;
        };
        let spills = self.spill_files.value();
        let open = self.send_batch(channel, batch).await?;
        if self.spill_files.value() > spills {
            faults.fire(FaultPoint::SpillWrite).await?;
        }
        Ok(open)
    }

    async fn send_batch(&self, channel: usize, batch: RecordBatch) -> Result<bool> {
        match &self.kind {
            SenderKind::Pipelined { sender, replicas } => {
                let mut open = false;
                for replica in 0..*replicas {
                    open |= sender
                        .send(channel * replicas + replica, batch.clone())
                        .await?;
                }
                Ok(open)
            }
            SenderKind::Blocking(BlockingWriter(Some(output))) => {
                output.append(channel, batch)?;
                Ok(true)
            }
            SenderKind::Blocking(BlockingWriter(None)) => Err(DataFusionError::Internal(format!(
                "{}: written after its end",
                self.name
            ))),
        }
    }

    /// The attempt wrote its last batch: readers end after what they have not read yet.
    pub fn finish(self) {
        match self.kind {
            SenderKind::Pipelined { sender, .. } => sender.finish(),
            SenderKind::Blocking(mut writer) => {
                if let Some(output) = writer.0.take() {
                    output.finish();
                }
            }
        }
    }

    /// The attempt failed with `error`: every reader fails at once with [`Self::reader_error`].
    pub fn fail(self, error: &DataFusionError) {
        let reader_error = self.reader_error(error);
        match self.kind {
            SenderKind::Pipelined { sender, .. } => sender.fail(reader_error),
            SenderKind::Blocking(mut writer) => {
                if let Some(output) = writer.0.take() {
                    output.fail(reader_error);
                }
            }
        }
    }

    /// What a reader of this output gets when its attempt failed with `error`: a user error as
    /// it is (the same text local mode shows, never retried), anything else as a retryable
    /// failure naming this output (worker and attempt) over the attempt's error.
    fn reader_error(&self, error: &DataFusionError) -> DataFusionError {
        let remote = RemoteError::of(error);
        if remote.kind == ErrorKind::User {
            return remote.to_error();
        }
        sluice_error(
            ErrorKind::Transport,
            format!(
                "{} is incomplete: its task failed before the end of its output: {remote}",
                self.name
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::Int32Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use futures::StreamExt;

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("v", DataType::Int32, false)]))
    }

    fn batch(values: &[i32]) -> RecordBatch {
        RecordBatch::try_new(schema(), vec![Arc::new(Int32Array::from(values.to_vec()))]).unwrap()
    }

    fn key(attempt: usize) -> AttemptKey {
        AttemptKey {
            job: JobId(1),
            stage: StageId(0),
            partition: 0,
            attempt,
        }
    }

    fn store() -> Arc<StreamStore> {
        Arc::new(StreamStore::new(
            "worker 1",
            Arc::new(RuntimeEnv::default()),
            Duration::from_millis(200),
        ))
    }

    async fn rows(store: &Arc<StreamStore>, id: StreamId) -> Result<Vec<i32>> {
        let mut stream = store.take_stream(id, schema());
        let mut values = Vec::new();
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int32Array>()
                .unwrap();
            values.extend(column.values().iter().copied());
        }
        Ok(values)
    }

    #[tokio::test]
    async fn a_pipelined_stream_is_read_once_and_a_blocking_one_again_and_again() {
        let store = store();
        let sender = store
            .create_output(key(0), 1, 1, OutputMode::Pipelined, schema())
            .unwrap();
        let blocking = store
            .create_output(key(1), 2, 3, OutputMode::Blocking, schema())
            .unwrap();
        let id = key(0).stream(0).replica(0);
        let reading = tokio::spawn({
            let store = store.clone();
            async move { rows(&store, id).await }
        });
        assert!(sender.send(0, batch(&[1, 2])).await.unwrap());
        sender.finish();
        assert_eq!(reading.await.unwrap().unwrap(), [1, 2]);
        let again = rows(&store, id).await.unwrap_err().to_string();
        assert!(again.contains("was already read"), "{again}");

        blocking.send(1, batch(&[7])).await.unwrap();
        blocking.send(1, batch(&[8, 9])).await.unwrap();
        blocking.finish();
        for replica in 0..3 {
            assert_eq!(
                rows(&store, key(1).stream(1).replica(replica))
                    .await
                    .unwrap(),
                [7, 8, 9]
            );
        }
        // Read again (a retried consumer).
        assert_eq!(
            rows(&store, key(1).stream(1).replica(0)).await.unwrap(),
            [7, 8, 9]
        );
        assert!(
            rows(&store, key(1).stream(0).replica(0))
                .await
                .unwrap()
                .is_empty()
        );
    }

    async fn received(receiver: StreamReceiver) -> Result<Vec<i32>> {
        let mut stream = receiver_stream(schema(), receiver);
        let mut values = Vec::new();
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int32Array>()
                .unwrap();
            values.extend(column.values().iter().copied());
        }
        Ok(values)
    }

    #[tokio::test(start_paused = true)]
    async fn a_pipelined_stream_given_back_before_it_delivered_is_taken_again_and_read_once() {
        let store = store();
        let sender = store
            .create_output(key(0), 1, 1, OutputMode::Pipelined, schema())
            .unwrap();
        let id = key(0).stream(0).replica(0);
        // A reader takes the stream and goes away before anything arrived (its connection died).
        let (_, first) = store.take(id).await.unwrap();
        assert_eq!(store.counts().untaken_streams, 0);
        // The next take waits while it is lent, and gets it once it is given back.
        let second = store.take(id);
        tokio::pin!(second);
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(first);
        let (_, again) = second.await.unwrap();
        assert!(sender.send(0, batch(&[1, 2])).await.unwrap());
        sender.finish();
        assert_eq!(received(again).await.unwrap(), [1, 2]);
        // Delivered: a further take is a retryable error naming the stream.
        let error = store.take(id).await.err().unwrap();
        assert_eq!(ErrorKind::of(&error), ErrorKind::Transport);
        assert_eq!(
            error.to_string(),
            format!(
                "External error: worker 1: {id} was already read; a pipelined task stream is read once"
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_take_of_a_stream_held_by_a_silent_reader_fails_after_the_lent_wait() {
        let store = store();
        let _sender = store
            .create_output(key(0), 1, 1, OutputMode::Pipelined, schema())
            .unwrap();
        let id = key(0).stream(0).replica(0);
        let (_, _held) = store.take(id).await.unwrap();
        let started = tokio::time::Instant::now();
        let error = store.take(id).await.err().unwrap().to_string();
        assert_eq!(started.elapsed(), LENT_WAIT);
        assert!(
            error.contains(&format!(
                "worker 1: {id} is held by an earlier reader that received nothing and did not \
                 give it back within 8 s"
            )),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_writer_that_fails_or_goes_away_fails_its_readers_naming_the_attempt() {
        for mode in [OutputMode::Pipelined, OutputMode::Blocking] {
            let store = store();
            let id = |attempt| key(attempt).stream(0).replica(0);
            // Dropped mid-stream (a stopped or panicked attempt).
            let sender = store.create_output(key(0), 1, 1, mode, schema()).unwrap();
            sender.send(0, batch(&[1, 2])).await.unwrap();
            drop(sender);
            let error = rows(&store, id(0)).await.unwrap_err();
            assert_eq!(
                error.to_string(),
                "External error: worker 1 job 1 stage 0 partition 0 attempt 0 is incomplete: its \
                 writer went away before the end of its output (its task failed, was stopped or \
                 panicked)",
                "{mode:?}"
            );
            assert_eq!(ErrorKind::of(&error), ErrorKind::Transport, "{mode:?}");
            // Failed with an environment error: retryable, naming the attempt and the cause.
            let sender = store.create_output(key(1), 1, 1, mode, schema()).unwrap();
            sender.send(0, batch(&[1])).await.unwrap();
            sender.fail(&DataFusionError::ResourcesExhausted(
                "sort needs 9 MB".into(),
            ));
            let error = rows(&store, id(1)).await.unwrap_err();
            assert_eq!(
                error.to_string(),
                "External error: worker 1 job 1 stage 0 partition 0 attempt 1 is incomplete: its \
                 task failed before the end of its output: Resources exhausted: sort needs 9 MB",
                "{mode:?}"
            );
            assert_eq!(ErrorKind::of(&error), ErrorKind::Transport, "{mode:?}");
            // Failed with a user error: the reader fails with the same error, never retried.
            let sender = store.create_output(key(2), 1, 1, mode, schema()).unwrap();
            sender.fail(&DataFusionError::ArrowError(
                Box::new(datafusion::arrow::error::ArrowError::DivideByZero),
                None,
            ));
            let error = rows(&store, id(2)).await.unwrap_err();
            assert_eq!(
                error.to_string(),
                "Arrow error: Divide by zero error",
                "{mode:?}"
            );
            assert_eq!(ErrorKind::of(&error), ErrorKind::User, "{mode:?}");
        }
    }

    #[tokio::test]
    async fn a_read_before_the_output_waits_and_times_out_naming_the_stream() {
        let store = store();
        let id = key(0).stream(0).replica(0);
        let error = rows(&store, id).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "External error: worker 1: stream job 1 stage 0 partition 0 attempt 0 channel 0 \
             replica 0 did not appear within 0.2 s (its task never started here)"
        );
        assert_eq!(
            crate::error::ErrorKind::of(&error),
            crate::error::ErrorKind::Transport
        );
    }

    #[tokio::test]
    async fn a_release_before_the_output_exists_applies_when_it_is_created() {
        let store = store();
        store.release(key(0)).unwrap();
        let sender = store
            .create_output(key(0), 1, 1, OutputMode::Pipelined, schema())
            .unwrap();
        // No reader will come: the producer learns at once and stops.
        assert!(!sender.send(0, batch(&[1])).await.unwrap());
        assert_eq!(store.counts(), StoreCounts::default());
        let error = rows(&store, key(0).stream(0).replica(0)).await.unwrap_err();
        assert!(error.to_string().contains("was released"), "{error}");
    }

    #[tokio::test]
    async fn removing_a_job_frees_its_outputs_and_fails_later_reads_at_once() {
        let store = store();
        let _sender = store
            .create_output(key(0), 2, 1, OutputMode::Pipelined, schema())
            .unwrap();
        assert_eq!(
            store.counts(),
            StoreCounts {
                outputs: 1,
                untaken_streams: 2
            }
        );
        store.remove_job(JobId(1)).unwrap();
        assert_eq!(store.counts(), StoreCounts::default());
        let error = rows(&store, key(0).stream(0).replica(0)).await.unwrap_err();
        assert!(
            error.to_string().contains("job 1 was cleaned up"),
            "{error}"
        );
        assert!(
            store
                .create_output(key(1), 1, 1, OutputMode::Pipelined, schema())
                .is_err()
        );
    }
}
