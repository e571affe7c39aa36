//! The job-graph planner on real DataFusion plans: every cut rule, the rewrites, replicas, topology
//! slicing and dependencies, unshippable nodes and the extension point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::datasource::MemTable;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, displayable};
use datafusion::prelude::{SessionConfig, SessionContext};
use sluice_planner::distribution::{DistributedExec, NodeDistribution};
use sluice_planner::{
    DISTRIBUTED_SETTINGS, DistributionRules, FilterDelivery, InputMode, JobGraph, JobGraphOptions,
    OutputDistribution, OutputMode, RescaleExec, RuntimeFilter, Stage, StageId, StageInput,
    StageInputExec, TaskPlacement,
};

fn context(settings: &[(&str, &str)]) -> SessionContext {
    let mut config = SessionConfig::new().with_target_partitions(4);
    for (key, value) in DISTRIBUTED_SETTINGS.iter().chain(settings) {
        config.options_mut().set(key, value).unwrap();
    }
    let ctx = SessionContext::new_with_config(config);
    for (name, partitions, rows) in [("big", 4, 1000), ("small", 2, 10)] {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("b", DataType::Int64, false),
        ]));
        let parts = (0..partitions)
            .map(|p| {
                let a: Int64Array = (0..rows).map(|i| Some(i * partitions + p)).collect();
                let b: Int64Array = (0..rows).map(|i| i % 7).collect();
                vec![RecordBatch::try_new(schema.clone(), vec![Arc::new(a), Arc::new(b)]).unwrap()]
            })
            .collect();
        let table = MemTable::try_new(schema, parts).unwrap();
        ctx.register_table(name, Arc::new(table)).unwrap();
    }
    ctx
}

async fn plan(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    ctx.sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap()
}

async fn graph(sql: &str) -> JobGraph {
    JobGraph::try_new(plan(&context(&[]), sql).await).unwrap()
}

fn text(plan: &Arc<dyn ExecutionPlan>) -> String {
    displayable(plan.as_ref()).indent(false).to_string()
}

fn assert_no_exchange_inside_stages(graph: &JobGraph) {
    for (id, stage) in graph.stages().iter().enumerate() {
        let t = text(&stage.plan);
        assert!(!t.contains("RepartitionExec"), "stage {id}:\n{t}");
        assert!(!t.contains("StageInputExec: stage="), "stage {id}:\n{t}");
        for input in &stage.inputs {
            assert!(input.stage.0 < id, "stage {id} reads a later stage");
        }
    }
}

#[tokio::test]
async fn hash_repartition_cuts_into_a_hash_distribution_read_by_shuffle() {
    let g = graph("select b, count(*) from big group by b").await;
    assert_no_exchange_inside_stages(&g);
    let producer = g
        .stages()
        .iter()
        .position(|s| matches!(s.distribution, OutputDistribution::Hash { .. }))
        .unwrap();
    let stage = &g.stages()[producer];
    assert_eq!(stage.distribution.channels(), 4);
    assert_eq!(stage.distribution.key_names(), vec!["b@0".to_string()]);
    let (consumer, input) = g.consumers(StageId(producer)).next().unwrap();
    assert_eq!(input.mode, InputMode::Shuffle);
    assert_eq!(g.stages()[consumer.0].partitions(), 4);
    assert_eq!(g.replicas(StageId(producer)), 1);
    // The final stage is last and written as one channel.
    let last = g.stages().last().unwrap();
    assert_eq!(last.distribution.channels(), 1);
    assert_eq!(last.placement, TaskPlacement::Worker);
}

#[tokio::test]
async fn round_robin_repartition_cuts_too() {
    let ctx = context(&[]);
    let p = plan(&ctx, "select a from small where a > 3").await;
    let p = Arc::new(
        datafusion::physical_plan::repartition::RepartitionExec::try_new(
            p,
            datafusion::physical_expr::Partitioning::RoundRobinBatch(3),
        )
        .unwrap(),
    );
    let g = JobGraph::try_new(p).unwrap();
    assert_eq!(g.stages().len(), 2);
    assert!(matches!(
        g.stages()[0].distribution,
        OutputDistribution::RoundRobin { channels: 3 }
    ));
    assert_eq!(g.stages()[1].inputs[0].mode, InputMode::Shuffle);
    assert_eq!(g.stages()[1].partitions(), 3);
}

#[tokio::test]
async fn sort_preserving_merge_reads_every_partition_with_merge() {
    let g = graph("select a from big order by a").await;
    let last = g.stages().last().unwrap();
    assert!(text(&last.plan).starts_with("SortPreservingMergeExec"));
    assert_eq!(last.inputs[0].mode, InputMode::Merge);
    // Merge is read by every consumer partition: one replica each.
    assert_eq!(g.replicas(last.inputs[0].stage), last.partitions());
}

#[tokio::test]
async fn coalesce_with_fetch_keeps_the_limit_above_the_cut() {
    let ctx = context(&[]);
    let p = plan(&ctx, "select a from big where b > 2").await;
    let coalesce = datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec::new(p)
        .with_fetch(Some(7));
    let g = JobGraph::try_new(Arc::new(coalesce)).unwrap();
    let last = text(&g.stages().last().unwrap().plan);
    assert!(
        last.starts_with("GlobalLimitExec: skip=0, fetch=7"),
        "{last}"
    );
    assert_eq!(
        g.stages().last().unwrap().inputs[0].mode,
        InputMode::Shuffle
    );
    assert!(matches!(
        g.stages()[0].distribution,
        OutputDistribution::RoundRobin { channels: 1 }
    ));
}

#[tokio::test]
async fn rescale_node_reads_contiguous_ranges() {
    let ctx = context(&[]);
    let p = plan(&ctx, "select a from big").await;
    assert_eq!(p.output_partitioning().partition_count(), 4);
    let g = JobGraph::try_new(Arc::new(RescaleExec::try_new(p, 2).unwrap())).unwrap();
    let last = g.stages().last().unwrap();
    assert_eq!(last.inputs[0].mode, InputMode::Rescale);
    assert_eq!(last.partitions(), 2);
    assert_eq!(g.replicas(last.inputs[0].stage), 1);
}

#[tokio::test]
async fn collect_left_build_sides_are_broadcast() {
    let ctx = context(&[("datafusion.optimizer.repartition_joins", "false")]);
    let p = plan(&ctx, "select * from small join big on small.a = big.a").await;
    assert!(text(&p).contains("mode=CollectLeft"), "{}", text(&p));
    let g = JobGraph::try_new(p).unwrap();
    let join_stage = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("HashJoinExec"))
        .unwrap();
    assert_eq!(join_stage.inputs[0].mode, InputMode::Broadcast);
    assert_eq!(
        g.replicas(join_stage.inputs[0].stage),
        join_stage.partitions()
    );
}

#[tokio::test]
async fn left_collect_left_join_becomes_partitioned() {
    let ctx = context(&[("datafusion.optimizer.repartition_joins", "false")]);
    let p = plan(&ctx, "select * from small left join big on small.a = big.a").await;
    assert!(text(&p).contains("mode=CollectLeft, join_type=Left"));
    let g = JobGraph::try_new(p.clone()).unwrap();
    let all: String = g.stages().iter().map(|s| text(&s.plan)).collect();
    assert!(all.contains("mode=Partitioned, join_type=Left"), "{all}");
    assert!(!all.contains("Broadcast"));
    // Inner joins keep collect-left.
    let inner = plan(&ctx, "select * from small join big on small.a = big.a").await;
    let g = JobGraph::try_new(inner).unwrap();
    let all: String = g.stages().iter().map(|s| text(&s.plan)).collect();
    assert!(all.contains("mode=CollectLeft"), "{all}");
}

#[tokio::test]
async fn null_aware_anti_join_keeps_collect_left_with_one_probe_partition() {
    let ctx = context(&[]);
    let p = plan(
        &ctx,
        "select * from big where a not in (select a from small)",
    )
    .await;
    let t = text(&p);
    if !t.contains("null_aware") {
        return; // DataFusion planned it differently; nothing to check.
    }
    let g = JobGraph::try_new(p).unwrap();
    let join = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("null_aware"))
        .unwrap();
    assert!(text(&join.plan).contains("mode=CollectLeft"));
    assert_eq!(join.partitions(), 1, "{}", text(&join.plan));
}

#[tokio::test]
async fn nested_loop_build_side_is_broadcast_and_replayable() {
    let g = graph("select * from small, big where small.a < big.a").await;
    let nlj = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("NestedLoopJoinExec"))
        .unwrap();
    assert_eq!(nlj.inputs[0].mode, InputMode::Broadcast);
    assert!(text(&nlj.plan).contains("replay"), "{}", text(&nlj.plan));
}

#[tokio::test]
async fn generated_series_run_on_the_driver_read_forward() {
    let g = graph("select value * 2 from generate_series(1, 100)").await;
    let driver = &g.stages()[0];
    assert_eq!(driver.placement, TaskPlacement::Driver);
    assert!(text(&driver.plan).contains("LazyMemoryExec"));
    let (_, input) = g.consumers(StageId(0)).next().unwrap();
    assert_eq!(input.mode, InputMode::Forward);
}

#[tokio::test]
async fn recursive_queries_run_whole_on_the_driver() {
    let g = graph(
        "with recursive r(n) as (select 1 union all select n + 1 from r where n < 5) select * from r",
    )
    .await;
    let driver = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("RecursiveQueryExec"))
        .unwrap();
    assert_eq!(driver.placement, TaskPlacement::Driver);
    assert!(text(&driver.plan).contains("WorkTableExec"));
    assert!(driver.inputs.is_empty());
}

#[tokio::test]
async fn driver_stages_stay_pipelined_when_exchanges_block() {
    // An unbounded recursive query under a LIMIT: a blocking driver output would never complete.
    let sql = "with recursive t as (select 1 i union all select g.i from generate_series(1, 1) g(i), t) \
               select * from t limit 10";
    let options = JobGraphOptions {
        exchange_mode: OutputMode::Blocking,
        ..JobGraphOptions::default()
    };
    let g = JobGraph::try_new_with(plan(&context(&[]), sql).await, &options).unwrap();
    let modes: Vec<(TaskPlacement, OutputMode)> =
        g.stages().iter().map(|s| (s.placement, s.mode)).collect();
    assert!(
        modes.contains(&(TaskPlacement::Driver, OutputMode::Pipelined)),
        "{modes:?}"
    );
    assert!(
        !modes.contains(&(TaskPlacement::Driver, OutputMode::Blocking)),
        "{modes:?}"
    );
}

#[tokio::test]
async fn window_top_n_runs_in_the_stage_after_its_repartition() {
    let ctx = context(&[("datafusion.optimizer.enable_window_topn", "true")]);
    let p = plan(
        &ctx,
        "select * from (select a, b, row_number() over (partition by b order by a) as rn from big) where rn <= 2",
    )
    .await;
    if !text(&p).contains("PartitionedTopKExec") {
        panic!("expected a PartitionedTopKExec:\n{}", text(&p));
    }
    let g = JobGraph::try_new(p).unwrap();
    let topk = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("PartitionedTopKExec"))
        .unwrap();
    assert_eq!(topk.placement, TaskPlacement::Worker);
    // It reads the hash repartition on the window's partition key: every key's rows in one task.
    assert_eq!(topk.inputs.len(), 1);
    assert_eq!(topk.inputs[0].mode, InputMode::Shuffle);
    let producer = g.stage(topk.inputs[0].stage).unwrap();
    assert_eq!(producer.distribution.kind(), "Hash");
}

#[tokio::test]
async fn a_piecewise_merge_left_join_reads_one_streamed_partition_and_broadcasts_its_buffer() {
    let ctx = context(&[("datafusion.optimizer.enable_piecewise_merge_join", "true")]);
    let p = plan(
        &ctx,
        "select big.a, other.a from big left join big other on big.a < other.b",
    )
    .await;
    if !text(&p).contains("PiecewiseMergeJoin") {
        panic!("expected a PiecewiseMergeJoinExec:\n{}", text(&p));
    }
    let g = JobGraph::try_new(p).unwrap();
    let join = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("PiecewiseMergeJoin"))
        .unwrap();
    // One task sees every streamed row, so it alone decides which buffered rows found no match.
    assert_eq!(join.partitions(), 1, "{}", text(&join.plan));
    assert_eq!(join.inputs.len(), 2, "{:?}", join.inputs);
}

/// A custom node that declares itself unsupported through the extension point.
#[derive(Debug)]
struct Opaque(Arc<dyn ExecutionPlan>);

impl datafusion::physical_plan::DisplayAs for Opaque {
    fn fmt_as(
        &self,
        _t: datafusion::physical_plan::DisplayFormatType,
        f: &mut std::fmt::Formatter,
    ) -> std::fmt::Result {
        write!(f, "Opaque")
    }
}

impl ExecutionPlan for Opaque {
    fn name(&self) -> &str {
        "Opaque"
    }
    fn properties(&self) -> &Arc<datafusion::physical_plan::PlanProperties> {
        self.0.properties()
    }
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.0]
    }
    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(
            &Arc<dyn datafusion::physical_expr::PhysicalExpr>,
        ) -> datafusion::common::Result<
            datafusion::common::tree_node::TreeNodeRecursion,
        >,
    ) -> datafusion::common::Result<datafusion::common::tree_node::TreeNodeRecursion> {
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    }
    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> datafusion::common::Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Opaque(children.remove(0))))
    }
    fn execute(
        &self,
        partition: usize,
        context: Arc<datafusion::execution::TaskContext>,
    ) -> datafusion::common::Result<datafusion::execution::SendableRecordBatchStream> {
        self.0.execute(partition, context)
    }
}

impl DistributedExec for Opaque {
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: false,
        }
    }
}

#[tokio::test]
async fn registered_extension_nodes_declare_their_distribution() {
    let ctx = context(&[]);
    let p: Arc<dyn ExecutionPlan> = Arc::new(Opaque(plan(&ctx, "select a from big").await));
    // Unregistered: it runs inside a stage like any per-partition node.
    let g = JobGraph::try_new(p.clone()).unwrap();
    assert_eq!(g.stages().len(), 1);
    // Registered as a driver node: its input becomes a worker stage read Forward.
    let mut rules = DistributionRules::default();
    rules.register::<Opaque>();
    let options = JobGraphOptions {
        rules,
        ..JobGraphOptions::default()
    };
    let g = JobGraph::try_new_with(p, &options).unwrap();
    assert_eq!(g.stages()[0].placement, TaskPlacement::Worker);
    assert_eq!(g.stages()[1].placement, TaskPlacement::Driver);
    assert_eq!(g.stages()[1].inputs[0].mode, InputMode::Forward);
    assert_eq!(g.stages()[1].partitions(), 4);
}

fn stage(
    inputs: Vec<StageInput>,
    partitions: usize,
    mode: OutputMode,
    template: &Arc<dyn ExecutionPlan>,
) -> Stage {
    let properties = template.properties().as_ref().clone().with_partitioning(
        datafusion::physical_expr::Partitioning::UnknownPartitioning(partitions),
    );
    Stage {
        inputs,
        plan: Arc::new(StageInputExec::new(0usize, Arc::new(properties))),
        mode,
        distribution: OutputDistribution::RoundRobin { channels: 1 },
        placement: TaskPlacement::Worker,
        wire_form: None,
    }
}

fn input(stage: usize, mode: InputMode) -> StageInput {
    StageInput {
        stage: StageId(stage),
        mode,
    }
}

#[tokio::test]
async fn forward_components_are_sliced_per_partition_and_blocking_outputs_end_components() {
    let template = plan(&context(&[]), "select a from big").await;
    let schema = template.schema();
    let stages = vec![
        stage(vec![], 2, OutputMode::Pipelined, &template),
        stage(
            vec![input(0, InputMode::Forward)],
            2,
            OutputMode::Blocking,
            &template,
        ),
        stage(
            vec![input(1, InputMode::Shuffle)],
            3,
            OutputMode::Pipelined,
            &template,
        ),
        stage(
            vec![input(2, InputMode::Merge)],
            1,
            OutputMode::Pipelined,
            &template,
        ),
    ];
    let g = JobGraph::from_stages(stages, schema).unwrap();
    let t = g.topology();
    let regions = t.regions();
    assert_eq!(regions.len(), 3, "{regions:?}");
    // Stages 0 and 1 (Forward, equal partitions) are sliced into one region per partition.
    let pairs = |r: usize| -> Vec<(usize, usize)> {
        regions[r]
            .tasks
            .iter()
            .map(|t| (t.stage.0, t.partition))
            .collect()
    };
    assert_eq!(pairs(0), [(0, 0), (1, 0)]);
    assert_eq!(pairs(1), [(0, 1), (1, 1)]);
    // Stage 1 is Blocking: stages 2 and 3 form the next region, after both slices.
    assert_eq!(pairs(2), [(2, 0), (2, 1), (2, 2), (3, 0)]);
    let deps: Vec<usize> = t
        .dependency_regions(sluice_planner::RegionId(2))
        .iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(deps, [0, 1]);
    // Kept as one dependency on the sliced component, whose regions both list region 2 as reader.
    assert_eq!(
        regions[2].depends_on,
        [sluice_planner::Dependency::Component(
            sluice_planner::ComponentId(0)
        )]
    );
    for r in 0..2 {
        let readers: Vec<usize> = t
            .readers(sluice_planner::RegionId(r))
            .map(|r| r.0)
            .collect();
        assert_eq!(readers, [2]);
    }
    assert_eq!(t.components(), [0..2, 2..3]);
    assert!(regions[0].depends_on.is_empty());
}

#[tokio::test]
async fn a_forward_consumer_of_a_blocking_producer_depends_on_the_same_partition_only() {
    let template = plan(&context(&[]), "select a from big").await;
    let stages = vec![
        stage(vec![], 2, OutputMode::Blocking, &template),
        stage(
            vec![input(0, InputMode::Forward)],
            2,
            OutputMode::Pipelined,
            &template,
        ),
    ];
    let g = JobGraph::from_stages(stages, template.schema()).unwrap();
    let t = g.topology();
    // Single-stage components slice per partition too: region p of stage 1 waits for region p of 0.
    assert_eq!(t.regions().len(), 4);
    for p in 0..2 {
        let consumer = &t.regions()[2 + p];
        assert_eq!(consumer.tasks.len(), 1);
        assert_eq!(
            (consumer.tasks[0].stage.0, consumer.tasks[0].partition),
            (1, p)
        );
        assert_eq!(
            consumer.depends_on,
            [sluice_planner::Dependency::Region(
                sluice_planner::RegionId(p)
            )]
        );
    }
}

#[tokio::test]
async fn graphs_with_bad_stage_order_are_refused() {
    let template = plan(&context(&[]), "select a from big").await;
    let stages = vec![stage(
        vec![input(0, InputMode::Forward)],
        2,
        OutputMode::Pipelined,
        &template,
    )];
    assert!(JobGraph::from_stages(stages, template.schema()).is_err());
}

/// Settings that make every equi-join a partitioned one: no side is broadcast.
const PARTITIONED_JOINS: [(&str, &str); 2] = [
    (
        "datafusion.optimizer.hash_join_single_partition_threshold",
        "0",
    ),
    (
        "datafusion.optimizer.hash_join_single_partition_threshold_rows",
        "0",
    ),
];

/// The job graph of `sql` with pipelined exchanges (the default) and partitioned joins.
async fn pipelined_join_graph(sql: &str) -> JobGraph {
    JobGraph::try_new(plan(&context(&PARTITIONED_JOINS), sql).await).unwrap()
}

/// The job graph of `sql` with blocking exchanges and partitioned joins.
async fn blocking_join_graph(sql: &str, runtime_filters: bool) -> JobGraph {
    let ctx = context(&PARTITIONED_JOINS);
    let options = JobGraphOptions {
        exchange_mode: OutputMode::Blocking,
        runtime_filters,
        ..JobGraphOptions::default()
    };
    JobGraph::try_new_with(plan(&ctx, sql).await, &options).unwrap()
}

#[tokio::test]
async fn a_partitioned_join_filters_its_probe_producer_which_waits_for_the_build_producer() {
    let g = blocking_join_graph("select big.b from small join big on small.a = big.a", true).await;
    let [filter] = g.runtime_filters() else {
        panic!(
            "one filter: {:?}\n{}",
            g.runtime_filters(),
            sluice_planner::explain::explain_text(&g)
        );
    };
    let join_stage = g
        .stages()
        .iter()
        .position(|s| text(&s.plan).contains("HashJoinExec: mode=Partitioned"))
        .unwrap();
    let join_inputs: Vec<StageId> = g.stages()[join_stage]
        .inputs
        .iter()
        .map(|i| i.stage)
        .collect();
    // The build side's producer filters the probe side's producer, on top of its plan.
    assert_eq!(join_inputs, [filter.source, filter.target]);
    assert!(filter.target_path.is_empty());
    assert_eq!(
        (
            filter.source_columns.as_slice(),
            filter.target_columns.as_slice()
        ),
        (&[0][..], &[0][..])
    );
    // The probe producer's regions wait for the build producer's, which they do not read.
    let topology = g.topology();
    let region = |stage: StageId| {
        topology
            .region_of(sluice_planner::TaskId {
                stage,
                partition: 0,
            })
            .unwrap()
    };
    assert!(
        topology
            .dependency_regions(region(filter.target))
            .contains(&region(filter.source)),
        "{}",
        sluice_planner::explain::explain_text(&g)
    );
    let explained = sluice_planner::explain::explain_text(&g);
    assert!(
        explained.contains(&format!(
            "runtime filter: [a@0] within stage {}'s [a@0], on top of the plan, for HashJoinExec Inner on (a@0 = a@0) in stage {join_stage}",
            filter.source
        )),
        "{explained}"
    );

    // Off: no filter, and the probe producer waits for nothing.
    let off =
        blocking_join_graph("select big.b from small join big on small.a = big.a", false).await;
    assert!(off.runtime_filters().is_empty());
    let probe_region = off
        .topology()
        .region_of(sluice_planner::TaskId {
            stage: filter.target,
            partition: 0,
        })
        .unwrap();
    assert_eq!(off.topology().dependency_regions(probe_region), []);
}

/// With pipelined exchanges the build side's producer runs alongside the probe side's: the filter
/// is planned all the same, delivered to the probe producer's running tasks, and nothing waits
/// (both stay in the job's one region).
#[tokio::test]
async fn with_pipelined_exchanges_a_join_filters_its_probe_producer_while_it_runs() {
    let g = pipelined_join_graph("select big.b from small join big on small.a = big.a").await;
    let explained = sluice_planner::explain::explain_text(&g);
    let [filter] = g.runtime_filters() else {
        panic!("one filter: {:?}\n{explained}", g.runtime_filters());
    };
    assert_eq!(filter.delivery, FilterDelivery::WhileRunning);
    let join_stage = stage_containing(&g, "HashJoinExec: mode=Partitioned");
    let join_inputs: Vec<StageId> = g.stages()[join_stage]
        .inputs
        .iter()
        .map(|i| i.stage)
        .collect();
    assert_eq!(join_inputs, [filter.source, filter.target], "{explained}");
    assert!(filter.target_path.is_empty());
    assert_eq!(filter.target_columns, [0]);
    assert!(
        !waits_for(&g, filter.target.0, filter.source.0),
        "{explained}"
    );
    assert!(
        explained.contains(&format!(
            "runtime filter: [a@0] within stage {}'s [a@0], on top of the plan, sent to its \
             running tasks, for HashJoinExec Inner on (a@0 = a@0) in stage {join_stage}",
            filter.source
        )),
        "{explained}"
    );
}

/// A broadcast join probing a scan of its own stage: with pipelined exchanges its filter goes into
/// that stage, on top of the scan, which prunes with it what it has not read when it arrives.
#[tokio::test]
async fn with_pipelined_exchanges_a_broadcast_joins_filter_goes_on_top_of_the_scan_it_probes() {
    let ctx = context(&[]);
    let sql = "select big.b from small join big on small.a = big.a";
    let g = JobGraph::try_new_with(plan(&ctx, sql).await, &JobGraphOptions::default()).unwrap();
    let explained = sluice_planner::explain::explain_text(&g);
    let [filter] = g.runtime_filters() else {
        panic!("one filter: {:?}\n{explained}", g.runtime_filters());
    };
    let join_stage = stage_containing(&g, "HashJoinExec: mode=CollectLeft");
    assert_eq!(
        (filter.target.0, filter.delivery),
        (join_stage, FilterDelivery::WhileRunning),
        "{explained}"
    );
    let node = sluice_planner::job_graph::runtime_filters::node_at(
        &g.stages()[join_stage].plan,
        &filter.target_path,
    )
    .unwrap();
    assert!(text(&node).starts_with("DataSourceExec"), "{}", text(&node));
}

/// The first stage of `g` whose plan's text contains `needle`.
fn stage_containing(g: &JobGraph, needle: &str) -> usize {
    g.stages()
        .iter()
        .position(|s| text(&s.plan).contains(needle))
        .unwrap_or_else(|| {
            panic!(
                "a stage with {needle}:\n{}",
                sluice_planner::explain::explain_text(g)
            )
        })
}

/// Whether partition 0 of stage `waiting` depends on partition 0 of stage `on`.
fn waits_for(g: &JobGraph, waiting: usize, on: usize) -> bool {
    let topology = g.topology();
    let region = |stage: usize| {
        topology
            .region_of(sluice_planner::TaskId {
                stage: StageId(stage),
                partition: 0,
            })
            .unwrap()
    };
    topology
        .dependency_regions(region(waiting))
        .contains(&region(on))
}

/// A semi join probing an inner join: its keys follow the probe key down through the inner join
/// (a `big` row whose key the subquery lacks only makes joined rows the semi join drops) and
/// into `big`'s scan stage when that stage comes after the subquery's.
#[tokio::test]
async fn a_semi_joins_filter_follows_its_key_through_an_inner_join_to_a_scan_stage() {
    let sql = "select big.b from small join big on small.a = big.a \
               where big.a in (select a from small where b = 1)";
    let g = blocking_join_graph(sql, true).await;
    let explained = sluice_planner::explain::explain_text(&g);
    let semi: Vec<&RuntimeFilter> = g
        .runtime_filters()
        .iter()
        .filter(|f| f.join.contains("Semi"))
        .collect();
    let [semi] = semi[..] else {
        panic!("one semi join filter:\n{explained}");
    };
    let stage_of = |needle: &str| stage_containing(&g, needle);
    let subquery = stage_of("FilterExec: b@1 = 1");
    let big_scan = stage_of("DataSourceExec: partitions=4");
    let joins = stage_of("join_type=RightSemi");
    // The semi join probes the inner join in its own stage: the filter went through that join.
    let semi_join = g.stages()[joins]
        .plan
        .children()
        .into_iter()
        .nth(1)
        .map(text);
    assert!(
        semi_join.is_some_and(
            |probe| probe.starts_with("HashJoinExec: mode=Partitioned, join_type=Inner")
        ),
        "{explained}"
    );
    // Not on top of the semi join's probe side (the inner join) in its own stage: through the
    // inner join's `big` side, on top of `big`'s scan stage, which now waits for the subquery.
    assert_eq!(
        (semi.source, semi.target, semi.target_path.as_slice()),
        (StageId(subquery), StageId(big_scan), &[][..]),
        "{explained}"
    );
    assert_eq!(semi.target_columns, [0]);
    assert!(
        explained.contains(&format!(
            "runtime filter: [a@0] within stage {subquery}'s [a@0], on top of the plan, for \
             HashJoinExec RightSemi on (a@0 = a@0) in stage {joins}"
        )),
        "{explained}"
    );
    assert!(waits_for(&g, big_scan, subquery), "{explained}");
}

/// A probe side made by an aggregate: the filter follows the group keys through it (a row whose
/// key the build side lacks only makes a group the join drops) and on into the stage of its
/// partial aggregate, onto the scan that reads `big`, which waits for the build side: only the
/// groups the join keeps are aggregated and shuffled.
#[tokio::test]
async fn a_filter_follows_an_aggregates_group_keys_to_the_scan_below_it() {
    let sql = "select g.n from (select a, b, count(*) as n from big group by a, b) g \
               where g.a in (select a from small where b = 1)";
    let g = blocking_join_graph(sql, true).await;
    let explained = sluice_planner::explain::explain_text(&g);
    let [filter] = g.runtime_filters() else {
        panic!("one filter:\n{explained}");
    };
    let stage_of = |needle: &str| stage_containing(&g, needle);
    let subquery = stage_of("FilterExec: b@1 = 1");
    let partial = stage_of("AggregateExec: mode=Partial");
    assert_eq!(
        (
            filter.source,
            filter.target,
            filter.target_columns.as_slice()
        ),
        (StageId(subquery), StageId(partial), &[0][..]),
        "{explained}"
    );
    let node = sluice_planner::job_graph::runtime_filters::node_at(
        &g.stages()[partial].plan,
        &filter.target_path,
    )
    .unwrap();
    assert!(text(&node).starts_with("DataSourceExec"), "{explained}");
    assert!(waits_for(&g, partial, subquery), "{explained}");
}

/// With grouping sets a row also counts in groups where its key is NULL (a ROLLUP's totals): the
/// keys stop at the aggregate, and the filter goes on top of the producer whose output the join
/// probes as it is.
#[tokio::test]
async fn a_filter_stops_at_an_aggregate_with_grouping_sets() {
    let sql = "select g.n from (select a, b, count(*) as n from big group by rollup(a, b)) g \
               where g.a in (select a from small where b = 1)";
    let g = blocking_join_graph(sql, true).await;
    let explained = sluice_planner::explain::explain_text(&g);
    let [filter] = g.runtime_filters() else {
        panic!("one filter:\n{explained}");
    };
    let aggregate = stage_containing(&g, "AggregateExec: mode=FinalPartitioned");
    assert_eq!(
        (filter.target, filter.target_path.as_slice()),
        (StageId(aggregate), &[][..]),
        "{explained}"
    );
}

#[tokio::test]
async fn joins_that_keep_unmatched_probe_rows_get_no_filter() {
    for sql in [
        "select big.b from small right join big on small.a = big.a",
        "select big.b from small full join big on small.a = big.a",
        // A NOT IN anti join: one NULL among the subquery's keys empties the answer.
        "select big.b from big where big.a not in (select a from small)",
    ] {
        let g = blocking_join_graph(sql, true).await;
        assert!(
            g.runtime_filters().is_empty(),
            "{sql}\n{}",
            sluice_planner::explain::explain_text(&g)
        );
    }
    // A key computed below the exchange is a column of the producer's output: it can filter.
    let g = blocking_join_graph(
        "select big.b from small join big on small.a + 1 = big.a",
        true,
    )
    .await;
    let [filter] = g.runtime_filters() else {
        panic!("one filter: {:?}", g.runtime_filters());
    };
    assert_eq!(filter.source_columns, [1]);
}

#[tokio::test]
async fn partitioned_joins_over_blocking_inputs_that_decide_each_probe_row_alone_may_be_split() {
    let mut candidates = 0;
    for sql in [
        "select big.b from small join big on small.a = big.a",
        "select big.b, small.b from small right join big on small.a = big.a",
        "select big.b from big where big.a in (select a from small where a > 1) and big.b > 0",
        "select big.b from big where not exists (select 1 from small where small.a = big.a)",
    ] {
        let g = blocking_join_graph(sql, true).await;
        let explained = sluice_planner::explain::explain_text(&g);
        let join_stage = g
            .stages()
            .iter()
            .position(|s| text(&s.plan).contains("HashJoinExec: mode=Partitioned"))
            .unwrap_or_else(|| panic!("{sql}: a partitioned join\n{explained}"));
        let join_text = text(&g.stages()[join_stage].plan);
        if join_text.contains("join_type=LeftAnti") || join_text.contains("join_type=LeftSemi") {
            // A left semi or anti join's output is made of build rows: never split.
            assert!(g.skew_joins().is_empty(), "{sql}\n{explained}");
            continue;
        }
        let [join] = g.skew_joins() else {
            panic!("{sql}: one candidate: {:?}\n{explained}", g.skew_joins());
        };
        assert_eq!(join.stage, StageId(join_stage), "{sql}");
        let inputs = &g.stages()[join_stage].inputs;
        // The build side is the join's left child, the probe side its right one, both shuffled.
        let (build, probe) = (inputs[join.build_input], inputs[join.probe_input]);
        assert_ne!(join.build_input, join.probe_input);
        assert_eq!(
            (build.mode, probe.mode),
            (InputMode::Shuffle, InputMode::Shuffle)
        );
        // `small` has two partitions, `big` four.
        assert_eq!(
            g.stages()[build.stage.0].partitions(),
            2,
            "{sql}: build side\n{explained}"
        );
        assert!(join.join.starts_with("HashJoinExec "), "{}", join.join);
        assert!(
            explained.contains(&format!(
                "skew split: once stages {} and {} finished, a partition with skewed probe rows",
                build.stage, probe.stage
            )),
            "{explained}"
        );
        candidates += 1;
    }
    assert!(candidates >= 3, "joins that may be split: {candidates}");
    // Joins whose output keeps unmatched build rows read the whole build partition in one task.
    for sql in [
        "select big.b from small left join big on small.a = big.a",
        "select big.b from small full join big on small.a = big.a",
    ] {
        let g = blocking_join_graph(sql, true).await;
        assert!(g.skew_joins().is_empty(), "{sql}: {:?}", g.skew_joins());
    }
    // A final aggregate above the join in its own stage relies on the join's partitioning.
    let grouped =
        "select small.a, count(*) from small join big on small.a = big.a group by small.a";
    let g = blocking_join_graph(grouped, true).await;
    let join_stage = g
        .stages()
        .iter()
        .find(|s| text(&s.plan).contains("HashJoinExec: mode=Partitioned"))
        .unwrap();
    let stage_text = text(&join_stage.plan);
    assert!(
        stage_text.contains("AggregateExec: mode=FinalPartitioned")
            || stage_text.contains("AggregateExec: mode=SinglePartitioned"),
        "the aggregate runs in the join's stage:\n{stage_text}"
    );
    assert!(
        g.skew_joins().is_empty(),
        "{:?}\n{stage_text}",
        g.skew_joins()
    );
    // Pipelined inputs have no exact row counts before the join starts.
    let pipelined =
        pipelined_join_graph("select big.b from small join big on small.a = big.a").await;
    assert!(pipelined.skew_joins().is_empty());
}

fn single_task_options(limit: u64) -> JobGraphOptions {
    JobGraphOptions {
        single_task_bytes: Some(limit),
        ..JobGraphOptions::default()
    }
}

/// The bytes the in-memory table `name` of [`context`] holds, as the single-task rule counts them.
async fn memory_bytes(ctx: &SessionContext, name: &str) -> u64 {
    let batches: Vec<RecordBatch> = ctx.table(name).await.unwrap().collect().await.unwrap();
    batches
        .iter()
        .map(|b| b.get_array_memory_size() as u64)
        .sum()
}

#[tokio::test]
async fn a_job_reading_at_most_the_single_task_bytes_runs_whole_as_one_task() {
    let ctx = context(&[]);
    let sql = "select b, count(*) from big group by b order by b";
    let read = memory_bytes(&ctx, "big").await;
    let g = JobGraph::try_new_with(plan(&ctx, sql).await, &single_task_options(read)).unwrap();
    assert_eq!(g.stages().len(), 1);
    let only = &g.stages()[0];
    assert_eq!(only.partitions(), 1);
    assert_eq!(only.placement, TaskPlacement::Worker);
    assert!(only.inputs.is_empty());
    // The whole plan, its exchange kept inside the task.
    let plan_text = text(&only.plan);
    assert!(
        plan_text.starts_with("SortPreservingMergeExec"),
        "{plan_text}"
    );
    assert!(
        plan_text.contains("RepartitionExec: partitioning=Hash"),
        "{plan_text}"
    );
    let single = g.single_task().unwrap();
    assert_eq!((single.read_bytes, single.limit_bytes), (read, read));
    let explained = sluice_planner::explain::explain_text(&g);
    assert_eq!(
        explained.lines().next().unwrap(),
        format!(
            "Single task: the scans read {read} bytes, at most sluice.single_task_bytes = {read}: \
             the whole plan runs in one task, its exchanges in memory"
        )
    );
}

#[tokio::test]
async fn a_job_reading_one_byte_more_than_the_single_task_bytes_is_cut_into_stages() {
    let ctx = context(&[]);
    let sql = "select b, count(*) from big group by b order by b";
    let read = memory_bytes(&ctx, "big").await;
    let g = JobGraph::try_new_with(plan(&ctx, sql).await, &single_task_options(read - 1)).unwrap();
    assert_eq!(g.single_task(), None);
    let cut = graph(sql).await;
    assert_eq!(g.stages().len(), cut.stages().len());
    assert!(g.stages().len() > 1);
    assert_no_exchange_inside_stages(&g);
    assert!(!sluice_planner::explain::explain_text(&g).contains("Single task"));
}

#[tokio::test]
async fn a_small_job_of_several_partitions_is_coalesced_to_one_and_reads_both_tables() {
    let ctx = context(&[]);
    let read = memory_bytes(&ctx, "big").await + memory_bytes(&ctx, "small").await;
    let sql = "select big.a from big join small on big.a = small.a";
    let g = JobGraph::try_new_with(plan(&ctx, sql).await, &single_task_options(read)).unwrap();
    assert_eq!(g.single_task().unwrap().read_bytes, read);
    let only = &g.stages()[0];
    assert_eq!(only.partitions(), 1);
    assert!(text(&only.plan).starts_with("CoalescePartitionsExec"));
}

#[tokio::test]
async fn a_job_with_a_driver_only_node_is_cut_however_little_it_reads() {
    let ctx = context(&[]);
    let sql = "select value * 2 from generate_series(1, 100)";
    let g = JobGraph::try_new_with(plan(&ctx, sql).await, &single_task_options(u64::MAX)).unwrap();
    assert_eq!(g.single_task(), None);
    assert_eq!(g.stages()[0].placement, TaskPlacement::Driver);
}

#[tokio::test]
async fn a_small_job_whose_whole_plan_fails_the_wire_check_is_cut_so_its_stages_still_reach_workers()
 {
    let ctx = context(&[]);
    let sql = "select b, count(*) from big group by b order by b";
    // A check that passes every plan but one holding an exchange: only the whole plan has one.
    let check: sluice_planner::WireCheck = Arc::new(|plan: &Arc<dyn ExecutionPlan>| {
        (!text(plan).contains("RepartitionExec")).then(bytes::Bytes::new)
    });
    let options = JobGraphOptions {
        wire_check: Some(check),
        ..single_task_options(u64::MAX)
    };
    let g = JobGraph::try_new_with(plan(&ctx, sql).await, &options).unwrap();
    assert_eq!(g.single_task(), None);
    assert!(g.stages().len() > 1);
    assert!(
        g.stages()
            .iter()
            .all(|s| s.placement == TaskPlacement::Worker)
    );
}
