//! Task preparation: turns one partition of a stage into a runnable plan.
//!
//! ```text
//!   stage plan                              task plan (stage s, partition p)
//!   ProjectionExec                          ShuffleWriterExec (stage s, output distribution)
//!     HashJoinExec                   ──►      ProjectionExec
//!       StageInputExec(input 0)                 HashJoinExec
//!       StageInputExec(input 1)                   ShuffleReaderExec (input 0's streams for task p)
//!                                                 ShuffleReaderExec (input 1's streams for task p)
//! ```
//!
//! Every task gets a fresh plan instance (`reset_plan_states`), so operator state that DataFusion
//! shares between the partitions of one instance (collected build sides, file work queues, dynamic
//! filters) is never shared between tasks: a task sees exactly what it would see on a remote worker.
//!
//! [`task_inputs`] is what the driver computes from the job graph for a task definition;
//! [`assemble_task`] is what a worker builds from those keys (it never sees the graph).

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::reset_plan_states;
use sluice_planner::{
    InputKey, InputMode, JobGraph, OutputDistribution, StageId, StageInputExec, task_input_keys,
};

use crate::plan::shuffle_reader::ShuffleReaderExec;
use crate::plan::shuffle_writer::ShuffleWriterExec;
use crate::stream_store::TaskStreams;

/// What one stage input of one task reads: the producer stage, how, and the producer streams of
/// each input partition (`keys[i]` for input partition `i`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInput {
    /// The producer stage.
    pub stage: StageId,
    /// How the input is read.
    pub mode: InputMode,
    /// The streams of each input partition.
    pub keys: Vec<Vec<InputKey>>,
}

/// The inputs of task (`stage_id`, `partition`) of `graph`, in the stage's input order.
pub fn task_inputs(
    graph: &JobGraph,
    stage_id: StageId,
    partition: usize,
) -> Result<Vec<TaskInput>> {
    let stage = graph
        .stage(stage_id)
        .ok_or_else(|| DataFusionError::Internal(format!("the job has no stage {stage_id}")))?;
    let placeholders = placeholder_partitions(&stage.plan)?;
    stage
        .inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            let producer = graph.stage(input.stage).ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "stage {stage_id} reads missing stage {}",
                    input.stage
                ))
            })?;
            let consumer_partitions =
                placeholders.get(index).copied().flatten().ok_or_else(|| {
                    DataFusionError::Internal(format!(
                        "stage {stage_id} has no placeholder for input {index}"
                    ))
                })?;
            let keys = task_input_keys(
                input.mode,
                producer.partitions(),
                producer.distribution.channels(),
                consumer_partitions,
                partition,
            )?;
            Ok(TaskInput {
                stage: input.stage,
                mode: input.mode,
                keys,
            })
        })
        .collect()
}

/// The partition count of each input's placeholder, by input index.
fn placeholder_partitions(plan: &Arc<dyn ExecutionPlan>) -> Result<Vec<Option<usize>>> {
    let mut counts = Vec::new();
    plan.apply(|node| {
        if let Some(placeholder) = node.downcast_ref::<StageInputExec<usize>>() {
            let index = *placeholder.input();
            if counts.len() <= index {
                counts.resize(index + 1, None);
            }
            counts[index] = Some(placeholder.properties().partitioning.partition_count());
        }
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    })?;
    Ok(counts)
}

/// The task plan from a stage plan and its inputs' stream keys: each `StageInputExec<usize>` becomes
/// a [`ShuffleReaderExec`] over `inputs[index]`, and a [`ShuffleWriterExec`] with `distribution`
/// becomes the root.
pub fn assemble_task(
    stage_id: StageId,
    stage_plan: Arc<dyn ExecutionPlan>,
    inputs: &[TaskInput],
    distribution: OutputDistribution,
    streams: &Arc<dyn TaskStreams>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let plan = stage_plan
        .transform_up(|node| {
            let Some(placeholder) = node.downcast_ref::<StageInputExec<usize>>() else {
                return Ok(Transformed::no(node));
            };
            let index = *placeholder.input();
            let input = inputs.get(index).ok_or_else(|| {
                DataFusionError::Internal(format!("stage {stage_id} has no input {index}"))
            })?;
            let reader = ShuffleReaderExec::new(
                input.stage,
                input.mode,
                input.keys.clone(),
                Arc::clone(streams),
                placeholder.properties().clone(),
            )
            .with_replay(placeholder.replay());
            Ok(Transformed::yes(Arc::new(reader) as Arc<dyn ExecutionPlan>))
        })?
        .data;
    let plan = reset_plan_states(plan)?;
    Ok(Arc::new(ShuffleWriterExec::new(
        plan,
        stage_id,
        distribution,
        Arc::clone(streams),
    )))
}
