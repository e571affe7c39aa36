//! A worker's stream store: the output channels of the task attempts running (or finished) on this
//! worker, kept until their readers take them or the job is cleaned up.
//!
//! ```text
//!   task attempt (job, stage s, partition p, attempt a) ── create_output ──► channel set
//!        receivers (channel c, replica r) ── take(stream id) ──► local reader, or Flight DoGet
//! ```
//!
//! Invariants:
//! - each (attempt, channel, replica) stream is taken at most once; a second take is an error naming
//!   the stream;
//! - a take that arrives before its task created the output waits (bounded by the read timeout, then
//!   a clear error); a take for a job already cleaned up fails at once;
//! - once every consumer of an attempt's output finished, the driver releases its unread streams; a
//!   release that arrives before the output exists applies when it is created, so a producer never
//!   waits for a reader that will not come;
//! - memory is bounded by the channel sets' `MemoryPool` reservations, with spill to disk; removing a
//!   job drops every buffered batch and spill file it still had here.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, SpillMetrics};
use sluice_runtime::{JobId, TaskSender};
use sluice_shuffle::{ChannelReceiver, channel_set};
use tokio::sync::Notify;

use crate::wire::{AttemptKey, StreamId};

/// Batches queued per channel before a pipelined producer waits (when every channel is full).
const CHANNEL_CAPACITY: usize = 2;

/// Jobs remembered as cleaned up, so late reads fail at once instead of waiting.
const CLEANED_JOBS_KEPT: usize = 4096;

struct Output {
    receivers: Vec<Option<ChannelReceiver>>,
    replicas: usize,
    schema: SchemaRef,
}

#[derive(Default)]
struct State {
    outputs: HashMap<AttemptKey, Output>,
    released: HashSet<AttemptKey>,
    cleaned: BTreeSet<JobId>,
}

/// The stream store of one worker; see the module docs.
pub(crate) struct WorkerStreamStore {
    name: String,
    state: Mutex<State>,
    changed: Notify,
    runtime: Arc<RuntimeEnv>,
}

/// What the store holds, for tests and diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounts {
    /// Task attempt outputs present.
    pub outputs: usize,
    /// Streams not yet taken.
    pub untaken_streams: usize,
}

impl std::fmt::Debug for WorkerStreamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerStreamStore")
            .field("name", &self.name)
            .finish()
    }
}

impl WorkerStreamStore {
    pub fn new(name: String, runtime: Arc<RuntimeEnv>) -> Self {
        Self {
            name,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            runtime,
        }
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
        blocking: bool,
        schema: SchemaRef,
    ) -> Result<TaskSender> {
        let capacity = if blocking {
            usize::MAX
        } else {
            CHANNEL_CAPACITY
        };
        let (sender, receivers) = channel_set(
            &format!("{} {key}", self.name),
            channels * replicas,
            capacity,
            schema.clone(),
            self.runtime.clone(),
            SpillMetrics::new(&ExecutionPlanMetricsSet::new(), key.partition),
        );
        {
            let mut state = self.lock()?;
            if state.cleaned.contains(&key.job) {
                return Err(DataFusionError::Execution(format!(
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
            let receivers: Vec<Option<ChannelReceiver>> = if state.released.remove(&key) {
                receivers.into_iter().map(|_| None).collect()
            } else {
                receivers.into_iter().map(Some).collect()
            };
            state.outputs.insert(
                key,
                Output {
                    receivers,
                    replicas,
                    schema,
                },
            );
        }
        self.changed.notify_waiters();
        Ok(TaskSender::new(sender, channels, replicas))
    }

    /// Takes stream `id`, waiting up to `timeout` for its task to create it.
    pub async fn take(
        &self,
        id: StreamId,
        timeout: Duration,
    ) -> Result<(SchemaRef, ChannelReceiver)> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(found) = self.try_take(id)? {
                return Ok(found);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(DataFusionError::Execution(format!(
                    "{}: {id} did not appear within {} s (its task never started here)",
                    self.name,
                    timeout.as_secs_f64()
                )));
            }
        }
    }

    fn try_take(&self, id: StreamId) -> Result<Option<(SchemaRef, ChannelReceiver)>> {
        let mut state = self.lock()?;
        if state.cleaned.contains(&id.job) {
            return Err(DataFusionError::Execution(format!(
                "{}: {id} is gone: job {} was cleaned up",
                self.name, id.job
            )));
        }
        let Some(output) = state.outputs.get_mut(&id.attempt_key()) else {
            return Ok(None);
        };
        let channels = output.receivers.len() / output.replicas.max(1);
        if id.channel >= channels || id.replica >= output.replicas {
            return Err(DataFusionError::Execution(format!(
                "{}: no {id}: the task writes {channels} channels in {} replicas",
                self.name, output.replicas
            )));
        }
        let index = id.channel * output.replicas + id.replica;
        match output.receivers.get_mut(index).and_then(Option::take) {
            Some(receiver) => Ok(Some((output.schema.clone(), receiver))),
            None => Err(DataFusionError::Execution(format!(
                "{}: {id} was already read or released; task streams are read once",
                self.name
            ))),
        }
    }

    /// Drops every stream of attempt `key` no reader took (all its consumers finished), now or when
    /// the attempt creates its output.
    pub fn release_unread(&self, key: AttemptKey) -> Result<()> {
        let mut state = self.lock()?;
        if state.cleaned.contains(&key.job) {
            return Ok(());
        }
        match state.outputs.get_mut(&key) {
            Some(output) => output.receivers.iter_mut().for_each(|r| drop(r.take())),
            None => {
                state.released.insert(key);
            }
        }
        Ok(())
    }

    /// Removes one attempt's output (a stopped attempt).
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

    /// What the store holds now.
    pub fn counts(&self) -> StoreCounts {
        let Ok(state) = self.lock() else {
            return StoreCounts::default();
        };
        StoreCounts {
            outputs: state.outputs.len(),
            untaken_streams: state
                .outputs
                .values()
                .map(|o| o.receivers.iter().filter(|r| r.is_some()).count())
                .sum(),
        }
    }
}
