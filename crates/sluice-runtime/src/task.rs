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
    InputKey, InputMode, InputReads, JobGraph, OutputDistribution, Stage, StageId, StageInputExec,
    input_reads, task_input_keys_of,
};

use crate::plan::shuffle_reader::ShuffleReaderExec;
use crate::plan::shuffle_writer::ShuffleWriterExec;
use crate::stream_store::TaskStreams;

/// What one stage input of one task reads: the producer stage, how, and the producer streams of
/// the input partitions the task reads (`keys[k]` for input partition `first + k`; a partition
/// outside them is not the task's to read, and its reader fails rather than read nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInput {
    /// The producer stage.
    pub stage: StageId,
    /// How the input is read.
    pub mode: InputMode,
    /// The streams of input partitions `first..first + keys.len()`.
    pub keys: Vec<Vec<InputKey>>,
    /// The first input partition `keys` lists (0 when it lists every one).
    pub first: usize,
}

/// What [`task_inputs`] needs of one stage, computed once per job rather than per task: each
/// input's placeholder partition count, and whether a task reads only its own partition of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageShape {
    partitions: Vec<Option<usize>>,
    reads: Vec<InputReads>,
}

impl StageShape {
    /// The shape of `stage`'s plan.
    pub fn of(stage: &Stage) -> Result<Self> {
        Ok(Self {
            partitions: placeholder_partitions(&stage.plan)?,
            reads: input_reads(&stage.plan, stage.inputs.len()),
        })
    }

    /// The shape of every stage of `graph`, by stage id.
    pub fn of_graph(graph: &JobGraph) -> Result<Vec<Self>> {
        graph.stages().iter().map(Self::of).collect()
    }
}

/// The inputs of task (`stage_id`, `partition`) of `graph`, in the stage's input order; `shape` is
/// the stage's [`StageShape`]. An input the task reads only its own partition of lists that one.
pub fn task_inputs(
    graph: &JobGraph,
    shape: &StageShape,
    stage_id: StageId,
    partition: usize,
) -> Result<Vec<TaskInput>> {
    let stage = graph
        .stage(stage_id)
        .ok_or_else(|| DataFusionError::Internal(format!("the job has no stage {stage_id}")))?;
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
                shape
                    .partitions
                    .get(index)
                    .copied()
                    .flatten()
                    .ok_or_else(|| {
                        DataFusionError::Internal(format!(
                            "stage {stage_id} has no placeholder for input {index}"
                        ))
                    })?;
            let wanted = match shape.reads.get(index) {
                Some(InputReads::OwnPartition) if partition < consumer_partitions => {
                    partition..partition + 1
                }
                _ => 0..consumer_partitions,
            };
            let first = wanted.start;
            let keys = task_input_keys_of(
                input.mode,
                producer.partitions(),
                producer.distribution.channels(),
                consumer_partitions,
                partition,
                wanted,
            )?;
            Ok(TaskInput {
                stage: input.stage,
                mode: input.mode,
                keys,
                first,
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
            .with_first_partition(input.first)
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

#[cfg(test)]
mod tests {
    use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;

    use super::*;
    use crate::simulation::graph::chain_graph;

    fn key(partition: usize) -> InputKey {
        InputKey {
            partition,
            channel: 0,
            replica: 0,
        }
    }

    #[test]
    fn a_task_reading_its_input_partition_wise_lists_only_its_own_partition() {
        let graph = chain_graph(2, 4, true).unwrap();
        let shape = StageShape::of(&graph.stages()[1]).unwrap();
        let inputs = task_inputs(&graph, &shape, StageId(1), 2).unwrap();
        assert_eq!(
            inputs,
            [TaskInput {
                stage: StageId(0),
                mode: InputMode::Rescale,
                keys: vec![vec![key(2)]],
                first: 2,
            }]
        );
    }

    #[test]
    fn a_task_merging_its_input_lists_every_partition() {
        let graph = chain_graph(2, 4, true).unwrap();
        let mut stage = graph.stages()[1].clone();
        stage.plan = Arc::new(CoalescePartitionsExec::new(Arc::clone(&stage.plan)));
        let shape = StageShape::of(&stage).unwrap();
        let inputs = task_inputs(&graph, &shape, StageId(1), 0).unwrap();
        assert_eq!(inputs[0].first, 0);
        assert_eq!(
            inputs[0].keys,
            [vec![key(0)], vec![key(1)], vec![key(2)], vec![key(3)]]
        );
    }
}
