//! The task definition of one attempt, built from the job's state: pure code, no IO.
//!
//! ```text
//!   stage s, partition p, attempt a ─► plan: the stage's shipped plan
//!                                   ─► inputs: task_inputs(graph, shape, s, p) keys (only partition
//!                                      p of an input the task reads partition-wise; a split skewed
//!                                      join's share in place of its own channel; a switched
//!                                      join's whole build side and no probe stream), each resolved
//!                                      to the producer's latest attempt and where it runs
//!                                   ─► output: the stage's distribution, replicas and output mode
//!                                   ─► the runtime filters it gets while it runs, with the key
//!                                      summary of each whose source finished
//! ```
//!
//! Invariant: every locator names the producer attempt a consumer placed now must read (the latest
//! one); a producer that was never placed is an error, never a guess.

use datafusion::common::{DataFusionError, Result};
use sluice_planner::{FilterDelivery, JobId, StageId, TaskAttempt, TaskId};

use super::broadcast_switch;
use super::job::JobEntry;
use super::placement::Location;
use super::skew_splits::reassign;
use crate::definition::{LiveRuntimeFilter, StreamLocator, TaskDefinition, TaskInputStreams};
use crate::task::task_inputs;

/// The definition of `attempt` of `job`; `address_of` gives each location's data-plane address.
pub(super) fn task_definition(
    job: JobId,
    entry: &JobEntry,
    attempt: TaskAttempt,
    address_of: &dyn Fn(Location) -> Option<String>,
) -> Result<TaskDefinition> {
    let stage_id = attempt.task.stage;
    let graph = &entry.graph;
    let stage = graph
        .stage(stage_id)
        .ok_or_else(|| DataFusionError::Internal(format!("job {job} has no stage {stage_id}")))?;
    let plan = entry.plans.get(stage_id.0).cloned().ok_or_else(|| {
        DataFusionError::Internal(format!("job {job}: stage {stage_id} was not shipped"))
    })?;
    let shape = entry.shapes.get(stage_id.0).ok_or_else(|| {
        DataFusionError::Internal(format!("job {job}: stage {stage_id} has no shape"))
    })?;
    let mut inputs = task_inputs(graph, shape, stage_id, attempt.task.partition)?;
    if let Some(split) = entry.skew_splits.get(&stage_id) {
        let build_partitions = stage
            .inputs
            .get(split.build_input)
            .and_then(|input| graph.stage(input.stage))
            .map_or(0, |producer| producer.partitions());
        reassign(&mut inputs, split, attempt.task.partition, build_partitions)?;
    }
    if let Some(switch) = entry.broadcast_switches.get(&stage_id) {
        let build = stage
            .inputs
            .get(switch.build_input)
            .and_then(|input| graph.stage(input.stage))
            .map(|producer| (producer.partitions(), producer.distribution.channels()))
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "job {job}: stage {stage_id}'s broadcast switch names a missing build input"
                ))
            })?;
        broadcast_switch::reassign(&mut inputs, switch, attempt.task.partition, build)?;
    }
    let inputs = inputs
        .into_iter()
        .map(|input| {
            let partitions = input
                .keys
                .iter()
                .map(|keys| {
                    keys.iter()
                        .map(|key| {
                            let producer = TaskId {
                                stage: input.stage,
                                partition: key.partition,
                            };
                            let (location, producer_attempt) =
                                entry.location_of(producer).ok_or_else(|| {
                                    DataFusionError::Internal(format!(
                                        "job {job}: {producer} was never placed"
                                    ))
                                })?;
                            let address = address_of(location).ok_or_else(|| {
                                DataFusionError::Internal(format!(
                                    "job {job}: {producer} runs at an unknown location"
                                ))
                            })?;
                            let stream = TaskAttempt {
                                task: producer,
                                attempt: producer_attempt,
                            }
                            .of_job(job)
                            .stream(key.channel)
                            .replica(key.replica);
                            Ok(StreamLocator { address, stream })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(TaskInputStreams {
                stage: input.stage,
                mode: input.mode,
                partitions,
                first: input.first,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TaskDefinition {
        attempt: attempt.of_job(job),
        plan,
        inputs,
        output: stage.distribution.clone(),
        replicas: graph.replicas(stage_id),
        output_mode: stage.mode,
        config: entry.config.clone(),
        memory_limit: entry.memory_limit,
        report_plan_metrics: entry.analyze,
        summarise_columns: entry
            .graph
            .runtime_filters()
            .iter()
            .find(|f| f.source == stage_id)
            .map(|f| f.source_columns.clone())
            .unwrap_or_default(),
        runtime_filters: live_filters(entry, stage_id),
        announce_running: stage_id == graph.final_stage(),
    })
}

/// Whether `stage` reads `input`'s output.
fn reads(entry: &JobEntry, stage: StageId, input: StageId) -> bool {
    entry
        .graph
        .stage(stage)
        .is_some_and(|s| s.inputs.iter().any(|i| i.stage == input))
}

/// The runtime filters `stage`'s tasks get while they run, with the summary of each whose source
/// finished already.
fn live_filters(entry: &JobEntry, stage: StageId) -> Vec<LiveRuntimeFilter> {
    entry
        .graph
        .runtime_filters()
        .iter()
        .enumerate()
        .filter(|(index, f)| {
            f.target == stage
                && f.delivery == FilterDelivery::WhileRunning
                && !entry.withdrawn_filters.contains(index)
        })
        .map(|(index, f)| LiveRuntimeFilter {
            filter: index,
            path: f.target_path.clone(),
            columns: f.target_columns.clone(),
            summary: entry.live_filters.get(&index).cloned().flatten(),
            // Settled (sent, or none could be built): nothing to wait for.
            wait: !entry.live_filters.contains_key(&index)
                && f.target != f.join_stage
                && !reads(entry, f.target, f.source),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use sluice_planner::{JobId, StageId, TaskAttempt, TaskId};

    use super::task_definition;
    use crate::driver::skew_splits::tests::{join_entry, run};

    /// Only a final-stage task's `Running` report is acted on (the job output starts reading it),
    /// so only its definition asks for it at once; every other task may leave it out if short.
    #[tokio::test]
    async fn only_the_final_stages_tasks_announce_running() {
        let (mut entry, _, _, _) = join_entry().await;
        let stages = entry.graph.stages().len();
        let final_stage = entry.graph.final_stage();
        assert!(stages >= 3, "{:#?}", entry.graph.stages());
        // Every task placed, so each definition finds its inputs' producers.
        for stage in 0..stages {
            for partition in 0..entry.graph.stages()[stage].partitions() {
                run(&mut entry, StageId(stage), partition, 0, &[]);
            }
        }
        let announced: Vec<bool> = (0..stages)
            .map(|stage| {
                let attempt = TaskAttempt {
                    task: TaskId {
                        stage: StageId(stage),
                        partition: 0,
                    },
                    attempt: 0,
                };
                task_definition(JobId(1), &entry, attempt, &|l| Some(format!("{l:?}")))
                    .unwrap()
                    .announce_running
            })
            .collect();
        let expected: Vec<bool> = (0..stages).map(|s| StageId(s) == final_stage).collect();
        assert_eq!(announced, expected);
    }
}
