//! What each stage of a job sends to its tasks, prepared once when the job is accepted: worker stages
//! are encoded with the wire codec (one encoding shared by every task and attempt of the stage);
//! driver stages keep their in-memory plan and the session's context.
//!
//! Where a stage runs is decided once, by the job graph builder (`Stage::placement`); this module only
//! follows it. A worker stage that cannot be encoded fails the job here, before any task runs,
//! naming the stage.

use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use sluice_planner::{JobGraph, TaskPlacement};

use crate::codec::encode_stage_plan;
use crate::definition::StagePlan;

/// The plan every task of each stage of `graph` runs, by stage.
pub(super) fn ship_stages(graph: &JobGraph, context: &Arc<TaskContext>) -> Result<Vec<StagePlan>> {
    graph
        .stages()
        .iter()
        .enumerate()
        .map(|(id, stage)| match stage.placement {
            TaskPlacement::Driver => Ok(StagePlan::InMemory {
                plan: Arc::clone(&stage.plan),
                context: Arc::clone(context),
            }),
            TaskPlacement::Worker => encode_stage_plan(Arc::clone(&stage.plan))
                .map(StagePlan::Encoded)
                .map_err(|e| {
                    DataFusionError::Plan(format!("stage {id} cannot be sent to workers: {e}"))
                }),
        })
        .collect()
}
