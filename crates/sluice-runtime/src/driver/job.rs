//! What the driver actor keeps per job, next to the scheduler's state: the shipped stage plans, the
//! session's settings, where every task attempt was placed, which attempts succeeded and what they
//! reported, and the job output's command channel.
//!
//! Invariants: `placed` remembers every attempt ever placed (a replaced attempt's output is found and
//! discarded through it); `latest` is the attempt a consumer placed now reads; metrics are keyed by
//! attempt and recorded only from reports the scheduler accepted, so a stale attempt never
//! overwrites the current one's.

use datafusion::common::HashMap;
use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::{JobGraph, StageId, TaskAttempt, TaskId};
use tokio::sync::mpsc;

use super::output::OutputCommand;
use super::placement::Location;
use crate::analyze::TaskMetrics;
use crate::definition::StagePlan;

/// The shell's state of one job; see the module docs.
pub(super) struct JobEntry {
    pub graph: Arc<JobGraph>,
    /// Per stage, the plan its tasks run.
    pub plans: Vec<StagePlan>,
    /// Per stage, what building its tasks' inputs needs (computed once).
    pub shapes: Vec<crate::task::StageShape>,
    pub config: Arc<std::collections::HashMap<String, String>>,
    /// The session's own memory limit, held per task (see `TaskDefinition::memory_limit`).
    pub memory_limit: Option<u64>,
    /// The job is an `EXPLAIN ANALYZE`: tasks report their plans with metrics.
    pub analyze: bool,
    pub placed: HashMap<TaskAttempt, Location>,
    pub latest: HashMap<TaskId, usize>,
    /// Tasks whose latest attempt succeeded, with that attempt (changed through
    /// [`JobEntry::task_succeeded`], [`JobEntry::forget_success`] and [`JobEntry::place`] only,
    /// which keep `done_per_stage` equal to its count per stage).
    pub succeeded: HashMap<TaskId, usize>,
    /// Per stage, how many of its tasks are in `succeeded`.
    done_per_stage: Vec<usize>,
    pub metrics: HashMap<TaskAttempt, TaskMetrics>,
    /// Final-stage attempts whose streams the output reads.
    pub announced: std::collections::HashMap<TaskId, usize>,
    pub retries: usize,
    /// Regions run again because their outputs were lost (lineage).
    pub reruns: usize,
    pub output: mpsc::UnboundedSender<OutputCommand>,
    /// Who asked for the job (from its session config), for progress reports.
    pub label: Option<Arc<super::JobLabel>>,
    /// What the REST API and system tables tell about it.
    pub record: super::JobRecord,
    /// Its task attempts, for the same readers.
    pub attempts: super::attempts::AttemptLog,
    /// Stages whose runtime filters were applied (or given up): never again for this job.
    pub filtered_stages: std::collections::BTreeSet<StageId>,
    /// What became of them and of the job's skew splits, for `EXPLAIN ANALYZE`.
    pub stage_notes: Vec<super::StageNote>,
    /// Per source stage of an applied filter, the summary it was built from (a re-run of the
    /// source is checked against it).
    pub applied_summaries: std::collections::HashMap<StageId, crate::runtime_filter::KeySummary>,
    /// The runtime filters delivered while their targets run, by index in the graph's list, once
    /// their source finished: the merged key summary sent (`None`: none could be built). Every
    /// later attempt of the target gets it with its definition.
    pub live_filters: std::collections::BTreeMap<usize, Option<bytes::Bytes>>,
    /// Live filters withdrawn because their target's region runs again
    /// (`runtime_filters::withdraw_for_retry`): no later attempt gets them.
    pub withdrawn_filters: std::collections::BTreeSet<usize>,
    /// Join stages whose skew split was decided (split or not): never again for this job.
    pub skew_decided: std::collections::BTreeSet<StageId>,
    /// The splits decided: every attempt of those stages' tasks reads what they say.
    pub skew_splits: std::collections::HashMap<StageId, super::skew_splits::SkewSplit>,
    /// Join stages whose broadcast switch was decided (switched or not): never again for this job.
    pub switch_decided: std::collections::BTreeSet<StageId>,
    /// The switches made: every attempt of those stages' tasks reads what they say.
    pub broadcast_switches:
        std::collections::HashMap<StageId, super::broadcast_switch::BroadcastSwitch>,
    /// The stage plans a runtime filter or an adaptive switch rewrote, unencoded (what `plans`
    /// holds for them, encoded), so a later rewrite starts from them.
    pub rewritten: std::collections::HashMap<StageId, Arc<dyn ExecutionPlan>>,
}

impl JobEntry {
    /// A job just accepted, none of its tasks placed; each stage's plan and shape come together.
    pub fn new(
        job: sluice_planner::JobId,
        graph: Arc<JobGraph>,
        (plans, shapes): (Vec<StagePlan>, Vec<crate::task::StageShape>),
        config: Arc<std::collections::HashMap<String, String>>,
        memory_limit: Option<u64>,
        label: Option<Arc<super::JobLabel>>,
        output: mpsc::UnboundedSender<OutputCommand>,
    ) -> Self {
        let record = super::JobRecord::of_graph(job.0, label.clone(), &graph);
        let done_per_stage = vec![0; graph.stages().len()];
        Self {
            analyze: crate::analyze::is_analyze(&graph),
            graph,
            plans,
            shapes,
            config,
            memory_limit,
            placed: HashMap::new(),
            latest: HashMap::new(),
            succeeded: HashMap::new(),
            done_per_stage,
            metrics: HashMap::new(),
            announced: std::collections::HashMap::new(),
            retries: 0,
            reruns: 0,
            output,
            label,
            attempts: super::attempts::AttemptLog::new(job, record.label.as_deref()),
            filtered_stages: std::collections::BTreeSet::new(),
            stage_notes: Vec::new(),
            applied_summaries: std::collections::HashMap::new(),
            live_filters: std::collections::BTreeMap::new(),
            withdrawn_filters: std::collections::BTreeSet::new(),
            skew_decided: std::collections::BTreeSet::new(),
            skew_splits: std::collections::HashMap::new(),
            switch_decided: std::collections::BTreeSet::new(),
            broadcast_switches: std::collections::HashMap::new(),
            rewritten: std::collections::HashMap::new(),
            record,
        }
    }

    /// Its record as the REST API and system tables show it now.
    pub fn current_record(&self) -> super::JobRecord {
        let mut record = self.record.clone();
        record.retries = self.retries;
        record.tasks_done = self.succeeded.len();
        record.attempts = Arc::new(self.attempts.records().to_vec());
        record
    }

    /// Its progress, `running` telling how many attempts of each stage run now.
    pub fn progress(
        &self,
        job: sluice_planner::JobId,
        running: impl Fn(StageId) -> usize,
    ) -> super::JobProgress {
        let rows = self.succeeded_metrics();
        let stages = self
            .graph
            .stages()
            .iter()
            .enumerate()
            .map(|(id, stage)| {
                let of_stage = |t: &TaskId| t.stage.0 == id;
                super::StageProgress {
                    total: stage.partitions(),
                    running: running(StageId(id)),
                    done: self.succeeded.keys().filter(|t| of_stage(t)).count(),
                    rows: rows
                        .iter()
                        .filter(|(t, _)| of_stage(t))
                        .map(|(_, m)| m.rows)
                        .sum(),
                }
            })
            .collect();
        super::JobProgress {
            job: job.0,
            stages,
            retries: self.retries,
            label: self.label.clone(),
        }
    }

    /// Where `task`'s latest attempt runs, and which attempt that is.
    pub fn location_of(&self, task: TaskId) -> Option<(Location, usize)> {
        let attempt = *self.latest.get(&task)?;
        let location = *self.placed.get(&TaskAttempt { task, attempt })?;
        Some((location, attempt))
    }

    /// Records that `attempt` is placed at `location` (a new attempt of its task).
    pub fn place(&mut self, attempt: TaskAttempt, location: Location) {
        self.placed.insert(attempt, location);
        self.latest.insert(attempt.task, attempt.attempt);
        self.forget_success(attempt.task);
    }

    /// Records that `attempt` succeeded: its task's output is the one consumers read.
    pub fn task_succeeded(&mut self, attempt: TaskAttempt) {
        if self
            .succeeded
            .insert(attempt.task, attempt.attempt)
            .is_none()
            && let Some(done) = self.done_per_stage.get_mut(attempt.task.stage.0)
        {
            *done += 1;
        }
    }

    /// `task`'s success no longer stands (its output was lost, or it runs again).
    pub fn forget_success(&mut self, task: TaskId) {
        if self.succeeded.remove(&task).is_some()
            && let Some(done) = self.done_per_stage.get_mut(task.stage.0)
        {
            *done = done.saturating_sub(1);
        }
    }

    /// Whether every task of `stage` has succeeded (a count kept as successes come and go, so a
    /// report costs the same whatever the stage's width).
    pub fn stage_complete(&self, stage: StageId) -> bool {
        match (self.graph.stage(stage), self.done_per_stage.get(stage.0)) {
            (Some(s), Some(done)) => *done == s.partitions(),
            _ => false,
        }
    }

    /// The plan `stage`'s tasks run now, unencoded: the job graph's, or what rewrote it.
    pub fn stage_plan(&self, stage: StageId) -> Option<Arc<dyn ExecutionPlan>> {
        match self.rewritten.get(&stage) {
            Some(plan) => Some(Arc::clone(plan)),
            None => self.graph.stage(stage).map(|s| Arc::clone(&s.plan)),
        }
    }

    /// `plan` becomes what `stage`'s tasks run (encoded for workers, or in memory for a stage on
    /// the driver's own executor, with its context).
    pub fn rewrite_stage(
        &mut self,
        stage: StageId,
        plan: Arc<dyn ExecutionPlan>,
    ) -> datafusion::common::Result<()> {
        let shipped = self.shipped_form(stage, &plan)?;
        self.install(stage, plan, shipped);
        Ok(())
    }

    /// What `stage`'s tasks would be sent to run `plan`: encoded for workers, or in memory for a
    /// stage on the driver's own executor, with its context. Changes nothing.
    pub fn shipped_form(
        &self,
        stage: StageId,
        plan: &Arc<dyn ExecutionPlan>,
    ) -> datafusion::common::Result<StagePlan> {
        match self.plans.get(stage.0) {
            Some(StagePlan::InMemory { context, .. }) => Ok(StagePlan::InMemory {
                plan: Arc::clone(plan),
                context: Arc::clone(context),
            }),
            Some(_) => crate::codec::encode_stage_plan(Arc::clone(plan)).map(StagePlan::Encoded),
            None => Err(datafusion::common::DataFusionError::Internal(format!(
                "stage {stage} was not shipped"
            ))),
        }
    }

    /// `plan`, sent as `shipped` (its [`JobEntry::shipped_form`]), becomes what `stage`'s tasks
    /// run.
    pub fn install(&mut self, stage: StageId, plan: Arc<dyn ExecutionPlan>, shipped: StagePlan) {
        if let Some(slot) = self.plans.get_mut(stage.0) {
            *slot = shipped;
        }
        self.rewritten.insert(stage, plan);
    }

    /// Whether `stage`'s tasks run on the driver's own executor (from memory).
    pub fn runs_on_driver(&self, stage: StageId) -> bool {
        matches!(self.plans.get(stage.0), Some(StagePlan::InMemory { .. }))
    }

    /// What `task`'s succeeded attempt reported (`None` if it has not succeeded, or said nothing).
    pub fn metrics_of_success(&self, task: TaskId) -> Option<&TaskMetrics> {
        let attempt = *self.succeeded.get(&task)?;
        self.metrics.get(&TaskAttempt { task, attempt })
    }

    /// What each task's succeeded attempt reported.
    pub fn succeeded_metrics(&self) -> std::collections::HashMap<TaskId, TaskMetrics> {
        self.succeeded
            .keys()
            .filter_map(|task| self.metrics_of_success(*task).map(|m| (*task, m.clone())))
            .collect()
    }
}
