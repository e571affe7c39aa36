//! Distributed-correctness rewrites applied to the physical plan before it is cut into stages.
//!
//! A single-process plan may rely on all partitions of an operator sharing one instance. Across tasks
//! they do not, so these shapes are rewritten first:
//!
//! 1. **Global limit over several partitions**: the limit would run per task; its input is coalesced
//!    to one partition so the skip/fetch is decided in one place.
//! 2. **Collect-left hash join emitting unmatched build rows** (Left, LeftAnti, LeftSemi, LeftMark,
//!    Full): each task would see only its own probe rows and emit build rows that other tasks
//!    matched (duplicates or wrong anti/semi results). It becomes a partitioned join with hash
//!    shuffles of both sides on the join keys. A null-aware anti join (`NOT IN`) must see every probe
//!    row's nullness, so it keeps collect-left and gets a single probe partition instead.
//! 3. **Nested-loop join with those join types**: no keys to hash on, so the probe side is coalesced
//!    to one partition and one task sees every probe row.
//! 4. **Piecewise merge join emitting unmatched buffered rows** (Left, Full): the last of an
//!    instance's `num_partitions` streamed partitions emits them, so in a task of its own (one
//!    partition per instance) they would never come. The streamed side is coalesced to one
//!    partition and the join rebuilt for one partition.
//!
//! ```text
//!   HashJoinExec CollectLeft, Left            HashJoinExec Partitioned, Left
//!     CoalescePartitionsExec          ──►       RepartitionExec Hash(left keys, n)
//!       build (m partitions)                      build (m partitions)
//!     probe (n partitions)                      RepartitionExec Hash(right keys, n)
//!                                                 probe (n partitions)
//! ```

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::common::Result;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::physical_expr::Partitioning;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::joins::{
    HashJoinExec, NestedLoopJoinExec, PartitionMode, PiecewiseMergeJoinExec,
};
use datafusion::physical_plan::limit::GlobalLimitExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

/// Applies every rewrite, bottom-up.
pub fn apply_all(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let plan = single_partition_for_global_limit(plan)?;
    let plan = partitioned_hash_join_for_unmatched_build_rows(plan)?;
    let plan = single_probe_partition_for_nested_loop_join(plan)?;
    single_streamed_partition_for_piecewise_merge_join(plan)
}

/// Whether a join of this type emits build-side (left) rows that found no match, which only the
/// instance that saw every probe row can decide.
pub fn emits_unmatched_build_rows(join_type: JoinType) -> bool {
    matches!(
        join_type,
        JoinType::Left
            | JoinType::LeftAnti
            | JoinType::LeftSemi
            | JoinType::LeftMark
            | JoinType::Full
    )
}

fn partitions(plan: &Arc<dyn ExecutionPlan>) -> usize {
    plan.output_partitioning().partition_count()
}

/// `plan` read as one partition: itself if it has one, else under a `CoalescePartitionsExec`.
pub(crate) fn coalesce(plan: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    if partitions(&plan) <= 1 {
        plan
    } else {
        Arc::new(CoalescePartitionsExec::new(plan))
    }
}

/// Rewrite 1: a `GlobalLimitExec` with skip or fetch over several partitions reads one partition.
pub fn single_partition_for_global_limit(
    plan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(limit) = node.downcast_ref::<GlobalLimitExec>() else {
            return Ok(Transformed::no(node));
        };
        let limits = limit.skip() > 0 || limit.fetch().is_some();
        if !limits || partitions(limit.input()) <= 1 {
            return Ok(Transformed::no(node));
        }
        let input = coalesce(limit.input().clone());
        Ok(Transformed::yes(Arc::new(GlobalLimitExec::new(
            input,
            limit.skip(),
            limit.fetch(),
        ))))
    })
    .map(|t| t.data)
}

/// Rewrite 2: collect-left hash joins whose join type emits unmatched build rows.
pub fn partitioned_hash_join_for_unmatched_build_rows(
    plan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(join) = node.downcast_ref::<HashJoinExec>() else {
            return Ok(Transformed::no(node));
        };
        if *join.partition_mode() != PartitionMode::CollectLeft
            || !emits_unmatched_build_rows(*join.join_type())
            || partitions(join.right()) <= 1
        {
            return Ok(Transformed::no(node));
        }
        if join.null_aware {
            let children = vec![join.left().clone(), coalesce(join.right().clone())];
            let rewritten = join.builder().with_new_children(children)?.reset_state();
            return Ok(Transformed::yes(rewritten.build_exec()?));
        }
        let n = partitions(join.right());
        let build = match join.left().downcast_ref::<CoalescePartitionsExec>() {
            Some(coalesce) if coalesce.fetch().is_none() => coalesce.input().clone(),
            _ => join.left().clone(),
        };
        let (left_keys, right_keys): (Vec<_>, Vec<_>) = join.on().iter().cloned().unzip();
        let left = RepartitionExec::try_new(build, Partitioning::Hash(left_keys, n))?;
        let right =
            RepartitionExec::try_new(join.right().clone(), Partitioning::Hash(right_keys, n))?;
        let rewritten = join
            .builder()
            .with_partition_mode(PartitionMode::Partitioned)
            .with_new_children(vec![Arc::new(left), Arc::new(right)])?
            .reset_state();
        Ok(Transformed::yes(rewritten.build_exec()?))
    })
    .map(|t| t.data)
}

/// Rewrite 3: nested-loop joins whose join type emits unmatched build rows get one probe partition.
pub fn single_probe_partition_for_nested_loop_join(
    plan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(join) = node.downcast_ref::<NestedLoopJoinExec>() else {
            return Ok(Transformed::no(node));
        };
        if !emits_unmatched_build_rows(*join.join_type()) || partitions(join.right()) <= 1 {
            return Ok(Transformed::no(node));
        }
        let children = vec![join.left().clone(), coalesce(join.right().clone())];
        Ok(Transformed::yes(replace_children_if_necessary(
            node.clone(),
            children,
        )?))
    })
    .map(|t| t.data)
}

/// Rewrite 4: piecewise merge joins that emit unmatched buffered rows run as one partition.
pub fn single_streamed_partition_for_piecewise_merge_join(
    plan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(join) = node.downcast_ref::<PiecewiseMergeJoinExec>() else {
            return Ok(Transformed::no(node));
        };
        if !matches!(join.join_type(), JoinType::Left | JoinType::Full) {
            return Ok(Transformed::no(node));
        }
        let rewritten = PiecewiseMergeJoinExec::try_new(
            join.buffered().clone(),
            coalesce(join.streamed().clone()),
            join.on.clone(),
            join.operator,
            join.join_type(),
            1,
        )?;
        Ok(Transformed::yes(
            Arc::new(rewritten) as Arc<dyn ExecutionPlan>
        ))
    })
    .map(|t| t.data)
}
