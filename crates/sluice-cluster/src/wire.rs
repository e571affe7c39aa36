//! Conversions between Sluice's runtime types and the protobuf messages of the cluster protocol:
//! input modes, output distributions (hash keys as datafusion-proto expressions), stream keys and
//! task status.
//!
//! Invariant: every decode of bytes from the network returns an error naming what was malformed;
//! nothing here panics on bad input.

use datafusion::arrow::datatypes::Schema;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::protobuf::PhysicalExprNode;
use prost::Message;
use sluice_planner::{InputMode, OutputDistribution, StageId};
use sluice_runtime::JobId;
use sluice_runtime::codec::SluiceCodec;
use sluice_runtime::scheduler::TaskStatus;

use crate::proto;

/// Converts an input mode to its protobuf enum.
pub(crate) fn input_mode_to_proto(mode: InputMode) -> proto::InputMode {
    match mode {
        InputMode::Forward => proto::InputMode::Forward,
        InputMode::Merge => proto::InputMode::Merge,
        InputMode::Shuffle => proto::InputMode::Shuffle,
        InputMode::Broadcast => proto::InputMode::Broadcast,
        InputMode::Rescale => proto::InputMode::Rescale,
    }
}

/// Reads an input mode from its protobuf enum value.
pub(crate) fn input_mode_from_proto(value: i32) -> Result<InputMode> {
    match proto::InputMode::try_from(value) {
        Ok(proto::InputMode::Forward) => Ok(InputMode::Forward),
        Ok(proto::InputMode::Merge) => Ok(InputMode::Merge),
        Ok(proto::InputMode::Shuffle) => Ok(InputMode::Shuffle),
        Ok(proto::InputMode::Broadcast) => Ok(InputMode::Broadcast),
        Ok(proto::InputMode::Rescale) => Ok(InputMode::Rescale),
        _ => Err(DataFusionError::Plan(format!(
            "task definition: unknown input mode {value}"
        ))),
    }
}

/// Encodes an output distribution; hash keys become datafusion-proto expressions.
pub(crate) fn encode_distribution(
    distribution: &OutputDistribution,
) -> Result<proto::OutputDistribution> {
    let kind = match distribution {
        OutputDistribution::Hash { keys, channels } => {
            let keys = keys
                .iter()
                .map(|key| Ok(serialize_physical_expr(key, &SluiceCodec)?.encode_to_vec()))
                .collect::<Result<Vec<_>>>()?;
            proto::output_distribution::Kind::Hash(proto::HashDistribution {
                keys,
                channels: to_u32(*channels, "channel count")?,
            })
        }
        OutputDistribution::RoundRobin { channels } => {
            proto::output_distribution::Kind::RoundRobinChannels(to_u32(
                *channels,
                "channel count",
            )?)
        }
    };
    Ok(proto::OutputDistribution { kind: Some(kind) })
}

/// Decodes an output distribution whose hash keys refer to `schema` (the stage plan's output).
pub(crate) fn decode_distribution(
    distribution: Option<&proto::OutputDistribution>,
    schema: &Schema,
    ctx: &TaskContext,
) -> Result<OutputDistribution> {
    match distribution.and_then(|d| d.kind.as_ref()) {
        Some(proto::output_distribution::Kind::Hash(hash)) => {
            let keys = hash
                .keys
                .iter()
                .map(|bytes| {
                    let node = PhysicalExprNode::decode(bytes.as_slice()).map_err(|e| {
                        DataFusionError::Plan(format!("task definition: malformed hash key: {e}"))
                    })?;
                    parse_physical_expr(&node, ctx, schema, &SluiceCodec)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(OutputDistribution::Hash {
                keys,
                channels: hash.channels as usize,
            })
        }
        Some(proto::output_distribution::Kind::RoundRobinChannels(channels)) => {
            Ok(OutputDistribution::RoundRobin {
                channels: *channels as usize,
            })
        }
        None => Err(DataFusionError::Plan(
            "task definition: no output distribution".to_string(),
        )),
    }
}

/// One stream of one task attempt, as named on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct StreamId {
    pub job: JobId,
    pub stage: StageId,
    pub partition: usize,
    pub attempt: usize,
    pub channel: usize,
    pub replica: usize,
}

impl StreamId {
    /// The task attempt that writes this stream.
    pub fn attempt_key(&self) -> AttemptKey {
        AttemptKey {
            job: self.job,
            stage: self.stage,
            partition: self.partition,
            attempt: self.attempt,
        }
    }

    pub fn to_proto(self) -> Result<proto::TaskStreamKey> {
        Ok(proto::TaskStreamKey {
            job: self.job.0,
            stage: to_u32(self.stage.0, "stage")?,
            partition: to_u32(self.partition, "partition")?,
            attempt: to_u32(self.attempt, "attempt")?,
            channel: to_u32(self.channel, "channel")?,
            replica: to_u32(self.replica, "replica")?,
        })
    }

    pub fn from_proto(key: &proto::TaskStreamKey) -> Self {
        Self {
            job: JobId(key.job),
            stage: StageId(key.stage as usize),
            partition: key.partition as usize,
            attempt: key.attempt as usize,
            channel: key.channel as usize,
            replica: key.replica as usize,
        }
    }

    /// Reads a Flight ticket (an encoded `TaskStreamKey`).
    pub fn from_ticket(bytes: &[u8]) -> Result<Self> {
        let key = proto::TaskStreamKey::decode(bytes).map_err(|e| {
            DataFusionError::Plan(format!(
                "malformed stream ticket ({} bytes): {e}",
                bytes.len()
            ))
        })?;
        Ok(Self::from_proto(&key))
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stream job {} stage {} partition {} attempt {} channel {} replica {}",
            self.job, self.stage, self.partition, self.attempt, self.channel, self.replica
        )
    }
}

/// One task attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct AttemptKey {
    pub job: JobId,
    pub stage: StageId,
    pub partition: usize,
    pub attempt: usize,
}

impl AttemptKey {
    pub fn of_definition(task: &proto::TaskDefinition) -> Self {
        Self {
            job: JobId(task.job),
            stage: StageId(task.stage as usize),
            partition: task.partition as usize,
            attempt: task.attempt as usize,
        }
    }

    pub fn to_proto(self) -> Result<proto::TaskAttemptId> {
        Ok(proto::TaskAttemptId {
            job: self.job.0,
            stage: to_u32(self.stage.0, "stage")?,
            partition: to_u32(self.partition, "partition")?,
            attempt: to_u32(self.attempt, "attempt")?,
        })
    }

    pub fn from_proto(id: &proto::TaskAttemptId) -> Self {
        Self {
            job: JobId(id.job),
            stage: StageId(id.stage as usize),
            partition: id.partition as usize,
            attempt: id.attempt as usize,
        }
    }
}

impl std::fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {} stage {} partition {} attempt {}",
            self.job, self.stage, self.partition, self.attempt
        )
    }
}

/// A status report's state and message as the scheduler's [`TaskStatus`].
pub(crate) fn status_from_report(report: &proto::TaskStatusReport) -> Result<TaskStatus> {
    match proto::TaskState::try_from(report.state) {
        Ok(proto::TaskState::Running) => Ok(TaskStatus::Running),
        Ok(proto::TaskState::Succeeded) => Ok(TaskStatus::Succeeded),
        Ok(proto::TaskState::Failed) => Ok(TaskStatus::Failed(report.error.clone())),
        Ok(proto::TaskState::Canceled) => Ok(TaskStatus::Canceled),
        _ => Err(DataFusionError::Plan(format!(
            "task status report: unknown state {}",
            report.state
        ))),
    }
}

/// A count as a protobuf `uint32`, or an error naming what overflowed.
pub(crate) fn to_u32(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| DataFusionError::Plan(format!("{what} {value} does not fit the wire format")))
}

/// An error as a gRPC status.
pub(crate) fn to_status(error: &DataFusionError) -> tonic::Status {
    tonic::Status::internal(error.to_string())
}
