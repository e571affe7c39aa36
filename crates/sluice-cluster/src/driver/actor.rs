//! The driver actor: the thin shell that feeds events to the pure [`JobScheduler`] and performs its
//! actions — placing regions on task slots, sending task definitions, stopping tasks, feeding the
//! job output and cleaning up workers.
//!
//! Invariants: a task attempt holds one slot of its worker from the moment it is placed until its
//! final status (or its RunTask failing) arrives; a region waits, first in first out, until all its
//! tasks fit; output of a task attempt reaches the caller only if the scheduler approves it (the
//! attempt is current), which also stops its region from being retried.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use datafusion::common::runtime::JoinSet;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::MemoryLimit;
use prost::Message;
use sluice_planner::{InputMode, JobGraph, OutputMode, RegionId, StageId, TaskId, TaskPlacement};
use sluice_runtime::JobId;
use sluice_runtime::analyze::{TaskMetrics, is_analyze, stage_reports};
use sluice_runtime::scheduler::{JobScheduler, SchedulerAction, TaskAttempt, TaskStatus};
use sluice_runtime::task_inputs;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use super::output::OutputCommand;
use super::placement::{Location, Placement, PlacementView, place};
use super::shipping::{ShippedStage, ship_stages};
use super::{DriverEvent, DriverOptions, Submission};
use crate::flight::FlightClients;
use crate::net::endpoint;
use crate::proto;
use crate::proto::worker_service_client::WorkerServiceClient;
use crate::wire::{AttemptKey, StreamId, input_mode_to_proto, status_from_report, to_u32};
use crate::worker::{LocalPlan, Worker};

/// A registered worker.
struct WorkerEntry {
    address: String,
    slots: usize,
    busy: usize,
    client: WorkerServiceClient<Channel>,
    last_heartbeat: Instant,
}

/// What the shell keeps per job, next to the scheduler's state.
struct JobEntry {
    graph: Arc<JobGraph>,
    context: Arc<TaskContext>,
    stages: Vec<ShippedStage>,
    config: HashMap<String, String>,
    /// The session's memory limit in bytes (0: none).
    memory_limit: u64,
    /// Where each task's latest attempt runs.
    locations: HashMap<TaskId, (Location, usize)>,
    /// Tasks whose latest attempt succeeded.
    done: std::collections::HashSet<TaskId>,
    /// What each task's succeeded attempt reported: rows written, wall time and (for
    /// `EXPLAIN ANALYZE`) its plan with metrics.
    reports: HashMap<TaskId, TaskMetrics>,
    /// The job is an `EXPLAIN ANALYZE`: tasks report their plans with metrics.
    analyze: bool,
    /// Final-stage attempts announced to the output.
    announced: HashMap<TaskId, usize>,
    output: mpsc::UnboundedSender<OutputCommand>,
    succeeded: bool,
    output_done: bool,
    cleanup_pending: bool,
}

/// The actor's state, for tests and diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverSnapshot {
    /// Jobs the scheduler still tracks.
    pub scheduler_jobs: usize,
    /// Jobs the shell still tracks (including succeeded ones whose output is being read).
    pub jobs: usize,
    /// Task attempts holding a slot.
    pub running_tasks: usize,
    /// Registered workers.
    pub workers: usize,
    /// Per worker, milliseconds since its last heartbeat (nothing acts on it yet).
    pub heartbeat_age_ms: Vec<u64>,
}

pub(crate) struct DriverActor {
    scheduler: JobScheduler,
    executor: Worker,
    workers: Vec<WorkerEntry>,
    jobs: HashMap<JobId, JobEntry>,
    running: HashMap<(JobId, TaskAttempt), Location>,
    waiting: VecDeque<(JobId, RegionId, Vec<TaskAttempt>)>,
    events: mpsc::UnboundedSender<DriverEvent>,
    rpcs: JoinSet<()>,
    flight: FlightClients,
}

impl DriverActor {
    pub fn new(
        options: DriverOptions,
        executor: Worker,
        events: mpsc::UnboundedSender<DriverEvent>,
    ) -> Self {
        Self {
            scheduler: JobScheduler::new(options.max_attempts),
            executor,
            workers: Vec::new(),
            jobs: HashMap::new(),
            running: HashMap::new(),
            waiting: VecDeque::new(),
            events,
            rpcs: JoinSet::new(),
            flight: FlightClients::default(),
        }
    }

    pub async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<DriverEvent>) {
        loop {
            tokio::select! {
                event = inbox.recv() => match event {
                    Some(event) => self.handle(event),
                    None => break,
                },
                Some(_) = self.rpcs.join_next(), if !self.rpcs.is_empty() => {}
            }
        }
    }

    fn handle(&mut self, event: DriverEvent) {
        match event {
            DriverEvent::RegisterWorker {
                address,
                slots,
                reply,
            } => {
                let id = self.register_worker(address, slots);
                let _ = reply.send(id);
                self.place_waiting();
            }
            DriverEvent::Heartbeat { worker } => {
                if let Some(entry) = worker
                    .checked_sub(1)
                    .and_then(|i| self.workers.get_mut(i as usize))
                {
                    entry.last_heartbeat = Instant::now();
                }
            }
            DriverEvent::TaskStatus(report) => self.task_status(&report),
            DriverEvent::Submit(submission) => self.submit(*submission),
            DriverEvent::Cancel(job) => {
                self.waiting.retain(|(j, _, _)| *j != job);
                let actions = self.scheduler.cancel_job(job);
                if actions.is_empty() {
                    self.clean_up(job);
                } else {
                    self.perform(actions);
                }
            }
            DriverEvent::ApproveOutput {
                job,
                attempt,
                reply,
            } => {
                let approved = self.scheduler.approve_output(job, attempt)
                    || self.jobs.get(&job).is_some_and(|entry| {
                        entry.succeeded
                            && entry.announced.get(&attempt.task) == Some(&attempt.attempt)
                    });
                let _ = reply.send(approved);
            }
            DriverEvent::OutputDone(job) => {
                if let Some(entry) = self.jobs.get_mut(&job) {
                    entry.output_done = true;
                    if entry.cleanup_pending {
                        self.clean_up(job);
                    }
                }
            }
            DriverEvent::TaskNotStarted {
                job,
                attempt,
                error,
            } => {
                self.free_slot(job, attempt);
                let actions =
                    self.scheduler
                        .task_status(job, attempt, u64::MAX, TaskStatus::Failed(error));
                self.perform(actions);
                self.place_waiting();
            }
            DriverEvent::Progress(reply) => {
                let _ = reply.send(self.progress());
            }
            DriverEvent::Snapshot(reply) => {
                let _ = reply.send(DriverSnapshot {
                    scheduler_jobs: self.scheduler.active_jobs(),
                    jobs: self.jobs.len(),
                    running_tasks: self.running.len(),
                    workers: self.workers.len(),
                    heartbeat_age_ms: self
                        .workers
                        .iter()
                        .map(|w| {
                            u64::try_from(w.last_heartbeat.elapsed().as_millis())
                                .unwrap_or(u64::MAX)
                        })
                        .collect(),
                });
            }
        }
    }

    fn progress(&self) -> Vec<crate::JobProgress> {
        let mut jobs: Vec<crate::JobProgress> = self
            .jobs
            .iter()
            .filter(|(_, entry)| !entry.succeeded)
            .map(|(job, entry)| {
                let stages = entry
                    .graph
                    .stages()
                    .iter()
                    .enumerate()
                    .map(|(id, stage)| {
                        let of_stage = |t: &TaskId| t.stage.0 == id;
                        crate::StageProgress {
                            total: stage.partitions(),
                            running: self
                                .running
                                .keys()
                                .filter(|(j, a)| j == job && of_stage(&a.task))
                                .count(),
                            done: entry.done.iter().filter(|t| of_stage(t)).count(),
                            rows: entry
                                .reports
                                .iter()
                                .filter(|(t, _)| of_stage(t) && entry.done.contains(t))
                                .map(|(_, report)| report.rows)
                                .sum(),
                        }
                    })
                    .collect();
                crate::JobProgress { job: job.0, stages }
            })
            .collect();
        jobs.sort_by_key(|j| j.job);
        jobs
    }

    fn register_worker(&mut self, address: String, slots: usize) -> u64 {
        let client = match endpoint(&address) {
            Ok(endpoint) => WorkerServiceClient::new(endpoint.connect_lazy())
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
            // An address tonic cannot parse: the worker gets an id but no slots.
            Err(_) => return 0,
        };
        self.workers.push(WorkerEntry {
            address,
            slots,
            busy: 0,
            client,
            last_heartbeat: Instant::now(),
        });
        self.workers.len() as u64
    }

    fn submit(&mut self, submission: Submission) {
        let Submission {
            graph,
            context,
            output,
            reply,
        } = submission;
        if self.workers.is_empty() {
            let _ = reply.send(Err(DataFusionError::Execution(
                "the cluster has no workers".to_string(),
            )));
            return;
        }
        let stages = match ship_stages(&graph) {
            Ok(stages) => stages,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let config = context
            .session_config()
            .options()
            .entries()
            .into_iter()
            .filter_map(|entry| entry.value.map(|value| (entry.key, value)))
            .collect();
        let memory_limit = match context.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => bytes as u64,
            _ => 0,
        };
        let analyze = is_analyze(&graph);
        let (job, actions) = match self.scheduler.accept_job(graph.clone()) {
            Ok(accepted) => accepted,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        self.jobs.insert(
            job,
            JobEntry {
                graph,
                context,
                stages,
                config,
                memory_limit,
                locations: HashMap::new(),
                done: std::collections::HashSet::new(),
                reports: HashMap::new(),
                analyze,
                announced: HashMap::new(),
                output,
                succeeded: false,
                output_done: false,
                cleanup_pending: false,
            },
        );
        let _ = reply.send(Ok(job));
        self.perform(actions);
    }

    fn task_status(&mut self, report: &proto::TaskStatusReport) {
        let Ok(status) = status_from_report(report) else {
            return;
        };
        let job = JobId(report.job);
        let attempt = TaskAttempt {
            task: TaskId {
                stage: StageId(report.stage as usize),
                partition: report.partition as usize,
            },
            attempt: report.attempt as usize,
        };
        let terminal = status != TaskStatus::Running;
        if terminal {
            self.free_slot(job, attempt);
        }
        if status == TaskStatus::Succeeded {
            if let Some(entry) = self.jobs.get_mut(&job) {
                entry.reports.insert(
                    attempt.task,
                    TaskMetrics {
                        rows: report.output_rows,
                        elapsed_ms: report.elapsed_ms,
                        plan: report.plan_metrics.clone(),
                    },
                );
            }
            self.task_done(job, attempt);
        }
        let actions = self
            .scheduler
            .task_status(job, attempt, report.sequence, status);
        self.perform(actions);
        if terminal {
            self.place_waiting();
        }
    }

    /// Records a succeeded attempt; once every task of its stage is done, the unread streams of the
    /// stage's inputs are released (no consumer will read them), so their producers stop waiting.
    fn task_done(&mut self, job: JobId, attempt: TaskAttempt) {
        let Some(entry) = self.jobs.get_mut(&job) else {
            return;
        };
        if entry.locations.get(&attempt.task).map(|(_, a)| *a) != Some(attempt.attempt) {
            return;
        }
        entry.done.insert(attempt.task);
        let stage_id = attempt.task.stage;
        let Some(stage) = entry.graph.stage(stage_id) else {
            return;
        };
        let complete = (0..stage.partitions()).all(|partition| {
            entry.done.contains(&TaskId {
                stage: stage_id,
                partition,
            })
        });
        if !complete {
            return;
        }
        let mut releases = Vec::new();
        for input in &stage.inputs {
            let Some(producer) = entry.graph.stage(input.stage) else {
                continue;
            };
            for partition in 0..producer.partitions() {
                let task = TaskId {
                    stage: input.stage,
                    partition,
                };
                if let Some((location, producer_attempt)) = entry.locations.get(&task) {
                    let id = StreamId {
                        job,
                        stage: input.stage,
                        partition,
                        attempt: *producer_attempt,
                        channel: 0,
                        replica: 0,
                    };
                    releases.push((*location, id));
                }
            }
        }
        for (location, id) in releases {
            let address = self.address_of(location);
            let flight = self.flight.clone();
            self.rpcs.spawn(async move {
                // A producer that cannot be reached has nothing left to release.
                let _ = flight.release(&address, id).await;
            });
        }
    }

    fn free_slot(&mut self, job: JobId, attempt: TaskAttempt) {
        if let Some(Location::Worker(w)) = self.running.remove(&(job, attempt))
            && let Some(worker) = self.workers.get_mut(w)
        {
            worker.busy = worker.busy.saturating_sub(1);
        }
    }

    fn perform(&mut self, actions: Vec<SchedulerAction>) {
        for action in actions {
            match action {
                SchedulerAction::RunRegion { job, region, tasks } => {
                    self.waiting.push_back((job, region, tasks));
                    self.place_waiting();
                }
                SchedulerAction::StopTasks { job, tasks } => self.stop_tasks(job, &tasks),
                SchedulerAction::ExtendOutput { job, task } => self.extend_output(job, task),
                SchedulerAction::JobSucceeded { job } => {
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        entry.succeeded = true;
                        let stages = if entry.analyze {
                            stage_reports(&entry.graph, &entry.reports)
                        } else {
                            Vec::new()
                        };
                        let _ = entry.output.send(OutputCommand::Finish(Ok(stages)));
                    }
                }
                SchedulerAction::JobFailed { job, error } => {
                    if let Some(entry) = self.jobs.get_mut(&job) {
                        let _ = entry
                            .output
                            .send(OutputCommand::Finish(Err(format!("job {job}: {error}"))));
                    }
                }
                SchedulerAction::CleanUpJob { job } => {
                    let deferred = self.jobs.get_mut(&job).is_some_and(|entry| {
                        let wait = entry.succeeded && !entry.output_done;
                        entry.cleanup_pending = wait;
                        wait
                    });
                    if !deferred {
                        self.clean_up(job);
                    }
                }
            }
        }
    }

    /// Places waiting regions, oldest first, while they fit.
    fn place_waiting(&mut self) {
        while let Some((job, region, tasks)) = self.waiting.pop_front() {
            if !self.jobs.contains_key(&job) {
                continue;
            }
            let ids: Vec<TaskId> = tasks.iter().map(|t| t.task).collect();
            let free: Vec<usize> = self
                .workers
                .iter()
                .map(|w| w.slots.saturating_sub(w.busy))
                .collect();
            let total: Vec<usize> = self.workers.iter().map(|w| w.slots).collect();
            let placement = match self.jobs.get(&job) {
                Some(entry) => place(&ids, &JobView(entry), &free, &total),
                None => continue,
            };
            match placement {
                Placement::Placed(locations) => self.launch(job, &tasks, &locations),
                Placement::Wait => {
                    self.waiting.push_front((job, region, tasks));
                    return;
                }
                Placement::Impossible(message) => {
                    if let Some(entry) = self.jobs.get(&job) {
                        let _ = entry
                            .output
                            .send(OutputCommand::Finish(Err(format!("job {job}: {message}"))));
                    }
                    let actions = self.scheduler.cancel_job(job);
                    self.perform(actions);
                }
            }
        }
    }

    fn launch(&mut self, job: JobId, tasks: &[TaskAttempt], locations: &[Location]) {
        let Some(entry) = self.jobs.get_mut(&job) else {
            return;
        };
        for (attempt, location) in tasks.iter().zip(locations) {
            entry.done.remove(&attempt.task);
            entry
                .locations
                .insert(attempt.task, (*location, attempt.attempt));
            self.running.insert((job, *attempt), *location);
            if let Location::Worker(w) = location
                && let Some(worker) = self.workers.get_mut(*w)
            {
                worker.busy += 1;
            }
        }
        for (attempt, location) in tasks.iter().zip(locations) {
            if let Err(error) = self.start(job, *attempt, *location) {
                let _ = self.events.send(DriverEvent::TaskNotStarted {
                    job,
                    attempt: *attempt,
                    error: error.to_string(),
                });
            }
        }
    }

    fn address_of(&self, location: Location) -> String {
        match location {
            Location::Driver => self.executor.address().to_string(),
            Location::Worker(w) => self
                .workers
                .get(w)
                .map(|w| w.address.clone())
                .unwrap_or_default(),
        }
    }

    fn start(&mut self, job: JobId, attempt: TaskAttempt, location: Location) -> Result<()> {
        let definition = self.definition(job, attempt)?;
        let entry = self
            .jobs
            .get(&job)
            .ok_or_else(|| DataFusionError::Internal(format!("job {job} is gone")))?;
        match location {
            Location::Driver => {
                let stage = entry.graph.stage(attempt.task.stage).ok_or_else(|| {
                    DataFusionError::Internal(format!(
                        "job {job} has no stage {}",
                        attempt.task.stage
                    ))
                })?;
                let local = LocalPlan {
                    plan: Arc::clone(&stage.plan),
                    context: Arc::clone(&entry.context),
                };
                self.executor.shared().start_task(definition, Some(local))
            }
            Location::Worker(w) => {
                let worker = self
                    .workers
                    .get(w)
                    .ok_or_else(|| DataFusionError::Internal(format!("no worker {w}")))?;
                let mut client = worker.client.clone();
                let address = worker.address.clone();
                let request = proto::RunTaskRequest {
                    task: definition.encode_to_vec(),
                };
                let events = self.events.clone();
                self.rpcs.spawn(async move {
                    if let Err(status) = client.run_task(request).await {
                        let _ = events.send(DriverEvent::TaskNotStarted {
                            job,
                            attempt,
                            error: format!(
                                "worker {address} did not start the task: {}",
                                status.message()
                            ),
                        });
                    }
                });
                Ok(())
            }
        }
    }

    /// The task definition of one attempt: its stage's shipped plan and its inputs' locators.
    fn definition(&self, job: JobId, attempt: TaskAttempt) -> Result<proto::TaskDefinition> {
        let entry = self
            .jobs
            .get(&job)
            .ok_or_else(|| DataFusionError::Internal(format!("job {job} is gone")))?;
        let stage_id = attempt.task.stage;
        let stage = entry.graph.stage(stage_id).ok_or_else(|| {
            DataFusionError::Internal(format!("job {job} has no stage {stage_id}"))
        })?;
        let shipped = entry
            .stages
            .get(stage_id.0)
            .ok_or_else(|| DataFusionError::Internal(format!("stage {stage_id} not shipped")))?;
        let inputs = task_inputs(&entry.graph, stage_id, attempt.task.partition)?
            .into_iter()
            .map(|input| {
                let partitions = input
                    .keys
                    .iter()
                    .map(|keys| {
                        let streams = keys
                            .iter()
                            .map(|key| {
                                let producer = TaskId {
                                    stage: input.stage,
                                    partition: key.partition,
                                };
                                let (location, producer_attempt) =
                                    entry.locations.get(&producer).copied().ok_or_else(|| {
                                        DataFusionError::Internal(format!(
                                            "job {job}: stage {} partition {} was never placed",
                                            producer.stage, producer.partition
                                        ))
                                    })?;
                                let id = StreamId {
                                    job,
                                    stage: input.stage,
                                    partition: key.partition,
                                    attempt: producer_attempt,
                                    channel: key.channel,
                                    replica: key.replica,
                                };
                                Ok(proto::StreamLocator {
                                    address: self.address_of(location),
                                    key: Some(id.to_proto()?),
                                })
                            })
                            .collect::<Result<Vec<_>>>()?;
                        Ok(proto::InputPartition { streams })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(proto::TaskInput {
                    stage: to_u32(input.stage.0, "stage")?,
                    mode: input_mode_to_proto(input.mode) as i32,
                    partitions,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(proto::TaskDefinition {
            job: job.0,
            stage: to_u32(stage_id.0, "stage")?,
            partition: to_u32(attempt.task.partition, "partition")?,
            attempt: to_u32(attempt.attempt, "attempt")?,
            plan: shipped.plan.clone().map(|b| b.to_vec()).unwrap_or_default(),
            inputs,
            output: Some(shipped.distribution.clone()),
            replicas: to_u32(entry.graph.replicas(stage_id), "replicas")?,
            blocking: stage.mode == OutputMode::Blocking,
            config: entry.config.clone(),
            memory_limit: entry.memory_limit,
            report_plan_metrics: entry.analyze,
        })
    }

    fn stop_tasks(&mut self, job: JobId, tasks: &[TaskAttempt]) {
        for attempt in tasks {
            let Some(location) = self.running.get(&(job, *attempt)).copied() else {
                continue;
            };
            let key = AttemptKey {
                job,
                stage: attempt.task.stage,
                partition: attempt.task.partition,
                attempt: attempt.attempt,
            };
            match location {
                Location::Driver => {
                    let _ = self.executor.shared().stop_task(key);
                }
                Location::Worker(w) => {
                    let Some(worker) = self.workers.get(w) else {
                        continue;
                    };
                    let Ok(task) = key.to_proto() else {
                        continue;
                    };
                    let mut client = worker.client.clone();
                    self.rpcs.spawn(async move {
                        // A worker that cannot be reached has no task to stop.
                        let _ = client
                            .stop_task(proto::StopTaskRequest { task: Some(task) })
                            .await;
                    });
                }
            }
        }
    }

    fn extend_output(&mut self, job: JobId, attempt: TaskAttempt) {
        let Some(entry) = self.jobs.get(&job) else {
            return;
        };
        let Some((location, _)) = entry.locations.get(&attempt.task).copied() else {
            return;
        };
        let final_stage = entry.graph.final_stage();
        let channels = entry
            .graph
            .stage(final_stage)
            .map_or(1, |s| s.distribution.channels());
        let streams = (0..channels)
            .map(|channel| StreamId {
                job,
                stage: attempt.task.stage,
                partition: attempt.task.partition,
                attempt: attempt.attempt,
                channel,
                replica: 0,
            })
            .collect();
        let address = self.address_of(location);
        if let Some(entry) = self.jobs.get_mut(&job) {
            entry.announced.insert(attempt.task, attempt.attempt);
            let _ = entry.output.send(OutputCommand::Add {
                attempt,
                address,
                streams,
            });
        }
    }

    /// Removes the job's streams everywhere and forgets it.
    fn clean_up(&mut self, job: JobId) {
        self.jobs.remove(&job);
        let _ = self.executor.shared().clean_up_job(job);
        for worker in &self.workers {
            let mut client = worker.client.clone();
            self.rpcs.spawn(async move {
                let _ = client
                    .clean_up_job(proto::CleanUpJobRequest { job: job.0 })
                    .await;
            });
        }
    }
}

/// Placement's view of one job.
struct JobView<'a>(&'a JobEntry);

impl PlacementView for JobView<'_> {
    fn on_driver(&self, task: TaskId) -> bool {
        let stage = task.stage.0;
        self.0
            .graph
            .stages()
            .get(stage)
            .is_some_and(|s| s.placement == TaskPlacement::Driver)
            || self.0.stages.get(stage).is_some_and(|s| s.plan.is_none())
    }

    fn forward_producer(&self, task: TaskId) -> Option<TaskId> {
        let stage = self.0.graph.stage(task.stage)?;
        stage
            .inputs
            .iter()
            .find(|input| input.mode == InputMode::Forward)
            .map(|input| TaskId {
                stage: input.stage,
                partition: task.partition,
            })
    }

    fn placed(&self, task: TaskId) -> Option<Location> {
        self.0.locations.get(&task).map(|(location, _)| *location)
    }
}
