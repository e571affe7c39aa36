//! Which partitions of each stage input one task reads. A task runs one output partition of its
//! stage plan; when every node between the plan's root and a `StageInputExec` maps its output
//! partition `p` to partition `p` of that child (and both have the same partition count), the task
//! running `p` reads only partition `p` of the input, and its definition needs only that
//! partition's streams. Anything else — a node that merges partitions (`CoalescePartitionsExec`,
//! `SortPreservingMergeExec`, a collected join side, `UnionExec`'s shifted numbering) or a node this
//! module does not know — reads every partition, as if unknown.
//!
//! ```text
//!   AggregateExec(partial) ─► FilterExec ─► StageInputExec#0        task p reads #0 partition p
//!   HashJoinExec(CollectLeft) ─┬─ left:  StageInputExec#0           task p reads every partition of #0
//!                              └─ right: StageInputExec#1           task p reads #1 partition p
//!   CoalescePartitionsExec ─► StageInputExec#0                     task 0 reads every partition of #0
//! ```
//!
//! Invariant: `OwnPartition` is only ever claimed through the known nodes below; a wrong claim would
//! make a task miss streams, so the reader fails on a partition its definition does not list
//! instead of reading nothing.

use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode, SortMergeJoinExec};
use datafusion::physical_plan::limit::LocalLimitExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec};

use crate::plan::stage_input::StageInputExec;

/// How the task running partition `p` of a stage plan reads one stage input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputReads {
    /// Only the input's partition `p`.
    OwnPartition,
    /// Any of its partitions (the definition lists them all).
    Every,
}

/// Per stage input (by its placeholder index), how a task of `plan` reads it. An input with no
/// placeholder in the plan reads `Every` partition (there is nothing to narrow).
pub fn input_reads(plan: &Arc<dyn ExecutionPlan>, inputs: usize) -> Vec<InputReads> {
    let mut reads = vec![None; inputs];
    visit(plan, true, &mut reads);
    reads
        .into_iter()
        .map(|read| read.unwrap_or(InputReads::Every))
        .collect()
}

fn visit(node: &Arc<dyn ExecutionPlan>, aligned: bool, reads: &mut Vec<Option<InputReads>>) {
    if let Some(placeholder) = node.downcast_ref::<StageInputExec<usize>>() {
        let index = *placeholder.input();
        if reads.len() <= index {
            reads.resize(index + 1, None);
        }
        let read = if aligned {
            InputReads::OwnPartition
        } else {
            InputReads::Every
        };
        // A placeholder seen twice reads what either of its places needs.
        reads[index] = Some(match reads[index] {
            Some(InputReads::Every) => InputReads::Every,
            _ => read,
        });
        return;
    }
    let partitions = node.properties().partitioning.partition_count();
    for (index, child) in node.children().into_iter().enumerate() {
        let same_count = child.properties().partitioning.partition_count() == partitions;
        let child_aligned = aligned && same_count && maps_partition_to_itself(node, index);
        visit(child, child_aligned, reads);
    }
}

/// Whether `node`'s output partition `p` reads only partition `p` of its child `child`.
fn maps_partition_to_itself(node: &Arc<dyn ExecutionPlan>, child: usize) -> bool {
    if node.downcast_ref::<FilterExec>().is_some()
        || node.downcast_ref::<ProjectionExec>().is_some()
        || node.downcast_ref::<LocalLimitExec>().is_some()
        || node.downcast_ref::<AggregateExec>().is_some()
        || node.downcast_ref::<BoundedWindowAggExec>().is_some()
        || node.downcast_ref::<WindowAggExec>().is_some()
        || node.downcast_ref::<SortMergeJoinExec>().is_some()
        || node.downcast_ref::<CooperativeExec>().is_some()
    {
        return true;
    }
    if let Some(sort) = node.downcast_ref::<SortExec>() {
        return sort.preserve_partitioning();
    }
    if let Some(join) = node.downcast_ref::<HashJoinExec>() {
        return match join.partition_mode() {
            PartitionMode::Partitioned => true,
            // The build side is collected whole by every task; the probe side is partitioned.
            PartitionMode::CollectLeft => child == 1,
            PartitionMode::Auto => false,
        };
    }
    false
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_expr::expressions::{col, lit};
    use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::PlanProperties;
    use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
    use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
    use datafusion::physical_plan::repartition::RepartitionExec;

    use super::*;

    fn placeholder(index: usize, partitions: usize) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        Arc::new(StageInputExec::new(
            index,
            Arc::new(PlanProperties::new(
                EquivalenceProperties::new(schema),
                Partitioning::UnknownPartitioning(partitions),
                EmissionType::Incremental,
                Boundedness::Bounded,
            )),
        ))
    }

    fn filter(input: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        let predicate = datafusion::physical_expr::expressions::binary(
            col("v", &input.schema()).unwrap(),
            datafusion::logical_expr::Operator::Gt,
            lit(1i64),
            &input.schema(),
        )
        .unwrap();
        Arc::new(FilterExec::try_new(predicate, input).unwrap())
    }

    #[test]
    fn a_partition_wise_path_reads_its_own_partition_and_a_merge_reads_every_one() {
        let own = filter(filter(placeholder(0, 4)));
        assert_eq!(input_reads(&own, 1), [InputReads::OwnPartition]);
        let merged: Arc<dyn ExecutionPlan> =
            Arc::new(CoalescePartitionsExec::new(filter(placeholder(0, 4))));
        assert_eq!(input_reads(&merged, 1), [InputReads::Every]);
        // A partition-wise node above a merge: the merge already read every partition.
        let single: Arc<dyn ExecutionPlan> =
            Arc::new(CoalescePartitionsExec::new(placeholder(0, 4)));
        assert_eq!(input_reads(&filter(single), 1), [InputReads::Every]);
    }

    #[test]
    fn a_sort_reads_its_own_partition_only_when_it_preserves_partitioning() {
        let sort = |preserve: bool| -> Arc<dyn ExecutionPlan> {
            let input = placeholder(0, 4);
            let ordering = LexOrdering::new(vec![PhysicalSortExpr::new_default(
                col("v", &input.schema()).unwrap(),
            )])
            .unwrap();
            Arc::new(SortExec::new(ordering, input).with_preserve_partitioning(preserve))
        };
        assert_eq!(input_reads(&sort(true), 1), [InputReads::OwnPartition]);
        assert_eq!(input_reads(&sort(false), 1), [InputReads::Every]);
    }

    #[test]
    fn a_repartition_of_the_same_width_reads_every_partition_and_a_missing_input_is_every() {
        // The same partition count above and below: only the node's kind makes it `Every`.
        let repartition: Arc<dyn ExecutionPlan> = Arc::new(
            RepartitionExec::try_new(placeholder(0, 4), Partitioning::RoundRobinBatch(4)).unwrap(),
        );
        assert_eq!(
            input_reads(&repartition, 2),
            [InputReads::Every, InputReads::Every]
        );
        assert_eq!(
            input_reads(&placeholder(0, 3), 1),
            [InputReads::OwnPartition]
        );
    }
}
