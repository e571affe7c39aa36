//! `StageInputExec<I>`: the leaf that marks "read another stage's output here".
//!
//! It is a placeholder, never an operator: executing it is an error. While the job graph is built,
//! `I = StageInput` names the producer stage and the input mode; in finished stage plans `I = usize`
//! indexes the stage's `inputs`, so a stage plan is a plain DataFusion plan that a worker resolves by
//! replacing each placeholder with a reader for that input's streams.
//!
//! Invariant: the placeholder carries the plan properties (schema, partitioning, ordering) that its
//! reader will deliver, so the operators above it keep their planning assumptions.

use std::fmt::{self, Debug};
use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{Result, internal_err};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use super::{RECOMPUTE, no_children};
use crate::job_graph::StageInput;

/// What a placeholder refers to: a [`StageInput`] while building, an input index afterwards.
pub trait StageInputRef: Debug + Clone + Send + Sync + 'static {
    /// The text shown in plan displays.
    fn label(&self) -> String;
}

impl StageInputRef for StageInput {
    fn label(&self) -> String {
        format!("stage={}, mode={}", self.stage, self.mode.name())
    }
}

impl StageInputRef for usize {
    fn label(&self) -> String {
        format!("input={self}")
    }
}

/// A leaf standing for another stage's output; see the module docs.
#[derive(Debug, Clone)]
pub struct StageInputExec<I: StageInputRef> {
    input: I,
    properties: Arc<PlanProperties>,
    replay: bool,
}

impl<I: StageInputRef> StageInputExec<I> {
    /// A placeholder for `input` delivering `properties`.
    pub fn new(input: I, properties: Arc<PlanProperties>) -> Self {
        Self {
            input,
            properties,
            replay: false,
        }
    }

    /// Marks that the operator above may execute a partition of this input more than once, so its
    /// reader must be able to serve it again.
    pub fn with_replay(mut self, replay: bool) -> Self {
        self.replay = replay;
        self
    }

    /// Whether a partition may be read more than once.
    pub fn replay(&self) -> bool {
        self.replay
    }

    /// What the placeholder refers to.
    pub fn input(&self) -> &I {
        &self.input
    }
}

impl<I: StageInputRef> DisplayAs for StageInputExec<I> {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "StageInputExec: {}, partitions={}{}",
            self.input.label(),
            self.properties.partitioning.partition_count(),
            if self.replay { ", replay" } else { "" }
        )
    }
}

impl<I: StageInputRef> ExecutionPlan for StageInputExec<I> {
    fn name(&self) -> &str {
        "StageInputExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        no_children(self.name(), &children)?;
        Ok(self)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(children, RECOMPUTE)
    }

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        internal_err!(
            "StageInputExec ({}) partition {partition} must be replaced by a stage reader before execution",
            self.input.label()
        )
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::Schema;
    use datafusion::physical_plan::empty::EmptyExec;

    use super::*;
    use crate::job_graph::{InputMode, StageId};

    #[test]
    fn executing_a_placeholder_is_an_error() {
        let empty = EmptyExec::new(Arc::new(Schema::empty()));
        let input = StageInput {
            stage: StageId(3),
            mode: InputMode::Shuffle,
        };
        let placeholder = StageInputExec::new(input, empty.properties().clone());
        let ctx = Arc::new(TaskContext::default());
        let error = placeholder.execute(0, ctx).err().map(|e| e.to_string());
        assert!(
            error
                .as_deref()
                .is_some_and(|e| e.contains("stage=3, mode=Shuffle")),
            "{error:?}"
        );
    }
}
