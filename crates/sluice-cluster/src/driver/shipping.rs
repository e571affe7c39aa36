//! What each stage of a job sends to workers, prepared once when the job is accepted: the stage plan's
//! bytes, its output distribution, or the decision to run the stage on the driver's executor.
//!
//! A worker-placed stage runs on the driver instead when its plan would not survive the wire exactly:
//! datafusion-proto 55 encodes a `Float16` literal as `Float32`, so such a stage would compute with a
//! different type on a worker. Running it on the driver (from the in-memory plan) keeps the answer
//! right; every other worker stage must encode, or the job fails naming the stage.

use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_expr::expressions::Literal;
use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::{JobGraph, TaskPlacement};
use sluice_runtime::codec::encode_stage_plan;

use crate::proto;
use crate::wire::encode_distribution;

/// One stage as the driver ships it.
pub(crate) struct ShippedStage {
    /// The encoded plan; `None` when the stage runs on the driver.
    pub plan: Option<bytes::Bytes>,
    pub distribution: proto::OutputDistribution,
}

/// Prepares every stage of `graph`.
pub(crate) fn ship_stages(graph: &JobGraph) -> Result<Vec<ShippedStage>> {
    graph
        .stages()
        .iter()
        .enumerate()
        .map(|(id, stage)| {
            let distribution = encode_distribution(&stage.distribution).map_err(|e| {
                DataFusionError::Plan(format!(
                    "stage {id}: output distribution has no wire form: {e}"
                ))
            })?;
            let ships =
                stage.placement == TaskPlacement::Worker && !has_lossy_literal(&stage.plan)?;
            let plan = if ships {
                Some(encode_stage_plan(Arc::clone(&stage.plan)).map_err(|e| {
                    DataFusionError::Plan(format!(
                        "stage {id} cannot be sent to workers: {e}; run it with --mode local"
                    ))
                })?)
            } else {
                None
            };
            Ok(ShippedStage { plan, distribution })
        })
        .collect()
}

/// Whether `plan` holds a literal that datafusion-proto 55 does not encode exactly.
fn has_lossy_literal(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
    let mut lossy = false;
    plan.apply(|node| {
        node.apply_expressions(&mut |expr| {
            expr.apply(|e| {
                if let Some(literal) = e.downcast_ref::<Literal>()
                    && matches!(literal.value(), ScalarValue::Float16(_))
                {
                    lossy = true;
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })?;
        Ok(if lossy {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(lossy)
}
