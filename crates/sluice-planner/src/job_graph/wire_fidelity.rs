//! Whether a stage plan survives the wire exactly. datafusion-proto 55 encodes a `Float16` literal as
//! `Float32`, so a stage holding one would compute with another type on a worker; the builder places
//! such a stage on the driver, which runs it from the in-memory plan. This is the only place that
//! decision is made: `Stage::placement` carries it to EXPLAIN, the scheduler and task placement.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_expr::expressions::Literal;
use datafusion::physical_plan::ExecutionPlan;

/// Whether `plan` holds a literal that datafusion-proto 55 does not encode exactly.
pub(crate) fn has_lossy_literal(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
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
