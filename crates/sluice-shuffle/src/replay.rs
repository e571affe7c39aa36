//! Replayable channel buffers: the output of a blocking stage, which its consumers read after it
//! finished, as often as they need (every replica of a channel, and again after a consumer failed and
//! was retried), until it is released.
//!
//! ```text
//!  producer ──append(channel, batch)──►  channel 0: [mem][mem][spilled][mem]   (kept, never popped)
//!                                        channel 1: [mem]
//!  reader A of channel 0 ─ cursor 0,1,2,3 ─► batches in append order
//!  reader B of channel 0 ─ cursor 0,1,…   ─► the same batches again
//! ```
//!
//! Invariants: every reader of a channel sees exactly the batches appended to it, in order; a reader
//! that catches up with the writer waits for the next batch or for the writer to finish; a writer
//! that fails or is dropped without finishing (`stream_end`) fails every reader at once, never a
//! clean end; memory is held
//! in one `MemoryReservation` and a batch the pool has no room for goes to an lz4 Arrow IPC spill file
//! (read back by every reader, deleted when the output is dropped); an output made [`Residence::Disk`]
//! writes every batch to such a file and holds no pool memory at all, so outputs kept for a whole
//! job never take memory from the operators; a write never waits for readers.

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
use tokio::sync::Notify;

use crate::channels::read_spilled_batch;
use crate::stream_end::WriterEnd;

#[derive(Clone)]
enum Entry {
    Memory(RecordBatch),
    Spilled(Arc<dyn SpillFile>),
}

struct State {
    channels: Vec<Vec<Entry>>,
    writing: bool,
    end: WriterEnd,
    reservation: MemoryReservation,
}

/// Where a replayable output keeps its batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    /// In the memory pool while it has room, then in files.
    Memory,
    /// Always in Arrow IPC files of the runtime's disk manager.
    Disk,
}

/// A blocking stage output's channels; see the module docs. Shared by its writer and its readers.
pub struct ReplayableOutput {
    name: String,
    residence: Residence,
    state: Mutex<State>,
    appended: Notify,
    spill: SpillManager,
}

impl std::fmt::Debug for ReplayableOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayableOutput")
            .field("name", &self.name)
            .finish()
    }
}

impl ReplayableOutput {
    /// `channels` empty channels for batches of `schema`, kept as `residence` says (memory in
    /// `runtime`'s pool, files in its disk manager).
    pub fn new(
        name: &str,
        channels: usize,
        schema: SchemaRef,
        runtime: Arc<RuntimeEnv>,
        spill_metrics: SpillMetrics,
        residence: Residence,
    ) -> Arc<Self> {
        let spill = SpillManager::new(runtime.clone(), spill_metrics, schema)
            .with_compression_type(SpillCompression::Lz4Frame);
        Arc::new(Self {
            name: name.to_string(),
            residence,
            state: Mutex::new(State {
                channels: vec![Vec::new(); channels],
                writing: true,
                end: WriterEnd::Clean,
                reservation: MemoryConsumer::new(format!("{name} (replayable)"))
                    .register(&runtime.memory_pool),
            }),
            appended: Notify::new(),
            spill,
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| {
            DataFusionError::Internal(format!("{}: replayable output poisoned", self.name))
        })
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.lock().map_or(0, |state| state.channels.len())
    }

    /// Appends `batch` to `channel`: in memory if the output resides there and the pool has room,
    /// else in a file.
    pub fn append(&self, channel: usize, batch: RecordBatch) -> Result<()> {
        let bytes = get_record_batch_memory_size(&batch);
        let entry = {
            let state = self.lock()?;
            if channel >= state.channels.len() {
                return Err(DataFusionError::Internal(format!(
                    "{}: channel {channel} out of range ({} channels)",
                    self.name,
                    state.channels.len()
                )));
            }
            if self.residence == Residence::Memory && state.reservation.try_grow(bytes).is_ok() {
                Some(Entry::Memory(batch.clone()))
            } else {
                None
            }
        };
        let entry = match entry {
            Some(entry) => entry,
            None => match self
                .spill
                .spill_record_batch_and_finish(std::slice::from_ref(&batch), &self.name)?
            {
                Some(file) => Entry::Spilled(file),
                None => return Ok(()), // an empty batch: nothing to keep
            },
        };
        self.lock()?.channels[channel].push(entry);
        self.appended.notify_waiters();
        Ok(())
    }

    /// The writer appended its last batch: readers that caught up end instead of waiting.
    pub fn finish(&self) {
        self.end_writing(|_| {});
    }

    /// The writer failed: every reader gets `error` at once, then its end (a writer that already
    /// ended changes nothing).
    pub fn fail(&self, error: DataFusionError) {
        self.end_writing(|end| end.fail(error));
    }

    /// The writer went away without finishing (its task was stopped or panicked): every reader
    /// gets an `IncompleteStream` error. Nothing changes if it already finished or failed.
    pub fn abandon(&self) {
        self.end_writing(WriterEnd::abandon);
    }

    fn end_writing(&self, record: impl FnOnce(&mut WriterEnd)) {
        if let Ok(mut state) = self.lock()
            && state.writing
        {
            state.writing = false;
            record(&mut state.end);
        }
        self.appended.notify_waiters();
    }

    /// Whether the writer has ended the output (finished, failed or abandoned it).
    pub fn is_closed(&self) -> bool {
        self.lock().is_ok_and(|state| !state.writing)
    }

    /// Memory held, in bytes (spilled batches excluded).
    pub fn memory_bytes(&self) -> usize {
        self.lock().map_or(0, |state| state.reservation.size())
    }

    /// A reader of `channel` from its first batch.
    pub fn reader(self: &Arc<Self>, channel: usize) -> Result<ReplayReader> {
        let channels = self.lock()?.channels.len();
        if channel >= channels {
            return Err(DataFusionError::Internal(format!(
                "{}: channel {channel} out of range ({channels} channels)",
                self.name
            )));
        }
        Ok(ReplayReader {
            output: Arc::clone(self),
            channel,
            position: 0,
            ended: false,
        })
    }
}

/// One reader of one channel of a [`ReplayableOutput`].
pub struct ReplayReader {
    output: Arc<ReplayableOutput>,
    channel: usize,
    position: usize,
    /// It returned the error that ended it.
    ended: bool,
}

impl ReplayReader {
    /// The next batch, `None` at the end of a finished output; the writer's error (once, at once)
    /// if it failed or went away without finishing.
    pub async fn recv(&mut self) -> Option<Result<RecordBatch>> {
        if self.ended {
            return None;
        }
        loop {
            let appended = self.output.appended.notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            let entry = {
                let state = match self.output.lock() {
                    Ok(state) => state,
                    Err(error) => return Some(Err(error)),
                };
                if let Some(error) = state.end.reader_error(&self.output.name) {
                    self.ended = true;
                    return Some(Err(error));
                }
                match state.channels[self.channel].get(self.position) {
                    Some(entry) => Some(entry.clone()),
                    None if !state.writing => return None,
                    None => None,
                }
            };
            match entry {
                Some(Entry::Memory(batch)) => {
                    self.position += 1;
                    return Some(Ok(batch));
                }
                Some(Entry::Spilled(file)) => {
                    // Counted as read only once read back: a `recv` dropped mid-way reads it
                    // again next time.
                    let batch = self.read_spilled(file).await;
                    self.position += 1;
                    return Some(batch);
                }
                None => appended.await,
            }
        }
    }

    async fn read_spilled(&self, file: Arc<dyn SpillFile>) -> Result<RecordBatch> {
        // Every reader reads the file again; the output keeps it until it is dropped.
        read_spilled_batch(&self.output.spill, file, &self.output.name, self.channel).await
    }
}

#[cfg(test)]
mod tests {
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

    fn output(pool: usize, dir: &std::path::Path) -> Arc<ReplayableOutput> {
        output_in(pool, dir, Residence::Memory)
    }

    fn output_in(
        pool: usize,
        dir: &std::path::Path,
        residence: Residence,
    ) -> Arc<ReplayableOutput> {
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(GreedyMemoryPool::new(pool)))
            .with_disk_manager_builder(
                DiskManagerBuilder::default()
                    .with_mode(DiskManagerMode::Directories(vec![dir.to_path_buf()])),
            )
            .build_arc()
            .unwrap();
        ReplayableOutput::new(
            "test",
            2,
            schema(),
            runtime,
            SpillMetrics::new(&ExecutionPlanMetricsSet::new(), 0),
            residence,
        )
    }

    async fn read_all(mut reader: ReplayReader) -> Vec<i64> {
        let mut values = Vec::new();
        while let Some(batch) = reader.recv().await {
            let batch = batch.unwrap();
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            values.extend((0..column.len()).map(|i| column.value(i)));
        }
        values
    }

    #[tokio::test]
    async fn every_reader_sees_every_batch_in_order_across_memory_and_spill() {
        let dir = tempfile::tempdir().unwrap();
        // Room for about two batches of 1000 rows: the rest spills.
        let out = output(20_000, dir.path());
        for i in 0..6 {
            out.append(0, batch(i * 1000, 1000)).unwrap();
        }
        out.append(1, batch(-5, 5)).unwrap();
        out.finish();
        let expected: Vec<i64> = (0..6000).collect();
        assert_eq!(read_all(out.reader(0).unwrap()).await, expected);
        // A second reader (another replica, or a retried consumer) reads the same again.
        assert_eq!(read_all(out.reader(0).unwrap()).await, expected);
        assert_eq!(
            read_all(out.reader(1).unwrap()).await,
            vec![-5, -4, -3, -2, -1]
        );
        assert!(out.memory_bytes() <= 20_000, "{}", out.memory_bytes());
        assert!(
            files_in(dir.path()) >= 4,
            "{} spill files",
            files_in(dir.path())
        );
        drop(out);
        assert_eq!(files_in(dir.path()), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_dropped_while_reading_a_spilled_batch_back_skips_no_batch() {
        let dir = tempfile::tempdir().unwrap();
        let out = output_in(1 << 30, dir.path(), Residence::Disk);
        for i in 0..100 {
            out.append(0, batch(i * 10, 10)).unwrap();
        }
        out.finish();
        let mut reader = out.reader(0).unwrap();
        let mut firsts = Vec::new();
        let mut values = Vec::new();
        let mut dropped_mid_read = 0;
        loop {
            // One poll starts reading a batch back from its file (on a blocking thread: often
            // still pending), then the call is dropped; the next call returns that batch.
            let mut first = Box::pin(reader.recv());
            let batch = match futures::poll!(first.as_mut()) {
                std::task::Poll::Ready(batch) => batch,
                std::task::Poll::Pending => {
                    drop(first);
                    dropped_mid_read += 1;
                    reader.recv().await
                }
            };
            let Some(batch) = batch else { break };
            let batch = batch.unwrap();
            let column = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            firsts.push(column.value(0));
            values.extend(column.values().iter().copied());
        }
        // The first value of each batch read, then every value.
        assert_eq!(firsts, (0..100).map(|i| i * 10).collect::<Vec<_>>());
        assert_eq!(values, (0..1000).collect::<Vec<_>>());
        // Reading back often completes within the first poll; some reads must have been dropped.
        assert!(dropped_mid_read >= 1, "{dropped_mid_read} reads dropped");
    }

    #[tokio::test]
    async fn a_disk_output_writes_every_batch_to_a_file_and_holds_no_memory() {
        let dir = tempfile::tempdir().unwrap();
        let out = output_in(1 << 30, dir.path(), Residence::Disk);
        for i in 0..3 {
            out.append(0, batch(i * 10, 10)).unwrap();
        }
        out.finish();
        assert_eq!(out.memory_bytes(), 0);
        assert_eq!(files_in(dir.path()), 3);
        let expected: Vec<i64> = (0..30).collect();
        assert_eq!(read_all(out.reader(0).unwrap()).await, expected);
        assert_eq!(read_all(out.reader(0).unwrap()).await, expected);
        drop(out);
        assert_eq!(files_in(dir.path()), 0);
    }

    fn files_in(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| {
                        if e.path().is_dir() {
                            files_in(&e.path())
                        } else {
                            1
                        }
                    })
                    .sum()
            })
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn a_reader_that_catches_up_waits_for_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let out = output(1 << 20, dir.path());
        out.append(0, batch(0, 3)).unwrap();
        let reader = out.reader(0).unwrap();
        let read = tokio::spawn(read_all(reader));
        tokio::task::yield_now().await;
        out.append(0, batch(3, 2)).unwrap();
        out.finish();
        assert_eq!(read.await.unwrap(), vec![0, 1, 2, 3, 4]);
        assert!(out.is_closed());
    }

    #[tokio::test]
    async fn an_abandoned_or_failed_output_fails_every_reader_never_ends_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let out = output(1 << 20, dir.path());
        out.append(0, batch(0, 3)).unwrap();
        let mut waiting_reader = out.reader(1).unwrap();
        // The reader waits first (join! polls it first), then the writer goes away.
        let (waited, ()) = tokio::join!(
            async {
                let first = waiting_reader.recv().await.map(|r| r.map(|b| b.num_rows()));
                (
                    first.map(|r| r.map_err(|e| e.to_string())),
                    waiting_reader.recv().await.is_none(),
                )
            },
            async {
                tokio::task::yield_now().await;
                out.abandon();
            }
        );
        let expected = "External error: test is incomplete: its writer went away before the end \
                        of its output (its task failed, was stopped or panicked)";
        assert_eq!(waited, (Some(Err(expected.to_string())), true));
        // A reader from the start gets the error before the batch already appended.
        let mut reader = out.reader(0).unwrap();
        assert_eq!(
            reader.recv().await.unwrap().unwrap_err().to_string(),
            expected
        );
        assert!(reader.recv().await.is_none());
        // A later finish changes nothing.
        out.finish();
        assert!(out.reader(0).unwrap().recv().await.unwrap().is_err());

        let failed = output(1 << 20, dir.path());
        failed.append(0, batch(0, 3)).unwrap();
        failed.fail(DataFusionError::ResourcesExhausted("pool".into()));
        let error = failed.reader(0).unwrap().recv().await.unwrap().unwrap_err();
        assert_eq!(error.to_string(), "Resources exhausted: pool");
    }

    #[test]
    fn a_channel_out_of_range_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let out = output(1 << 20, dir.path());
        assert!(out.append(2, batch(0, 1)).is_err());
        assert!(out.reader(2).is_err());
    }
}
