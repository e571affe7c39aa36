//! Stage plans on the wire: datafusion-proto for DataFusion's nodes plus a `PhysicalExtensionCodec`
//! for Sluice's own (`StageInputExec<usize>`, `RescaleExec`).
//!
//! ```text
//!   stage plan ──encode_stage_plan (once per stage)──► bytes ──decode_stage_plan (per task)──► plan
//!   StageInputExec<usize>  ⇄  SluiceNode::StageInput { input, schema, partitioning, ordering, replay }
//!   RescaleExec            ⇄  SluiceNode::Rescale { partitions }   (its input: a child plan)
//! ```
//!
//! Functions are resolved by name in the decoding side's registry (the task context), never from a
//! hand-kept list. Invariant: a decoded placeholder has the schema, partitioning and ordering the
//! encoded one declared, so the operators above it are rebuilt with the same assumptions.

use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::{ExecutionPlan, PlanProperties};
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use datafusion_proto::physical_plan::from_proto::{
    parse_physical_sort_exprs, parse_protobuf_partitioning,
};
use datafusion_proto::physical_plan::to_proto::{
    serialize_partitioning, serialize_physical_sort_exprs,
};
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;
use sluice_planner::{RescaleExec, StageInputExec};

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
}

#[derive(Clone, PartialEq, prost::Message)]
struct RescaleNode {
    #[prost(uint64, tag = "1")]
    partitions: u64,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(message, tag = "1")]
    StageInput(StageInputNode),
    #[prost(message, tag = "2")]
    Rescale(RescaleNode),
}

#[derive(Clone, PartialEq, prost::Message)]
struct SluiceNode {
    #[prost(oneof = "Kind", tags = "1, 2")]
    kind: Option<Kind>,
}

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
                );
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
            None => internal_err!("empty Sluice plan node"),
        }
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
            })
        } else if let Some(rescale) = node.downcast_ref::<RescaleExec>() {
            Kind::Rescale(RescaleNode {
                partitions: rescale.properties().partitioning.partition_count() as u64,
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

/// Encodes a stage plan for the wire.
pub fn encode_stage_plan(plan: Arc<dyn ExecutionPlan>) -> Result<bytes::Bytes> {
    physical_plan_to_bytes_with_extension_codec(plan, &SluiceCodec)
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

    #[test]
    fn malformed_bytes_are_errors() {
        let error = decode_stage_plan(b"\xff\x00garbage", &TaskContext::default());
        assert!(error.is_err());
    }
}
