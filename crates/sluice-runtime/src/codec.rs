//! Stage plans on the wire: datafusion-proto for DataFusion's nodes plus a `PhysicalExtensionCodec`
//! for Sluice's own (`StageInputExec<usize>`, `RescaleExec`) and for the DataFusion nodes that
//! datafusion-proto 55 has no form for (`PartitionedTopKExec`, `PiecewiseMergeJoinExec`), so every
//! plan local mode runs can run on workers.
//!
//! ```text
//!   stage plan ──encode_stage_plan (once per stage)──► bytes ──decode_stage_plan (per task)──► plan
//!   StageInputExec<usize>  ⇄  SluiceNode::StageInput { input, schema, partitioning, ordering, replay }
//!   RescaleExec            ⇄  SluiceNode::Rescale { partitions }              (child: its input)
//!   PartitionedTopKExec    ⇄  SluiceNode::PartitionedTopK { ordering, prefix, fetch, kind }
//!   PiecewiseMergeJoinExec ⇄  SluiceNode::PiecewiseMergeJoin { on, operator, join type,
//!                                                               partitions } (children: both sides)
//!   KeyBloomFilterExpr     ⇄  BLOOM_EXPR_TAG + the filter's bytes          (inputs: its key columns)
//! ```
//!
//! Functions are resolved by name in the decoding side's registry (the task context), never from a
//! hand-kept list. Invariant: a decoded placeholder has the schema, partitioning and ordering the
//! encoded one declared, so the operators above it are rebuilt with the same assumptions.

use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::common::{DataFusionError, JoinType, Result, internal_err};
use datafusion::datasource::sink::DataSinkExec;
use datafusion::execution::TaskContext;
use datafusion::execution::object_store::{ObjectStoreRegistry, ObjectStoreUrl};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::LexOrdering;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_expr_common::physical_expr::proto_decode::PhysicalExprDecodeCtx;
use datafusion::physical_expr_common::physical_expr::proto_encode::PhysicalExprEncodeCtx;
use datafusion::physical_plan::ExecutionPlanProperties;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::{
    Boundedness, EmissionType, EvaluationType, SchedulingType,
};
use datafusion::physical_plan::joins::PiecewiseMergeJoinExec;
use datafusion::physical_plan::sorts::partitioned_topk::{PartitionedTopKExec, WindowFnKind};
use datafusion::physical_plan::{ExecutionPlan, PlanProperties};
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use datafusion_proto::physical_plan::from_proto::{
    parse_physical_expr_with_converter, parse_physical_sort_exprs, parse_protobuf_partitioning,
};
use datafusion_proto::physical_plan::to_proto::{
    serialize_partitioning, serialize_physical_expr_with_converter, serialize_physical_sort_exprs,
};
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;
use sluice_planner::{JobGraphOptions, RescaleExec, StageInputExec};

use crate::key_bloom::KeyBloomFilter;
use crate::key_bloom_expr::KeyBloomFilterExpr;
use crate::write::{FileWriteExec, SinkFormat, Staging};

#[derive(Clone, PartialEq, prost::Message)]
struct StageInputNode {
    #[prost(uint64, tag = "1")]
    input: u64,
    #[prost(message, optional, tag = "2")]
    schema: Option<protobuf::Schema>,
    #[prost(message, optional, tag = "3")]
    partitioning: Option<protobuf::Partitioning>,
    #[prost(message, repeated, tag = "4")]
    ordering: Vec<protobuf::PhysicalSortExprNode>,
    #[prost(bool, tag = "5")]
    replay: bool,
    /// The placeholder's evaluation type: 0 lazy, 1 eager.
    #[prost(uint32, tag = "6")]
    evaluation: u32,
    /// The placeholder's scheduling type: 0 non-cooperative, 1 cooperative.
    #[prost(uint32, tag = "7")]
    scheduling: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RescaleNode {
    #[prost(uint64, tag = "1")]
    partitions: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PartitionedTopKNode {
    #[prost(message, repeated, tag = "1")]
    ordering: Vec<protobuf::PhysicalSortExprNode>,
    #[prost(uint64, tag = "2")]
    partition_prefix_len: u64,
    #[prost(uint64, tag = "3")]
    fetch: u64,
    /// 0: `ROW_NUMBER`, 1: `RANK`.
    #[prost(uint32, tag = "4")]
    kind: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PiecewiseMergeJoinNode {
    /// Over the buffered (left) side's schema.
    #[prost(message, optional, tag = "1")]
    on_buffered: Option<protobuf::PhysicalExprNode>,
    /// Over the streamed (right) side's schema.
    #[prost(message, optional, tag = "2")]
    on_streamed: Option<protobuf::PhysicalExprNode>,
    /// 0: `<`, 1: `<=`, 2: `>`, 3: `>=`.
    #[prost(uint32, tag = "3")]
    operator: u32,
    /// A datafusion-proto `JoinType`.
    #[prost(int32, tag = "4")]
    join_type: i32,
    /// The partitions one instance of the join runs (its streamed side's count).
    #[prost(uint64, tag = "5")]
    partitions: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct FileWriteNode {
    /// The statement's sink (format, options, target) as datafusion-proto encodes it: a
    /// `DataSinkExec` over an empty input of the written schema.
    #[prost(bytes = "vec", tag = "1")]
    sink_plan: Vec<u8>,
    /// The staging's store URL, root path and token.
    #[prost(string, tag = "2")]
    staging_store: String,
    #[prost(string, tag = "3")]
    staging_root: String,
    #[prost(string, tag = "4")]
    staging_token: String,
}

// Nodes are built once per encode or decode; the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(message, tag = "1")]
    StageInput(StageInputNode),
    #[prost(message, tag = "2")]
    Rescale(RescaleNode),
    #[prost(message, tag = "3")]
    PartitionedTopK(PartitionedTopKNode),
    #[prost(message, tag = "4")]
    PiecewiseMergeJoin(PiecewiseMergeJoinNode),
    #[prost(message, tag = "5")]
    FileWrite(FileWriteNode),
}

#[derive(Clone, PartialEq, prost::Message)]
struct SluiceNode {
    #[prost(oneof = "Kind", tags = "1, 2, 3, 4, 5")]
    kind: Option<Kind>,
}

fn operator_to_wire(operator: Operator) -> Result<u32> {
    Ok(match operator {
        Operator::Lt => 0,
        Operator::LtEq => 1,
        Operator::Gt => 2,
        Operator::GtEq => 3,
        other => return internal_err!("PiecewiseMergeJoinExec with operator {other}"),
    })
}

fn operator_from_wire(value: u32) -> Result<Operator> {
    Ok(match value {
        0 => Operator::Lt,
        1 => Operator::LtEq,
        2 => Operator::Gt,
        3 => Operator::GtEq,
        other => return internal_err!("unknown PiecewiseMergeJoinExec operator {other}"),
    })
}

/// The first bytes of an encoded `KeyBloomFilterExpr` (its key columns are the node's inputs).
const BLOOM_EXPR_TAG: &[u8] = b"sluice.bloom1";

/// The extension codec for Sluice's plan nodes.
#[derive(Debug, Default, Clone, Copy)]
pub struct SluiceCodec;

fn to_usize(value: u64, what: &str) -> Result<usize> {
    usize::try_from(value)
        .map_err(|_| DataFusionError::Internal(format!("{what} {value} too large")))
}

impl PhysicalExtensionCodec for SluiceCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node = SluiceNode::decode(buf)
            .map_err(|e| DataFusionError::Internal(format!("malformed Sluice plan node: {e}")))?;
        match node.kind {
            Some(Kind::StageInput(read)) => {
                let schema = read.schema.as_ref().ok_or_else(|| {
                    DataFusionError::Internal("stage input without schema".into())
                })?;
                let schema = Arc::new(Schema::try_from(schema)?);
                let decode_ctx = PhysicalPlanDecodeContext::new(ctx, self);
                let partitioning = parse_protobuf_partitioning(
                    read.partitioning.as_ref(),
                    &decode_ctx,
                    &schema,
                    proto_converter,
                )?
                .ok_or_else(|| {
                    DataFusionError::Internal("stage input without partitioning".into())
                })?;
                let ordering = parse_physical_sort_exprs(
                    &read.ordering,
                    &decode_ctx,
                    &schema,
                    proto_converter,
                )?;
                let mut equivalence = EquivalenceProperties::new(schema);
                if !ordering.is_empty() {
                    equivalence.add_ordering(ordering);
                }
                let properties = PlanProperties::new(
                    equivalence,
                    partitioning,
                    EmissionType::Incremental,
                    Boundedness::Bounded,
                )
                .with_evaluation_type(match read.evaluation {
                    1 => EvaluationType::Eager,
                    _ => EvaluationType::Lazy,
                })
                .with_scheduling_type(match read.scheduling {
                    1 => SchedulingType::Cooperative,
                    _ => SchedulingType::NonCooperative,
                });
                let placeholder =
                    StageInputExec::new(to_usize(read.input, "stage input")?, Arc::new(properties))
                        .with_replay(read.replay);
                Ok(Arc::new(placeholder))
            }
            Some(Kind::Rescale(rescale)) => match inputs {
                [input] => Ok(Arc::new(RescaleExec::try_new(
                    Arc::clone(input),
                    to_usize(rescale.partitions, "partition count")?,
                )?)),
                _ => internal_err!("RescaleExec takes one input, got {}", inputs.len()),
            },
            Some(Kind::PartitionedTopK(topk)) => {
                let [input] = inputs else {
                    return internal_err!(
                        "PartitionedTopKExec takes one input, got {}",
                        inputs.len()
                    );
                };
                let decode_ctx = PhysicalPlanDecodeContext::new(ctx, self);
                let ordering = parse_physical_sort_exprs(
                    &topk.ordering,
                    &decode_ctx,
                    &input.schema(),
                    proto_converter,
                )?;
                let ordering = LexOrdering::new(ordering).ok_or_else(|| {
                    DataFusionError::Internal("PartitionedTopKExec without an ordering".into())
                })?;
                let kind = match topk.kind {
                    0 => WindowFnKind::RowNumber,
                    1 => WindowFnKind::Rank,
                    other => return internal_err!("unknown PartitionedTopKExec kind {other}"),
                };
                Ok(Arc::new(PartitionedTopKExec::try_new(
                    Arc::clone(input),
                    ordering,
                    to_usize(topk.partition_prefix_len, "partition prefix")?,
                    to_usize(topk.fetch, "fetch")?,
                    kind,
                )?))
            }
            Some(Kind::PiecewiseMergeJoin(join)) => {
                let [buffered, streamed] = inputs else {
                    return internal_err!(
                        "PiecewiseMergeJoinExec takes two inputs, got {}",
                        inputs.len()
                    );
                };
                let decode_ctx = PhysicalPlanDecodeContext::new(ctx, self);
                let expr = |node: &Option<protobuf::PhysicalExprNode>, schema: &Schema| {
                    let node = node.as_ref().ok_or_else(|| {
                        DataFusionError::Internal("PiecewiseMergeJoinExec without its keys".into())
                    })?;
                    parse_physical_expr_with_converter(node, schema, &decode_ctx, proto_converter)
                };
                let on = (
                    expr(&join.on_buffered, &buffered.schema())?,
                    expr(&join.on_streamed, &streamed.schema())?,
                );
                let join_type = protobuf::JoinType::try_from(join.join_type).map_err(|_| {
                    DataFusionError::Internal(format!("unknown join type {}", join.join_type))
                })?;
                Ok(Arc::new(PiecewiseMergeJoinExec::try_new(
                    Arc::clone(buffered),
                    Arc::clone(streamed),
                    on,
                    operator_from_wire(join.operator)?,
                    JoinType::from(join_type),
                    to_usize(join.partitions, "partition count")?,
                )?))
            }
            Some(Kind::FileWrite(write)) => {
                let [input] = inputs else {
                    return internal_err!("FileWriteExec takes one input, got {}", inputs.len());
                };
                decode_file_write(write, Arc::clone(input), ctx)
            }
            None => internal_err!("empty Sluice plan node"),
        }
    }

    fn try_decode_expr(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn PhysicalExpr>],
        _ctx: &PhysicalExprDecodeCtx<'_>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let Some(filter) = buf.strip_prefix(BLOOM_EXPR_TAG) else {
            return internal_err!("an unknown Sluice expression ({} bytes)", buf.len());
        };
        if inputs.is_empty() {
            return internal_err!("a Bloom filter expression without key columns");
        }
        Ok(Arc::new(KeyBloomFilterExpr::new(
            inputs.to_vec(),
            Arc::new(KeyBloomFilter::from_bytes(filter)?),
        )))
    }

    fn try_encode_expr(
        &self,
        node: &Arc<dyn PhysicalExpr>,
        buf: &mut Vec<u8>,
        _ctx: &PhysicalExprEncodeCtx<'_>,
    ) -> Result<()> {
        let Some(bloom) = node.downcast_ref::<KeyBloomFilterExpr>() else {
            return internal_err!("Sluice's codec cannot encode the expression {node}");
        };
        buf.extend_from_slice(BLOOM_EXPR_TAG);
        buf.extend_from_slice(&bloom.filter().to_bytes());
        Ok(())
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        let kind = if let Some(read) = node.downcast_ref::<StageInputExec<usize>>() {
            let properties = read.properties();
            let ordering = properties
                .output_ordering()
                .map(|o| serialize_physical_sort_exprs(o.iter().cloned(), self, proto_converter))
                .transpose()?
                .unwrap_or_default();
            Kind::StageInput(StageInputNode {
                input: *read.input() as u64,
                schema: Some(protobuf::Schema::try_from(
                    properties.eq_properties.schema().as_ref(),
                )?),
                partitioning: Some(serialize_partitioning(
                    &properties.partitioning,
                    self,
                    proto_converter,
                )?),
                ordering,
                replay: read.replay(),
                evaluation: match properties.evaluation_type {
                    EvaluationType::Eager => 1,
                    EvaluationType::Lazy => 0,
                },
                scheduling: match properties.scheduling_type {
                    SchedulingType::Cooperative => 1,
                    SchedulingType::NonCooperative => 0,
                },
            })
        } else if let Some(rescale) = node.downcast_ref::<RescaleExec>() {
            Kind::Rescale(RescaleNode {
                partitions: rescale.properties().partitioning.partition_count() as u64,
            })
        } else if let Some(topk) = node.downcast_ref::<PartitionedTopKExec>() {
            Kind::PartitionedTopK(PartitionedTopKNode {
                ordering: serialize_physical_sort_exprs(
                    topk.expr().iter().cloned(),
                    self,
                    proto_converter,
                )?,
                partition_prefix_len: topk.partition_prefix_len() as u64,
                fetch: topk.fetch() as u64,
                kind: match topk.fn_kind() {
                    WindowFnKind::RowNumber => 0,
                    WindowFnKind::Rank => 1,
                },
            })
        } else if let Some(join) = node.downcast_ref::<PiecewiseMergeJoinExec>() {
            let expr = |e| serialize_physical_expr_with_converter(e, self, proto_converter);
            Kind::PiecewiseMergeJoin(PiecewiseMergeJoinNode {
                on_buffered: Some(expr(&join.on.0)?),
                on_streamed: Some(expr(&join.on.1)?),
                operator: operator_to_wire(join.operator)?,
                join_type: protobuf::JoinType::from(join.join_type()) as i32,
                partitions: join.streamed().output_partitioning().partition_count() as u64,
            })
        } else if let Some(write) = node.downcast_ref::<FileWriteExec>() {
            let schema = write.children()[0].schema();
            let sink: Arc<dyn ExecutionPlan> = Arc::new(DataSinkExec::new(
                Arc::new(EmptyExec::new(schema)),
                write.format().as_data_sink(),
                None,
            ));
            let staging = write.staging();
            Kind::FileWrite(FileWriteNode {
                sink_plan: encode_stage_plan(sink)?.to_vec(),
                staging_store: staging.store.as_str().to_string(),
                staging_root: staging.root.to_string(),
                staging_token: staging.token.clone(),
            })
        } else {
            return Err(DataFusionError::NotImplemented(format!(
                "{} cannot be sent to a worker: it has no wire form",
                node.name()
            )));
        };
        SluiceNode { kind: Some(kind) }
            .encode(buf)
            .map_err(|e| DataFusionError::Internal(format!("encoding a Sluice plan node: {e}")))
    }
}

fn decode_file_write(
    write: FileWriteNode,
    input: Arc<dyn ExecutionPlan>,
    ctx: &TaskContext,
) -> Result<Arc<dyn ExecutionPlan>> {
    let sink_plan = decode_stage_plan(&write.sink_plan, ctx)?;
    let format = sink_plan
        .downcast_ref::<DataSinkExec>()
        .and_then(|sink| SinkFormat::of(sink.sink()))
        .ok_or_else(|| DataFusionError::Internal("FileWriteExec without a file sink".into()))?;
    let staging = Staging {
        store: ObjectStoreUrl::parse(&write.staging_store)?,
        root: object_store::path::Path::parse(&write.staging_root)
            .map_err(|e| DataFusionError::Internal(format!("FileWriteExec staging: {e}")))?,
        token: write.staging_token,
    };
    Ok(Arc::new(FileWriteExec::try_new(input, format, staging)?))
}

/// Encodes a stage plan for the wire.
pub fn encode_stage_plan(plan: Arc<dyn ExecutionPlan>) -> Result<bytes::Bytes> {
    physical_plan_to_bytes_with_extension_codec(plan, &SluiceCodec)
}

/// `plan`'s encoded form if it comes back from the wire as it went: it encodes, decodes (functions
/// resolving in a fresh registry, as on a worker), and the decoded plan shows the same plan and
/// schema. A stage that fails this runs on the driver (`JobGraphOptions::wire_check`); one that
/// passes ships these bytes ([`sluice_planner::Stage::wire_bytes`]).
///
/// Decoding a file scan binds its object store, which a worker builds from its own environment;
/// the check decodes with [`AnyStoreRegistry`], so that a scan of `s3://…` is judged by its wire
/// form and not by whether this process has built that store yet, while a scan of a store only the
/// driver's session has stays on the driver.
pub fn survives_wire(plan: &Arc<dyn ExecutionPlan>) -> Option<bytes::Bytes> {
    let bytes = encode_stage_plan(Arc::clone(plan)).ok()?;
    let registry = WIRE_CHECK_CONTEXT.as_ref()?;
    let decoded = decode_stage_plan(&bytes, registry).ok()?;
    let shown = |p: &Arc<dyn ExecutionPlan>| {
        datafusion::physical_plan::displayable(p.as_ref())
            .indent(true)
            .to_string()
    };
    (decoded.schema() == plan.schema() && shown(&decoded) == shown(plan)).then_some(bytes)
}

/// The context [`survives_wire`] decodes in, built once: a fresh session's functions (as on a
/// worker) and [`AnyStoreRegistry`]; `None` if its runtime cannot be built.
static WIRE_CHECK_CONTEXT: std::sync::LazyLock<Option<Arc<TaskContext>>> =
    std::sync::LazyLock::new(|| {
        let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
            .with_object_store_registry(Arc::new(AnyStoreRegistry::default()))
            .build_arc()
            .ok()?;
        let config = datafusion::prelude::SessionConfig::new();
        Some(datafusion::prelude::SessionContext::new_with_config_rt(config, runtime).task_ctx())
    });

/// An object store registry with a store for every URL a worker can build a store for itself
/// (local files, and the remote schemes it builds from its own environment): one empty in-memory
/// store, which a plan decoded only to be compared never reads. Any other scheme (a store
/// registered only in the driver's session) has none, so a scan of it stays on the driver.
#[derive(Debug, Default)]
struct AnyStoreRegistry {
    store: Arc<object_store::memory::InMemory>,
}

impl ObjectStoreRegistry for AnyStoreRegistry {
    fn register_store(
        &self,
        _url: &url::Url,
        _store: Arc<dyn object_store::ObjectStore>,
    ) -> Option<Arc<dyn object_store::ObjectStore>> {
        None
    }

    fn get_store(&self, url: &url::Url) -> Result<Arc<dyn object_store::ObjectStore>> {
        if url.scheme() == "file" || crate::object_stores::is_remote(url.as_str()) {
            Ok(Arc::clone(&self.store) as Arc<dyn object_store::ObjectStore>)
        } else {
            Err(DataFusionError::Plan(format!(
                "{url}: workers build no store for this scheme"
            )))
        }
    }
}

/// The job graph options every distributed run uses: the defaults, with [`survives_wire`] deciding
/// which stages cannot travel and run on the driver.
pub fn distributed_graph_options() -> JobGraphOptions {
    let mut rules = sluice_planner::DistributionRules::default();
    rules.register::<crate::write::FileCommitExec>();
    JobGraphOptions {
        rules,
        wire_check: Some(Arc::new(survives_wire)),
        ..JobGraphOptions::default()
    }
}

/// [`distributed_graph_options`] with every exchange in `exchange` mode.
pub fn distributed_graph_options_with(exchange: sluice_planner::OutputMode) -> JobGraphOptions {
    JobGraphOptions {
        exchange_mode: exchange,
        ..distributed_graph_options()
    }
}

/// `options` with the switches a session's settings turn: runtime filters follow
/// `datafusion.optimizer.enable_dynamic_filter_pushdown`, small jobs run as one task under
/// `sluice.single_task_bytes` (when not 0).
pub fn with_session_switches(
    options: JobGraphOptions,
    settings: &datafusion::common::config::ConfigOptions,
) -> JobGraphOptions {
    let single_task_bytes = settings
        .extensions
        .get::<crate::options::SluiceOptions>()
        .map_or(crate::options::SINGLE_TASK_BYTES, |sluice| {
            sluice.single_task_bytes
        });
    JobGraphOptions {
        runtime_filters: options.runtime_filters
            && settings.optimizer.enable_dynamic_filter_pushdown,
        single_task_bytes: (single_task_bytes > 0).then_some(single_task_bytes),
        ..options
    }
}

/// Decodes a stage plan; functions and tables resolve in `ctx`.
pub fn decode_stage_plan(bytes: &[u8], ctx: &TaskContext) -> Result<Arc<dyn ExecutionPlan>> {
    physical_plan_from_bytes_with_extension_codec(bytes, ctx, &SluiceCodec)
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::{DataType, Field};
    use datafusion::physical_plan::displayable;
    use datafusion::physical_plan::empty::EmptyExec;

    use super::*;

    fn text(plan: &Arc<dyn ExecutionPlan>) -> String {
        displayable(plan.as_ref()).indent(true).to_string()
    }

    #[test]
    fn sluice_nodes_round_trip() {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let empty: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema).with_partitions(4));
        let read: Arc<dyn ExecutionPlan> =
            Arc::new(StageInputExec::new(2usize, empty.properties().clone()).with_replay(true));
        let plan: Arc<dyn ExecutionPlan> = Arc::new(RescaleExec::try_new(read, 2).unwrap());
        let bytes = encode_stage_plan(Arc::clone(&plan)).unwrap();
        let decoded = decode_stage_plan(&bytes, &TaskContext::default()).unwrap();
        assert_eq!(text(&decoded), text(&plan));
        assert!(text(&decoded).contains("input=2, partitions=4, replay"));
    }

    /// A file write stage travels with its sink's format, options, target and staging, so its
    /// tasks run on workers.
    #[tokio::test]
    async fn a_file_write_round_trips_with_its_sink_and_staging() {
        use datafusion::prelude::SessionContext;
        let ctx = SessionContext::new();
        ctx.sql("create table t as values (1, 'a'), (2, 'b')")
            .await
            .unwrap();
        let plan = ctx
            .sql(
                "copy (select * from t) to '/tmp/never-written/out/' stored as parquet \
                 partitioned by (column2) options ('format.compression' 'zstd(3)')",
            )
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let (plan, staging) = crate::write::stage_file_writes(plan).unwrap();
        assert!(staging.is_some());
        let write = Arc::clone(plan.children()[0]);
        round_trips_with(
            write,
            "FileWriteExec: format=parquet, target=file:///tmp/never-written/out/",
        );
    }

    /// A scan of objects in a store of a scheme workers build themselves (here an in-memory one
    /// registered as `s3://lake`) travels: its tasks run on workers, which read their own byte
    /// ranges (the netns S3 test shows real workers do); one of a scheme only this session has
    /// stays on the driver.
    #[tokio::test]
    async fn a_scan_of_an_object_store_travels_to_workers_and_one_of_the_drivers_own_stays() {
        use datafusion::prelude::{SessionConfig, SessionContext};
        use sluice_planner::TaskPlacement;
        let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
        let scan = scan_stage_over(&ctx, "s3://lake", 2).await;
        assert_eq!(
            scan.placement,
            TaskPlacement::Worker,
            "{}",
            text(&scan.plan)
        );
        // A worker decodes it with the stores of its own registry, and reads the same files.
        let bytes = encode_stage_plan(Arc::clone(&scan.plan)).unwrap();
        let decoded = decode_stage_plan(&bytes, &ctx.task_ctx()).unwrap();
        assert_eq!(text(&decoded), text(&scan.plan));
        assert!(
            text(&decoded).contains("t/part-0.parquet"),
            "{}",
            text(&decoded)
        );
        // A store of a scheme no worker builds (registered in this session only) stays here.
        let scan = scan_stage_over(&ctx, "mem://pond", 1).await;
        assert_eq!(
            scan.placement,
            TaskPlacement::Driver,
            "{}",
            text(&scan.plan)
        );
    }

    /// The scan stage of a distributed count over a Parquet table of `parts` files written to an
    /// in-memory store registered in `ctx` as `store` (`scheme://bucket`).
    async fn scan_stage_over(
        ctx: &datafusion::prelude::SessionContext,
        store: &str,
        parts: usize,
    ) -> sluice_planner::Stage {
        let url = url::Url::parse(store).unwrap();
        ctx.register_object_store(&url, Arc::new(object_store::memory::InMemory::new()));
        for part in 0..parts {
            ctx.sql(&format!(
                "copy (values ({part}, 'a'), (2, 'b')) to '{store}/t/part-{part}.parquet' \
                 stored as parquet"
            ))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        }
        let table = url.scheme().to_string();
        ctx.sql(&format!(
            "create external table {table} stored as parquet location '{store}/t/'"
        ))
        .await
        .unwrap();
        let plan = ctx
            .sql(&format!("select count(*) from {table} where column1 > 0"))
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let graph =
            sluice_planner::JobGraph::try_new_with(plan, &distributed_graph_options()).unwrap();
        graph
            .stages()
            .iter()
            .find(|s| text(&s.plan).contains("DataSourceExec"))
            .unwrap()
            .clone()
    }

    /// The plan of `sql` with `setting` on, over two small tables.
    async fn plan_with(setting: &str, sql: &str) -> Arc<dyn ExecutionPlan> {
        use datafusion::prelude::{SessionConfig, SessionContext};
        let mut config = SessionConfig::new().with_target_partitions(4);
        config.options_mut().set(setting, "true").unwrap();
        let ctx = SessionContext::new_with_config(config);
        ctx.sql("create table t as values (1, 10), (2, 20), (1, 30), (3, 40)")
            .await
            .unwrap();
        ctx.sql("create table u as values (5, 'a'), (25, 'b')")
            .await
            .unwrap();
        ctx.sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap()
    }

    fn round_trips_with(plan: Arc<dyn ExecutionPlan>, node: &str) {
        let before = text(&plan);
        assert!(before.contains(node), "{before}");
        let bytes = encode_stage_plan(Arc::clone(&plan)).unwrap();
        // Functions resolve by name in the decoding side's registry, as on a worker.
        let registry = datafusion::prelude::SessionContext::new().task_ctx();
        let decoded = decode_stage_plan(&bytes, &registry).unwrap();
        assert_eq!(text(&decoded), before);
    }

    #[tokio::test]
    async fn a_window_top_n_round_trips() {
        let plan = plan_with(
            "datafusion.optimizer.enable_window_topn",
            "select * from (select column1, column2, row_number() over (partition by column1 \
             order by column2 desc) as rn from t) where rn <= 1",
        )
        .await;
        round_trips_with(plan, "PartitionedTopKExec");
    }

    /// A runtime filter's Bloom filter travels inside the plan it filters (delivered before the
    /// target starts) and drops on the worker what it dropped on the driver.
    #[tokio::test]
    async fn a_bloom_filter_predicate_round_trips_and_keeps_the_same_rows() {
        use datafusion::arrow::array::{Int64Array, RecordBatch};
        use datafusion::physical_expr::expressions::Column;
        use datafusion::physical_plan::filter::FilterExec;
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let mut filter = KeyBloomFilter::for_building();
        let build: Arc<dyn datafusion::arrow::array::Array> =
            Arc::new(Int64Array::from_iter_values((0..1000).map(|k| k * 3)));
        let mut hashes = Vec::new();
        crate::key_bloom::hash_keys(&[build], 1000, &mut hashes).unwrap();
        hashes.iter().for_each(|h| filter.insert(*h));
        let expr = KeyBloomFilterExpr::new(
            vec![Arc::new(Column::new("k", 0))],
            Arc::new(filter.finish().unwrap()),
        );
        let input: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(Arc::clone(&schema)));
        let read: Arc<dyn ExecutionPlan> =
            Arc::new(StageInputExec::new(1usize, input.properties().clone()));
        let plan: Arc<dyn ExecutionPlan> =
            Arc::new(FilterExec::try_new(Arc::new(expr), read).unwrap());
        let bytes = encode_stage_plan(Arc::clone(&plan)).unwrap();
        let decoded = decode_stage_plan(&bytes, &TaskContext::default()).unwrap();
        assert_eq!(text(&decoded), text(&plan));
        assert!(
            text(&decoded).contains("FilterExec: (k@0) IN BLOOM FILTER (8 KiB, 1000 rows)"),
            "{}",
            text(&decoded)
        );
        let predicate = decoded.downcast_ref::<FilterExec>().unwrap().predicate();
        let probe = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(0..3000))],
        )
        .unwrap();
        let keep = predicate
            .evaluate(&probe)
            .unwrap()
            .into_array(3000)
            .unwrap();
        let keep = datafusion::arrow::array::as_boolean_array(&keep);
        let kept: Vec<i64> = (0..3000).filter(|&k| keep.value(k as usize)).collect();
        assert_eq!(kept, (0..1000).map(|k| k * 3).collect::<Vec<i64>>());
    }

    #[tokio::test]
    async fn a_piecewise_merge_join_round_trips() {
        let plan = plan_with(
            "datafusion.optimizer.enable_piecewise_merge_join",
            "select t.column2, u.column2 from t join u on t.column2 < u.column1",
        )
        .await;
        round_trips_with(plan, "PiecewiseMergeJoin");
    }

    #[tokio::test]
    async fn stages_the_wire_would_change_run_on_the_driver() {
        use sluice_planner::{JobGraph, TaskPlacement};
        // datafusion-proto 55 drops the empty grouping set of the partial aggregate.
        let plan = plan_with(
            "datafusion.execution.collect_statistics",
            "select sum(column2) from t group by grouping sets (())",
        )
        .await;
        let graph = JobGraph::try_new_with(plan, &distributed_graph_options()).unwrap();
        let placements: Vec<(String, TaskPlacement)> = graph
            .stages()
            .iter()
            .map(|s| (text(&s.plan), s.placement))
            .collect();
        let partial = placements
            .iter()
            .find(|(plan, _)| plan.contains("mode=Partial"))
            .unwrap();
        assert_eq!(partial.1, TaskPlacement::Driver, "{placements:#?}");
        // Every other stage travels.
        assert!(
            placements
                .iter()
                .filter(|(plan, _)| !plan.contains("mode=Partial"))
                .all(|(_, placement)| *placement == TaskPlacement::Worker),
            "{placements:#?}"
        );
    }

    #[tokio::test]
    async fn a_worker_stage_keeps_the_bytes_its_wire_check_encoded_until_its_plan_changes() {
        use sluice_planner::{JobGraph, TaskPlacement};
        let plan = plan_with(
            "datafusion.execution.collect_statistics",
            "select column1, sum(column2) from t group by column1",
        )
        .await;
        let graph = JobGraph::try_new_with(plan, &distributed_graph_options()).unwrap();
        let workers: Vec<_> = graph
            .stages()
            .iter()
            .filter(|s| s.placement == TaskPlacement::Worker)
            .collect();
        assert_eq!(workers.len(), 2, "{:#?}", graph.stages());
        let context = datafusion::prelude::SessionContext::new().task_ctx();
        for stage in &workers {
            let bytes = stage
                .wire_bytes()
                .expect("a worker stage has its wire form");
            assert_eq!(bytes, &encode_stage_plan(Arc::clone(&stage.plan)).unwrap());
            let decoded = decode_stage_plan(bytes, &context).unwrap();
            assert_eq!(text(&decoded), text(&stage.plan));
        }
        // A stage whose plan was replaced since has no wire form: its old bytes are not its plan's.
        let mut replaced = workers[0].clone();
        replaced.plan = Arc::new(
            datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec::new(
                Arc::clone(&replaced.plan),
            ),
        );
        assert!(replaced.wire_bytes().is_none());
        // Without a wire check (the planner's own tests) no stage has one.
        let plan = plan_with(
            "datafusion.execution.collect_statistics",
            "select column1, sum(column2) from t group by column1",
        )
        .await;
        let unchecked =
            JobGraph::try_new_with(plan, &sluice_planner::JobGraphOptions::default()).unwrap();
        assert!(unchecked.stages().iter().all(|s| s.wire_bytes().is_none()));
    }

    #[test]
    fn malformed_bytes_are_errors() {
        let error = decode_stage_plan(b"\xff\x00garbage", &TaskContext::default());
        assert!(error.is_err());
    }
}
