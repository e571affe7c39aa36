//! Runtime filters across stages: a join's build side, once its producer stage finished, filters the
//! join's probe side, in another stage or in the join's own: before it is read (blocking
//! exchanges), or what is still to be read of it (pipelined exchanges).
//!
//! ```text
//!   stage B (Blocking) ──Shuffle──┐            B's tasks summarise the build keys of their output
//!                                 ▼            (bounds; the distinct keys when few, else a
//!                                              Bloom filter of them)
//!   stage S: HashJoinExec(on b = p)            when B finished, the driver merges the summaries
//!                                 ▲            and puts FilterExec(p within them) on top of P's
//!   stage P (Blocking) ──Shuffle──┘            plan, pushed down into its scan, before P starts
//! ```
//!
//! A probe side that is not another stage's output (a broadcast join probing a scan of its own
//! stage) gets the filter above the join's probe child in the join's stage, which (with blocking
//! exchanges) starts after B anyway. The filter goes as deep as the probe keys can be followed: through projections,
//! filters, either side of an inner join and an aggregate's group keys, and on into the stages
//! producing them where the keys reach a scan, so a semi join's few keys can filter the scans
//! under the inner join that feeds it, and a decorrelated subquery's aggregate (TPC-H q17's average
//! per part) aggregates only the rows of the parts the join keeps:
//!
//! ```text
//!   stage 1 (57 keys) ─Broadcast─► stage 6: RightSemi(l = o) ◄─ Inner(o = l) ◄─ stage 4 ◄─ stage 3 (orders scan)
//!                                                   filter goes on top of stage 3's plan: o IN (57 keys)
//! ```
//!
//! With pipelined exchanges every stage of a job runs at once, so the topology adds no wait: the
//! target's tasks start with an empty filter in place, and the driver sends the predicate to them
//! once the source finished ([`FilterDelivery::WhileRunning`]); it drops what they have not read
//! yet (a target task that does not read the source holds back its reading until the filter
//! arrives, for at most `sluice.runtime_filter_wait_ms`: the runtime's `plan::await_filters`). Such
//! a filter is only planned where it reaches a scan or a producer's output before its shuffle
//! (the probe rows a join's own stage reads were shuffled already).
//!
//! Invariants of a [`RuntimeFilter`]:
//! - it only drops probe rows that cannot match: the join's type drops unmatched probe rows (inner,
//!   left outer, semi and anti joins on the build side, right semi; not a `NOT IN` anti join, whose
//!   one `NULL` probe key empties its output, nor a mark join), keys are plain columns of equal,
//!   totally ordered types compared with `NULL` never equal to `NULL`;
//! - its source stage is a whole build side: the filter is built from every row, once the
//!   source finished;
//! - a target that is another stage comes after the source in stage order (it cannot feed it);
//!   delivered before the target starts, source and target are `Blocking`, so the topology can
//!   make the target's region wait for the source (each is the last stage of its component);
//!   otherwise the filter goes into the join's own stage.

use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::{JoinType, NullEquality, Result, internal_err};
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, SortMergeJoinExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;

use super::{OutputMode, Stage};
use crate::ids::StageId;
use crate::plan::RECOMPUTE;
use crate::plan::stage_input::StageInputExec;

/// One runtime filter of a job graph; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeFilter {
    /// The build side's producer: its tasks summarise `source_columns` of their output.
    pub source: StageId,
    /// The build keys, as columns of the source stage's output.
    pub source_columns: Vec<usize>,
    /// The stage whose plan gets the filter.
    pub target: StageId,
    /// Child indices from the target plan's root to the node the filter goes on top of (empty: the
    /// root).
    pub target_path: Vec<usize>,
    /// The probe keys, as columns of that node's output, pairwise with `source_columns`.
    pub target_columns: Vec<usize>,
    /// The join, for EXPLAIN: `HashJoinExec Inner on (a = b)` and the stage holding it.
    pub join: String,
    /// The stage holding the join (the target is it or a stage that produces its probe side).
    pub join_stage: StageId,
    /// When the filter reaches its target.
    pub delivery: FilterDelivery,
}

/// When a runtime filter reaches its target: before the target starts (its source is `Blocking`,
/// so the target can wait for it), or while the target runs (a `Pipelined` source runs alongside
/// its target, whose regions cannot wait for it; its tasks may hold back their reading).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterDelivery {
    /// The target waits for the source, and every task of it runs the filtered plan.
    BeforeStart,
    /// The target's tasks start with an empty filter (a `DynamicFilterPhysicalExpr` that keeps
    /// every row) in place; once the source finished, the driver sends the predicate to the
    /// running tasks, and it applies to what they have not read yet (an attempt started later
    /// gets it with its definition).
    WhileRunning,
}

/// Whether unmatched probe (right) rows leave no trace in the join's output.
fn drops_unmatched_probe_rows(join_type: JoinType) -> bool {
    matches!(
        join_type,
        JoinType::Inner
            | JoinType::Left
            | JoinType::LeftSemi
            | JoinType::LeftAnti
            | JoinType::RightSemi
    )
}

/// Key types whose order a bounds filter may rely on (no floats: `NaN` orders apart from how
/// joins compare it; no dictionaries or nested types).
fn orderable(data_type: &DataType) -> bool {
    data_type.is_integer()
        || matches!(
            data_type,
            DataType::Date32
                | DataType::Date64
                | DataType::Timestamp(_, _)
                | DataType::Decimal128(_, _)
                | DataType::Decimal256(_, _)
                | DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Utf8View
        )
}

/// The input index of the `StageInputExec` below `plan`, through nodes that keep every row and
/// column as they are (unlimited sorts).
fn stage_input_below(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    if let Some(input) = plan.downcast_ref::<StageInputExec<usize>>() {
        return Some(*input.input());
    }
    if let Some(sort) = plan.downcast_ref::<SortExec>()
        && sort.fetch().is_none()
    {
        return stage_input_below(sort.input());
    }
    None
}

/// What a filter's way down depends on: the job's stages, the filter's source, and how the filter
/// is delivered (see [`deepest_target`]).
#[derive(Clone, Copy)]
struct Way<'a> {
    stages: &'a [Stage],
    source: StageId,
    delivery: FilterDelivery,
}

/// Where a filter on `columns` of the output of `node` (at `path` in `stage`'s plan) goes: the
/// deepest place below it that sees the same key values, so it drops rows before they are joined,
/// shuffled or read. It follows the keys down through nodes that neither limit nor change them:
/// projections and filters that pass the key columns on as they are, unlimited sorts, coalescing
/// and repartitioning, either side of an inner hash join (a row of one side whose key the build
/// side lacks only makes joined rows with that key, which the filtered join drops too), an
/// aggregate whose group keys they are (such a row only makes a group the join drops), and into a
/// producer stage read by `StageInputExec` that comes after the filter's `source` (so it cannot
/// feed it) and can take the filter (a filter delivered before the target starts needs a
/// `Blocking` producer, which can wait; one delivered while it runs goes into any producer) when
/// the keys lead to a scan there (a producer whose keys stop at another node would wait only to
/// filter its output), or when that producer's
/// output is the join's probe side as it is (`direct`: only unlimited sorts between them), whose
/// whole plan then gets the filter. It stops at any other node.
fn deepest_target(
    way: Way<'_>,
    stage: StageId,
    node: &Arc<dyn ExecutionPlan>,
    path: &mut Vec<usize>,
    columns: Vec<usize>,
    direct: bool,
) -> (StageId, Vec<usize>, Vec<usize>) {
    let Way {
        stages,
        source,
        delivery,
    } = way;
    let here = |path: &Vec<usize>, columns: Vec<usize>| (stage, path.clone(), columns);
    if node.fetch().is_some() {
        return here(path, columns);
    }
    if let Some(input) = node.downcast_ref::<StageInputExec<usize>>() {
        let producer = stages
            .get(stage.0)
            .and_then(|s| s.inputs.get(*input.input()))
            .map(|input| input.stage)
            .filter(|p| {
                p.0 > source.0
                    && (delivery == FilterDelivery::WhileRunning
                        || stages
                            .get(p.0)
                            .is_some_and(|s| s.mode == OutputMode::Blocking))
            });
        // Crossing (which, delivered before the target starts, makes the producer wait for the
        // source) is worth it where the filter then reaches a scan, and drops rows before they
        // are read, shuffled or aggregated.
        let crossed = producer
            .and_then(|p| stages.get(p.0).map(|s| (p, s)))
            .map(|(producer, stage)| {
                deepest_target(
                    way,
                    producer,
                    &stage.plan,
                    &mut Vec::new(),
                    columns.clone(),
                    false,
                )
            })
            .filter(|(target, path, _)| {
                stages
                    .get(target.0)
                    .and_then(|stage| node_at(&stage.plan, path).ok())
                    .is_some_and(|node| node.downcast_ref::<DataSourceExec>().is_some())
            });
        return match (crossed, producer) {
            (Some(found), _) => found,
            // The join's probe side is this producer's output as it is: its whole plan gets the
            // filter (pushed down within it by the driver), as any scan's would.
            (None, Some(producer)) if direct => (producer, Vec::new(), columns),
            _ => here(path, columns),
        };
    }
    let (child, mapped) = match key_origin(node, &columns) {
        Some(origin) => origin,
        None => return here(path, columns),
    };
    let Some(next) = node.children().get(child).map(|c| Arc::clone(c)) else {
        return here(path, columns);
    };
    let direct = direct && node.downcast_ref::<SortExec>().is_some();
    path.push(child);
    let found = deepest_target(way, stage, &next, path, mapped, direct);
    path.pop();
    found
}

/// The child of `node` whose output holds `columns` of `node`'s output unchanged (every row with
/// those key values passes them on), and their indices there; `None` for any node that is not
/// known to.
fn key_origin(node: &Arc<dyn ExecutionPlan>, columns: &[usize]) -> Option<(usize, Vec<usize>)> {
    let through = |projection: Option<&[usize]>| -> Option<Vec<usize>> {
        columns
            .iter()
            .map(|c| match projection {
                Some(projection) => projection.get(*c).copied(),
                None => Some(*c),
            })
            .collect()
    };
    if node.downcast_ref::<SortExec>().is_some()
        || node.downcast_ref::<CoalescePartitionsExec>().is_some()
        || node.downcast_ref::<RepartitionExec>().is_some()
    {
        return Some((0, columns.to_vec()));
    }
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        return Some((0, through(filter.projection().as_deref())?));
    }
    if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        let mapped = columns
            .iter()
            .map(|c| {
                let expr = projection.expr().get(*c)?;
                expr.expr.downcast_ref::<Column>().map(Column::index)
            })
            .collect::<Option<Vec<usize>>>()?;
        return Some((0, mapped));
    }
    // An aggregate's group keys: a row whose key the build side lacks only makes a group with
    // that key, which the join drops. Not with grouping sets (a row also counts in groups where
    // the key is NULL), nor with a limit on the groups (fewer rows would change which are kept).
    if let Some(aggregate) = node.downcast_ref::<AggregateExec>()
        && aggregate.group_expr().is_single()
        && aggregate.limit_options().is_none()
    {
        let groups = aggregate.group_expr().expr();
        let mapped = columns
            .iter()
            .map(|c| {
                let (expr, _) = groups.get(*c)?;
                expr.downcast_ref::<Column>().map(Column::index)
            })
            .collect::<Option<Vec<usize>>>()?;
        return Some((0, mapped));
    }
    if let Some(join) = node.downcast_ref::<HashJoinExec>()
        && *join.join_type() == JoinType::Inner
    {
        let joined = through(join.projection.as_deref())?;
        let left = join.left().schema().fields().len();
        if joined.iter().all(|c| *c < left) {
            return Some((0, joined));
        }
        if joined.iter().all(|c| *c >= left) {
            return Some((1, joined.iter().map(|c| c - left).collect()));
        }
    }
    None
}

/// The join's parts a filter needs: type, null equality, key columns (build, probe), children.
struct JoinParts<'a> {
    name: &'static str,
    join_type: JoinType,
    null_equality: NullEquality,
    /// A `NOT IN` anti join: one `NULL` probe key empties its output, so no probe row may go.
    null_aware: bool,
    on: Vec<(Arc<dyn PhysicalExpr>, Arc<dyn PhysicalExpr>)>,
    left: &'a Arc<dyn ExecutionPlan>,
    right: &'a Arc<dyn ExecutionPlan>,
}

fn join_parts(plan: &Arc<dyn ExecutionPlan>) -> Option<JoinParts<'_>> {
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        return Some(JoinParts {
            name: "HashJoinExec",
            join_type: *join.join_type(),
            null_equality: join.null_equality(),
            null_aware: join.null_aware,
            on: join.on().to_vec(),
            left: join.left(),
            right: join.right(),
        });
    }
    if let Some(join) = plan.downcast_ref::<SortMergeJoinExec>() {
        return Some(JoinParts {
            name: "SortMergeJoinExec",
            join_type: join.join_type(),
            null_equality: join.null_equality(),
            null_aware: false,
            on: join.on().to_vec(),
            left: join.left(),
            right: join.right(),
        });
    }
    None
}

/// The key columns of `on` (build, probe), if every key is a plain column of one orderable type
/// on both sides.
fn key_columns(parts: &JoinParts<'_>) -> Option<(Vec<usize>, Vec<usize>, Vec<String>)> {
    let left_schema = parts.left.schema();
    let right_schema = parts.right.schema();
    let mut build = Vec::new();
    let mut probe = Vec::new();
    let mut names = Vec::new();
    for (l, r) in &parts.on {
        let l = l.downcast_ref::<Column>()?;
        let r = r.downcast_ref::<Column>()?;
        let lt = left_schema.fields().get(l.index())?.data_type();
        let rt = right_schema.fields().get(r.index())?.data_type();
        if lt != rt || !orderable(lt) {
            return None;
        }
        build.push(l.index());
        probe.push(r.index());
        names.push(format!("{l} = {r}"));
    }
    (!build.is_empty()).then_some((build, probe, names))
}

/// Every runtime filter of `stages` (a job graph's, in topological order). A job with blocking
/// exchanges has only filters delivered before their targets start (from `Blocking` sources: its
/// driver stages, always `Pipelined`, are none), so one plan never gets both kinds; a job with
/// pipelined exchanges only filters delivered while their targets run.
pub(crate) fn find(stages: &[Stage]) -> Vec<RuntimeFilter> {
    let delivery = if stages.iter().any(|s| s.mode == OutputMode::Blocking) {
        FilterDelivery::BeforeStart
    } else {
        FilterDelivery::WhileRunning
    };
    let mut filters = Vec::new();
    for (s, stage) in stages.iter().enumerate() {
        let mut path = Vec::new();
        visit(
            stages,
            delivery,
            StageId(s),
            &stage.plan,
            &mut path,
            &mut filters,
        );
    }
    filters
}

fn visit(
    stages: &[Stage],
    delivery: FilterDelivery,
    stage: StageId,
    plan: &Arc<dyn ExecutionPlan>,
    path: &mut Vec<usize>,
    filters: &mut Vec<RuntimeFilter>,
) {
    if let Some(filter) = join_filter(stages, delivery, stage, plan, path) {
        filters.push(filter);
    }
    for (i, child) in plan.children().into_iter().enumerate() {
        path.push(i);
        visit(stages, delivery, stage, child, path, filters);
        path.pop();
    }
}

/// The filter of the join at `path` in `stage`'s plan, if it has one.
fn join_filter(
    stages: &[Stage],
    delivery: FilterDelivery,
    stage: StageId,
    plan: &Arc<dyn ExecutionPlan>,
    path: &[usize],
) -> Option<RuntimeFilter> {
    let parts = join_parts(plan)?;
    if !drops_unmatched_probe_rows(parts.join_type)
        || parts.null_equality != NullEquality::NullEqualsNothing
        || parts.null_aware
    {
        return None;
    }
    let (source_columns, target_columns, names) = key_columns(&parts)?;
    let inputs = &stages.get(stage.0)?.inputs;
    let source = inputs.get(stage_input_below(parts.left)?)?.stage;
    if delivery == FilterDelivery::BeforeStart && stages.get(source.0)?.mode != OutputMode::Blocking
    {
        return None;
    }
    let join = format!(
        "{} {:?} on ({}) in stage {stage}",
        parts.name,
        parts.join_type,
        names.join(", ")
    );
    // As deep below the probe side as its keys can be followed (into the stages that produce
    // it, when they can take the filter); at least on top of the probe side in this stage.
    let mut probe_path = path.to_vec();
    probe_path.push(1);
    let way = Way {
        stages,
        source,
        delivery,
    };
    let (target, target_path, target_columns) = deepest_target(
        way,
        stage,
        parts.right,
        &mut probe_path,
        target_columns,
        true,
    );
    // A filter sent while the join's own stage runs, above its probe child there, would only
    // check rows the join is about to probe anyway (they were read and shuffled already): it is
    // worth sending where it reaches a scan, or another stage's output before it is shuffled.
    if delivery == FilterDelivery::WhileRunning && target == stage {
        let root = &stages.get(stage.0)?.plan;
        let node = node_at(root, &target_path).ok()?;
        node.downcast_ref::<DataSourceExec>()?;
    }
    Some(RuntimeFilter {
        source,
        source_columns,
        target,
        target_path,
        target_columns,
        join,
        join_stage: stage,
        delivery,
    })
}

/// The node at `path` (child indices from the root) of `plan`.
pub fn node_at(plan: &Arc<dyn ExecutionPlan>, path: &[usize]) -> Result<Arc<dyn ExecutionPlan>> {
    let mut node = Arc::clone(plan);
    for i in path {
        let child = node.children().get(*i).map(|c| Arc::clone(c));
        node = match child {
            Some(child) => child,
            None => return internal_err!("a runtime filter's path has no child {i}"),
        };
    }
    Ok(node)
}

/// `plan` with the node at `path` (child indices from the root) replaced by what `replace` makes
/// of it; the nodes above take their new children.
pub fn replace_at(
    plan: Arc<dyn ExecutionPlan>,
    path: &[usize],
    replace: &mut dyn FnMut(Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let Some((first, rest)) = path.split_first() else {
        return replace(plan);
    };
    let mut children: Vec<Arc<dyn ExecutionPlan>> = plan.children().into_iter().cloned().collect();
    let Some(child) = children.get(*first).cloned() else {
        return internal_err!(
            "a runtime filter's path leads to child {first} of {}, which has {}",
            plan.name(),
            children.len()
        );
    };
    children[*first] = replace_at(child, rest, replace)?;
    plan.replace_children(children, RECOMPUTE)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use datafusion::arrow::datatypes::{Field, Schema};
    use datafusion::physical_expr::expressions::lit;
    use datafusion::physical_plan::displayable;
    use datafusion::physical_plan::empty::EmptyExec;
    use datafusion::physical_plan::union::UnionExec;

    /// `plan` with a `FilterExec` of `predicate` on top of the node at `path`.
    fn insert_filter(
        plan: Arc<dyn ExecutionPlan>,
        path: &[usize],
        predicate: Arc<dyn PhysicalExpr>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        replace_at(plan, path, &mut |node| {
            Ok(Arc::new(FilterExec::try_new(Arc::clone(&predicate), node)?))
        })
    }

    #[test]
    fn a_filter_goes_on_top_of_the_node_its_path_names() {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let leaf = || Arc::new(EmptyExec::new(Arc::clone(&schema))) as Arc<dyn ExecutionPlan>;
        let union = UnionExec::try_new(vec![leaf(), leaf()]).unwrap();
        let filtered = insert_filter(union, &[1], lit(true)).unwrap();
        let text = displayable(filtered.as_ref()).indent(false).to_string();
        assert_eq!(
            text,
            "UnionExec\n  EmptyExec\n  FilterExec: true\n    EmptyExec\n"
        );
        let top = insert_filter(filtered, &[], lit(false)).unwrap();
        assert!(
            displayable(top.as_ref())
                .indent(false)
                .to_string()
                .starts_with("FilterExec: false\n  UnionExec\n"),
        );
        let error = insert_filter(top, &[0, 5], lit(true)).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("leads to child 5 of UnionExec, which has 2"),
            "{error}"
        );
    }
}
