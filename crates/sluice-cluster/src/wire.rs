//! Conversions between the runtime's values and the protobuf messages of the cluster protocol: ids,
//! task definitions (hash keys as datafusion-proto expressions), status reports, and errors — the one
//! place where an error's kind becomes a gRPC status code and back.
//!
//! ```text
//!   TaskDefinition ⇄ proto::TaskDefinition      TaskStatusReport ⇄ proto::TaskStatusReport
//!   RemoteError    ⇄ proto::TaskError ⇄ tonic::Status {code by kind, details = TaskError}
//! ```
//!
//! Invariant: every decode of bytes from the network returns an error naming what was malformed;
//! nothing here panics on bad input.

use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::protobuf::PhysicalExprNode;
use prost::Message;
use sluice_planner::{
    AttemptKey, InputMode, JobId, OutputDistribution, OutputMode, StageId, StreamId, TaskStreamKey,
    WorkerId,
};
use sluice_runtime::analyze::TaskMetrics;
use sluice_runtime::codec::SluiceCodec;
use sluice_runtime::error::{ErrorKind, RemoteError};
use sluice_runtime::{
    LiveRuntimeFilter, RuntimeFilterUpdate, StagePlan, StreamLocator, TaskDefinition,
    TaskInputStreams, TaskState, TaskStatusReport,
};
use tonic::Code;

use crate::proto;

fn input_mode_to_proto(mode: InputMode) -> proto::InputMode {
    match mode {
        InputMode::Forward => proto::InputMode::Forward,
        InputMode::Merge => proto::InputMode::Merge,
        InputMode::Shuffle => proto::InputMode::Shuffle,
        InputMode::Broadcast => proto::InputMode::Broadcast,
        InputMode::Rescale => proto::InputMode::Rescale,
    }
}

fn input_mode_from_proto(value: i32) -> Result<InputMode> {
    match proto::InputMode::try_from(value) {
        Ok(proto::InputMode::Forward) => Ok(InputMode::Forward),
        Ok(proto::InputMode::Merge) => Ok(InputMode::Merge),
        Ok(proto::InputMode::Shuffle) => Ok(InputMode::Shuffle),
        Ok(proto::InputMode::Broadcast) => Ok(InputMode::Broadcast),
        Ok(proto::InputMode::Rescale) => Ok(InputMode::Rescale),
        _ => Err(malformed(format!("unknown input mode {value}"))),
    }
}

fn malformed(what: impl Into<String>) -> DataFusionError {
    DataFusionError::Plan(format!("malformed cluster message: {}", what.into()))
}

/// This build's version (Sluice's and DataFusion's), as a worker names it when it registers: the
/// driver accepts only its own, since plans travel in this version's datafusion-proto encoding and a
/// task's settings as the ones that differ from its DataFusion defaults. (Builds of one version from
/// different commits are not told apart.)
pub fn build() -> String {
    format!(
        "sluice {} (DataFusion {})",
        env!("CARGO_PKG_VERSION"),
        datafusion::DATAFUSION_VERSION
    )
}

/// A count as a protobuf `uint32`, or an error naming what overflowed.
pub(crate) fn to_u32(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| DataFusionError::Plan(format!("{what} {value} does not fit the wire format")))
}

fn encode_distribution(distribution: &OutputDistribution) -> Result<proto::OutputDistribution> {
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

/// An output distribution whose hash keys refer to `schema` (the stage plan's output).
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
                    let node = PhysicalExprNode::decode(bytes.as_slice())
                        .map_err(|e| malformed(format!("hash key: {e}")))?;
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
        None => Err(malformed("no output distribution")),
    }
}

pub(crate) fn stream_to_proto(id: StreamId) -> Result<proto::TaskStreamKey> {
    let key = id.stream;
    Ok(proto::TaskStreamKey {
        job: key.job.0,
        stage: to_u32(key.stage.0, "stage")?,
        partition: to_u32(key.partition, "partition")?,
        attempt: to_u32(key.attempt, "attempt")?,
        channel: to_u32(key.channel, "channel")?,
        replica: to_u32(id.replica, "replica")?,
    })
}

pub(crate) fn stream_from_proto(key: &proto::TaskStreamKey) -> StreamId {
    TaskStreamKey {
        job: JobId(key.job),
        stage: StageId(key.stage as usize),
        partition: key.partition as usize,
        attempt: key.attempt as usize,
        channel: key.channel as usize,
    }
    .replica(key.replica as usize)
}

/// Reads a Flight ticket (an encoded `TaskStreamKey`).
pub(crate) fn stream_from_ticket(bytes: &[u8]) -> Result<StreamId> {
    let key = proto::TaskStreamKey::decode(bytes)
        .map_err(|e| malformed(format!("stream ticket ({} bytes): {e}", bytes.len())))?;
    Ok(stream_from_proto(&key))
}

pub(crate) fn attempt_to_proto(key: AttemptKey) -> Result<proto::TaskAttemptId> {
    Ok(proto::TaskAttemptId {
        job: key.job.0,
        stage: to_u32(key.stage.0, "stage")?,
        partition: to_u32(key.partition, "partition")?,
        attempt: to_u32(key.attempt, "attempt")?,
    })
}

pub(crate) fn attempt_from_proto(id: &proto::TaskAttemptId) -> AttemptKey {
    AttemptKey {
        job: JobId(id.job),
        stage: StageId(id.stage as usize),
        partition: id.partition as usize,
        attempt: id.attempt as usize,
    }
}

/// A task definition as bytes for `RunTask`. Only worker stages travel: an in-memory plan (a
/// driver stage) never leaves the driver.
pub(crate) fn encode_definition(definition: &TaskDefinition) -> Result<Vec<u8>> {
    let StagePlan::Encoded(plan) = &definition.plan else {
        return Err(DataFusionError::Internal(format!(
            "{}: only an encoded stage plan can be sent to a worker, not {:?}",
            definition.attempt, definition.plan
        )));
    };
    let key = definition.attempt;
    let inputs = definition
        .inputs
        .iter()
        .map(|input| {
            let partitions = input
                .partitions
                .iter()
                .map(|streams| {
                    let streams = streams
                        .iter()
                        .map(|locator| {
                            Ok(proto::StreamLocator {
                                address: locator.address.clone(),
                                key: Some(stream_to_proto(locator.stream)?),
                            })
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok(proto::InputPartition { streams })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(proto::TaskInput {
                stage: to_u32(input.stage.0, "stage")?,
                mode: input_mode_to_proto(input.mode) as i32,
                partitions,
                first_partition: to_u32(input.first, "first partition")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let message = proto::TaskDefinition {
        job: key.job.0,
        stage: to_u32(key.stage.0, "stage")?,
        partition: to_u32(key.partition, "partition")?,
        attempt: to_u32(key.attempt, "attempt")?,
        plan: plan.to_vec(),
        inputs,
        output: Some(encode_distribution(&definition.output)?),
        replicas: to_u32(definition.replicas, "replicas")?,
        blocking: definition.output_mode == OutputMode::Blocking,
        config: definition.config.as_ref().clone(),
        memory_limit: definition.memory_limit,
        report_plan_metrics: definition.report_plan_metrics,
        summarise_columns: definition
            .summarise_columns
            .iter()
            .map(|c| to_u32(*c, "summarised column"))
            .collect::<Result<Vec<_>>>()?,
        announce_running: definition.announce_running,
        runtime_filters: definition
            .runtime_filters
            .iter()
            .map(|f| {
                Ok(proto::LiveRuntimeFilter {
                    filter: to_u32(f.filter, "runtime filter")?,
                    path: to_u32s(&f.path, "runtime filter path")?,
                    columns: to_u32s(&f.columns, "runtime filter column")?,
                    summary: f.summary.as_ref().map(|b| b.to_vec()),
                    wait: f.wait,
                })
            })
            .collect::<Result<Vec<_>>>()?,
    };
    Ok(message.encode_to_vec())
}

/// A `RunTask` request's bytes as a task definition, its hash keys decoded against the stage plan's
/// schema in `ctx` (the worker's function registry).
pub(crate) fn decode_definition(bytes: &[u8], ctx: &TaskContext) -> Result<TaskDefinition> {
    let message = proto::TaskDefinition::decode(bytes)
        .map_err(|e| malformed(format!("task definition ({} bytes): {e}", bytes.len())))?;
    let attempt = AttemptKey {
        job: JobId(message.job),
        stage: StageId(message.stage as usize),
        partition: message.partition as usize,
        attempt: message.attempt as usize,
    };
    if message.plan.is_empty() {
        return Err(malformed(format!(
            "the task definition of {attempt} has no plan"
        )));
    }
    // The hash keys refer to the stage plan's output schema: decode the plan here, once (functions
    // resolve in the worker's registry; the attempt gets its own context when it starts).
    let plan = sluice_runtime::codec::decode_stage_plan(&message.plan, ctx)
        .map_err(|e| e.context(format!("decoding the plan of {attempt}")))?;
    let output = decode_distribution(message.output.as_ref(), &plan.schema(), ctx)?;
    let inputs = message
        .inputs
        .iter()
        .map(|input| {
            let partitions = input
                .partitions
                .iter()
                .map(|partition| {
                    partition
                        .streams
                        .iter()
                        .map(|locator| {
                            let key = locator.key.as_ref().ok_or_else(|| {
                                malformed(format!("a locator of {attempt} has no stream key"))
                            })?;
                            Ok(StreamLocator {
                                address: locator.address.clone(),
                                stream: stream_from_proto(key),
                            })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(TaskInputStreams {
                stage: StageId(input.stage as usize),
                mode: input_mode_from_proto(input.mode)?,
                partitions,
                first: input.first_partition as usize,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TaskDefinition {
        attempt,
        plan: StagePlan::Decoded(plan),
        inputs,
        output,
        replicas: (message.replicas as usize).max(1),
        output_mode: if message.blocking {
            OutputMode::Blocking
        } else {
            OutputMode::Pipelined
        },
        config: Arc::new(message.config),
        memory_limit: message.memory_limit,
        report_plan_metrics: message.report_plan_metrics,
        summarise_columns: message
            .summarise_columns
            .iter()
            .map(|c| *c as usize)
            .collect(),
        runtime_filters: message
            .runtime_filters
            .into_iter()
            .map(|f| LiveRuntimeFilter {
                filter: f.filter as usize,
                path: f.path.iter().map(|i| *i as usize).collect(),
                columns: f.columns.iter().map(|c| *c as usize).collect(),
                summary: f.summary.map(bytes::Bytes::from),
                wait: f.wait,
            })
            .collect(),
        announce_running: message.announce_running,
    })
}

fn to_u32s(values: &[usize], what: &str) -> Result<Vec<u32>> {
    values.iter().map(|v| to_u32(*v, what)).collect()
}

/// A runtime filter update as an `ApplyRuntimeFilter` request.
pub(crate) fn encode_filter_update(
    update: &RuntimeFilterUpdate,
) -> Result<proto::ApplyRuntimeFilterRequest> {
    Ok(proto::ApplyRuntimeFilterRequest {
        job: update.job.0,
        stage: to_u32(update.stage.0, "stage")?,
        filter: to_u32(update.filter, "runtime filter")?,
        summary: update.summary.to_vec(),
    })
}

/// An `ApplyRuntimeFilter` request as a runtime filter update.
pub(crate) fn decode_filter_update(
    message: proto::ApplyRuntimeFilterRequest,
) -> RuntimeFilterUpdate {
    RuntimeFilterUpdate {
        job: JobId(message.job),
        stage: StageId(message.stage as usize),
        filter: message.filter as usize,
        summary: bytes::Bytes::from(message.summary),
    }
}

pub(crate) fn error_to_proto(error: &RemoteError) -> proto::TaskError {
    proto::TaskError {
        kind: error.kind.name().to_string(),
        contexts: error.contexts.clone(),
        root: error.root.clone(),
        message: error.message.clone(),
        peer: error.peer.clone().unwrap_or_default(),
    }
}

pub(crate) fn error_from_proto(error: &proto::TaskError) -> RemoteError {
    RemoteError {
        kind: ErrorKind::from_name(&error.kind),
        contexts: error.contexts.clone(),
        root: error.root.clone(),
        message: error.message.clone(),
        peer: (!error.peer.is_empty()).then(|| error.peer.clone()),
    }
}

fn metrics_to_proto(m: &TaskMetrics) -> proto::TaskMetrics {
    proto::TaskMetrics {
        output_rows: m.rows,
        output_batches: m.batches,
        output_bytes: m.shuffled_bytes,
        input_rows: m.input_rows,
        input_batches: m.input_batches,
        read_local_bytes: m.read_local_bytes,
        read_remote_bytes: m.read_remote_bytes,
        scanned_rows: m.scanned_rows,
        scanned_bytes: m.scanned_bytes,
        elapsed_ms: m.elapsed_ms,
        compute_ms: m.compute_ms,
        spill_count: m.spill_count,
        spilled_bytes: m.spilled_bytes,
        peak_memory_bytes: m.peak_memory_bytes,
        plan: m.plan.clone(),
        fetch_retries: m.fetch_retries,
        fetch_retried: m.fetch_retried.clone(),
        key_summary: m.key_summary.clone(),
        channel_rows: m.channel_rows.clone(),
    }
}

fn metrics_from_proto(m: &proto::TaskMetrics) -> TaskMetrics {
    TaskMetrics {
        rows: m.output_rows,
        batches: m.output_batches,
        shuffled_bytes: m.output_bytes,
        input_rows: m.input_rows,
        input_batches: m.input_batches,
        read_local_bytes: m.read_local_bytes,
        read_remote_bytes: m.read_remote_bytes,
        scanned_rows: m.scanned_rows,
        scanned_bytes: m.scanned_bytes,
        elapsed_ms: m.elapsed_ms,
        compute_ms: m.compute_ms,
        spill_count: m.spill_count,
        spilled_bytes: m.spilled_bytes,
        peak_memory_bytes: m.peak_memory_bytes,
        plan: m.plan.clone(),
        fetch_retries: m.fetch_retries,
        fetch_retried: m.fetch_retried.clone(),
        key_summary: m.key_summary.clone(),
        channel_rows: m.channel_rows.clone(),
    }
}

pub(crate) fn report_to_proto(report: &TaskStatusReport) -> Result<proto::TaskStatusReport> {
    let key = report.attempt;
    let mut message = proto::TaskStatusReport {
        worker_id: report.worker.0,
        job: key.job.0,
        stage: to_u32(key.stage.0, "stage")?,
        partition: to_u32(key.partition, "partition")?,
        attempt: to_u32(key.attempt, "attempt")?,
        sequence: report.sequence,
        state: proto::TaskState::Running as i32,
        error: None,
        metrics: None,
        // Set by the reporter: the driver instance it registered with.
        driver_epoch: 0,
    };
    match &report.state {
        TaskState::Running => {}
        TaskState::Succeeded(metrics) => {
            message.state = proto::TaskState::Succeeded as i32;
            message.metrics = Some(metrics_to_proto(metrics));
        }
        TaskState::Failed(error) => {
            message.state = proto::TaskState::Failed as i32;
            message.error = Some(error_to_proto(error));
        }
        TaskState::Canceled => message.state = proto::TaskState::Canceled as i32,
    }
    Ok(message)
}

pub(crate) fn report_from_proto(report: &proto::TaskStatusReport) -> Result<TaskStatusReport> {
    let state = match proto::TaskState::try_from(report.state) {
        Ok(proto::TaskState::Running) => TaskState::Running,
        Ok(proto::TaskState::Succeeded) => match &report.metrics {
            Some(metrics) => TaskState::Succeeded(metrics_from_proto(metrics)),
            None => {
                return Err(malformed(
                    "task status report: a succeeded report without its metrics".to_string(),
                ));
            }
        },
        Ok(proto::TaskState::Failed) => TaskState::Failed(match &report.error {
            Some(error) => error_from_proto(error),
            None => RemoteError::new(ErrorKind::Internal, "the task failed without an error"),
        }),
        Ok(proto::TaskState::Canceled) => TaskState::Canceled,
        _ => {
            return Err(malformed(format!(
                "task status report: unknown state {}",
                report.state
            )));
        }
    };
    Ok(TaskStatusReport {
        worker: WorkerId(report.worker_id),
        attempt: AttemptKey {
            job: JobId(report.job),
            stage: StageId(report.stage as usize),
            partition: report.partition as usize,
            attempt: report.attempt as usize,
        },
        sequence: report.sequence,
        state,
    })
}

/// The gRPC code of an error kind. The only place kinds meet codes.
fn code_of(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::User => Code::InvalidArgument,
        ErrorKind::ResourcesExhausted => Code::ResourceExhausted,
        ErrorKind::Cancelled => Code::Cancelled,
        ErrorKind::Transport => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
    }
}

/// The kind a status code means when a status carries no error details (it came from tonic
/// itself, or from a peer that is not a Sluice worker).
fn kind_of(code: Code) -> ErrorKind {
    match code {
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => ErrorKind::User,
        Code::ResourceExhausted => ErrorKind::ResourcesExhausted,
        Code::Cancelled => ErrorKind::Cancelled,
        Code::Internal | Code::Unimplemented | Code::DataLoss => ErrorKind::Internal,
        _ => ErrorKind::Transport,
    }
}

/// An error as a gRPC status: the code by its kind, the error itself in the details.
pub(crate) fn to_status(error: &DataFusionError) -> tonic::Status {
    remote_to_status(&RemoteError::of(error))
}

/// A wire error as a gRPC status.
pub(crate) fn remote_to_status(error: &RemoteError) -> tonic::Status {
    let details = error_to_proto(error).encode_to_vec();
    tonic::Status::with_details(code_of(error.kind), error.to_string(), details.into())
}

/// The error a status stands for, with `what` (the call, the peer) around anything that did not
/// come from a Sluice error on the other side.
pub(crate) fn from_status(status: &tonic::Status, what: &str) -> RemoteError {
    match proto::TaskError::decode(status.details()) {
        Ok(error) if !error.root.is_empty() => error_from_proto(&error),
        _ => RemoteError::new(
            kind_of(status.code()),
            format!("{what}: {}", status.message()),
        ),
    }
}

/// Whether the peer answered a call with `status` (it handled the call and said no), rather than
/// the connection failing (the peer vanished, the stream was cut, the call timed out). A status
/// carrying a Sluice error in its details is always an answer, whatever its code; without details,
/// `Unavailable`, `DeadlineExceeded`, `Cancelled` (hyper's word for a connection reset mid-stream)
/// and `Unknown` are no answer, and neither is a status this side made from a failure of the
/// connection (it holds that error as its source: an HTTP/2 error such as a frame cut short by a
/// killed peer becomes `Internal`), since a peer's answer arrives as a status with no source.
pub(crate) fn peer_answered(status: &tonic::Status) -> bool {
    let carries_error =
        proto::TaskError::decode(status.details()).is_ok_and(|e| !e.root.is_empty());
    let made_here = std::error::Error::source(status).is_some();
    carries_error
        || !(made_here
            || matches!(
                status.code(),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
            ))
}

/// [`from_status`] for a call to the worker at `peer`: a call it did not answer (see
/// [`peer_answered`]) is a transport error naming `peer` as unreachable, evidence for the driver
/// that it is gone.
pub(crate) fn from_status_at(status: &tonic::Status, what: &str, peer: &str) -> RemoteError {
    if peer_answered(status) {
        return from_status(status, what);
    }
    let mut error = RemoteError::new(
        ErrorKind::Transport,
        format!("{what}: {}", status.message()),
    );
    error.peer = Some(peer.to_string());
    error
}

#[cfg(test)]
pub(crate) mod tests {
    use datafusion::arrow::datatypes::{DataType, Field};
    use datafusion::physical_plan::ExecutionPlan;
    use datafusion::physical_plan::empty::EmptyExec;
    use datafusion::physical_plan::expressions::col;
    use sluice_planner::TaskAttempt;
    use sluice_runtime::codec::encode_stage_plan;

    use super::*;

    /// A task definition with every field set (its hash keys over a one-column plan).
    pub(crate) fn sample_definition() -> TaskDefinition {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let plan: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema.clone()));
        let key = AttemptKey {
            job: JobId(7),
            stage: StageId(1),
            partition: 2,
            attempt: 1,
        };
        let producer = TaskAttempt {
            task: sluice_planner::TaskId {
                stage: StageId(0),
                partition: 3,
            },
            attempt: 2,
        };
        TaskDefinition {
            attempt: key,
            plan: StagePlan::Encoded(encode_stage_plan(plan).unwrap()),
            inputs: vec![TaskInputStreams {
                stage: StageId(0),
                mode: InputMode::Shuffle,
                partitions: vec![vec![StreamLocator {
                    address: "127.0.0.1:1".into(),
                    stream: producer.of_job(JobId(7)).stream(2).replica(0),
                }]],
                first: 2,
            }],
            output: OutputDistribution::Hash {
                keys: vec![col("k", &schema).unwrap()],
                channels: 4,
            },
            replicas: 3,
            output_mode: OutputMode::Blocking,
            config: Arc::new([("a".to_string(), "b".to_string())].into()),
            memory_limit: Some(1 << 30),
            report_plan_metrics: true,
            summarise_columns: vec![1, 0],
            runtime_filters: vec![
                LiveRuntimeFilter {
                    filter: 2,
                    path: vec![0, 1],
                    columns: vec![3],
                    summary: None,
                    wait: true,
                },
                LiveRuntimeFilter {
                    filter: 0,
                    path: Vec::new(),
                    columns: vec![0, 1],
                    summary: Some(bytes::Bytes::from_static(b"summary")),
                    wait: false,
                },
            ],
            announce_running: true,
        }
    }

    #[test]
    fn a_definition_round_trips() {
        let definition = sample_definition();
        let key = definition.attempt;
        let bytes = encode_definition(&definition).unwrap();
        let back = decode_definition(&bytes, &TaskContext::default()).unwrap();
        assert_eq!(back.attempt, key);
        assert_eq!(back.inputs, definition.inputs);
        assert_eq!(back.output.channels(), 4);
        assert_eq!(back.output.key_names(), ["k@0"]);
        assert_eq!(back.replicas, 3);
        assert_eq!(back.output_mode, OutputMode::Blocking);
        assert_eq!(back.config, definition.config);
        assert_eq!(back.memory_limit, Some(1 << 30));
        assert!(back.report_plan_metrics);
        assert_eq!(back.summarise_columns, [1, 0]);
        assert_eq!(back.runtime_filters, definition.runtime_filters);
        assert!(back.announce_running);
    }

    #[test]
    fn a_runtime_filter_update_round_trips() {
        let update = RuntimeFilterUpdate {
            job: JobId(9),
            stage: StageId(4),
            filter: 3,
            summary: bytes::Bytes::from_static(b"keys"),
        };
        let request = encode_filter_update(&update).unwrap();
        let bytes = request.encode_to_vec();
        let back = proto::ApplyRuntimeFilterRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(decode_filter_update(back), update);
    }

    #[test]
    fn garbage_is_an_error_naming_what_was_malformed() {
        let error = decode_definition(b"\xff\xff\xff", &TaskContext::default()).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("malformed cluster message: task definition (3 bytes)"),
            "{error}"
        );
        let error = stream_from_ticket(b"\x0a\xff").unwrap_err();
        assert!(error.to_string().contains("stream ticket"), "{error}");
    }

    #[test]
    fn errors_keep_kind_and_text_through_a_status() {
        let divide = DataFusionError::ArrowError(
            Box::new(datafusion::arrow::error::ArrowError::DivideByZero),
            None,
        );
        let status = to_status(&divide);
        assert_eq!(status.code(), Code::InvalidArgument);
        let back = from_status(&status, "reading x");
        assert_eq!(back.kind, ErrorKind::User);
        assert_eq!(
            back.to_error().to_string(),
            "Arrow error: Divide by zero error"
        );
        // A status from tonic itself (no details): the code decides the kind.
        let refused = tonic::Status::unavailable("connection refused");
        let back = from_status(&refused, "reading x from 127.0.0.1:9");
        assert_eq!(back.kind, ErrorKind::Transport);
        assert_eq!(
            back.message,
            "reading x from 127.0.0.1:9: connection refused"
        );
    }

    #[test]
    fn a_stream_cut_by_a_vanished_peer_is_evidence_against_it_but_its_own_answer_is_not() {
        // Hyper reports a connection reset in the middle of a DoGet as `Cancelled`, no details.
        let cut = tonic::Status::cancelled("operation was canceled");
        let back = from_status_at(&cut, "reading s from 127.0.0.1:9", "127.0.0.1:9");
        assert_eq!(back.kind, ErrorKind::Transport);
        assert_eq!(back.peer.as_deref(), Some("127.0.0.1:9"));
        assert_eq!(
            back.message,
            "reading s from 127.0.0.1:9: operation was canceled"
        );
        // The peer answered with a Sluice error (its task was cancelled): no evidence it is gone.
        let answered = to_status(&sluice_runtime::error::sluice_error(
            ErrorKind::Cancelled,
            "job 1 cancelled",
        ));
        let back = from_status_at(&answered, "reading s", "127.0.0.1:9");
        assert_eq!(back.kind, ErrorKind::Cancelled);
        assert_eq!(back.peer, None);
        // A plain refusal without details (not a connection failure) names no peer either.
        let refused = tonic::Status::invalid_argument("bad ticket");
        let back = from_status_at(&refused, "reading s", "127.0.0.1:9");
        assert_eq!((back.kind, back.peer), (ErrorKind::User, None));
    }

    #[test]
    fn a_refusal_with_a_sluice_error_is_an_answer_whatever_its_code() {
        // A draining worker refuses RunTask with a transport error: retryable elsewhere, and an
        // answer (the worker is alive), not evidence that it is gone.
        let draining = remote_to_status(&RemoteError::new(
            ErrorKind::Transport,
            "sluice worker (pid 7) is draining and takes no new task",
        ));
        assert_eq!(draining.code(), Code::Unavailable);
        assert!(peer_answered(&draining));
        let back = from_status(&draining, "starting a task");
        assert_eq!(back.kind, ErrorKind::Transport);
        assert!(!peer_answered(&tonic::Status::unavailable(
            "connection refused"
        )));
        assert!(peer_answered(&tonic::Status::invalid_argument("bad task")));
    }

    #[test]
    fn a_status_made_here_from_a_broken_connection_is_no_answer_whatever_its_code() {
        // What tonic makes of an HTTP/2 error on this side (a peer killed mid-frame): `Internal`,
        // with the connection's error as its source.
        let mut cut =
            tonic::Status::internal("h2 protocol error: error reading a body from connection");
        cut.set_source(Arc::new(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "frame cut short",
        )));
        assert!(!peer_answered(&cut));
        let error = from_status_at(&cut, "reading s from w", "127.0.0.1:1");
        assert_eq!(
            (error.kind, error.peer.as_deref()),
            (ErrorKind::Transport, Some("127.0.0.1:1"))
        );
        // The same code sent by the peer, with no source, is its answer.
        assert!(peer_answered(&tonic::Status::internal(
            "h2 protocol error: error reading a body from connection"
        )));
    }

    #[test]
    fn reports_round_trip() {
        let report = TaskStatusReport {
            worker: WorkerId(2),
            attempt: AttemptKey {
                job: JobId(1),
                stage: StageId(0),
                partition: 0,
                attempt: 0,
            },
            sequence: 2,
            state: TaskState::Failed(RemoteError::new(ErrorKind::Transport, "gone")),
        };
        let back = report_from_proto(&report_to_proto(&report).unwrap()).unwrap();
        assert_eq!(back, report);
        let mut bad = report_to_proto(&report).unwrap();
        bad.state = 99;
        assert!(report_from_proto(&bad).is_err());
    }

    #[test]
    fn every_task_metric_survives_the_wire() {
        // Distinct values, so a field mapped to the wrong field or dropped shows.
        let metrics = TaskMetrics {
            rows: 1,
            batches: 2,
            shuffled_bytes: 3,
            input_rows: 4,
            input_batches: 5,
            read_local_bytes: 6,
            read_remote_bytes: 7,
            scanned_rows: 8,
            scanned_bytes: 15,
            elapsed_ms: 9,
            compute_ms: 10,
            spill_count: 11,
            spilled_bytes: 12,
            peak_memory_bytes: 13,
            plan: "ShuffleWriterExec".into(),
            fetch_retries: 14,
            fetch_retried: "reading stream … from 10.0.0.2:1: tcp connect error".into(),
            key_summary: vec![16, 17],
            channel_rows: vec![18, 0, 19],
        };
        let report = TaskStatusReport {
            worker: WorkerId(1),
            attempt: AttemptKey {
                job: JobId(3),
                stage: StageId(1),
                partition: 2,
                attempt: 1,
            },
            sequence: 2,
            state: TaskState::Succeeded(metrics.clone()),
        };
        let back = report_from_proto(&report_to_proto(&report).unwrap()).unwrap();
        assert_eq!(back.state, TaskState::Succeeded(metrics));
        let mut bare = report_to_proto(&report).unwrap();
        bare.metrics = None;
        let error = report_from_proto(&bare).unwrap_err().to_string();
        assert!(
            error.contains("a succeeded report without its metrics"),
            "{error}"
        );
    }
}
