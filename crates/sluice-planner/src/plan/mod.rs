//! Sluice's own plan nodes that the planner places into stage plans, and the child-handling helpers
//! every Sluice node (here and in `sluice-runtime`) shares.

pub mod rescale;
pub mod stage_input;

use std::sync::Arc;

use datafusion::common::{Result, internal_err};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};

/// The `replace_children` options that `with_new_children` means: recompute the node's properties.
pub const RECOMPUTE: ReplaceChildrenOptions =
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);

/// The one child in `children`, or an internal error naming `node`.
pub fn only_child(
    node: &str,
    mut children: Vec<Arc<dyn ExecutionPlan>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    match (children.pop(), children.is_empty()) {
        (Some(child), true) => Ok(child),
        _ => internal_err!("{node} takes exactly one child"),
    }
}

/// An internal error naming `node` unless `children` is empty (for leaves).
pub fn no_children(node: &str, children: &[Arc<dyn ExecutionPlan>]) -> Result<()> {
    if children.is_empty() {
        Ok(())
    } else {
        internal_err!("{node} is a leaf and takes no children")
    }
}
