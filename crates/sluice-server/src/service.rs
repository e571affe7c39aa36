//! [`SluiceFlightSql`]: the Flight SQL service. Each call finds its session ([`Sessions`]), plans or
//! runs through it, and maps failures with [`status_of`].
//!
//! ```text
//!  GetFlightInfo(CommandStatementQuery)        plan → file under a handle → FlightInfo{schema, ticket}
//!  DoGet(TicketStatementQuery)                 take the handle → run → FlightData while the job runs
//!  DoPut(CommandStatementUpdate)               run every statement → affected rows
//!  CreatePreparedStatement / DoPut(bind) / GetFlightInfo(CommandPreparedStatementQuery) / Close
//!  GetFlightInfo + DoGet of Catalogs, DbSchemas, Tables, TableTypes, SqlInfo, XdbcTypeInfo
//! ```
//!
//! Invariants: a query runs only when its `DoGet` is polled, and dropping the `DoGet` call drops the
//! job output stream, which cancels the job on every worker.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Schema};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::sql::metadata::{SqlInfoData, XdbcTypeInfoData};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, CommandGetCatalogs, CommandGetDbSchemas,
    CommandGetSqlInfo, CommandGetTableTypes, CommandGetTables, CommandGetXdbcTypeInfo,
    CommandPreparedStatementQuery, CommandPreparedStatementUpdate, CommandStatementQuery,
    CommandStatementUpdate, DoPutPreparedStatementResult, ProstMessageExt, SqlInfo,
    TicketStatementQuery,
};
use arrow_flight::{
    CancelFlightInfoRequest, CancelFlightInfoResult, CancelStatus, FlightDescriptor,
    FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse, IpcMessage, SchemaAsIpc,
    Ticket,
};
use base64::Engine;
use datafusion::common::ScalarValue;
use datafusion::execution::SendableRecordBatchStream;
use futures::{FutureExt, Stream, TryStreamExt, stream};
use prost::Message;
use sluice_engine::{PlannedStatement, SluiceError, SluiceSession, SluiceStatement};
use tonic::{Request, Response, Status, Streaming};

use crate::admission::into_datafusion;
use crate::cancellable::UntilCancelled;
use crate::metadata;
use crate::poll::statement_ticket;
use crate::queries::{Queries, QueryHandle, Taken};
use crate::sessions::{SessionKey, Sessions};
use crate::status::{status_of, status_of_datafusion};
use sluice_runtime::JobLabel;

type DoGetStream = <SluiceFlightSql as FlightService>::DoGetStream;

/// The action that returns [`SluiceFlightSql::state_json`].
pub const STATE_ACTION: &str = "sluice.state";

/// Flight's action that cancels the statement of a `FlightInfo`.
pub const CANCEL_FLIGHT_INFO: &str = "CancelFlightInfo";

/// The Flight SQL service of `sluice server`.
pub struct SluiceFlightSql {
    sessions: Arc<Sessions>,
    queries: Arc<Queries>,
    /// Statement updates run so far (their job tags' numbers).
    updates: std::sync::atomic::AtomicU64,
    sql_info: SqlInfoData,
    xdbc_info: XdbcTypeInfoData,
}

impl std::fmt::Debug for SluiceFlightSql {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SluiceFlightSql")
            .field("sessions", &self.sessions)
            .field("queries", &self.queries)
            .finish_non_exhaustive()
    }
}

impl SluiceFlightSql {
    /// A service over `sessions`, filing statements in `queries`.
    pub fn new(sessions: Arc<Sessions>, queries: Arc<Queries>) -> Result<Self, Status> {
        Ok(Self {
            sessions,
            queries,
            updates: std::sync::atomic::AtomicU64::new(0),
            sql_info: metadata::sql_info()?,
            xdbc_info: metadata::xdbc_type_info()?,
        })
    }

    /// The sessions it serves.
    pub(crate) fn sessions(&self) -> &Arc<Sessions> {
        &self.sessions
    }

    /// The statements it filed.
    pub(crate) fn queries(&self) -> &Arc<Queries> {
        &self.queries
    }

    /// The server's state as JSON (the `sluice.state` action): what a client or test checks to see
    /// that nothing is left running or held after its queries.
    pub async fn state_json(&self) -> Result<String, Status> {
        let cluster = self
            .sessions
            .base()
            .runner()
            .cluster_state()
            .await
            .map_err(status_of_datafusion)?;
        let (driver, workers) = match cluster {
            Some(state) => (
                serde_json::json!({
                    "jobs": state.driver.jobs,
                    "running_tasks": state.driver.running_tasks,
                    "workers": state.driver.workers.len(),
                    "waiting_regions": state.driver.waiting_regions,
                }),
                workers_json(&state),
            ),
            None => (serde_json::Value::Null, Vec::new()),
        };
        Ok(serde_json::json!({
            "mode": self.sessions.base().runner().mode_name(),
            "sessions": self.sessions.len(),
            "pending_statements": self.queries.pending_count(),
            "running_statements": self.queries.running_count(),
            "queued_statements": self.sessions.admission().queued(),
            "max_concurrent_jobs": self.sessions.admission().limit(),
            "postgres_connections": self.sessions.postgres_connections().load(Ordering::Relaxed),
            "driver": driver,
            "workers": workers,
        })
        .to_string())
    }

    /// `CancelFlightInfo`: the statement of the FlightInfo in `body` is dropped if it has not run
    /// and ended (its job cancelled on every worker) if it runs.
    fn cancel_flight_info(
        &self,
        body: &[u8],
        key: &crate::sessions::SessionKey,
    ) -> Result<Response<<Self as FlightService>::DoActionStream>, Status> {
        let request = CancelFlightInfoRequest::decode(body)
            .map_err(|e| Status::invalid_argument(format!("not a CancelFlightInfoRequest: {e}")))?;
        let info = request
            .info
            .ok_or_else(|| Status::invalid_argument("the FlightInfo to cancel has no ticket"))?;
        let handle = crate::poll::statement_of(&info)?;
        self.queries.cancel(handle, key)?;
        let result = arrow_flight::Result {
            body: CancelFlightInfoResult {
                status: CancelStatus::Cancelled as i32,
            }
            .encode_to_vec()
            .into(),
        };
        Ok(Response::new(Box::pin(stream::once(
            async move { Ok(result) },
        ))))
    }

    /// Files the statement `planned` plans; the FlightInfo's ticket fetches it.
    async fn file_statement(
        &self,
        planned: impl Future<Output = Result<PlannedStatement, SluiceError>>,
        session: Arc<SluiceSession>,
        key: crate::sessions::SessionKey,
        descriptor: FlightDescriptor,
        sql: String,
    ) -> Result<Response<FlightInfo>, Status> {
        let planned = planned.await.map_err(|e| status_of(&e))?;
        let schema = planned.schema();
        let handle = self.queries.file(key, session, planned, sql);
        let info = FlightInfo::new()
            .try_with_schema(schema.as_ref())
            .map_err(|e| Status::internal(format!("encoding the result schema: {e}")))?
            .with_endpoint(FlightEndpoint::new().with_ticket(statement_ticket(handle)))
            .with_descriptor(descriptor)
            .with_ordered(true);
        Ok(Response::new(info))
    }
}

/// Each worker of `state` as JSON (the `sluice.state` action's and the REST API's shape).
pub(crate) fn workers_json(state: &sluice_runtime::runner::ClusterState) -> Vec<serde_json::Value> {
    let driver = &state.driver;
    state
        .workers
        .iter()
        .map(|w| {
            // The driver's view of the worker (absent for the driver's own executor).
            let seen = driver.worker_at(&w.address);
            serde_json::json!({
                "address": w.address,
                "slots": seen.map(|s| s.slots),
                "busy_slots": seen.map(|s| s.busy),
                "last_heartbeat_ms_ago": seen.map(|s| s.heartbeat_age_ms),
                "running_tasks": w.running_tasks,
                "live_attempts": w.live_attempts,
                "stream_outputs": w.stream_outputs,
                "memory_used": w.memory_used,
                "memory_limit": w.memory_limit,
            })
        })
        .collect()
}

/// The tag a statement's job carries in the driver's progress.
pub(crate) fn statement_tag(handle: QueryHandle) -> String {
    format!("flight-sql {handle}")
}

impl SluiceFlightSql {
    /// The job label of a statement update (`DoPut`) of `key`'s session.
    fn update_label(&self, key: &SessionKey, sql: String) -> JobLabel {
        JobLabel {
            tag: format!(
                "flight-sql update {}",
                self.updates.fetch_add(1, Ordering::Relaxed) + 1
            ),
            sql,
            user: self.sessions.user_name(key),
        }
    }

    /// Runs a statement update as every statement runs: through admission (waiting for a slot
    /// like a `DoGet`), labelled, its result streamed and counted ([`affected_rows`]).
    async fn run_update(
        &self,
        session: Arc<SluiceSession>,
        planned: PlannedStatement,
        label: JobLabel,
    ) -> Result<i64, Status> {
        let schema = planned.schema();
        let stream = self.sessions.admission().run(schema, move || {
            session
                .run_labelled(planned, label)
                .map_err(into_datafusion)
        });
        affected_rows(stream).await
    }
}

/// The single statement `sql` holds (Flight SQL runs one statement per request).
fn one_statement(session: &SluiceSession, sql: &str) -> Result<SluiceStatement, SluiceError> {
    let mut statements = session.parse_sql(sql)?;
    match statements.len() {
        1 => Ok(statements.remove(0)),
        0 => Err(SluiceError::invalid("no SQL statement given")),
        n => Err(SluiceError::invalid(format!(
            "one statement per Flight SQL request, got {n}: send them one by one"
        ))),
    }
}

/// `stream` as Flight data, errors mapped once.
fn encode(stream: SendableRecordBatchStream) -> DoGetStream {
    let schema = stream.schema();
    let batches = stream.map_err(|e| FlightError::Tonic(Box::new(status_of_datafusion(e))));
    let data = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .build(batches)
        .map_err(Status::from);
    Box::pin(data)
}

/// One metadata batch as Flight data.
fn encode_batch(batch: RecordBatch) -> DoGetStream {
    let schema = batch.schema();
    let data = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .build(stream::once(async move { Ok(batch) }))
        .map_err(Status::from);
    Box::pin(data)
}

/// A FlightInfo whose ticket is `command` itself (metadata commands are answered statelessly).
fn metadata_info(
    command: impl ProstMessageExt,
    schema: &Schema,
    descriptor: FlightDescriptor,
) -> Result<Response<FlightInfo>, Status> {
    let info = FlightInfo::new()
        .try_with_schema(schema)
        .map_err(|e| Status::internal(format!("encoding a metadata schema: {e}")))?
        .with_endpoint(
            FlightEndpoint::new().with_ticket(Ticket::new(command.as_any().encode_to_vec())),
        )
        .with_descriptor(descriptor);
    Ok(Response::new(info))
}

/// Rows a DDL/DML statement affected: DataFusion's `count` column for `INSERT`, else 0.
/// What a statement update reports: the rows a write's `count` column says it wrote, else the
/// rows its result had (as Postgres counts a `SELECT`). The stream is read to its end one batch at
/// a time, never collected, so a large result costs no memory here.
async fn affected_rows(mut stream: SendableRecordBatchStream) -> Result<i64, Status> {
    use futures::StreamExt;
    let schema = stream.schema();
    let counted = schema.fields().len() == 1
        && schema.field(0).name() == "count"
        && schema.field(0).data_type() == &DataType::UInt64;
    let mut total: u64 = 0;
    while let Some(batch) = stream.next().await {
        let batch = batch.map_err(|e| status_of(&SluiceError::from(e)))?;
        let rows = match batch
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::UInt64Array>()
        {
            Some(counts) if counted => counts.iter().flatten().sum(),
            _ => batch.num_rows() as u64,
        };
        total = total.saturating_add(rows);
    }
    Ok(i64::try_from(total).unwrap_or(i64::MAX))
}

/// The one row of parameter values a client bound, column by column.
/// At most `limit` bytes of Flight data are read: a client that sends more gets one error, and
/// the rest of its stream is not read.
async fn bound_parameters(
    request: Request<PeekableFlightDataStream>,
    limit: usize,
) -> Result<Vec<ScalarValue>, Status> {
    let mut received = 0usize;
    let data = request
        .into_inner()
        .map_err(FlightError::from)
        .and_then(move |data| {
            received = received
                .saturating_add(data.data_header.len())
                .saturating_add(data.data_body.len());
            futures::future::ready(if received > limit {
                Err(FlightError::ProtocolError(format!(
                    "the bound parameters are larger than max_parameter_bytes ({})",
                    crate::limits::human_bytes(limit)
                )))
            } else {
                Ok(data)
            })
        });
    let batches: Vec<RecordBatch> = FlightRecordBatchStream::new_from_flight_data(data)
        .try_collect()
        .await
        .map_err(|e| match e {
            FlightError::ProtocolError(message) => Status::resource_exhausted(message),
            other => Status::invalid_argument(format!("reading the bound parameters: {other}")),
        })?;
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    let Some(batch) = batches.iter().find(|batch| batch.num_rows() > 0) else {
        return Ok(Vec::new());
    };
    if rows != 1 {
        return Err(Status::invalid_argument(format!(
            "a prepared statement binds one row of parameters, got {rows}"
        )));
    }
    batch
        .columns()
        .iter()
        .map(|column| {
            ScalarValue::try_from_array(column, 0)
                .map_err(|e| Status::invalid_argument(format!("a bound parameter: {e}")))
        })
        .collect()
}

fn ipc_schema(schema: &Schema) -> Result<prost::bytes::Bytes, Status> {
    let message: Result<IpcMessage, _> =
        SchemaAsIpc::new(schema, &IpcWriteOptions::default()).try_into();
    message
        .map(|IpcMessage(bytes)| bytes)
        .map_err(|e| Status::internal(format!("encoding a schema: {e}")))
}

/// The user name and password of `authorization: Basic base64(user:password)` (none: an anonymous
/// user with no password).
fn basic_credentials<T>(request: &Request<T>) -> Result<(String, String), Status> {
    let Some(value) = request.metadata().get("authorization") else {
        return Ok(("anonymous".to_string(), String::new()));
    };
    let text = value
        .to_str()
        .map_err(|_| Status::invalid_argument("the authorization header is not text"))?;
    let encoded = text.strip_prefix("Basic ").ok_or_else(|| {
        Status::invalid_argument("the handshake takes 'authorization: Basic base64(user:password)'")
    })?;
    // Clients differ on padding (ADBC's Go driver sends none): accept both.
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let decoded = engine
        .decode(encoded.trim())
        .map_err(|e| Status::invalid_argument(format!("basic credentials: {e}")))?;
    let text = String::from_utf8(decoded)
        .map_err(|_| Status::invalid_argument("basic credentials are not UTF-8"))?;
    let (user, password) = text.split_once(':').unwrap_or((text.as_str(), ""));
    Ok((user.to_string(), password.to_string()))
}

#[tonic::async_trait]
impl FlightSqlService for SluiceFlightSql {
    type FlightService = SluiceFlightSql;

    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<
        Response<Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>>,
        Status,
    > {
        let (user, password) = basic_credentials(&request)?;
        let address = request.remote_addr().map(|address| address.ip());
        let token = self.sessions.open_from(&user, &password, address).await?;
        let reply = HandshakeResponse {
            protocol_version: 0,
            payload: token.clone().into_bytes().into(),
        };
        let mut response: Response<Pin<Box<dyn Stream<Item = _> + Send>>> =
            Response::new(Box::pin(stream::once(async move { Ok(reply) })));
        let header = format!("Bearer {token}")
            .parse()
            .map_err(|_| Status::internal("a session token is not a header value"))?;
        response.metadata_mut().insert("authorization", header);
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let (key, session) = self.sessions.of_request(&request)?;
        let sql = query.query.clone();
        let planned = {
            let session = session.clone();
            async move {
                let statement = one_statement(&session, &query.query)?;
                session.plan(statement).await
            }
        };
        let descriptor = request.get_ref().clone();
        self.file_statement(planned, session, key, descriptor, sql)
            .await
    }

    async fn get_flight_info_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let (key, session) = self.sessions.of_request(&request)?;
        let handle = QueryHandle::from_bytes(&query.prepared_statement_handle)?;
        let prepared = self.queries.prepared(handle, &key)?;
        let sql = prepared.sql.clone();
        let planned = {
            let session = session.clone();
            async move {
                session
                    .plan_with_parameters(&prepared.sql, prepared.parameters)
                    .await
            }
        };
        let descriptor = request.get_ref().clone();
        self.file_statement(planned, session, key, descriptor, sql)
            .await
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let (key, _) = self.sessions.of_request(&request)?;
        let handle = QueryHandle::from_bytes(&ticket.statement_handle)?;
        let admission = self.sessions.admission();
        let ticket = admission.ticket();
        let (taken, running) = self.queries.take_and_start(handle, &key, ticket)?;
        let Taken {
            session,
            planned,
            sql,
        } = taken;
        let label = JobLabel {
            tag: statement_tag(handle),
            sql,
            user: self.sessions.user_name(&key),
        };
        let schema = planned.schema();
        let stream = admission.run_as(ticket, schema, move || {
            session
                .run_labelled(planned, label)
                .map_err(into_datafusion)
        });
        let ended = Status::cancelled(format!("{handle} was cancelled (CancelFlightInfo)"));
        Ok(Response::new(Box::pin(UntilCancelled::new(
            encode(stream),
            running.cancelled().boxed(),
            ended,
        ))))
    }

    async fn do_put_statement_update(
        &self,
        command: CommandStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let (key, session) = self.sessions.of_request(&request)?;
        let statement = one_statement(&session, &command.query).map_err(|e| status_of(&e))?;
        let planned = session.plan(statement).await.map_err(|e| status_of(&e))?;
        let label = self.update_label(&key, command.query);
        self.run_update(session, planned, label).await
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        request: Request<arrow_flight::Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        let (key, session) = self.sessions.of_request(&request)?;
        let (dataset, parameters) = session
            .describe(&query.query)
            .await
            .map_err(|e| status_of(&e))?;
        let handle = self.queries.prepare(key, query.query)?;
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: handle.to_bytes().into(),
            dataset_schema: ipc_schema(&dataset)?,
            parameter_schema: ipc_schema(&parameters)?,
        })
    }

    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        let (key, _) = self.sessions.of_request(&request)?;
        let handle = QueryHandle::from_bytes(&query.prepared_statement_handle)?;
        let limit = self.sessions.limits().parameter_bytes;
        let parameters = bound_parameters(request, limit).await?;
        self.queries.bind(handle, &key, parameters)?;
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(handle.to_bytes().into()),
        })
    }

    async fn do_put_prepared_statement_update(
        &self,
        query: CommandPreparedStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let (key, session) = self.sessions.of_request(&request)?;
        let handle = QueryHandle::from_bytes(&query.prepared_statement_handle)?;
        let prepared = self.queries.prepared(handle, &key)?;
        let mut parameters =
            bound_parameters(request, self.sessions.limits().parameter_bytes).await?;
        if parameters.is_empty() {
            parameters = prepared.parameters;
        }
        let planned = session
            .plan_with_parameters(&prepared.sql, parameters)
            .await
            .map_err(|e| status_of(&e))?;
        let label = self.update_label(&key, prepared.sql);
        self.run_update(session, planned, label).await
    }

    async fn do_action_close_prepared_statement(
        &self,
        query: ActionClosePreparedStatementRequest,
        request: Request<arrow_flight::Action>,
    ) -> Result<(), Status> {
        let (key, _) = self.sessions.of_request(&request)?;
        let handle = QueryHandle::from_bytes(&query.prepared_statement_handle)?;
        self.queries.close(handle, &key)
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.sessions.of_request(&request)?;
        let schema = query.into_builder().schema();
        metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let (_, session) = self.sessions.of_request(&request)?;
        let batch = metadata::catalogs(session.context(), query)?;
        Ok(Response::new(encode_batch(batch)))
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.sessions.of_request(&request)?;
        let schema = query.clone().into_builder().schema();
        metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let (_, session) = self.sessions.of_request(&request)?;
        let batch = metadata::schemas(session.context(), query)?;
        Ok(Response::new(encode_batch(batch)))
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.sessions.of_request(&request)?;
        let schema = query.clone().into_builder().schema();
        metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let (_, session) = self.sessions.of_request(&request)?;
        let batch = metadata::tables(session.context(), query).await?;
        Ok(Response::new(encode_batch(batch)))
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.sessions.of_request(&request)?;
        let schema = query.into_builder().schema();
        metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        self.sessions.of_request(&request)?;
        Ok(Response::new(encode_batch(metadata::table_types(query)?)))
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.sessions.of_request(&request)?;
        let schema = query.clone().into_builder(&self.sql_info).schema();
        metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        self.sessions.of_request(&request)?;
        let batch = query
            .into_builder(&self.sql_info)
            .build()
            .map_err(|e| Status::internal(format!("SqlInfo: {e}")))?;
        Ok(Response::new(encode_batch(batch)))
    }

    async fn get_flight_info_xdbc_type_info(
        &self,
        query: CommandGetXdbcTypeInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.sessions.of_request(&request)?;
        let schema = query.into_builder(&self.xdbc_info).schema();
        metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_xdbc_type_info(
        &self,
        query: CommandGetXdbcTypeInfo,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        self.sessions.of_request(&request)?;
        let batch = query
            .into_builder(&self.xdbc_info)
            .build()
            .map_err(|e| Status::internal(format!("XdbcTypeInfo: {e}")))?;
        Ok(Response::new(encode_batch(batch)))
    }

    async fn do_action_fallback(
        &self,
        request: Request<arrow_flight::Action>,
    ) -> Result<Response<<Self as FlightService>::DoActionStream>, Status> {
        let (key, _) = self.sessions.of_request(&request)?;
        let kind = request.get_ref().r#type.clone();
        if kind == CANCEL_FLIGHT_INFO {
            return self.cancel_flight_info(&request.get_ref().body, &key);
        }
        if kind != STATE_ACTION {
            return Err(Status::invalid_argument(format!(
                "unknown action '{kind}' (this server's own: '{STATE_ACTION}')"
            )));
        }
        let body = self.state_json().await?;
        let result = arrow_flight::Result {
            body: body.into_bytes().into(),
        };
        Ok(Response::new(Box::pin(stream::once(
            async move { Ok(result) },
        ))))
    }

    async fn list_custom_actions(&self) -> Option<Vec<Result<arrow_flight::ActionType, Status>>> {
        Some(vec![Ok(arrow_flight::ActionType {
            r#type: STATE_ACTION.to_string(),
            description: "the server's state as JSON: sessions, statements waiting for their \
                          DoGet, the driver's jobs and tasks, and per worker its running tasks, \
                          stream outputs and memory in use"
                .to_string(),
        })])
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}
