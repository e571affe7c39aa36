//! Which algorithm equi-joins use: the `joins` setting and the physical optimizer rule that
//! carries it out.
//!
//! DataFusion's hash join keeps its whole build side in memory and cannot spill: under a memory
//! budget, a join whose build side does not fit fails with `Resources exhausted` however much
//! disk there is. A sort-merge join sorts both sides (the sorts spill) and buffers one key's rows
//! at a time (also spillable), so its memory is bounded by the sorts' merge reservations
//! (`datafusion.execution.sort_spill_reservation_bytes` each, two sorts per partition) and its
//! largest key group, not by its inputs. It gives up what only the hash join has: dynamic filters
//! pushed into the probe side's scan, and limit pushdown, and it is slower (it sorts both sides:
//! for the 22 TPC-H queries at SF 10 under a 4 GiB limit, 1.9x the hash joins' time in local mode
//! and 2.2x on two workers; BENCHMARKS.md). So the
//! `auto` default plans hash joins and uses sort-merge joins only for a query that proved it needs
//! them ([`crate::join_fallback`]):
//!
//! ```text
//!   joins = hash        every equi-join a hash join
//!   joins = sort-merge  partitioned joins sort-merge joins; small build sides stay hash (broadcast)
//!   joins = auto        hash joins; under a memory limit, a query that runs out of memory before
//!                       it returned a row is planned again as with sort-merge and run once more
//! ```
//!
//! With sort-merge joins, the split follows Spark's:
//!
//! ```text
//!   build side small (JoinSelection's collect-left thresholds) ─► HashJoinExec (CollectLeft: broadcast)
//!   both sides partitioned on the keys                         ─► SortMergeJoinExec  (spills)
//! ```
//!
//! [`SortMergeJoins`] runs right after DataFusion's `JoinSelection` (which has chosen between
//! collect-left and partitioned) and before the rule that adds repartitions and sorts, so the
//! sorts a sort-merge join needs are planned by DataFusion itself, inside the stage that reads
//! the shuffle. Invariants: only `Partitioned` hash joins over bounded inputs change (DataFusion
//! plans null-aware `NOT IN` joins as collect-left, and pushes limits later, but a join carrying
//! either is left alone should that change); the output schema is unchanged (a hash join's
//! embedded projection becomes a `ProjectionExec`). The job graph's rewrites run after the
//! optimizer and may turn a broadcast join whose build side must be seen whole (left, semi,
//! anti, full) into a partitioned hash join; those stay hash joins. With
//! `datafusion.optimizer.prefer_hash_join = false` DataFusion plans every equi-join as a
//! sort-merge join itself, whatever `joins` says; with `repartition_joins = false` or one target
//! partition every join is collect-left and nothing changes.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::datatypes::Schema;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::{JoinSide, Result, internal_datafusion_err};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode, SortMergeJoinExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

/// The `joins` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JoinStrategy {
    /// Hash joins; under a memory limit, a query that runs out of memory before it returned a row
    /// runs again with sort-merge joins ([`crate::join_fallback`]).
    #[default]
    Auto,
    /// Always hash joins (DataFusion's default; fastest, but a build side must fit in memory).
    Hash,
    /// Partitioned joins are sort-merge joins, with or without a memory limit.
    SortMerge,
}

impl JoinStrategy {
    /// The name used in config files, flags and `sluice config`.
    pub fn name(self) -> &'static str {
        match self {
            JoinStrategy::Auto => "auto",
            JoinStrategy::Hash => "hash",
            JoinStrategy::SortMerge => "sort-merge",
        }
    }

    /// Whether partitioned joins are planned as sort-merge joins from the start.
    pub fn sort_merge(self) -> bool {
        self == JoinStrategy::SortMerge
    }

    /// Whether a query whose hash joins run out of memory runs again with sort-merge joins,
    /// given whether memory is bounded (unbounded, nothing runs out).
    pub fn falls_back(self, memory_limited: bool) -> bool {
        self == JoinStrategy::Auto && memory_limited
    }
}

impl fmt::Display for JoinStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for JoinStrategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(JoinStrategy::Auto),
            "hash" => Ok(JoinStrategy::Hash),
            "sort-merge" => Ok(JoinStrategy::SortMerge),
            other => Err(format!(
                "unknown joins '{other}' (known: auto, hash, sort-merge)"
            )),
        }
    }
}

/// DataFusion's physical optimizer rules, with [`SortMergeJoins`] right after `join_selection`
/// when `sort_merge` holds (a unit test pins the position, should DataFusion rename that rule).
pub fn physical_optimizer_rules(
    sort_merge: bool,
) -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let mut rules = PhysicalOptimizer::new().rules;
    if sort_merge {
        let at = rules
            .iter()
            .position(|rule| rule.name() == "join_selection")
            .map_or(0, |i| i + 1);
        rules.insert(at, Arc::new(SortMergeJoins));
    }
    rules
}

/// Turns partitioned hash joins into sort-merge joins (see the module docs).
#[derive(Debug, Default)]
pub struct SortMergeJoins;

impl PhysicalOptimizerRule for SortMergeJoins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match node.downcast_ref::<HashJoinExec>() {
            Some(join) if converts(join) => Ok(Transformed::yes(sort_merge_join(join)?)),
            _ => Ok(Transformed::no(node)),
        })
        .data()
    }

    fn name(&self) -> &str {
        "sluice_sort_merge_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether `plan` holds a join that [`SortMergeJoins`] would turn into a sort-merge join (the
/// plan a fallback would change).
pub fn has_sort_merge_candidates(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.exists(|node| Ok(node.downcast_ref::<HashJoinExec>().is_some_and(converts)))
        .unwrap_or(false)
}

fn converts(join: &HashJoinExec) -> bool {
    *join.partition_mode() == PartitionMode::Partitioned
        && !join.null_aware
        && join.fetch().is_none()
        // A sort needs its whole input: an unbounded side keeps the hash join.
        && !join.left().boundedness().is_unbounded()
        && !join.right().boundedness().is_unbounded()
}

/// The sort-merge join equal to `join`: same inputs, keys, filter (its columns reordered, left
/// side first), join type and null handling, keys ascending with nulls first, then `join`'s
/// projection if it has one.
fn sort_merge_join(join: &HashJoinExec) -> Result<Arc<dyn ExecutionPlan>> {
    let filter = join.filter().map(left_columns_first).transpose()?;
    let merge: Arc<dyn ExecutionPlan> = Arc::new(SortMergeJoinExec::try_new(
        Arc::clone(join.left()),
        Arc::clone(join.right()),
        join.on().to_vec(),
        filter,
        *join.join_type(),
        vec![SortOptions::default(); join.on().len()],
        join.null_equality(),
    )?);
    let Some(projection) = &join.projection else {
        return Ok(merge);
    };
    let schema = merge.schema();
    let columns = projection
        .iter()
        .map(|&i| {
            let name = schema.field(i).name().clone();
            (
                Arc::new(Column::new(&name, i)) as Arc<dyn PhysicalExpr>,
                name,
            )
        })
        .collect::<Vec<_>>();
    Ok(Arc::new(ProjectionExec::try_new(columns, merge)?))
}

/// `filter` with its intermediate columns in the order DataFusion 55's sort-merge join builds
/// them: every left column, then every right column, each side in the filter's own order.
///
/// A hash join's filter lists its columns in any order: `JoinSelection` swaps a join's inputs by
/// negating each column's side, so a swapped join lists right columns first. The sort-merge join
/// assembles the filter's batch left columns first whatever the filter says, so such a filter
/// would read each column at another's position: a type error when the types differ (TPC-H q19:
/// "expected Decimal128(15, 2) but found Utf8View") and silently wrong rows when they agree.
fn left_columns_first(filter: &JoinFilter) -> Result<JoinFilter> {
    let indices = filter.column_indices();
    let mut order: Vec<usize> = (0..indices.len()).collect();
    // Stable: each side keeps its own order.
    order.sort_by_key(|&i| indices[i].side != JoinSide::Left);
    if order.iter().enumerate().all(|(new, &old)| new == old) {
        return Ok(filter.clone());
    }
    let mut position = vec![0; order.len()];
    for (new, &old) in order.iter().enumerate() {
        position[old] = new;
    }
    let schema = filter.schema();
    let fields: Vec<_> = order.iter().map(|&old| schema.field(old).clone()).collect();
    let expression = Arc::clone(filter.expression())
        .transform_up(|expr| match expr.downcast_ref::<Column>() {
            Some(column) => {
                let moved = position.get(column.index()).copied().ok_or_else(|| {
                    internal_datafusion_err!(
                        "join filter column {column} is not among its {} columns",
                        position.len()
                    )
                })?;
                Ok(Transformed::yes(
                    Arc::new(Column::new(column.name(), moved)) as Arc<dyn PhysicalExpr>,
                ))
            }
            None => Ok(Transformed::no(expr)),
        })
        .data()?;
    Ok(JoinFilter::new(
        expression,
        order.iter().map(|&old| indices[old].clone()).collect(),
        Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone())),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field};
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::common::{JoinType, NullEquality, ScalarValue};
    use datafusion::datasource::MemTable;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{BinaryExpr, Literal};
    use datafusion::physical_plan::joins::utils::ColumnIndex;
    use datafusion::physical_plan::{collect, displayable};
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// `k` with duplicates and nulls, `v` naming the row.
    fn table(name: &str, keys: &[Option<i64>]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("v", DataType::Utf8, false),
        ]));
        let values: Vec<String> = (0..keys.len()).map(|i| format!("{name}{i}")).collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(keys.to_vec())),
                Arc::new(StringArray::from(values)),
            ],
        )
        .unwrap()
    }

    fn keys(n: i64, modulo: i64) -> Vec<Option<i64>> {
        (0..n)
            .map(|i| if i % 17 == 0 { None } else { Some(i % modulo) })
            .collect()
    }

    /// A context over `a` (300 rows, keys 0..40) and `b` (200 rows, keys 0..60), with or without
    /// the rule; `broadcast_small` keeps DataFusion's collect-left thresholds, else every join is
    /// partitioned.
    fn context(sort_merge: bool, broadcast_small: bool) -> SessionContext {
        let mut config = SessionConfig::new().with_target_partitions(3);
        if !broadcast_small {
            let optimizer = &mut config.options_mut().optimizer;
            optimizer.hash_join_single_partition_threshold = 0;
            optimizer.hash_join_single_partition_threshold_rows = 0;
        }
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features()
            .with_physical_optimizer_rules(physical_optimizer_rules(sort_merge))
            .build();
        let ctx = SessionContext::new_with_state(state);
        for (name, rows) in [("a", keys(300, 40)), ("b", keys(200, 60))] {
            let batch = table(name, &rows);
            let halves = vec![
                vec![batch.slice(0, 100)],
                vec![batch.slice(100, batch.num_rows() - 100)],
            ];
            let provider = MemTable::try_new(batch.schema(), halves).unwrap();
            ctx.register_table(name, Arc::new(provider)).unwrap();
        }
        ctx
    }

    async fn plan_and_rows(ctx: &SessionContext, sql: &str) -> (String, Vec<String>) {
        let frame = ctx.sql(sql).await.unwrap();
        let plan = frame.create_physical_plan().await.unwrap();
        let text = displayable(plan.as_ref()).indent(true).to_string();
        let batches = collect(plan, ctx.task_ctx()).await.unwrap();
        (text, data_rows(&batches))
    }

    /// The rows as table lines, sorted (no header or frame).
    fn data_rows(batches: &[RecordBatch]) -> Vec<String> {
        let text = pretty_format_batches(batches).unwrap().to_string();
        let mut rows: Vec<String> = text
            .lines()
            .filter(|line| line.starts_with('|'))
            .skip(1)
            .map(str::to_string)
            .collect();
        rows.sort();
        rows
    }

    const JOINS: &[&str] = &[
        "SELECT a.v, b.v FROM a JOIN b ON a.k = b.k",
        "SELECT a.v, b.v FROM a LEFT JOIN b ON a.k = b.k AND b.v < 'b150'",
        "SELECT a.v, b.v FROM a FULL JOIN b ON a.k = b.k",
        "SELECT a.v FROM a WHERE EXISTS (SELECT 1 FROM b WHERE b.k = a.k AND b.v <> a.v)",
        "SELECT a.v FROM a WHERE NOT EXISTS (SELECT 1 FROM b WHERE b.k = a.k)",
        "SELECT a.k, count(*) FROM a JOIN b ON a.k = b.k GROUP BY a.k",
    ];

    #[tokio::test]
    async fn partitioned_hash_joins_become_sort_merge_joins_with_the_same_rows() {
        let hash = context(false, false);
        let merge = context(true, false);
        for sql in JOINS {
            let (hash_plan, expected) = plan_and_rows(&hash, sql).await;
            let (merge_plan, rows) = plan_and_rows(&merge, sql).await;
            assert!(
                hash_plan.contains("HashJoinExec: mode=Partitioned"),
                "{sql}:\n{hash_plan}"
            );
            assert!(
                merge_plan.contains("SortMergeJoinExec"),
                "{sql}:\n{merge_plan}"
            );
            assert!(!merge_plan.contains("HashJoinExec"), "{sql}:\n{merge_plan}");
            assert!(expected.len() > 10, "{sql}: the query returns rows");
            assert_eq!(rows, expected, "{sql}");
        }
    }

    #[tokio::test]
    async fn small_build_sides_stay_broadcast_hash_joins() {
        let merge = context(true, true);
        let (plan, _) = plan_and_rows(&merge, JOINS[0]).await;
        assert!(plan.contains("HashJoinExec: mode=CollectLeft"), "{plan}");
        assert!(!plan.contains("SortMergeJoinExec"), "{plan}");
    }

    #[tokio::test]
    async fn not_in_subqueries_keep_their_null_semantics_under_the_rule() {
        let hash = context(false, false);
        let merge = context(true, false);
        // `b.k` holds nulls, so `NOT IN` is never true; without them it keeps the unmatched keys.
        for sql in [
            "SELECT a.v FROM a WHERE a.k NOT IN (SELECT b.k FROM b)",
            "SELECT a.v FROM a WHERE a.k NOT IN (SELECT b.k FROM b WHERE b.k IS NOT NULL AND b.k < 35)",
        ] {
            let (_, expected) = plan_and_rows(&hash, sql).await;
            let (_, rows) = plan_and_rows(&merge, sql).await;
            assert_eq!(rows, expected, "{sql}");
        }
        let (_, some) = plan_and_rows(
            &merge,
            "SELECT a.v FROM a WHERE a.k NOT IN (SELECT b.k FROM b WHERE b.k IS NOT NULL AND b.k < 35)",
        )
        .await;
        // The rows of `a` with keys 35..=39 (none below 35 in the subquery): 33 of them.
        assert_eq!(some.len(), 33, "{some:?}");
        let (_, none) = plan_and_rows(
            &merge,
            "SELECT a.v FROM a WHERE a.k NOT IN (SELECT b.k FROM b)",
        )
        .await;
        assert_eq!(none, Vec::<String>::new());
    }

    fn scan(batch: &RecordBatch) -> Arc<dyn ExecutionPlan> {
        MemorySourceConfig::try_new_exec(&[vec![batch.clone()]], batch.schema(), None).unwrap()
    }

    /// A hash join of `left` and `right` on their `k` columns.
    fn hash_join(
        left: &RecordBatch,
        right: &RecordBatch,
        join_type: JoinType,
        projection: Option<Vec<usize>>,
        null_aware: bool,
    ) -> Arc<dyn ExecutionPlan> {
        let on = vec![(
            Arc::new(Column::new("k", 0)) as Arc<dyn PhysicalExpr>,
            Arc::new(Column::new("k", 0)) as Arc<dyn PhysicalExpr>,
        )];
        Arc::new(
            HashJoinExec::try_new(
                scan(left),
                scan(right),
                on,
                None,
                &join_type,
                projection,
                PartitionMode::Partitioned,
                NullEquality::NullEqualsNothing,
                null_aware,
            )
            .unwrap(),
        )
    }

    #[test]
    fn a_null_aware_partitioned_hash_join_is_left_alone() {
        let left = table("l", &[Some(1), None]);
        let right = table("r", &[Some(1), Some(3)]);
        let rule = |plan: &Arc<dyn ExecutionPlan>| {
            SortMergeJoins
                .optimize(Arc::clone(plan), &ConfigOptions::default())
                .unwrap()
        };
        let null_aware = hash_join(&left, &right, JoinType::LeftAnti, None, true);
        assert!(Arc::ptr_eq(&rule(&null_aware), &null_aware));
        // The same join without the flag is converted.
        let plain = hash_join(&left, &right, JoinType::LeftAnti, None, false);
        let converted = rule(&plain);
        assert!(converted.downcast_ref::<SortMergeJoinExec>().is_some());
    }

    #[tokio::test]
    async fn a_hash_joins_projection_is_kept_as_a_projection_over_the_merge_join() {
        // Sorted single-partition inputs, so the merge join runs as built (no sorts planned here).
        let left = table("l", &[Some(1), Some(2), Some(2), Some(5)]);
        let right = table("r", &[Some(2), Some(3), Some(5), Some(5)]);
        let hash = hash_join(&left, &right, JoinType::Inner, Some(vec![3, 1]), false);
        let merge = SortMergeJoins
            .optimize(Arc::clone(&hash), &ConfigOptions::default())
            .unwrap();
        let text = displayable(merge.as_ref()).indent(true).to_string();
        assert!(
            text.starts_with("ProjectionExec: expr=[v@3 as v, v@1 as v]"),
            "{text}"
        );
        assert!(text.contains("SortMergeJoinExec"), "{text}");
        assert_eq!(merge.schema(), hash.schema());
        let ctx = SessionContext::new();
        let expected = data_rows(&collect(hash, ctx.task_ctx()).await.unwrap());
        let rows = data_rows(&collect(merge, ctx.task_ctx()).await.unwrap());
        // Key 2: l1 and l2 with r0; key 5: l3 with r2 and r3.
        assert_eq!(
            expected,
            ["| r0 | l1 |", "| r0 | l2 |", "| r2 | l3 |", "| r3 | l3 |"]
        );
        assert_eq!(rows, expected);
    }

    /// Rows of `a` and `b`'s join on `k` with `filter` over the intermediate columns
    /// `[b.k (right), a.v (left), b.v (right)]`, as a hash join and as the rule's merge join.
    async fn rows_with_a_right_first_filter(
        filter: Arc<dyn PhysicalExpr>,
    ) -> (Vec<String>, Vec<String>) {
        let left = table("l", &[Some(1), Some(2), Some(2), Some(5), Some(5)]);
        let right = table("r", &[Some(2), Some(2), Some(5), Some(7)]);
        let on = vec![(
            Arc::new(Column::new("k", 0)) as Arc<dyn PhysicalExpr>,
            Arc::new(Column::new("k", 0)) as Arc<dyn PhysicalExpr>,
        )];
        let side = |side, index| ColumnIndex { index, side };
        let join_filter = JoinFilter::new(
            filter,
            vec![
                side(JoinSide::Right, 0),
                side(JoinSide::Left, 1),
                side(JoinSide::Right, 1),
            ],
            Arc::new(Schema::new(vec![
                Field::new("rk", DataType::Int64, true),
                Field::new("lv", DataType::Utf8, false),
                Field::new("rv", DataType::Utf8, false),
            ])),
        );
        let hash: Arc<dyn ExecutionPlan> = Arc::new(
            HashJoinExec::try_new(
                scan(&left),
                scan(&right),
                on,
                Some(join_filter),
                &JoinType::Inner,
                None,
                PartitionMode::Partitioned,
                NullEquality::NullEqualsNothing,
                false,
            )
            .unwrap(),
        );
        let merge = SortMergeJoins
            .optimize(Arc::clone(&hash), &ConfigOptions::default())
            .unwrap();
        assert!(merge.downcast_ref::<SortMergeJoinExec>().is_some());
        let ctx = SessionContext::new();
        let expected = data_rows(&collect(hash, ctx.task_ctx()).await.unwrap());
        let rows = data_rows(&collect(merge, ctx.task_ctx()).await.unwrap());
        (expected, rows)
    }

    #[tokio::test]
    async fn a_filter_listing_right_columns_first_gives_the_hash_joins_rows() {
        // `rv > lv` on strings: with the columns read in the wrong order (the swapped join of
        // DataFusion's sort-merge join) this would be `lv > rv` and return the other rows.
        let filter: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            Arc::new(Column::new("rv", 2)),
            Operator::Gt,
            Arc::new(Column::new("lv", 1)),
        ));
        let (expected, rows) = rows_with_a_right_first_filter(filter).await;
        // Every l-value sorts before every r-value, so each key match passes: 2 x 2 for key 2,
        // 2 x 1 for key 5.
        assert_eq!(expected.len(), 6, "{expected:?}");
        assert_eq!(rows, expected);
        // A filter over columns of other types (TPC-H q19's shape): `rk >= 5`, an Int64 column
        // listed first though the merge join's batch starts with a left Utf8 column.
        let filter: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            Arc::new(Column::new("rk", 0)),
            Operator::GtEq,
            Arc::new(Literal::new(ScalarValue::Int64(Some(5)))),
        ));
        let (expected, rows) = rows_with_a_right_first_filter(filter).await;
        assert_eq!(expected, ["| 5 | l3 | 5 | r2 |", "| 5 | l4 | 5 | r2 |"]);
        assert_eq!(rows, expected);
    }

    #[test]
    fn auto_plans_hash_joins_and_falls_back_only_under_a_memory_limit() {
        assert!(!JoinStrategy::Auto.sort_merge());
        assert!(JoinStrategy::Auto.falls_back(true));
        assert!(!JoinStrategy::Auto.falls_back(false));
        assert!(!JoinStrategy::Hash.sort_merge());
        assert!(!JoinStrategy::Hash.falls_back(true));
        assert!(JoinStrategy::SortMerge.sort_merge());
        assert!(!JoinStrategy::SortMerge.falls_back(true));
        assert_eq!(
            "sort-merge".parse::<JoinStrategy>(),
            Ok(JoinStrategy::SortMerge)
        );
        assert_eq!(
            "merge".parse::<JoinStrategy>(),
            Err("unknown joins 'merge' (known: auto, hash, sort-merge)".to_string())
        );
        let rules = physical_optimizer_rules(true);
        let names: Vec<&str> = rules.iter().map(|r| r.name()).collect();
        let at = names.iter().position(|n| *n == "join_selection").unwrap();
        assert_eq!(names[at + 1], "sluice_sort_merge_joins");
        assert_eq!(physical_optimizer_rules(false).len(), rules.len() - 1);
    }
}
