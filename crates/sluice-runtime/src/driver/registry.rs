//! The worker registry: membership, liveness and task slots of the driver's workers. Pure state
//! (no I/O): the actor asks it and acts on the answers.
//!
//! Invariants:
//! - a worker id is given once and never again (a worker that comes back registers afresh under a
//!   new id); the address of every id ever given is kept, since locators may still name it;
//! - a running attempt holds one slot of its location from [`WorkerRegistry::hold`] until
//!   [`WorkerRegistry::free`] or its worker's [`WorkerRegistry::remove`], exactly once;
//! - a draining worker keeps its running attempts but is offered no new ones;
//! - a worker is silent when it sends heartbeats ([`Liveness::Heartbeats`]) and none arrived for
//!   longer than the timeout; in-process workers are never silent;
//! - `on_worker` and `held` are indexes of `running` (per worker, per job), changed with it in
//!   `hold`, `free` and `remove` only, so no question about one worker or one job scans every
//!   running attempt.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use datafusion::common::HashMap;

use sluice_planner::{AttemptKey, JobId, WorkerId};
use tokio::time::Instant;

use super::placement::{Location, Slots};
use super::{ExecutorEndpoint, Liveness, WorkerRegistration, WorkerSnapshot};
use crate::transport::WorkerClient;

/// A registered worker.
struct WorkerEntry {
    registration: WorkerRegistration,
    busy: usize,
    last_heartbeat: Instant,
    /// It is draining: no new task goes there.
    draining: bool,
    /// When it registered (milliseconds since the Unix epoch).
    registered_ms: u64,
}

/// The driver's workers and the slots their running attempts hold.
pub(crate) struct WorkerRegistry {
    workers: BTreeMap<WorkerId, WorkerEntry>,
    /// Addresses of every worker ever registered (lost ones too).
    addresses: HashMap<WorkerId, String>,
    next_worker: u64,
    /// Where each running attempt runs (one slot held there when it is a worker).
    running: HashMap<AttemptKey, Location>,
    /// Of the running attempts, the acceptance number their worker answered to `RunTask`.
    accepted: HashMap<AttemptKey, u64>,
    /// The running attempts of each worker.
    on_worker: HashMap<WorkerId, BTreeSet<AttemptKey>>,
    /// Worker slots each job's running attempts hold.
    held: HashMap<JobId, usize>,
    /// The driver's own executor (driver-placed stages).
    executor: ExecutorEndpoint,
}

impl WorkerRegistry {
    pub fn new(executor: ExecutorEndpoint) -> Self {
        Self {
            workers: BTreeMap::new(),
            addresses: HashMap::new(),
            next_worker: 1,
            running: HashMap::new(),
            accepted: HashMap::new(),
            on_worker: HashMap::new(),
            held: HashMap::new(),
            executor,
        }
    }

    /// Registers a worker under a new id.
    pub fn register(&mut self, registration: WorkerRegistration) -> WorkerId {
        let id = WorkerId(self.next_worker);
        self.next_worker += 1;
        self.addresses.insert(id, registration.address.clone());
        self.workers.insert(
            id,
            WorkerEntry {
                registration,
                busy: 0,
                last_heartbeat: Instant::now(),
                draining: false,
                registered_ms: crate::driver::history::now_ms(),
            },
        );
        id
    }

    /// A heartbeat of `worker`; whether it is registered.
    pub fn heartbeat(&mut self, worker: WorkerId) -> bool {
        match self.workers.get_mut(&worker) {
            Some(entry) => {
                entry.last_heartbeat = Instant::now();
                true
            }
            None => false,
        }
    }

    /// Marks `worker` draining; its address, if it is registered.
    pub fn drain(&mut self, worker: WorkerId) -> Option<String> {
        let entry = self.workers.get_mut(&worker)?;
        entry.draining = true;
        Some(entry.registration.address.clone())
    }

    /// Removes `worker`: its address and the attempts that ran there (sorted), which no longer
    /// hold slots. `None` when it was not registered.
    pub fn remove(&mut self, worker: WorkerId) -> Option<(String, Vec<AttemptKey>)> {
        let entry = self.workers.remove(&worker)?;
        let lost: Vec<AttemptKey> = self
            .on_worker
            .get(&worker)
            .map(|keys| keys.iter().copied().collect())
            .unwrap_or_default();
        for key in &lost {
            self.unhold(*key);
        }
        self.on_worker.remove(&worker);
        Some((entry.registration.address, lost))
    }

    /// How many registrations there were (lost workers too).
    pub fn registrations(&self) -> u64 {
        self.next_worker - 1
    }

    /// Whether `worker` is registered.
    pub fn contains(&self, worker: WorkerId) -> bool {
        self.workers.contains_key(&worker)
    }

    /// Workers that send heartbeats and sent none for longer than `timeout`, with their silence
    /// in seconds.
    pub fn silent(&self, timeout: Duration) -> Vec<(WorkerId, f64)> {
        self.workers
            .iter()
            .filter(|(_, w)| w.registration.liveness == Liveness::Heartbeats)
            .filter_map(|(id, w)| {
                let silence = w.last_heartbeat.elapsed();
                (silence > timeout).then_some((*id, silence.as_secs_f64()))
            })
            .collect()
    }

    /// The registered worker at `address` other than `except`, and whether it sent a heartbeat
    /// within `recent` (a worker without heartbeats never counts as beating).
    pub fn at_address(
        &self,
        address: &str,
        except: Option<WorkerId>,
        recent: Duration,
    ) -> Option<(WorkerId, bool)> {
        self.workers
            .iter()
            .find(|(id, w)| w.registration.address == address && Some(**id) != except)
            .map(|(id, w)| {
                let beats = w.registration.liveness == Liveness::Heartbeats
                    && w.last_heartbeat.elapsed() <= recent;
                (*id, beats)
            })
    }

    /// The slots of every worker taking tasks (not draining), in id order.
    pub fn slots(&self) -> Vec<Slots> {
        self.workers
            .iter()
            .filter(|(_, w)| !w.draining)
            .map(|(id, w)| Slots {
                worker: *id,
                free: w.registration.slots.saturating_sub(w.busy),
                total: w.registration.slots,
            })
            .collect()
    }

    /// `key` runs at `location` (a slot held there when it is a worker).
    pub fn hold(&mut self, key: AttemptKey, location: Location) {
        // Held again (never expected): the earlier hold is given back first.
        self.free(key);
        self.running.insert(key, location);
        if let Location::Worker(w) = location {
            self.on_worker.entry(w).or_default().insert(key);
            *self.held.entry(key.job).or_insert(0) += 1;
            if let Some(worker) = self.workers.get_mut(&w) {
                worker.busy += 1;
            }
        }
    }

    /// `key` no longer runs: its slot is free again.
    pub fn free(&mut self, key: AttemptKey) {
        if let Some(Location::Worker(w)) = self.unhold(key)
            && let Some(worker) = self.workers.get_mut(&w)
        {
            worker.busy = worker.busy.saturating_sub(1);
        }
    }

    /// Forgets running attempt `key` and its index entries; where it ran.
    fn unhold(&mut self, key: AttemptKey) -> Option<Location> {
        self.accepted.remove(&key);
        let location = self.running.remove(&key)?;
        if let Location::Worker(w) = location {
            if let Some(keys) = self.on_worker.get_mut(&w) {
                keys.remove(&key);
            }
            if let Some(held) = self.held.get_mut(&key.job) {
                *held = held.saturating_sub(1);
                if *held == 0 {
                    self.held.remove(&key.job);
                }
            }
        }
        Some(location)
    }

    /// Where running attempt `key` runs.
    pub fn location(&self, key: &AttemptKey) -> Option<Location> {
        self.running.get(key).copied()
    }

    /// Running attempts, with where they run.
    pub fn running(&self) -> impl Iterator<Item = (&AttemptKey, &Location)> {
        self.running.iter()
    }

    /// How many attempts run.
    pub fn running_count(&self) -> usize {
        self.running.len()
    }

    /// Records the acceptance number `worker` answered for running attempt `key`.
    pub fn accepted(&mut self, key: AttemptKey, accepted: u64) {
        if self.running.contains_key(&key) {
            self.accepted.insert(key, accepted);
        }
    }

    /// The attempts running on `worker` with the acceptance numbers they got (if known yet).
    pub fn running_on(&self, worker: WorkerId) -> Vec<(AttemptKey, Option<u64>)> {
        self.on_worker
            .get(&worker)
            .into_iter()
            .flatten()
            .map(|key| (*key, self.accepted.get(key).copied()))
            .collect()
    }

    /// Worker slots each job's running attempts hold.
    pub fn slots_held(&self) -> &HashMap<JobId, usize> {
        &self.held
    }

    /// The client of the worker (or driver executor) at `location`, while it is registered.
    pub fn client(&self, location: Location) -> Option<Arc<dyn WorkerClient>> {
        match location {
            Location::Driver => Some(Arc::clone(&self.executor.client)),
            Location::Worker(w) => self
                .workers
                .get(&w)
                .map(|w| Arc::clone(&w.registration.client)),
        }
    }

    /// The driver executor's client and every registered worker's.
    pub fn all_clients(&self) -> Vec<Arc<dyn WorkerClient>> {
        std::iter::once(Arc::clone(&self.executor.client))
            .chain(
                self.workers
                    .values()
                    .map(|w| Arc::clone(&w.registration.client)),
            )
            .collect()
    }

    /// The data-plane address of `location` (lost workers too).
    pub fn address_of(&self, location: Location) -> Option<String> {
        match location {
            Location::Driver => Some(self.executor.address.clone()),
            Location::Worker(w) => self.addresses.get(&w).cloned(),
        }
    }

    /// `worker (address)`, or the id alone when its address is unknown.
    pub fn name(&self, worker: WorkerId) -> String {
        match self.addresses.get(&worker) {
            Some(address) => format!("{worker} ({address})"),
            None => worker.to_string(),
        }
    }

    /// What each registered worker is, in id order; `holds_outputs` says whether a live job placed
    /// an attempt on a worker.
    pub fn snapshots(&self, holds_outputs: impl Fn(WorkerId) -> bool) -> Vec<WorkerSnapshot> {
        self.workers
            .iter()
            .map(|(id, w)| WorkerSnapshot {
                id: *id,
                address: w.registration.address.clone(),
                slots: w.registration.slots,
                busy: w.busy,
                heartbeat_age_ms: u64::try_from(w.last_heartbeat.elapsed().as_millis())
                    .unwrap_or(u64::MAX),
                draining: w.draining,
                holds_outputs: holds_outputs(*id),
                registered_ms: w.registered_ms,
            })
            .collect()
    }
}
