//! A seeded simulation of the driver at cluster scale: a real [`Driver`] (scheduler, placement,
//! definitions, shipping, journal, job output) over a fleet of fake workers that run nothing. It
//! measures what the driver itself costs: task transitions per second, how long placing a whole
//! region takes, and the driver's memory per finished task.
//!
//! ```text
//!   job runners ── Driver::execute(chain graph) ──► driver actor ── RunTask / StopTask ──► SimWorker × N
//!        ▲                                              ▲                                     │ FleetEvent
//!        └── job output ◄── SimFetcher (1 row/task)     └── reports (Running, Succeeded) ◄── Simulator
//!                                                           worker_gone + a new worker ◄──────┘ (losses)
//! ```
//!
//! The simulator keeps a virtual clock: each accepted attempt gets a seeded random duration, and
//! attempts complete in virtual-time order as fast as the driver takes their reports, so the wall
//! time measured is the driver's (and the simulator's) work, never sleeping. Workers are lost at
//! evenly spaced points of the run (after every `tasks / (losses + 1)` successes), each a worker
//! running attempts, chosen by the seed; a new worker registers in its place, as an autoscaler
//! would start one. Invariants: the simulator reports only attempts the driver placed on a live
//! fake worker, each at most once per sequence number; a stopped attempt reports `Canceled`; a
//! lost worker's attempts report nothing (the driver judges them lost).

mod fleet;
pub(crate) mod graph;
mod rng;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use futures::StreamExt;
use sluice_planner::{AttemptKey, JobId, StageId, WorkerId};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::analyze::TaskMetrics;
use crate::definition::{TaskState, TaskStatusReport};
use crate::driver::{
    Driver, DriverHandle, DriverOptions, ExecutorEndpoint, Liveness, WorkerRegistration,
};
use fleet::{FleetEvent, FleetIndex, SimFetcher, SimWorker};
use graph::chain_graph;
use rng::SplitMix64;

/// What to simulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulationConfig {
    /// Fake workers registered before the first job.
    pub workers: usize,
    /// Task slots of each.
    pub slots: usize,
    /// Jobs run, in all.
    pub jobs: usize,
    /// Jobs running at once.
    pub concurrent_jobs: usize,
    /// Stages of each job (a chain).
    pub stages: usize,
    /// Tasks of each stage.
    pub width: usize,
    /// Blocking exchange (`true`: every task its own region, a stage after the one before it), or
    /// pipelined (each job one region, placed whole).
    pub blocking: bool,
    /// The shortest and longest simulated task time, in virtual milliseconds.
    pub task_ms: (u64, u64),
    /// Workers lost during the run (each replaced by a new one).
    pub losses: usize,
    /// The seed of task times and loss victims.
    pub seed: u64,
}

impl Default for SimulationConfig {
    fn default() -> Self {
        Self {
            workers: 1000,
            slots: 8,
            jobs: 1,
            concurrent_jobs: 1,
            stages: 100,
            width: 1000,
            blocking: true,
            task_ms: (10, 1000),
            losses: 0,
            seed: 1,
        }
    }
}

impl SimulationConfig {
    /// Tasks of all jobs (attempts beyond one per task are retries).
    pub fn tasks(&self) -> u64 {
        (self.jobs as u64)
            .saturating_mul(self.stages as u64)
            .saturating_mul(self.width as u64)
    }
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SimulationReport {
    /// The configuration it ran.
    pub config: SimulationConfig,
    /// Jobs that succeeded with one row per final task.
    pub jobs_succeeded: usize,
    /// Why the others failed (or returned the wrong rows).
    pub job_errors: Vec<String>,
    /// Attempts the fleet was asked to run.
    pub attempts: u64,
    /// Status reports the fleet sent (running, succeeded, cancelled).
    pub reports: u64,
    /// Attempts the driver stopped while they ran.
    pub stops: u64,
    /// The most attempts running on the fleet at once.
    pub peak_running: usize,
    /// Workers the driver counted lost.
    pub workers_lost: usize,
    /// Task regions the driver ran again.
    pub regions_retried: usize,
    /// Ended jobs in the driver's history at the end.
    pub history_jobs: usize,
    /// Wall time from the first submission to the last job's end.
    pub elapsed: Duration,
    /// Per stage that waited for the one before it (every stage after the first, in blocking
    /// exchange): from the report completing the stage before it to the fleet receiving the last
    /// of its `width` tasks — the placement of `width` regions that became ready at once.
    pub placements: Vec<Duration>,
    /// The process's resident memory before the first job and after the last (Linux only).
    pub rss_bytes: Option<(u64, u64)>,
}

impl SimulationReport {
    /// Scheduling transitions: attempts placed plus reports taken.
    pub fn transitions(&self) -> u64 {
        self.attempts + self.reports
    }

    /// Transitions per second of wall time.
    pub fn transitions_per_second(&self) -> f64 {
        self.transitions() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The `q` quantile (0..=1) of [`Self::placements`].
    pub fn placement_quantile(&self, q: f64) -> Option<Duration> {
        let mut sorted = self.placements.clone();
        sorted.sort_unstable();
        let last = sorted.len().checked_sub(1)?;
        let rank = ((last as f64) * q.clamp(0.0, 1.0)).round() as usize;
        sorted.get(rank).copied()
    }

    /// Resident memory grown per task of the run, in bytes (the driver's, with the simulator's).
    pub fn rss_growth_per_task(&self) -> Option<f64> {
        let (before, after) = self.rss_bytes?;
        Some((after as f64 - before as f64) / (self.config.tasks().max(1) as f64))
    }
}

impl fmt::Display for SimulationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "{} workers x {} slots; {} job(s) of {} stage(s) x {} tasks, {} at once, {} exchange; \
             task times {}-{} ms (virtual); {} worker loss(es); seed {}",
            c.workers,
            c.slots,
            c.jobs,
            c.stages,
            c.width,
            c.concurrent_jobs,
            if c.blocking { "blocking" } else { "pipelined" },
            c.task_ms.0,
            c.task_ms.1,
            c.losses,
            c.seed
        )?;
        writeln!(
            f,
            "jobs succeeded: {}/{}; attempts {} for {} tasks (at most {} at once); stops {}; \
             workers lost {}; regions retried {}; jobs in history {}",
            self.jobs_succeeded,
            c.jobs,
            self.attempts,
            c.tasks(),
            self.peak_running,
            self.stops,
            self.workers_lost,
            self.regions_retried,
            self.history_jobs
        )?;
        writeln!(
            f,
            "transitions: {} in {:.3} s = {:.0}/s",
            self.transitions(),
            self.elapsed.as_secs_f64(),
            self.transitions_per_second()
        )?;
        let ms = |d: Option<Duration>| {
            d.map_or("-".to_string(), |d| format!("{:.2}", d.as_secs_f64() * 1e3))
        };
        writeln!(
            f,
            "stage placement ({} stages of {} tasks, ready to all sent): median {} ms, p99 {} ms, \
             max {} ms",
            self.placements.len(),
            c.width,
            ms(self.placement_quantile(0.5)),
            ms(self.placement_quantile(0.99)),
            ms(self.placement_quantile(1.0))
        )?;
        match (self.rss_bytes, self.rss_growth_per_task()) {
            (Some((before, after)), Some(per_task)) => writeln!(
                f,
                "resident memory: {:.1} MiB before, {:.1} MiB after = {per_task:.0} bytes per task",
                before as f64 / 1048576.0,
                after as f64 / 1048576.0
            )?,
            _ => writeln!(f, "resident memory: not measured on this platform")?,
        }
        for error in &self.job_errors {
            writeln!(f, "job failed: {error}")?;
        }
        Ok(())
    }
}

/// Runs the simulation `config` describes on the current runtime.
pub async fn simulate(config: &SimulationConfig) -> Result<SimulationReport> {
    if config.workers == 0 || config.slots == 0 || config.concurrent_jobs == 0 {
        return Err(DataFusionError::Plan(
            "a simulation needs at least one worker, one slot and one job at a time".into(),
        ));
    }
    // Fail bad shapes before anything starts.
    chain_graph(config.stages, config.width, config.blocking)?;
    let driver = Arc::new(Driver::start(
        DriverOptions::default(),
        ExecutorEndpoint {
            address: "sim:driver".into(),
            // The driver's executor runs driver-placed stages; a chain graph has none.
            client: Arc::new(SimWorker::new(
                FleetIndex(usize::MAX),
                mpsc::unbounded_channel().0,
            )),
        },
        Arc::new(SimFetcher),
    ));
    let (events, inbox) = mpsc::unbounded_channel();
    let mut simulator = Simulator::new(driver.handle().clone(), config, events);
    for _ in 0..config.workers {
        simulator.add_worker().await?;
    }
    let rss_before = resident_bytes();
    let started = Instant::now();
    let mut runners = JoinSet::new();
    let next_job = Arc::new(AtomicUsize::new(0));
    for _ in 0..config.concurrent_jobs.min(config.jobs.max(1)) {
        runners.spawn(run_jobs(
            Arc::clone(&driver),
            config.clone(),
            Arc::clone(&next_job),
        ));
    }
    let outcomes = simulator.run(inbox, &mut runners).await?;
    let elapsed = started.elapsed();
    let rss_after = resident_bytes();
    let snapshot = driver.snapshot().await?;
    let history_jobs = driver.handle().jobs().await?.len();
    let (succeeded, job_errors): (Vec<_>, Vec<_>) = outcomes.into_iter().partition(Result::is_ok);
    Ok(SimulationReport {
        config: config.clone(),
        jobs_succeeded: succeeded.len(),
        job_errors: job_errors.into_iter().filter_map(Result::err).collect(),
        attempts: simulator.attempts,
        reports: simulator.reports,
        stops: simulator.stops,
        peak_running: simulator.peak_running,
        workers_lost: snapshot.counters.workers_lost,
        regions_retried: snapshot.counters.regions_retried,
        history_jobs,
        elapsed,
        placements: simulator.placements,
        rss_bytes: rss_before.zip(rss_after),
    })
}

/// Runs jobs one after another until `config.jobs` were taken; each job's outcome: `Ok` when it
/// returned one row per final task, each exactly once.
async fn run_jobs(
    driver: Arc<Driver>,
    config: SimulationConfig,
    next_job: Arc<AtomicUsize>,
) -> Vec<Result<(), String>> {
    let mut outcomes = Vec::new();
    while next_job.fetch_add(1, Ordering::Relaxed) < config.jobs {
        outcomes.push(run_job(&driver, &config).await);
    }
    outcomes
}

async fn run_job(driver: &Driver, config: &SimulationConfig) -> Result<(), String> {
    let graph =
        chain_graph(config.stages, config.width, config.blocking).map_err(|e| e.to_string())?;
    let mut output = driver.execute(graph, Arc::new(TaskContext::default()));
    let mut partitions = Vec::with_capacity(config.width);
    while let Some(batch) = output.next().await {
        let batch = batch.map_err(|e| e.to_string())?;
        let column = batch
            .column(0)
            .as_any()
            .downcast_ref::<datafusion::arrow::array::Int64Array>()
            .ok_or("the job output is not the simulated Int64 column")?;
        partitions.extend(column.values().iter().copied());
    }
    partitions.sort_unstable();
    let expected: Vec<i64> = (0..config.width as i64).collect();
    if partitions == expected {
        Ok(())
    } else {
        Err(format!(
            "the job returned {} rows, not one per final task ({})",
            partitions.len(),
            config.width
        ))
    }
}

/// An attempt's virtual end, ordered by time then by acceptance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Completion {
    end_us: u64,
    order: u64,
}

/// The fleet's side: what runs where, in virtual time, and what the driver is told.
struct Simulator {
    handle: DriverHandle,
    config: SimulationConfig,
    events: mpsc::UnboundedSender<FleetEvent>,
    rng: SplitMix64,
    clock_us: u64,
    accepted: u64,
    /// Completions by virtual end; an entry whose attempt no longer runs (stopped, lost) is skipped.
    due: BinaryHeap<Reverse<Completion>>,
    completing: HashMap<u64, (FleetIndex, AttemptKey)>,
    running: HashMap<AttemptKey, FleetIndex>,
    by_worker: Vec<HashSet<AttemptKey>>,
    ids: Vec<Option<WorkerId>>,
    successes: u64,
    losses_done: usize,
    /// Per stage of a running job: which partitions succeeded, and when the last one did.
    stage_done: HashMap<(JobId, StageId), (Vec<bool>, usize)>,
    ready_at: HashMap<(JobId, StageId), Instant>,
    first_placed: HashMap<(JobId, StageId), usize>,
    placements: Vec<Duration>,
    attempts: u64,
    reports: u64,
    stops: u64,
    peak_running: usize,
}

impl Simulator {
    fn new(
        handle: DriverHandle,
        config: &SimulationConfig,
        events: mpsc::UnboundedSender<FleetEvent>,
    ) -> Self {
        Self {
            handle,
            config: config.clone(),
            events,
            rng: SplitMix64::new(config.seed),
            clock_us: 0,
            accepted: 0,
            due: BinaryHeap::new(),
            completing: HashMap::new(),
            running: HashMap::new(),
            by_worker: Vec::new(),
            ids: Vec::new(),
            successes: 0,
            losses_done: 0,
            stage_done: HashMap::new(),
            ready_at: HashMap::new(),
            first_placed: HashMap::new(),
            placements: Vec::new(),
            attempts: 0,
            reports: 0,
            stops: 0,
            peak_running: 0,
        }
    }

    async fn add_worker(&mut self) -> Result<()> {
        let index = FleetIndex(self.ids.len());
        let id = self
            .handle
            .register_worker(WorkerRegistration {
                address: format!("sim:worker-{}", index.0),
                slots: self.config.slots,
                client: Arc::new(SimWorker::new(index, self.events.clone())),
                liveness: Liveness::InProcess,
            })
            .await?;
        self.ids.push(Some(id));
        self.by_worker.push(HashSet::new());
        Ok(())
    }

    /// Plays the fleet until every job runner ended; their outcomes.
    async fn run(
        &mut self,
        mut inbox: mpsc::UnboundedReceiver<FleetEvent>,
        runners: &mut JoinSet<Vec<Result<(), String>>>,
    ) -> Result<Vec<Result<(), String>>> {
        let mut outcomes = Vec::new();
        let mut completed = 0u64;
        loop {
            while let Ok(event) = inbox.try_recv() {
                self.apply(event)?;
            }
            if let Some(Reverse(next)) = self.due.pop() {
                self.complete(next).await?;
                completed += 1;
                if completed.is_multiple_of(32) {
                    tokio::task::yield_now().await;
                }
                continue;
            }
            tokio::select! {
                event = inbox.recv() => match event {
                    Some(event) => self.apply(event)?,
                    None => return Err(DataFusionError::Internal("the fleet's channel closed".into())),
                },
                joined = runners.join_next() => match joined {
                    Some(Ok(done)) => outcomes.extend(done),
                    Some(Err(e)) => outcomes.push(Err(format!("a job runner panicked: {e}"))),
                    None => return Ok(outcomes),
                },
            }
        }
    }

    fn apply(&mut self, event: FleetEvent) -> Result<()> {
        match event {
            FleetEvent::Run(worker, attempt) => {
                let Some(id) = self.live(worker) else {
                    // Placed on a worker already lost: the driver loses the attempt with it.
                    return Ok(());
                };
                self.attempts += 1;
                self.note_placed(attempt);
                self.running.insert(attempt, worker);
                self.peak_running = self.peak_running.max(self.running.len());
                self.by_worker[worker.0].insert(attempt);
                let (low, high) = self.config.task_ms;
                let end_us = self
                    .clock_us
                    .saturating_add(self.rng.between(low, high).saturating_mul(1000));
                self.accepted += 1;
                self.due.push(Reverse(Completion {
                    end_us,
                    order: self.accepted,
                }));
                self.completing.insert(self.accepted, (worker, attempt));
                self.report(id, attempt, 1, TaskState::Running)
            }
            FleetEvent::Stop(worker, attempt) => {
                let Some(id) = self.live(worker) else {
                    return Ok(());
                };
                if self.running.remove(&attempt).is_some() {
                    self.by_worker[worker.0].remove(&attempt);
                    self.stops += 1;
                    self.report(id, attempt, 2, TaskState::Canceled)?;
                }
                Ok(())
            }
        }
    }

    async fn complete(&mut self, next: Completion) -> Result<()> {
        let Some((worker, attempt)) = self.completing.remove(&next.order) else {
            return Ok(());
        };
        if self.running.get(&attempt) != Some(&worker) {
            return Ok(());
        }
        let Some(id) = self.live(worker) else {
            return Ok(());
        };
        self.clock_us = self.clock_us.max(next.end_us);
        self.running.remove(&attempt);
        self.by_worker[worker.0].remove(&attempt);
        self.report(
            id,
            attempt,
            2,
            TaskState::Succeeded(TaskMetrics {
                rows: 1,
                batches: 1,
                elapsed_ms: next.end_us / 1000,
                ..TaskMetrics::default()
            }),
        )?;
        self.note_succeeded(attempt);
        self.successes += 1;
        let every = self.config.tasks() / (self.config.losses as u64 + 1);
        if self.losses_done < self.config.losses
            && self.successes >= every.max(1) * (self.losses_done as u64 + 1)
        {
            self.lose_a_worker().await?;
        }
        Ok(())
    }

    /// A worker running attempts, chosen by the seed, is gone; a new one registers in its place.
    async fn lose_a_worker(&mut self) -> Result<()> {
        let busy: Vec<usize> = (0..self.by_worker.len())
            .filter(|w| self.ids[*w].is_some() && !self.by_worker[*w].is_empty())
            .collect();
        let Some(&victim) =
            busy.get(self.rng.between(0, busy.len() as u64) as usize % busy.len().max(1))
        else {
            return Ok(());
        };
        let Some(id) = self.ids[victim].take() else {
            return Ok(());
        };
        for attempt in std::mem::take(&mut self.by_worker[victim]) {
            self.running.remove(&attempt);
        }
        self.losses_done += 1;
        self.handle.worker_gone(id, "simulated loss")?;
        self.add_worker().await
    }

    fn live(&self, worker: FleetIndex) -> Option<WorkerId> {
        self.ids.get(worker.0).copied().flatten()
    }

    fn report(
        &mut self,
        worker: WorkerId,
        attempt: AttemptKey,
        sequence: u64,
        state: TaskState,
    ) -> Result<()> {
        self.reports += 1;
        self.handle.report(TaskStatusReport {
            worker,
            attempt,
            sequence,
            state,
        })
    }

    /// The first attempt of every task of a stage has reached the fleet: that region's placement
    /// ends (measured for stages that waited for the one before them).
    fn note_placed(&mut self, attempt: AttemptKey) {
        if attempt.attempt != 0 || attempt.stage.0 == 0 || !self.config.blocking {
            return;
        }
        let key = (attempt.job, attempt.stage);
        let placed = self.first_placed.entry(key).or_default();
        *placed += 1;
        if *placed == self.config.width {
            self.first_placed.remove(&key);
            if let Some(ready) = self
                .ready_at
                .remove(&(attempt.job, StageId(attempt.stage.0 - 1)))
            {
                self.placements.push(ready.elapsed());
            }
        }
    }

    /// A task succeeded; the first time every task of its stage has, the next stage is ready.
    fn note_succeeded(&mut self, attempt: AttemptKey) {
        let last_stage = attempt.stage.0 + 1 == self.config.stages;
        if last_stage || !self.config.blocking {
            return;
        }
        let key = (attempt.job, attempt.stage);
        let width = self.config.width;
        let (done, count) = self
            .stage_done
            .entry(key)
            .or_insert_with(|| (vec![false; width], 0));
        if let Some(slot) = done.get_mut(attempt.partition)
            && !*slot
        {
            *slot = true;
            *count += 1;
        }
        if *count == width {
            self.stage_done.remove(&key);
            self.ready_at.insert(key, Instant::now());
        }
    }
}

/// This process's resident memory (Linux: `VmRSS` of `/proc/self/status`).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
