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

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::reset_plan_states;
use sluice_planner::{JobGraph, StageId, StageInputExec, task_input_keys};

use crate::plan::shuffle_reader::ShuffleReaderExec;
use crate::plan::shuffle_writer::ShuffleWriterExec;
use crate::stream_store::StreamStore;

/// The plan task (`stage`, `partition`) executes: `stage_plan` (the stage's plan, as decoded from the
/// wire) with readers for its inputs and a writer at the root. Execute it at `partition`.
pub fn prepare_task(
    graph: &JobGraph,
    stage_id: StageId,
    stage_plan: Arc<dyn ExecutionPlan>,
    partition: usize,
    store: &Arc<StreamStore>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let stage = graph
        .stage(stage_id)
        .ok_or_else(|| DataFusionError::Internal(format!("the job has no stage {stage_id}")))?;
    let plan = stage_plan
        .transform_up(|node| {
            let Some(placeholder) = node.downcast_ref::<StageInputExec<usize>>() else {
                return Ok(Transformed::no(node));
            };
            let index = *placeholder.input();
            let input = stage.inputs.get(index).ok_or_else(|| {
                DataFusionError::Internal(format!("stage {stage_id} has no input {index}"))
            })?;
            let producer = graph.stage(input.stage).ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "stage {stage_id} reads missing stage {}",
                    input.stage
                ))
            })?;
            let keys = task_input_keys(
                input.mode,
                producer.partitions(),
                producer.distribution.channels(),
                placeholder.properties().partitioning.partition_count(),
                partition,
            )?;
            let reader = ShuffleReaderExec::new(
                input.stage,
                input.mode,
                keys,
                Arc::clone(store),
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
        stage.distribution.clone(),
        Arc::clone(store),
    )))
}
