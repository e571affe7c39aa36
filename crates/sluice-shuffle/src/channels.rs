//! Channel buffers between a shuffle's producers and its consumers: bounded memory, backpressure, spill.
//!
//! ```text
//!  producers ──send(channel, batch)──►  channel 0: [mem][mem][spilled][mem] ──recv──► consumer 0
//!     (cloned ChannelSender)            channel 1: [mem]                     ──recv──► consumer 1
//!                                       channel 2: (empty)                   ──recv──► consumer 2
//! ```
//!
//! Invariants:
//! - **FIFO per channel**: a consumer receives one producer's batches in the order they were sent,
//!   whether each was kept in memory or spilled to disk.
//! - **Backpressure like DataFusion's gate**: a send waits only while *every* open channel is full (holds
//!   `capacity` or more batches). One slow consumer does not stall the others; if it falls far behind,
//!   memory stays bounded because of the next rule.
//! - **Bounded memory**: each channel holds a `MemoryReservation` in the runtime's `MemoryPool`. When a
//!   reservation cannot grow, the batch goes to a spill file (Arrow IPC, lz4) instead, and is read back in
//!   its turn. Spill files are deleted as soon as they are read, or when the channel is dropped.
//! - **Explicit end**: the channels end (after what is buffered) only when every sender has called
//!   [`ChannelSender::finish`]. A sender that fails ([`ChannelSender::fail`]) or is dropped without
//!   finishing (a stopped task, a panic) makes every receiver return an error at once, never a clean
//!   end: a consumer never mistakes a failed producer's partial output for all of it
//!   (`stream_end`).
//! - **Cancellation**: dropping a receiver frees its reservation and files and makes sends to it no-ops.
//!   A `recv` dropped before it returned (mid-way through reading a spilled batch back) loses no
//!   batch: the receiver reads that one again first. Nothing here spawns a task.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion_common::config::SpillCompression;
use datafusion_common::utils::memory::get_record_batch_memory_size;
use datafusion_common::{DataFusionError, Result};
use datafusion_execution::SpillFile;
use datafusion_execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion_execution::runtime_env::RuntimeEnv;
use datafusion_physical_plan::metrics::SpillMetrics;
use datafusion_physical_plan::spill::SpillManager;
use futures::StreamExt;
use tokio::sync::Notify;

use crate::stream_end::WriterEnd;

enum Entry {
    Memory { batch: RecordBatch, bytes: usize },
    Spilled { file: Arc<dyn SpillFile> },
}

struct Channel {
    queue: VecDeque<Entry>,
    reservation: MemoryReservation,
    open: bool,
}

struct State {
    channels: Vec<Channel>,
    senders: usize,
    end: WriterEnd,
}

struct Shared {
    state: Mutex<State>,
    capacity: usize,
    space: Notify,
    data: Vec<Notify>,
    spill: SpillManager,
    name: String,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| {
            DataFusionError::Internal(format!("{}: channel state poisoned", self.name))
        })
    }
}

impl State {
    fn open_channels(&self) -> usize {
        self.channels.iter().filter(|c| c.open).count()
    }

    fn all_open_full(&self, capacity: usize) -> bool {
        self.channels
            .iter()
            .filter(|c| c.open)
            .all(|c| c.queue.len() >= capacity)
    }
}

/// Creates `channels` channels for batches of `schema`; `name` identifies them in memory-pool reports
/// and errors (e.g. `"job 3 stage 1 partition 0"`). A channel is full at `capacity` queued batches.
pub fn channel_set(
    name: &str,
    channels: usize,
    capacity: usize,
    schema: SchemaRef,
    runtime: Arc<RuntimeEnv>,
    spill_metrics: SpillMetrics,
) -> (ChannelSender, Vec<ChannelReceiver>) {
    let spill = SpillManager::new(runtime.clone(), spill_metrics, schema)
        .with_compression_type(SpillCompression::Lz4Frame);
    let state = State {
        channels: (0..channels)
            .map(|i| Channel {
                queue: VecDeque::new(),
                reservation: MemoryConsumer::new(format!("{name} channel {i}"))
                    .register(&runtime.memory_pool),
                open: true,
            })
            .collect(),
        senders: 1,
        end: WriterEnd::Clean,
    };
    let shared = Arc::new(Shared {
        state: Mutex::new(state),
        capacity: capacity.max(1),
        space: Notify::new(),
        data: (0..channels).map(|_| Notify::new()).collect(),
        spill,
        name: name.to_string(),
    });
    let receivers = (0..channels)
        .map(|channel| ChannelReceiver {
            shared: shared.clone(),
            channel,
            ended: false,
            spilled_head: None,
        })
        .collect();
    (
        ChannelSender {
            shared,
            finished: false,
        },
        receivers,
    )
}

/// The producing side; clone it for several producers. The channels end cleanly once every clone
/// has called [`finish`](Self::finish); a clone dropped without it fails every receiver.
pub struct ChannelSender {
    shared: Arc<Shared>,
    finished: bool,
}

impl Clone for ChannelSender {
    fn clone(&self) -> Self {
        if let Ok(mut state) = self.shared.lock() {
            state.senders += 1;
        }
        Self {
            shared: self.shared.clone(),
            finished: false,
        }
    }
}

impl Drop for ChannelSender {
    fn drop(&mut self) {
        if let Ok(mut state) = self.shared.lock() {
            state.senders = state.senders.saturating_sub(1);
            if !self.finished {
                state.end.abandon();
            }
        }
        for notify in &self.shared.data {
            notify.notify_waiters();
        }
    }
}

impl ChannelSender {
    /// This producer sent its last batch: once every producer finished, receivers end after what
    /// is buffered.
    pub fn finish(mut self) {
        self.finished = true;
    }

    /// This producer failed: every receiver gets `error` at once (and then its end), whatever is
    /// still buffered.
    pub fn fail(mut self, error: DataFusionError) {
        if let Ok(mut state) = self.shared.lock() {
            state.end.fail(error);
        }
        self.finished = true;
    }

    /// Queues `batch` for `channel`, waiting while every open channel is full. Returns `false` when no
    /// consumer is left at all (the producer may stop); a batch for a channel whose consumer is gone is
    /// dropped.
    pub async fn send(&self, channel: usize, batch: RecordBatch) -> Result<bool> {
        let shared = &self.shared;
        if channel >= shared.data.len() {
            return Err(DataFusionError::Internal(format!(
                "{}: channel {channel} out of range ({} channels)",
                shared.name,
                shared.data.len()
            )));
        }
        let bytes = get_record_batch_memory_size(&batch);
        loop {
            let space = shared.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            let must_wait = {
                let mut state = shared.lock()?;
                if state.open_channels() == 0 {
                    return Ok(false);
                }
                if state.all_open_full(shared.capacity) {
                    true
                } else {
                    let target = &mut state.channels[channel];
                    if !target.open {
                        return Ok(true);
                    }
                    if target.reservation.try_grow(bytes).is_ok() {
                        target.queue.push_back(Entry::Memory { batch, bytes });
                        drop(state);
                        shared.data[channel].notify_waiters();
                        return Ok(true);
                    }
                    false
                }
            };
            if must_wait {
                space.await;
                continue;
            }
            // The pool is exhausted: write the batch to disk, outside the lock.
            let file = shared
                .spill
                .spill_record_batch_and_finish(std::slice::from_ref(&batch), &shared.name)?;
            if let Some(file) = file {
                let mut state = shared.lock()?;
                let target = &mut state.channels[channel];
                if target.open {
                    target.queue.push_back(Entry::Spilled { file });
                }
                drop(state);
                shared.data[channel].notify_waiters();
            }
            return Ok(true);
        }
    }
}

/// The consuming side of one channel.
pub struct ChannelReceiver {
    shared: Arc<Shared>,
    channel: usize,
    /// It returned its end, or the error that ended it.
    ended: bool,
    /// The spilled batch at the channel's head, taken off the queue and being read back: kept
    /// until its read completes, so a `recv` dropped mid-read loses nothing (the next one reads it
    /// again, first).
    spilled_head: Option<Arc<dyn SpillFile>>,
}

impl ChannelReceiver {
    /// The channel's index.
    pub fn channel(&self) -> usize {
        self.channel
    }

    /// The next batch; `None` once every sender finished and the queue is empty. If a sender
    /// failed or went away without finishing, its error (once, at once), then `None`.
    /// Cancel-safe: a call dropped before it returned took no batch from the channel.
    pub async fn recv(&mut self) -> Option<Result<RecordBatch>> {
        if self.ended {
            return None;
        }
        if let Some(file) = self.spilled_head.clone() {
            // A sender's failure still comes first, as for a batch taken from the queue.
            let failed = match self.shared.lock() {
                Ok(state) => state.end.reader_error(&self.shared.name),
                Err(error) => Some(error),
            };
            if let Some(error) = failed {
                self.ended = true;
                return Some(Err(error));
            }
            return Some(self.read_spilled_head(file).await);
        }
        let shared = self.shared.clone();
        loop {
            let data = shared.data[self.channel].notified();
            tokio::pin!(data);
            data.as_mut().enable();
            let entry = {
                let mut state = match shared.lock() {
                    Ok(state) => state,
                    Err(error) => return Some(Err(error)),
                };
                if let Some(error) = state.end.reader_error(&shared.name) {
                    self.ended = true;
                    return Some(Err(error));
                }
                let channel = &mut state.channels[self.channel];
                match channel.queue.pop_front() {
                    Some(entry) => {
                        if let Entry::Memory { bytes, .. } = &entry {
                            channel.reservation.shrink(*bytes);
                        }
                        if channel.queue.len() + 1 == shared.capacity {
                            drop(state);
                            shared.space.notify_waiters();
                        }
                        Some(entry)
                    }
                    None if state.senders == 0 => {
                        self.ended = true;
                        return None;
                    }
                    None => None,
                }
            };
            match entry {
                Some(Entry::Memory { batch, .. }) => return Some(Ok(batch)),
                Some(Entry::Spilled { file }) => return Some(self.read_spilled_head(file).await),
                None => data.await,
            }
        }
    }

    /// Reads the channel's spilled head `file` back, keeping it as `spilled_head` until read (a
    /// call dropped meanwhile leaves it for the next one); once read, the receiver lets go of the
    /// file, which deletes it.
    async fn read_spilled_head(&mut self, file: Arc<dyn SpillFile>) -> Result<RecordBatch> {
        self.spilled_head = Some(Arc::clone(&file));
        let batch =
            read_spilled_batch(&self.shared.spill, file, &self.shared.name, self.channel).await;
        self.spilled_head = None;
        batch
    }
}

/// The one batch a spill file of `channel` of `name` holds.
pub(crate) async fn read_spilled_batch(
    spill: &SpillManager,
    file: Arc<dyn SpillFile>,
    name: &str,
    channel: usize,
) -> Result<RecordBatch> {
    let mut stream = spill.read_spill_as_stream_unbuffered(file, None)?;
    stream.next().await.ok_or_else(|| {
        DataFusionError::Internal(format!(
            "{name} channel {channel}: spill file holds no batch"
        ))
    })?
}

impl Drop for ChannelReceiver {
    fn drop(&mut self) {
        if let Ok(mut state) = self.shared.lock() {
            let channel = &mut state.channels[self.channel];
            channel.open = false;
            channel.queue.clear();
            channel.reservation.free();
        }
        self.shared.space.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use arrow::array::{Array, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion_execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
    use datafusion_execution::memory_pool::GreedyMemoryPool;
    use datafusion_execution::runtime_env::RuntimeEnvBuilder;
    use datafusion_physical_plan::metrics::ExecutionPlanMetricsSet;

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]))
    }

    fn batch(start: i64, rows: i64) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![Arc::new(Int64Array::from_iter_values(start..start + rows))],
        )
        .unwrap()
    }

    fn runtime(pool_bytes: usize, spill_dir: &std::path::Path) -> Arc<RuntimeEnv> {
        RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(GreedyMemoryPool::new(pool_bytes)))
            .with_disk_manager_builder(
                DiskManagerBuilder::default()
                    .with_mode(DiskManagerMode::Directories(vec![spill_dir.to_path_buf()])),
            )
            .build_arc()
            .unwrap()
    }

    fn set(
        channels: usize,
        capacity: usize,
        runtime: Arc<RuntimeEnv>,
    ) -> (ChannelSender, Vec<ChannelReceiver>) {
        let metrics = ExecutionPlanMetricsSet::new();
        channel_set(
            "test",
            channels,
            capacity,
            schema(),
            runtime,
            SpillMetrics::new(&metrics, 0),
        )
    }

    fn files_in(dir: &std::path::Path) -> usize {
        walk(dir)
    }

    fn walk(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| {
                        if e.path().is_dir() {
                            walk(&e.path())
                        } else {
                            1
                        }
                    })
                    .sum()
            })
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn ten_times_the_pool_through_a_slow_consumer_in_order_without_leftover_files() {
        let dir = tempfile::tempdir().unwrap();
        let pool = 256 * 1024;
        let runtime = runtime(pool, dir.path());
        // Two channels: channel 1 stays empty, so the gate never closes and channel 0 must spill.
        let (sender, mut receivers) = set(2, 2, runtime.clone());
        let mut consumer = receivers.remove(0);
        let rows_per_batch = 4096i64; // 32 KiB of Int64 values per batch
        let batches = (10 * pool as i64) / (rows_per_batch * 8);
        let producer = async move {
            for i in 0..batches {
                assert!(
                    sender
                        .send(0, batch(i * rows_per_batch, rows_per_batch))
                        .await
                        .unwrap()
                );
            }
            sender.finish();
        };
        let reader = async move {
            let mut next = 0i64;
            while let Some(batch) = consumer.recv().await {
                let batch = batch.unwrap();
                let values = batch
                    .column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap();
                for v in values.values() {
                    assert_eq!(*v, next);
                    next += 1;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            next
        };
        let ((), read) = tokio::join!(producer, reader);
        assert_eq!(read, batches * rows_per_batch);
        drop(receivers);
        assert_eq!(runtime.memory_pool.reserved(), 0);
        assert_eq!(files_in(dir.path()), 0, "spill files left behind");
    }

    /// The values of `batches`, in order.
    fn values_of(batches: &[RecordBatch]) -> Vec<i64> {
        batches
            .iter()
            .flat_map(|b| {
                let values = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                values.values().to_vec()
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_receive_dropped_while_reading_a_spilled_batch_back_loses_no_batch() {
        let dir = tempfile::tempdir().unwrap();
        // No pool memory at all: every batch is spilled.
        let runtime = runtime(0, dir.path());
        let (sender, mut receivers) = set(1, 128, runtime);
        let mut receiver = receivers.remove(0);
        for i in 0..100 {
            assert!(sender.send(0, batch(i * 10, 10)).await.unwrap());
        }
        sender.finish();
        assert_eq!(files_in(dir.path()), 100);
        let mut received = Vec::new();
        let mut dropped_mid_read = 0;
        loop {
            // Each batch: one poll, which starts reading the spill file back (on a blocking
            // thread: often still pending), then the call is dropped; the next call must
            // return that same batch.
            let mut first = Box::pin(receiver.recv());
            match futures::poll!(first.as_mut()) {
                std::task::Poll::Ready(Some(batch)) => received.push(batch.unwrap()),
                std::task::Poll::Ready(None) => break,
                std::task::Poll::Pending => {
                    drop(first);
                    dropped_mid_read += 1;
                    match receiver.recv().await {
                        Some(batch) => received.push(batch.unwrap()),
                        None => break,
                    }
                }
            }
        }
        // The first value of each batch received, then every value.
        let firsts: Vec<i64> = received
            .iter()
            .map(|b| values_of(std::slice::from_ref(b))[0])
            .collect();
        assert_eq!(firsts, (0..100).map(|i| i * 10).collect::<Vec<_>>());
        assert_eq!(values_of(&received), (0..1000).collect::<Vec<_>>());
        // Reading back often completes within the first poll; some reads must have been dropped.
        assert!(dropped_mid_read >= 1, "{dropped_mid_read} reads dropped");
        assert_eq!(files_in(dir.path()), 0, "spill files left behind");
    }

    #[tokio::test]
    async fn producers_wait_only_when_every_channel_is_full() {
        let dir = tempfile::tempdir().unwrap();
        let (sender, mut receivers) = set(2, 1, runtime(1 << 30, dir.path()));
        // Channel 0 full, channel 1 empty: sends keep going.
        sender.send(0, batch(0, 1)).await.unwrap();
        sender.send(0, batch(1, 1)).await.unwrap();
        // Fill channel 1 too: every channel is full, the next send must wait.
        sender.send(1, batch(2, 1)).await.unwrap();
        let blocked =
            tokio::time::timeout(Duration::from_millis(50), sender.send(0, batch(3, 1))).await;
        assert!(
            blocked.is_err(),
            "send should wait while all channels are full"
        );
        // Draining channel 1 below capacity opens the gate.
        let first = receivers[1].recv().await.unwrap().unwrap();
        assert_eq!(first.num_rows(), 1);
        let sent = tokio::time::timeout(Duration::from_secs(5), sender.send(0, batch(3, 1))).await;
        assert!(matches!(sent, Ok(Ok(true))));
    }

    #[tokio::test]
    async fn dropping_receivers_releases_memory_and_files_and_unblocks_senders() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = runtime(64 * 1024, dir.path());
        let (sender, receivers) = set(1, 1000, runtime.clone());
        for i in 0..20 {
            sender.send(0, batch(i * 1000, 1000)).await.unwrap();
        }
        assert!(runtime.memory_pool.reserved() > 0);
        assert!(files_in(dir.path()) > 0, "the test should have spilled");
        drop(receivers);
        assert_eq!(runtime.memory_pool.reserved(), 0);
        assert_eq!(files_in(dir.path()), 0);
        assert!(
            !sender.send(0, batch(0, 1)).await.unwrap(),
            "no consumer left"
        );
    }

    #[tokio::test]
    async fn finished_senders_end_the_channels_after_the_buffered_batches() {
        let dir = tempfile::tempdir().unwrap();
        let (sender, mut receivers) = set(1, 4, runtime(1 << 30, dir.path()));
        let second = sender.clone();
        sender.send(0, batch(0, 2)).await.unwrap();
        sender.finish();
        second.send(0, batch(2, 2)).await.unwrap();
        // One producer still writing: a reader that caught up waits.
        assert_eq!(receivers[0].recv().await.unwrap().unwrap().num_rows(), 2);
        assert_eq!(receivers[0].recv().await.unwrap().unwrap().num_rows(), 2);
        let waiting = tokio::time::timeout(Duration::from_millis(50), receivers[0].recv()).await;
        assert!(
            waiting.is_err(),
            "the stream must not end before every sender finished"
        );
        second.finish();
        assert!(receivers[0].recv().await.is_none());
    }

    /// Drains `receiver`: the batches' row counts, then the error that ended it, if any.
    async fn drain(receiver: &mut ChannelReceiver) -> (Vec<usize>, Option<String>) {
        let mut rows = Vec::new();
        while let Some(batch) = receiver.recv().await {
            match batch {
                Ok(batch) => rows.push(batch.num_rows()),
                Err(error) => {
                    assert!(receiver.recv().await.is_none(), "an error ends the stream");
                    return (rows, Some(error.to_string()));
                }
            }
        }
        (rows, None)
    }

    #[tokio::test]
    async fn a_sender_dropped_without_finishing_fails_every_receiver_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (sender, mut receivers) = set(2, 4, runtime(1 << 30, dir.path()));
        let second = sender.clone();
        sender.send(0, batch(0, 3)).await.unwrap();
        sender.send(1, batch(3, 1)).await.unwrap();
        second.finish();
        // The producer's task panicked or was stopped: its sender is dropped mid-stream.
        drop(sender);
        for receiver in &mut receivers {
            let (rows, error) = drain(receiver).await;
            // The buffered batch is not delivered: it is part of an incomplete output.
            assert_eq!(rows, Vec::<usize>::new());
            assert_eq!(
                error.as_deref(),
                Some(
                    "External error: test is incomplete: its writer went away before the end \
                     of its output (its task failed, was stopped or panicked)"
                )
            );
        }
    }

    #[tokio::test]
    async fn a_failed_sender_hands_its_error_to_a_waiting_receiver() {
        let dir = tempfile::tempdir().unwrap();
        let (sender, mut receivers) = set(1, 4, runtime(1 << 30, dir.path()));
        let mut receiver = receivers.remove(0);
        // The receiver waits first (join! polls it first), then the sender fails.
        let ((rows, error), ()) = tokio::join!(drain(&mut receiver), async {
            tokio::task::yield_now().await;
            sender.fail(DataFusionError::Execution("disk on fire".into()));
        });
        assert_eq!(rows, Vec::<usize>::new());
        assert_eq!(error.as_deref(), Some("Execution error: disk on fire"));
    }

    #[tokio::test]
    async fn out_of_range_channel_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (sender, _receivers) = set(1, 1, runtime(1 << 20, dir.path()));
        assert!(sender.send(5, batch(0, 1)).await.is_err());
    }
}
