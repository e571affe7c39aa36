//! Skew-split candidates: partitioned hash joins whose hot partition the driver may spread over
//! several tasks once both sides' producers finished and their channel row counts are known.
//!
//! ```text
//!   build producer B (Blocking) ─Shuffle─┐   channel h holds 90 % of the probe rows:
//!                                        ▼
//!   stage J: HashJoinExec(Partitioned)       task h: build channel h + probe channel h of producers {0, 1}
//!                                        ▲   task j: build channels j, h + probe channel j (all)
//!   probe producer P (Blocking) ─Shuffle─┘            + probe channel h of producers {2, 3}
//! ```
//!
//! Why it is right: equal keys hash to the same channel on both sides, so a probe row of channel
//! `h` can only match build rows of channel `h`; a task that reads build channels `j` and `h` and
//! probe rows of both joins each probe row against every build row it could match, and nothing
//! else. Each probe row is read by exactly one task.
//!
//! Invariants of a [`SkewJoin`]:
//! - the join is a `HashJoinExec` in `Partitioned` mode whose type decides each probe row's output
//!   from that row and the build side alone (inner, right, right semi, right anti): build rows are
//!   read by several tasks, so a type that emits unmatched build rows is never split;
//! - both children are `StageInputExec`s (through projections and filters) read
//!   with `Shuffle` from `Blocking` producers, so their row counts per channel are exact and known
//!   before the join's stage starts;
//! - nothing above the join in its stage relies on rows being hash-partitioned (only projections,
//!   filters, partial aggregates and per-partition sorts), and the stage's reader
//!   repartitions or merges its output (or it is the job's output): a key may come out of several
//!   tasks.

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;

use super::{InputMode, OutputMode, Stage};
use crate::ids::StageId;
use crate::plan::stage_input::StageInputExec;

/// A join whose hot partitions may be split across tasks; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkewJoin {
    /// The stage holding the join.
    pub stage: StageId,
    /// The stage input (index into the stage's inputs) of the build side.
    pub build_input: usize,
    /// The stage input of the probe side.
    pub probe_input: usize,
    /// The join, for notes: `HashJoinExec Inner on (a@0 = a@0) in stage 2`.
    pub join: String,
}

/// Every skew-split candidate of `stages` (a job graph's, in topological order).
pub(crate) fn find(stages: &[Stage]) -> Vec<SkewJoin> {
    let last = stages.len().saturating_sub(1);
    stages
        .iter()
        .enumerate()
        .filter(|(index, _)| *index == last || read_without_partitioning(stages, StageId(*index)))
        .filter_map(|(index, stage)| candidate(stages, StageId(index), &stage.plan))
        .collect()
}

/// Whether the stage reading `stage` ignores how its rows are partitioned (repartitions or merges
/// them, or reads all of them in every task).
fn read_without_partitioning(stages: &[Stage], stage: StageId) -> bool {
    stages
        .iter()
        .flat_map(|s| s.inputs.iter())
        .filter(|input| input.stage == stage)
        .all(|input| input.mode != InputMode::Forward)
}

/// The candidate whose join sits below `plan` through nodes that keep no state across rows of a
/// partition's key (see the module docs).
fn candidate(stages: &[Stage], stage: StageId, plan: &Arc<dyn ExecutionPlan>) -> Option<SkewJoin> {
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        return join_candidate(stages, stage, join);
    }
    let passes = plan.downcast_ref::<ProjectionExec>().is_some()
        || plan.downcast_ref::<FilterExec>().is_some()
        || plan
            .downcast_ref::<AggregateExec>()
            .is_some_and(|a| *a.mode() == AggregateMode::Partial)
        || plan
            .downcast_ref::<SortExec>()
            .is_some_and(|s| s.preserve_partitioning());
    match plan.children().as_slice() {
        [child] if passes => candidate(stages, stage, child),
        _ => None,
    }
}

fn join_candidate(stages: &[Stage], stage: StageId, join: &HashJoinExec) -> Option<SkewJoin> {
    let splits_probe_side = matches!(
        join.join_type(),
        JoinType::Inner | JoinType::Right | JoinType::RightSemi | JoinType::RightAnti
    );
    if *join.partition_mode() != PartitionMode::Partitioned || !splits_probe_side {
        return None;
    }
    let inputs = &stages.get(stage.0)?.inputs;
    let build_input = shuffled_input_below(join.left())?;
    let probe_input = shuffled_input_below(join.right())?;
    for index in [build_input, probe_input] {
        let input = inputs.get(index)?;
        let producer = stages.get(input.stage.0)?;
        if input.mode != InputMode::Shuffle || producer.mode != OutputMode::Blocking {
            return None;
        }
    }
    let keys: Vec<String> = join
        .on()
        .iter()
        .map(|(l, r)| format!("{l} = {r}"))
        .collect();
    Some(SkewJoin {
        stage,
        build_input,
        probe_input,
        join: format!(
            "HashJoinExec {:?} on ({}) in stage {stage}",
            join.join_type(),
            keys.join(", ")
        ),
    })
}

/// The input index of the `StageInputExec` below `plan`, through nodes that only project or
/// filter rows.
fn shuffled_input_below(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    if let Some(input) = plan.downcast_ref::<StageInputExec<usize>>() {
        return Some(*input.input());
    }
    let passes = plan.downcast_ref::<ProjectionExec>().is_some()
        || plan.downcast_ref::<FilterExec>().is_some();
    match plan.children().as_slice() {
        [child] if passes => shuffled_input_below(child),
        _ => None,
    }
}
