//! Elastic workers: how many workers a driver asks its cluster manager for, and which idle ones it
//! lets go. [`ScalingPolicy`] is pure (a view of the driver and the time in, actions out);
//! [`autoscale`] is its shell: it reads the driver's snapshot, asks the policy, and calls the
//! driver and the manager.
//!
//! ```text
//!   driver snapshot (workers: busy / holding / idle / draining; slots the waiting regions need)
//!        │ every 250 ms
//!        ▼
//!   ScalingPolicy::decide ─► Start(n) ─► ClusterManager::start_workers(n)
//!                         └► Drain(w) ─► ClusterManager::drain(w) ─► driver: no new task for w
//! ```
//!
//! Invariants:
//! - the policy's own starts never take the live workers (registered, not draining) plus the
//!   starts still pending above `max_workers`; a worker started elsewhere that joins is never
//!   refused;
//! - while the live and pending workers are fewer than `min_workers`, it starts the difference (so
//!   a worker that died is replaced), at most once per `restart_interval`;
//! - above the floor it asks for workers only while regions wait for slots, as many as the slots
//!   they lack (`slots_per_worker` each), minus the starts still pending;
//! - a start is pending until a worker registers (counted by the driver's registrations, so one
//!   that registered and died between two looks still counts), it fails, or `start_timeout`
//!   passes;
//! - it drains only an idle worker (no attempt runs there and no live job placed one there) that
//!   its manager started, once it has been idle for `idle_timeout`, never below `min_workers` and
//!   never while regions wait or starts are pending;
//! - the workers started before the policy began and not registered yet count as pending.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use sluice_planner::WorkerId;
use tokio::time::Instant;

use crate::cluster_manager::ClusterManager;
use crate::driver::{DriverHandle, DriverSnapshot};

/// What the policy keeps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScalingLimits {
    /// The floor: workers kept even when idle (and replaced when they die).
    pub min_workers: usize,
    /// The ceiling of the policy's own starts.
    pub max_workers: usize,
    /// Task slots of each worker the manager starts.
    pub slots_per_worker: usize,
    /// How long a worker stays idle before it is let go.
    pub idle_timeout: Duration,
    /// How long a start may take before it no longer counts as pending.
    pub start_timeout: Duration,
    /// The shortest time between two starts that restore the floor.
    pub restart_interval: Duration,
}

/// One registered worker as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerView {
    pub id: WorkerId,
    pub slots: usize,
    pub busy: usize,
    /// No attempt runs there and no live job placed one there.
    pub idle: bool,
    pub draining: bool,
    /// Its manager started it (only those are let go).
    pub managed: bool,
}

/// The driver as the policy sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScalingView {
    pub workers: Vec<WorkerView>,
    /// Worker slots the waiting regions need.
    pub waiting_slots: usize,
    /// Registrations since the driver started (also of workers already gone again).
    pub registrations: u64,
}

impl ScalingView {
    /// The view of `snapshot`; `managed` says which workers the manager started.
    pub fn of(snapshot: &DriverSnapshot, managed: impl Fn(WorkerId) -> bool) -> Self {
        Self {
            workers: snapshot
                .workers
                .iter()
                .map(|w| WorkerView {
                    id: w.id,
                    slots: w.slots,
                    busy: w.busy,
                    idle: w.is_idle(),
                    draining: w.draining,
                    managed: managed(w.id),
                })
                .collect(),
            waiting_slots: snapshot.waiting_slots,
            registrations: snapshot.registrations,
        }
    }
}

/// Why workers are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartReason {
    /// Fewer than `min_workers` are live or starting.
    Floor { live: usize },
    /// Waiting regions lack this many slots.
    Waiting { lacking: usize },
}

/// What the policy asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalingAction {
    Start { count: usize, reason: StartReason },
    Drain(WorkerId),
}

/// The policy's memory between two decisions; see the module docs.
#[derive(Debug)]
pub struct ScalingPolicy {
    limits: ScalingLimits,
    /// When each pending start was asked for, oldest first.
    pending: VecDeque<Instant>,
    /// The driver's registrations at the last decision.
    registrations: u64,
    /// Since when each idle worker has been idle.
    idle_since: HashMap<WorkerId, Instant>,
    /// The last start that restored the floor.
    last_floor_start: Option<Instant>,
}

impl ScalingPolicy {
    pub fn new(limits: ScalingLimits) -> Self {
        Self {
            limits,
            pending: VecDeque::new(),
            registrations: 0,
            idle_since: HashMap::new(),
            last_floor_start: None,
        }
    }

    /// Before the policy began, `started` workers were started and the driver had `registrations`
    /// (some perhaps of workers started elsewhere): the rest of the started ones are pending like
    /// the policy's own starts.
    pub fn started_before(&mut self, started: usize, registrations: u64, now: Instant) {
        self.registrations = registrations;
        let registered = usize::try_from(registrations).unwrap_or(usize::MAX);
        self.ask(started.saturating_sub(registered), now);
    }

    /// Starts asked for that no worker has answered yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// `count` of the starts asked for failed: they are no longer pending.
    pub fn start_failed(&mut self, count: usize) {
        for _ in 0..count {
            self.pending.pop_back();
        }
    }

    /// What to do now.
    pub fn decide(&mut self, view: &ScalingView, now: Instant) -> Vec<ScalingAction> {
        let limits = self.limits;
        // Each registration since answers the oldest pending start, also of a worker that is
        // already gone again.
        for _ in self.registrations..view.registrations {
            self.pending.pop_front();
        }
        self.registrations = self.registrations.max(view.registrations);
        self.pending
            .retain(|asked| now.duration_since(*asked) < limits.start_timeout);
        let present: BTreeSet<WorkerId> = view.workers.iter().map(|w| w.id).collect();
        self.idle_since.retain(|id, _| present.contains(id));

        let live: Vec<&WorkerView> = view.workers.iter().filter(|w| !w.draining).collect();
        let supply = live.len() + self.pending.len();
        let mut actions = Vec::new();
        if supply < limits.min_workers {
            let due = self
                .last_floor_start
                .is_none_or(|last| now.duration_since(last) >= limits.restart_interval);
            if due {
                let count = limits.min_workers - supply;
                self.ask(count, now);
                self.last_floor_start = Some(now);
                actions.push(ScalingAction::Start {
                    count,
                    reason: StartReason::Floor { live: live.len() },
                });
            }
        } else if view.waiting_slots > 0 {
            let free: usize = live.iter().map(|w| w.slots.saturating_sub(w.busy)).sum();
            let lacking = view.waiting_slots.saturating_sub(free);
            let wanted = lacking.div_ceil(limits.slots_per_worker.max(1));
            let count = wanted
                .saturating_sub(self.pending.len())
                .min(limits.max_workers.saturating_sub(supply));
            if count > 0 {
                self.ask(count, now);
                actions.push(ScalingAction::Start {
                    count,
                    reason: StartReason::Waiting { lacking },
                });
            }
        }

        for worker in &live {
            if worker.idle {
                self.idle_since.entry(worker.id).or_insert(now);
            } else {
                self.idle_since.remove(&worker.id);
            }
        }
        if view.waiting_slots == 0 && self.pending.is_empty() {
            let mut staying = live.len();
            // The newest workers go first: the oldest have the warmest caches.
            for worker in live.iter().rev() {
                if staying <= limits.min_workers {
                    break;
                }
                let idle_long = self
                    .idle_since
                    .get(&worker.id)
                    .is_some_and(|since| now.duration_since(*since) >= limits.idle_timeout);
                if worker.managed && idle_long {
                    self.idle_since.remove(&worker.id);
                    staying -= 1;
                    actions.push(ScalingAction::Drain(worker.id));
                }
            }
        }
        actions
    }

    fn ask(&mut self, count: usize, now: Instant) {
        self.pending.extend(std::iter::repeat_n(now, count));
    }
}

/// How often [`autoscale`] looks at the driver.
pub const SCALING_INTERVAL: Duration = Duration::from_millis(250);

/// Runs the policy over `driver` with `manager` (which started `started` workers before) until the
/// driver is gone (or the future is dropped). A start or drain that fails is logged and changes nothing else: a job that fits the
/// workers there are never fails for it.
pub async fn autoscale(
    driver: DriverHandle,
    manager: Arc<dyn ClusterManager>,
    limits: ScalingLimits,
    started: usize,
) {
    let mut policy = ScalingPolicy::new(limits);
    // The workers started before it began that have not registered yet are pending.
    if let Ok(snapshot) = driver.snapshot().await {
        policy.started_before(started, snapshot.registrations, Instant::now());
    }
    let mut tick = tokio::time::interval(SCALING_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Ok(snapshot) = driver.snapshot().await else {
            return;
        };
        let view = ScalingView::of(&snapshot, |worker| manager.manages(worker));
        for action in policy.decide(&view, Instant::now()) {
            match action {
                ScalingAction::Start { count, reason } => {
                    let why = match reason {
                        StartReason::Floor { live } => {
                            format!("{live} of at least {} workers are live", limits.min_workers)
                        }
                        StartReason::Waiting { lacking } => {
                            format!("waiting task regions lack {lacking} slots")
                        }
                    };
                    tracing::info!(
                        target: "sluice::cluster",
                        count,
                        manager = manager.name(),
                        "starting {count} worker(s): {why}"
                    );
                    if let Err(error) = manager.start_workers(count).await {
                        tracing::warn!(
                            target: "sluice::cluster",
                            %error,
                            "cannot start {count} worker(s)"
                        );
                        policy.start_failed(count);
                    }
                }
                ScalingAction::Drain(worker) => {
                    tracing::info!(
                        target: "sluice::cluster",
                        worker = worker.0,
                        "letting {worker} go: idle for {:.1} s",
                        limits.idle_timeout.as_secs_f64()
                    );
                    // The manager first: a worker it cannot drain stays as it is. A task placed
                    // there meanwhile is refused by the draining worker and placed elsewhere.
                    match manager.drain(worker).await {
                        Ok(()) => {
                            if driver.drain(worker).is_err() {
                                return;
                            }
                        }
                        Err(error) => {
                            tracing::warn!(target: "sluice::cluster", %error, "cannot drain {worker}")
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn limits() -> ScalingLimits {
        ScalingLimits {
            min_workers: 1,
            max_workers: 4,
            slots_per_worker: 8,
            idle_timeout: Duration::from_secs(2),
            start_timeout: Duration::from_secs(60),
            restart_interval: Duration::from_secs(1),
        }
    }

    fn worker(id: u64, busy: usize, idle: bool) -> WorkerView {
        WorkerView {
            id: WorkerId(id),
            slots: 8,
            busy,
            idle,
            draining: false,
            managed: true,
        }
    }

    /// The view of `workers`, whose ids are also the driver's registrations so far.
    fn view(workers: Vec<WorkerView>, waiting_slots: usize) -> ScalingView {
        let registrations = workers.iter().map(|w| w.id.0).max().unwrap_or(0);
        ScalingView {
            workers,
            waiting_slots,
            registrations,
        }
    }

    fn start(count: usize, lacking: usize) -> ScalingAction {
        ScalingAction::Start {
            count,
            reason: StartReason::Waiting { lacking },
        }
    }

    #[test]
    fn waiting_regions_start_the_workers_their_lacking_slots_need_up_to_the_maximum() {
        let t0 = Instant::now();
        let mut policy = ScalingPolicy::new(limits());
        // A region of 19 tasks on one busy 8-slot worker: 19 lacking, 3 workers.
        let busy = view(vec![worker(1, 8, false)], 19);
        assert_eq!(policy.decide(&busy, t0), [start(3, 19)]);
        // Pending starts are not asked for again.
        assert_eq!(policy.decide(&busy, t0 + Duration::from_millis(250)), []);
        // Two joined (one still pending); more waiting now: only up to the maximum of 4.
        let joined = view(
            vec![
                worker(1, 8, false),
                worker(2, 8, false),
                worker(3, 8, false),
            ],
            40,
        );
        assert_eq!(policy.pending(), 3);
        assert_eq!(policy.decide(&joined, t0 + Duration::from_secs(1)), []);
        assert_eq!(policy.pending(), 1);
        let mut other = ScalingPolicy::new(limits());
        assert_eq!(other.decide(&joined, t0), [start(1, 40)]);
    }

    #[test]
    fn workers_started_before_the_policy_began_count_as_pending_until_they_register() {
        let t0 = Instant::now();
        let mut policy = ScalingPolicy::new(limits());
        // 3 started, 1 registered: 2 pending, so a region lacking 16 slots asks for nothing.
        policy.started_before(3, 1, t0);
        assert_eq!(policy.pending(), 2);
        let busy = view(vec![worker(1, 8, false)], 16);
        assert_eq!(policy.decide(&busy, t0), []);
        // They register: nothing pending, and the maximum of 4 leaves room for one more.
        let all = view(
            vec![
                worker(1, 8, false),
                worker(2, 8, false),
                worker(3, 8, false),
            ],
            40,
        );
        assert_eq!(policy.decide(&all, t0), [start(1, 40)]);
        assert_eq!(policy.pending(), 1);
    }

    #[test]
    fn a_worker_that_registered_and_died_between_two_looks_answers_its_start() {
        let t0 = Instant::now();
        let mut limits = limits();
        limits.min_workers = 3;
        let mut policy = ScalingPolicy::new(limits);
        policy.started_before(3, 0, t0);
        // Workers 1-3 registered, and 1 already died, before the policy looked.
        let mut two = view(vec![worker(2, 0, false), worker(3, 0, false)], 0);
        two.registrations = 3;
        let floor = ScalingAction::Start {
            count: 1,
            reason: StartReason::Floor { live: 2 },
        };
        assert_eq!(policy.decide(&two, t0), [floor]);
    }

    #[test]
    fn free_slots_are_counted_before_more_workers_are_asked_for() {
        let mut policy = ScalingPolicy::new(limits());
        let roomy = view(vec![worker(1, 2, false)], 6);
        assert_eq!(policy.decide(&roomy, Instant::now()), []);
        let tight = view(vec![worker(1, 2, false)], 7);
        assert_eq!(policy.decide(&tight, Instant::now()), [start(1, 1)]);
    }

    #[test]
    fn idle_workers_are_let_go_after_the_timeout_down_to_the_floor_newest_first() {
        let t0 = Instant::now();
        let mut policy = ScalingPolicy::new(limits());
        let idle = view(
            vec![worker(1, 0, true), worker(2, 0, true), worker(3, 0, true)],
            0,
        );
        assert_eq!(policy.decide(&idle, t0), []);
        assert_eq!(policy.decide(&idle, t0 + Duration::from_millis(1999)), []);
        assert_eq!(
            policy.decide(&idle, t0 + Duration::from_secs(2)),
            [
                ScalingAction::Drain(WorkerId(3)),
                ScalingAction::Drain(WorkerId(2))
            ]
        );
    }

    #[test]
    fn busy_holding_external_workers_and_waiting_regions_keep_workers() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        let mut policy = ScalingPolicy::new(limits());
        let mut external = worker(2, 0, true);
        external.managed = false;
        // Worker 1 runs an attempt, worker 2 was started elsewhere, worker 3 holds a live job's
        // output.
        let kept = view(vec![worker(1, 1, false), external, worker(3, 0, false)], 0);
        assert_eq!(policy.decide(&kept, t0), []);
        assert_eq!(policy.decide(&kept, later), []);
        // Idleness restarts when a worker is used again.
        let mut policy = ScalingPolicy::new(limits());
        let idle = view(vec![worker(1, 0, true), worker(2, 0, true)], 0);
        let used = view(vec![worker(1, 1, false), worker(2, 1, false)], 0);
        assert_eq!(policy.decide(&idle, t0), []);
        assert_eq!(policy.decide(&used, t0 + Duration::from_secs(1)), []);
        assert_eq!(policy.decide(&idle, t0 + Duration::from_secs(2)), []);
        assert_eq!(
            policy.decide(&idle, t0 + Duration::from_secs(4)),
            [ScalingAction::Drain(WorkerId(2))]
        );
        // Nothing is let go while regions wait (the idle worker may be the wrong one to use).
        let mut policy = ScalingPolicy::new(limits());
        let waiting = view(vec![worker(1, 8, false), worker(2, 0, true)], 1);
        assert_eq!(policy.decide(&waiting, t0), []);
        assert_eq!(policy.decide(&waiting, later), []);
    }

    #[test]
    fn a_dead_worker_below_the_floor_is_replaced_once_per_interval() {
        let t0 = Instant::now();
        let mut limits = limits();
        limits.min_workers = 2;
        let mut policy = ScalingPolicy::new(limits);
        let both = view(vec![worker(1, 0, false), worker(2, 0, false)], 0);
        assert_eq!(policy.decide(&both, t0), []);
        let one = view(vec![worker(1, 0, false)], 0);
        let floor = ScalingAction::Start {
            count: 1,
            reason: StartReason::Floor { live: 1 },
        };
        assert_eq!(policy.decide(&one, t0), [floor]);
        // The replacement fails to start: asked again, but not before the interval.
        policy.start_failed(1);
        assert_eq!(policy.decide(&one, t0 + Duration::from_millis(500)), []);
        assert_eq!(policy.decide(&one, t0 + Duration::from_secs(1)), [floor]);
        // A start that never registers stops counting after the start timeout.
        assert_eq!(policy.decide(&one, t0 + Duration::from_secs(30)), []);
        assert_eq!(policy.decide(&one, t0 + Duration::from_secs(62)), [floor]);
        // A draining worker does not count as live.
        let mut policy = ScalingPolicy::new(limits);
        let mut leaving = worker(2, 0, true);
        leaving.draining = true;
        assert_eq!(
            policy.decide(&view(vec![worker(1, 0, false), leaving], 0), t0),
            [floor]
        );
    }
}
