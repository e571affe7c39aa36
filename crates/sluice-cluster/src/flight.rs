//! The data plane: Arrow Flight between workers, and from workers to the driver's job output.
//!
//! ```text
//!   reader (consumer task or job output)            worker holding the stream
//!     DoGet(ticket = TaskStreamKey) ───────────────► store.take(stream) (waits for the task)
//!     ◄── FlightData (Arrow IPC; lz4/zstd optional) ── the stream's receiver
//!     ◄── FlightData(app_metadata = end marker)   ── only after the writer finished its output
//!     ◄── or a status: code by error kind, the error in its details
//! ```
//!
//! Invariants: batches arrive with exactly the types they were written with (`flight_ipc`: nested
//! types and dictionaries unchanged); a malformed or unknown ticket gets an error reply and the server keeps serving; a
//! failed read reaches the reader with its kind (so a consumer's retry decision sees a transport
//! failure as one); when a reader drops its stream, the server drops the receiver, so the producer
//! stops waiting for it; messages have no size limit (a batch may exceed gRPC's 4 MiB default); a
//! stream ends with [`STREAM_END`], which the server sends only after the stream's writer finished
//! it, and a reader whose call ends without it (a connection cut, a worker gone mid-stream) gets a
//! retryable error naming the stream, never a clean end.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use datafusion::arrow::array::{ArrayRef, AsArray, GenericByteViewArray, RecordBatch};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::datatypes::ByteViewType;
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::ipc::CompressionType;
use datafusion::arrow::ipc::writer::IpcWriteOptions;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{Stream, StreamExt, TryStreamExt, stream};
use prost::Message;
use sluice_planner::StreamId;
use sluice_runtime::StreamStore;
use sluice_runtime::error::ErrorKind;
use sluice_runtime::faults::{FaultPoint, FaultPoints};
use sluice_runtime::transport::{FetchRetries, StreamFetcher};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{ClusterLink, SecretChannel, connect_lazy};
use crate::flight_ipc::encode_stream;
use crate::flight_pool::ConnectionPool;
use crate::wire::{from_status_at, peer_answered, stream_from_ticket, stream_to_proto, to_status};

/// The `app_metadata` of the message that ends every task stream (it carries no data).
pub(crate) const STREAM_END: &[u8] = b"sluice:stream-end";

type BoxedStream<T> = Pin<Box<dyn Stream<Item = std::result::Result<T, Status>> + Send + 'static>>;

/// A worker's Flight service over its stream store.
pub(crate) struct StreamFlightService {
    store: Arc<StreamStore>,
    compression: Option<CompressionType>,
}

impl StreamFlightService {
    pub fn new(
        store: Arc<StreamStore>,
        compression: Option<CompressionType>,
    ) -> FlightServiceServer<Self> {
        FlightServiceServer::new(Self { store, compression })
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX)
    }
}

fn unsupported<T>(what: &str) -> std::result::Result<T, Status> {
    Err(Status::unimplemented(format!(
        "Sluice workers serve only DoGet of task streams, not {what}"
    )))
}

#[tonic::async_trait]
impl FlightService for StreamFlightService {
    type HandshakeStream = BoxedStream<HandshakeResponse>;
    type ListFlightsStream = BoxedStream<FlightInfo>;
    type DoGetStream = BoxedStream<FlightData>;
    type DoPutStream = BoxedStream<PutResult>;
    type DoExchangeStream = BoxedStream<FlightData>;
    type DoActionStream = BoxedStream<arrow_flight::Result>;
    type ListActionsStream = BoxedStream<ActionType>;

    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> std::result::Result<Response<Self::HandshakeStream>, Status> {
        unsupported("Handshake")
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> std::result::Result<Response<Self::ListFlightsStream>, Status> {
        unsupported("ListFlights")
    }

    async fn get_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        unsupported("GetFlightInfo")
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<PollInfo>, Status> {
        unsupported("PollFlightInfo")
    }

    async fn get_schema(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<SchemaResult>, Status> {
        unsupported("GetSchema")
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> std::result::Result<Response<Self::DoGetStream>, Status> {
        let id = stream_from_ticket(&request.into_inner().ticket).map_err(|e| to_status(&e))?;
        let (schema, receiver) = self.store.take(id).await.map_err(|e| to_status(&e))?;
        let batches = sluice_runtime::receiver_stream(schema.clone(), receiver)
            .and_then(|batch| futures::future::ready(compact_views(batch)));
        let options = IpcWriteOptions::default()
            .try_with_compression(self.compression)
            .map_err(|e| Status::internal(e.to_string()))?;
        let end = FlightData {
            app_metadata: STREAM_END.to_vec().into(),
            ..FlightData::default()
        };
        let data = encode_stream(schema, batches, options)
            .map_err(|e| to_status(&e))
            .chain(stream::once(async move { Ok(end) }));
        Ok(Response::new(Box::pin(data)))
    }

    async fn do_put(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoPutStream>, Status> {
        unsupported("DoPut")
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoExchangeStream>, Status> {
        unsupported("DoExchange")
    }

    async fn do_action(
        &self,
        _request: Request<Action>,
    ) -> std::result::Result<Response<Self::DoActionStream>, Status> {
        unsupported("DoAction")
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> std::result::Result<Response<Self::ListActionsStream>, Status> {
        Ok(Response::new(Box::pin(stream::empty())))
    }
}

/// Serves `store` over Flight on a free loopback port, as a worker does (the cluster secret checked,
/// `compression` applied): the address to read it at, and the server, which stops when dropped.
/// For tests and benchmarks of the data path; a worker serves its store beside its control service.
pub async fn serve_on_loopback(
    store: Arc<StreamStore>,
    link: &ClusterLink,
    compression: Option<CompressionType>,
) -> Result<(String, SpawnedTask<()>)> {
    let (listener, address) = crate::net::bind("a stream store", "127.0.0.1:0").await?;
    let flight = crate::auth::guarded(StreamFlightService::new(store, compression), link)?;
    let server = link
        .server()?
        .add_service(flight)
        .serve_with_incoming(crate::net::incoming(listener));
    let serving = SpawnedTask::spawn(async move {
        if let Err(error) = server.await {
            tracing::warn!(target: "sluice::flight", "a loopback stream server stopped: {error}");
        }
    });
    Ok((address, serving))
}

/// A batch whose string and binary view columns no longer point into buffers much larger than the
/// bytes they use. A view array made by `take` (a join's output, a shuffle's gather) shares its
/// source's whole data buffers; Arrow IPC writes every buffer an array references, so without this a
/// few thousand joined rows would carry the entire build side over the wire with every batch.
fn compact_views(batch: RecordBatch) -> Result<RecordBatch> {
    let mut changed = false;
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|column| {
            let compacted = match column.data_type() {
                DataType::Utf8View => compact(column.as_string_view()),
                DataType::BinaryView => compact(column.as_binary_view()),
                _ => None,
            };
            changed |= compacted.is_some();
            compacted.unwrap_or_else(|| Arc::clone(column))
        })
        .collect();
    if !changed {
        return Ok(batch);
    }
    Ok(RecordBatch::try_new(batch.schema(), columns)?)
}

/// `array` garbage-collected, if its data buffers hold more than twice the bytes its views use.
fn compact<T: ByteViewType + ?Sized>(array: &GenericByteViewArray<T>) -> Option<ArrayRef> {
    let held: usize = array.data_buffers().iter().map(Buffer::len).sum();
    (held > 2 * array.total_buffer_bytes_used() + 4096).then(|| Arc::new(array.gc()) as ArrayRef)
}

/// Reads streams from other workers over Flight, carrying the cluster secret; one call per
/// connection at a time, connections reused from call to call (`flight_pool`).
#[derive(Debug, Clone)]
pub struct FlightFetcher {
    link: ClusterLink,
    /// The reading worker's fault points (`flight_fetch` fires before each read).
    faults: Option<Arc<FaultPoints>>,
    pool: Arc<ConnectionPool>,
}

impl FlightFetcher {
    pub fn new(link: ClusterLink) -> Self {
        Self::with_faults(link, None)
    }

    /// A fetcher of a worker whose fault points are `faults`.
    pub fn with_faults(link: ClusterLink, faults: Option<Arc<FaultPoints>>) -> Self {
        Self {
            link,
            faults,
            pool: Arc::default(),
        }
    }
}

impl StreamFetcher for FlightFetcher {
    fn fetch(&self, address: &str, id: StreamId, schema: SchemaRef) -> SendableRecordBatchStream {
        self.fetch_counted(address, id, schema, Arc::default())
    }

    fn fetch_counted(
        &self,
        address: &str,
        id: StreamId,
        schema: SchemaRef,
        retries: Arc<FetchRetries>,
    ) -> SendableRecordBatchStream {
        let address = address.to_string();
        let link = self.link.clone();
        let faults = self.faults.clone();
        let pool = Arc::clone(&self.pool);
        let read = async move {
            if let Some(faults) = faults {
                faults.fire(FaultPoint::FlightFetch).await?;
            }
            let what = format!("reading {id} from {address}");
            let (response, channel) =
                do_get_patiently(&link, &pool, &address, id, &what, &retries).await?;
            let reuse = Reuse {
                pool,
                address: address.clone(),
                channel,
            };
            let data = until_end_marker(response, what.clone(), Some(reuse))
                .map_err(|status| FlightError::Tonic(Box::new(status)));
            let batches =
                FlightRecordBatchStream::new_from_flight_data(data).map_err(move |e| match e {
                    FlightError::Tonic(status) => read_error(&status, &what, &address),
                    other => sluice_runtime::error::transport_error(format!("{what}: {other}")),
                });
            Ok::<_, DataFusionError>(batches)
        };
        Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream::once(read).try_flatten(),
        ))
    }
}

/// How long a read keeps trying to reach the worker holding its stream (a network partition
/// between two workers that both still reach the driver heals within it unnoticed); then it fails
/// naming the worker, and the driver decides whether that worker is lost.
pub(crate) const FETCH_RETRY_WINDOW: Duration = Duration::from_secs(10);

/// The first pause before a read is made again; it doubles up to [`FETCH_RETRY_PAUSE_MAX`].
const FETCH_RETRY_PAUSE: Duration = Duration::from_millis(100);
const FETCH_RETRY_PAUSE_MAX: Duration = Duration::from_secs(2);

/// Opens the `DoGet` call of stream `id` at `address`, making it again (with backoff, within
/// [`FETCH_RETRY_WINDOW`]) while the call fails before the worker answered it: no connection, or
/// no answer. A call the worker answered, with a stream or an error, is never made twice. A call
/// whose connection broke after it reached the worker may have taken its stream: the worker gives
/// the stream back when it sees the connection die before the stream delivered anything (its own
/// pings), and the store lets the next take wait for that; a stream that did deliver into the dead
/// connection fails the call made again as a second take, which fails the read (naming the worker
/// as unreachable), never a read of part of the stream. Each retry is logged and counted in
/// `retries`. The first call may go over an idle connection of `pool`; if that one gets no answer
/// (its worker went away since), the call is made at once over a new connection, uncounted.
/// Returns the call's response and the connection it went over.
async fn do_get_patiently(
    link: &ClusterLink,
    pool: &ConnectionPool,
    address: &str,
    id: StreamId,
    what: &str,
    retries: &FetchRetries,
) -> Result<(Streaming<FlightData>, SecretChannel)> {
    let ticket = Ticket {
        ticket: stream_to_proto(id)?.encode_to_vec().into(),
    };
    let started = tokio::time::Instant::now();
    let mut pause = FETCH_RETRY_PAUSE;
    let mut tries = 0_u32;
    let mut pooled = true;
    // A call over an idle connection got no answer (it may have reached the worker).
    let mut unanswered = false;
    loop {
        // One call per connection at a time: a stream its reader has not reached yet (a join's
        // probe side) holds HTTP/2 flow-control window, so sharing a connection would throttle
        // the streams the reader needs first.
        let (channel, reused) = if pooled {
            pool.take(address, link)?
        } else {
            (connect_lazy(address, link)?, false)
        };
        pooled = false;
        let mut client = FlightServiceClient::new(channel.clone())
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        let status = match client.do_get(ticket.clone()).await {
            Ok(response) => return Ok((response.into_inner(), channel)),
            Err(status) => status,
        };
        let answered = peer_answered(&status);
        if !answered {
            // Its worker may be gone: no idle connection there is worth a try.
            pool.forget(address);
            if reused {
                tracing::info!(
                    target: "sluice::fetch",
                    stream = %id,
                    peer = address,
                    "{what}: an idle connection got no answer ({}); calling again over a new one",
                    status.message()
                );
                unanswered = true;
                continue;
            }
        }
        let waited = started.elapsed();
        if answered || waited + pause > FETCH_RETRY_WINDOW {
            let mut error = from_status_at(&status, what, address);
            if tries > 0 && !answered {
                error.message = format!(
                    "{} (tried for {:.1} s)",
                    error.message,
                    waited.as_secs_f64()
                );
            } else if (tries > 0 || unanswered) && error.kind == ErrorKind::Transport {
                // An earlier call that got no answer may have reached the worker and taken the
                // stream before its connection died: the failure is the connection's, so the
                // driver judges the worker as for a read that never reached it.
                let calls = tries + u32::from(unanswered);
                error.message = format!(
                    "{} (after {calls} call(s) that got no answer within {:.1} s: the first may \
                     have reached it and its answer been cut off)",
                    error.message,
                    waited.as_secs_f64()
                );
                error.peer = Some(address.to_string());
            }
            return Err(error.to_error());
        }
        let failure = format!("{what}: {}", status.message());
        tracing::warn!(
            target: "sluice::fetch",
            stream = %id,
            peer = address,
            "{failure}; trying again in {} ms",
            pause.as_millis()
        );
        retries.record(failure);
        tries += 1;
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(FETCH_RETRY_PAUSE_MAX);
    }
}

/// The messages of a `DoGet` call up to its end marker (not passed on); a call that ends without
/// one ends in an error saying the stream was cut (`what` names the stream and its worker), which
/// counts as no answer from the worker, as a connection reset does.
fn until_end_marker<S>(
    messages: S,
    what: String,
    reuse: Option<Reuse>,
) -> impl Stream<Item = std::result::Result<FlightData, Status>> + Send + 'static
where
    S: Stream<Item = std::result::Result<FlightData, Status>> + Send + Unpin + 'static,
{
    stream::unfold(Some((messages, reuse)), move |state| {
        let what = what.clone();
        async move {
            let (mut messages, reuse) = state?;
            let failure = match messages.next().await {
                Some(Ok(message)) if message.app_metadata.as_ref() == STREAM_END => {
                    // The end: nothing may follow it.
                    match messages.next().await {
                        None if message.data_header.is_empty() => {
                            // The call ended cleanly: its connection may carry the next one.
                            if let Some(reuse) = reuse {
                                reuse.pool.give_back(&reuse.address, reuse.channel);
                            }
                            return None;
                        }
                        Some(Err(status)) => status,
                        _ => Status::internal(format!(
                            "{what}: a malformed end marker, or messages after it"
                        )),
                    }
                }
                Some(Ok(message)) => return Some((Ok(message), Some((messages, reuse)))),
                Some(Err(status)) => status,
                None => Status::unavailable(format!(
                    "{what}: the stream ended before its end marker (the connection or its \
                     worker went away mid-stream)"
                )),
            };
            Some((Err(failure), None))
        }
    })
}

/// The connection a read went over, given back to its pool when the read ends cleanly.
struct Reuse {
    pool: Arc<ConnectionPool>,
    address: String,
    channel: SecretChannel,
}

fn read_error(status: &Status, what: &str, address: &str) -> DataFusionError {
    from_status_at(status, what, address).to_error()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use datafusion::arrow::array::{Int32Array, StringViewArray};
    use datafusion::arrow::compute::take;
    use datafusion::arrow::datatypes::{Field, Schema};

    use super::*;
    use crate::auth::ClusterSecret;

    /// Encodes `batch` as the Flight service does and decodes it as the fetcher does.
    async fn through_flight(batch: RecordBatch) -> Vec<RecordBatch> {
        let schema = batch.schema();
        let data = encode_stream(
            schema,
            futures::stream::iter([Ok(batch.clone()), Ok(batch)]),
            IpcWriteOptions::default(),
        )
        .map_err(|e| FlightError::ExternalError(Box::new(e)));
        FlightRecordBatchStream::new_from_flight_data(data)
            .try_collect()
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn lists_and_dictionaries_keep_their_types_and_values_over_flight() {
        use datafusion::arrow::array::{DictionaryArray, LargeListArray};
        use datafusion::arrow::datatypes::{Int32Type, Int64Type};
        let list = LargeListArray::from_iter_primitive::<Int64Type, _, _>(vec![Some(vec![
            Some(1),
            Some(2),
            Some(3),
        ])]);
        let dict: DictionaryArray<Int32Type> = vec!["a", "b", "a"].into_iter().collect();
        let batch = RecordBatch::try_from_iter(vec![("l", Arc::new(list) as ArrayRef)]).unwrap();
        assert_eq!(through_flight(batch.clone()).await, [batch.clone(), batch]);
        let batch = RecordBatch::try_from_iter(vec![("d", Arc::new(dict) as ArrayRef)]).unwrap();
        assert_eq!(through_flight(batch.clone()).await, [batch.clone(), batch]);
    }

    /// What a reader gets of `messages` through the end-marker check: data messages, then
    /// `Ok(())` for a clean end or the error's code and message.
    async fn through_end_check(
        messages: Vec<std::result::Result<FlightData, Status>>,
    ) -> (usize, std::result::Result<(), (tonic::Code, String)>) {
        let mut checked = Box::pin(until_end_marker(
            stream::iter(messages),
            "reading s from w".to_string(),
            None,
        ));
        let mut data = 0;
        while let Some(message) = checked.next().await {
            match message {
                Ok(_) => data += 1,
                Err(status) => {
                    assert!(checked.next().await.is_none(), "an error ends the stream");
                    return (data, Err((status.code(), status.message().to_string())));
                }
            }
        }
        (data, Ok(()))
    }

    #[tokio::test]
    async fn a_stream_ends_cleanly_only_with_its_end_marker() {
        let end = || FlightData {
            app_metadata: STREAM_END.to_vec().into(),
            ..FlightData::default()
        };
        let data = || FlightData {
            data_header: vec![1, 2, 3].into(),
            ..FlightData::default()
        };
        assert_eq!(
            through_end_check(vec![Ok(data()), Ok(data()), Ok(end())]).await,
            (2, Ok(()))
        );
        // Cut mid-stream: no marker. Unavailable counts as no answer from the worker.
        let (read, cut) = through_end_check(vec![Ok(data())]).await;
        assert_eq!(read, 1);
        assert_eq!(
            cut,
            Err((
                tonic::Code::Unavailable,
                "reading s from w: the stream ended before its end marker (the connection or \
                 its worker went away mid-stream)"
                    .to_string()
            ))
        );
        assert!(!crate::wire::peer_answered(&Status::unavailable("x")));
        // An error from the worker stays that error.
        let (_, failed) =
            through_end_check(vec![Ok(data()), Err(Status::internal("producer failed"))]).await;
        assert_eq!(
            failed,
            Err((tonic::Code::Internal, "producer failed".to_string()))
        );
        // Nothing may follow the marker.
        let (_, after) = through_end_check(vec![Ok(end()), Ok(data())]).await;
        assert_eq!(
            after,
            Err((
                tonic::Code::Internal,
                "reading s from w: a malformed end marker, or messages after it".to_string()
            ))
        );
    }

    #[test]
    fn view_columns_taken_from_a_large_array_are_compacted_before_the_wire() {
        let names: Vec<String> = (0..1000)
            .map(|i| format!("customer name number {i:08}"))
            .collect();
        let source = StringViewArray::from_iter_values(names.iter());
        let taken = take(&source, &Int32Array::from(vec![3, 997]), None).unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new(
            "n",
            DataType::Utf8View,
            false,
        )]));
        let batch = RecordBatch::try_new(schema, vec![taken]).unwrap();
        let held = |b: &RecordBatch| -> usize {
            b.column(0)
                .as_string_view()
                .data_buffers()
                .iter()
                .map(Buffer::len)
                .sum()
        };
        assert!(held(&batch) > 20_000);
        let compact = compact_views(batch.clone()).unwrap();
        assert!(held(&compact) < 100, "{}", held(&compact));
        assert_eq!(compact, batch);
    }

    /// A stream store served over Flight on loopback: the store, its address, the server.
    async fn serve_store(link: &ClusterLink) -> (Arc<StreamStore>, String, SpawnedTask<()>) {
        let store = Arc::new(StreamStore::new(
            "worker 1",
            Arc::new(datafusion::execution::runtime_env::RuntimeEnv::default()),
            Duration::from_secs(5),
        ));
        let (address, serving) = serve_on_loopback(Arc::clone(&store), link, None)
            .await
            .unwrap();
        (store, address, serving)
    }

    /// Attempt 0 of task 0/`partition` of job 1.
    fn attempt_key(partition: usize) -> sluice_planner::AttemptKey {
        sluice_planner::AttemptKey {
            job: sluice_planner::JobId(1),
            stage: sluice_planner::StageId(0),
            partition,
            attempt: 0,
        }
    }

    /// A batch larger than gRPC's default message limit (4 MiB) and than a frame
    /// ([`MAX_FRAME_SIZE`](crate::net::MAX_FRAME_SIZE)) crosses in several frames and arrives
    /// whole, after a small one, over one connection.
    #[tokio::test]
    async fn a_batch_larger_than_a_frame_and_than_grpcs_message_limit_arrives_whole() {
        use datafusion::arrow::array::Int64Array;
        use sluice_planner::OutputMode;

        let link = ClusterLink::new(ClusterSecret::random().unwrap(), None);
        let (store, address, _serving) = serve_store(&link).await;
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let batch = |rows: i64| {
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(0..rows))],
            )
            .unwrap()
        };
        // 6.4 MB of values: 7 frames of at most 1 MiB each.
        let (large, small) = (batch(800_000), batch(3));
        assert!(large.get_array_memory_size() > 6 * (crate::net::MAX_FRAME_SIZE as usize));
        let sender = store
            .create_output(attempt_key(0), 1, 1, OutputMode::Pipelined, schema.clone())
            .unwrap();
        let written = [small.clone(), large.clone(), small.clone()];
        let writing = async {
            for batch in written.clone() {
                assert!(sender.send(0, batch).await.unwrap());
            }
            sender.finish();
        };
        let reading = FlightFetcher::new(link.clone())
            .fetch(
                &address,
                attempt_key(0).stream(0).replica(0),
                schema.clone(),
            )
            .try_collect::<Vec<_>>();
        let ((), read) = tokio::join!(writing, reading);
        assert_eq!(read.unwrap(), written);
    }

    #[tokio::test]
    async fn a_read_that_ended_cleanly_leaves_its_connection_for_the_next_and_a_dropped_one_does_not()
     {
        use sluice_planner::OutputMode;

        let link = ClusterLink::new(ClusterSecret::random().unwrap(), None);
        let (store, address, _serving) = serve_store(&link).await;
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int32, false)]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int32Array::from(vec![1, 2, 3]))],
        )
        .unwrap();
        let fetcher = FlightFetcher::new(link.clone());
        for partition in 0..3 {
            let sender = store
                .create_output(
                    attempt_key(partition),
                    1,
                    1,
                    OutputMode::Pipelined,
                    schema.clone(),
                )
                .unwrap();
            assert!(sender.send(0, batch.clone()).await.unwrap());
            sender.finish();
        }
        // Two reads in turn: the second goes over the first's connection.
        for partition in 0..2 {
            let id = attempt_key(partition).stream(0).replica(0);
            let read: Vec<RecordBatch> = fetcher
                .fetch(&address, id, schema.clone())
                .try_collect()
                .await
                .unwrap();
            assert_eq!(read, std::slice::from_ref(&batch));
            assert_eq!(fetcher.pool.idle(&address), 1);
        }
        // A read dropped after its first batch (before the end marker) takes its connection
        // with it.
        let id = attempt_key(2).stream(0).replica(0);
        let mut read = fetcher.fetch(&address, id, schema.clone());
        assert_eq!(read.next().await.unwrap().unwrap(), batch);
        assert_eq!(fetcher.pool.idle(&address), 0);
        drop(read);
        assert_eq!(fetcher.pool.idle(&address), 0);
    }

    #[tokio::test]
    async fn a_stream_whose_first_reader_went_away_before_a_batch_is_read_whole_by_the_next() {
        use sluice_planner::OutputMode;

        let link = ClusterLink::new(ClusterSecret::random().unwrap(), None);
        let (store, address, _serving) = serve_store(&link).await;
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int32, false)]));
        let key = attempt_key(0);
        let sender = store
            .create_output(key, 1, 1, OutputMode::Pipelined, schema.clone())
            .unwrap();
        let id = key.stream(0).replica(0);
        // The first call reaches the worker, which takes the stream; its reader goes away before
        // a batch was written (as when its connection dies).
        let pool = ConnectionPool::default();
        let first = do_get_patiently(
            &link,
            &pool,
            &address,
            id,
            "first",
            &FetchRetries::default(),
        )
        .await
        .unwrap();
        assert_eq!(store.counts().untaken_streams, 0);
        drop(first);
        // The worker sees the call go and gives the stream back; the next read gets all of it.
        let given_back = async {
            while store.counts().untaken_streams == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), given_back)
            .await
            .unwrap();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int32Array::from(vec![1, 2, 3]))],
        )
        .unwrap();
        let reading = FlightFetcher::new(link.clone())
            .fetch(&address, id, schema)
            .try_collect::<Vec<_>>();
        let writing = async {
            assert!(sender.send(0, batch.clone()).await.unwrap());
            sender.finish();
        };
        let (read, ()) = tokio::join!(reading, writing);
        assert_eq!(read.unwrap(), [batch]);
    }

    /// A port nothing listens on (bound, then released).
    fn closed_port() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        drop(listener);
        address
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_that_reaches_no_worker_is_made_again_with_backoff_within_its_window() {
        let link = ClusterLink::new(ClusterSecret::random().unwrap(), None);
        let address = closed_port();
        let id = sluice_planner::TaskStreamKey {
            job: sluice_planner::JobId(1),
            stage: sluice_planner::StageId(0),
            partition: 0,
            attempt: 0,
            channel: 0,
        }
        .replica(0);
        let retries = FetchRetries::default();
        let what = format!("reading {id} from {address}");
        let error = do_get_patiently(
            &link,
            &ConnectionPool::default(),
            &address,
            id,
            &what,
            &retries,
        )
        .await
        .unwrap_err();
        // Pauses of 0.1, 0.2, 0.4, 0.8, 1.6, 2, 2 and 2 s (paused time): a ninth would end past
        // the 10 s window, so the read fails after 8 retries, 9.1 s in.
        assert_eq!(retries.count(), 8);
        assert!(
            retries.last().unwrap().starts_with(&what),
            "{:?}",
            retries.last()
        );
        let failure = sluice_runtime::RemoteError::of(&error);
        assert_eq!(failure.kind, sluice_runtime::ErrorKind::Transport);
        assert_eq!(failure.peer.as_deref(), Some(address.as_str()));
        assert!(failure.message.starts_with(&what), "{}", failure.message);
        assert!(
            failure.message.ends_with("(tried for 9.1 s)"),
            "{}",
            failure.message
        );
    }
}
