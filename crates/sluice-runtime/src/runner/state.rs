//! [`ClusterState`]: what a running cluster holds right now — the driver's jobs and slots, and per
//! worker its running attempts, stream-store outputs and memory in use — read on demand for
//! servers, tests and (later) the REST API.
//!
//! Invariant: a cluster with no job, no task, no stream output and no memory reserved on any worker
//! is idle ([`ClusterState::is_idle`]); every job leaves the cluster idle once it ended.

use sluice_planner::WorkerId;

use crate::driver::{DriverSnapshot, WorkerSnapshot};
use crate::worker::Worker;

/// One worker as it reports itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerState {
    /// Where it serves.
    pub address: String,
    /// Its id with the driver (`None`: the driver's own executor).
    pub id: Option<WorkerId>,
    /// What it does, as the driver sees it ([`WorkerSnapshot::state`]; `driver` for the driver's
    /// own executor).
    pub state: String,
    /// When it registered with the driver, in milliseconds since the Unix epoch.
    pub started_ms: Option<u64>,
    /// Task attempts running (neither finished nor stopped).
    pub running_tasks: usize,
    /// Attempt futures still alive (running, or stopped and not yet unwound).
    pub live_attempts: usize,
    /// Task outputs its stream store holds.
    pub stream_outputs: usize,
    /// Bytes its memory pool has handed out.
    pub memory_used: usize,
    /// Its memory pool's limit (`None`: unlimited).
    pub memory_limit: Option<usize>,
}

impl WorkerState {
    /// `worker`'s state as read in its own process.
    pub fn of(address: impl Into<String>, worker: &Worker) -> Self {
        let (running_tasks, store) = worker.counts();
        Self {
            address: address.into(),
            id: None,
            state: "driver".to_string(),
            started_ms: None,
            running_tasks,
            live_attempts: worker.live_attempts(),
            stream_outputs: store.outputs,
            memory_used: worker.memory_used(),
            memory_limit: worker.memory_limit(),
        }
    }
}

impl WorkerState {
    /// With what the driver knows of it: its id, state and start.
    pub fn seen_by_driver(mut self, seen: &WorkerSnapshot) -> Self {
        self.id = Some(seen.id);
        self.state = seen.state().to_string();
        self.started_ms = Some(seen.registered_ms);
        self
    }
}

/// The driver and every worker, read at one moment (each part read separately).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterState {
    /// The driver's view.
    pub driver: DriverSnapshot,
    /// Each registered worker's own view.
    pub workers: Vec<WorkerState>,
}

impl ClusterState {
    /// Nothing runs, no output is held, no memory is reserved.
    pub fn is_idle(&self) -> bool {
        self.driver.jobs == 0
            && self.driver.running_tasks == 0
            && self.workers.iter().all(|w| {
                w.running_tasks == 0
                    && w.live_attempts == 0
                    && w.stream_outputs == 0
                    && w.memory_used == 0
            })
    }

    /// Task attempts running on the workers.
    pub fn worker_tasks(&self) -> usize {
        self.workers.iter().map(|w| w.running_tasks).sum()
    }
}
