//! `RescaleExec`: Sluice's node that reduces a plan's partition count without a full exchange.
//!
//! ```text
//!   input partitions   0   1   2   3   4   5        (N = 6)
//!                      └───┬───┘   └─┬─┘   └─┬─┘
//!   output partitions      0         1       2      (M = 3): p reads [p*N/M, (p+1)*N/M)
//! ```
//!
//! In one process it reads its input partitions' streams interleaved. In a job graph it is a stage
//! boundary with the `Rescale` input mode, so each consumer task reads only its contiguous range of
//! producer partitions. Rows keep no order across the merged partitions, so the node declares none.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{Result, internal_err, plan_err};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::stream::{self, StreamExt};

use super::{RECOMPUTE, only_child};
use crate::distribution::{Boundary, DistributedExec, NodeDistribution};

/// The contiguous input partitions that output partition `output` of `outputs` reads, out of `inputs`.
pub fn rescale_range(output: usize, outputs: usize, inputs: usize) -> Range<usize> {
    let outputs = outputs.max(1);
    output * inputs / outputs..(output + 1) * inputs / outputs
}

/// Reduces `input`'s partitions to `partitions` contiguous groups; see the module docs.
#[derive(Debug, Clone)]
pub struct RescaleExec {
    input: Arc<dyn ExecutionPlan>,
    partitions: usize,
    properties: Arc<PlanProperties>,
}

impl RescaleExec {
    /// Groups `input`'s partitions into `partitions` (at least one, at most the input's count).
    pub fn try_new(input: Arc<dyn ExecutionPlan>, partitions: usize) -> Result<Self> {
        let inputs = input.output_partitioning().partition_count();
        if partitions == 0 || partitions > inputs {
            return plan_err!(
                "RescaleExec reduces {inputs} partitions; {partitions} output partitions is not in 1..={inputs}"
            );
        }
        let properties = PlanProperties::new(
            EquivalenceProperties::new(input.schema()),
            Partitioning::UnknownPartitioning(partitions),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        Ok(Self {
            input,
            partitions,
            properties: Arc::new(properties),
        })
    }

    /// The input plan.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for RescaleExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "RescaleExec: {} -> {} partitions",
            self.input.output_partitioning().partition_count(),
            self.partitions
        )
    }
}

impl ExecutionPlan for RescaleExec {
    fn name(&self) -> &str {
        "RescaleExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
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
        let input = only_child(self.name(), children)?;
        Ok(Arc::new(Self::try_new(input, self.partitions)?))
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
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition >= self.partitions {
            return internal_err!(
                "RescaleExec has {} partitions; partition {partition} does not exist",
                self.partitions
            );
        }
        let inputs = self.input.output_partitioning().partition_count();
        let streams = rescale_range(partition, self.partitions, inputs)
            .map(|p| self.input.execute(p, context.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            stream::select_all(streams).boxed(),
        )))
    }
}

impl DistributedExec for RescaleExec {
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Boundary(Boundary::Rescale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_input_once_and_in_order() {
        for inputs in 1..12 {
            for outputs in 1..=inputs {
                let covered: Vec<usize> = (0..outputs)
                    .flat_map(|p| rescale_range(p, outputs, inputs))
                    .collect();
                assert_eq!(
                    covered,
                    (0..inputs).collect::<Vec<_>>(),
                    "{inputs} -> {outputs}"
                );
            }
        }
        assert_eq!(rescale_range(1, 3, 6), 2..4);
    }
}
