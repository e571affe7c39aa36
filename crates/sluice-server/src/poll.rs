//! `PollFlightInfo`: a statement's progress for clients that ask while it runs (the remote CLI's
//! progress line, ADBC's incremental execution). arrow-flight's Flight SQL server answers
//! `PollFlightInfo` with "not implemented" and cannot be told otherwise, so [`SluiceFlightService`]
//! is the gRPC service: it hands every call to the Flight SQL service and answers polls itself.
//!
//! ```text
//!  PollFlightInfo(statement cmd) ─► plan + file it (as GetFlightInfo) ─► PollInfo { info, descriptor: poll-cmd, 0.0 }
//!  DoGet(info's ticket) ──────────► the job runs, streaming rows (the poll never starts it)
//!  PollFlightInfo(poll-cmd) ──────► PollInfo { info + app_metadata (JSON), descriptor, tasks done / total }
//!                          … until the result stream ended ─► PollInfo { info, no descriptor, 1.0 }
//! ```
//!
//! The JSON in `info.app_metadata`: `state` is `planned` (no `DoGet` yet), `queued` (with
//! `queue_position`, 1 = next), `running` (with `tasks_done`, `tasks_total`, `tasks_running`,
//! `retries` and the CLI's `line` once the driver lists the job) or `finished`.
//!
//! Invariants: the poll descriptor carries the statement's FlightInfo (so the server keeps nothing
//! per poll) and is honoured only for the session that planned the statement; results are fetched
//! only through the ticket, which starts the job: a client that polls without fetching sees
//! `planned` until the statement expires.

use std::pin::Pin;

use arrow_flight::flight_service_server::FlightService;
use arrow_flight::sql::{Command, ProstMessageExt, TicketStatementQuery};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::Stream;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use crate::queries::{Phase, QueryHandle};
use crate::service::{SluiceFlightSql, statement_tag};

/// The prefix of a poll descriptor's command; the statement's encoded FlightInfo follows.
const POLL_PREFIX: &[u8] = b"sluice-poll:";

/// The gRPC service of the Flight SQL endpoint: Flight SQL plus `PollFlightInfo`.
#[derive(Debug)]
pub struct SluiceFlightService {
    sql: SluiceFlightSql,
}

impl SluiceFlightService {
    /// Serves `sql`, answering polls too.
    pub fn new(sql: SluiceFlightSql) -> Self {
        Self { sql }
    }

    async fn poll(&self, request: Request<FlightDescriptor>) -> Result<PollInfo, Status> {
        let (key, _) = self.sql.sessions().of_request(&request)?;
        let info = match request.get_ref().cmd.strip_prefix(POLL_PREFIX) {
            Some(encoded) => FlightInfo::decode(encoded)
                .map_err(|e| Status::invalid_argument(format!("not a poll descriptor: {e}")))?,
            None => FlightService::get_flight_info(&self.sql, request)
                .await?
                .into_inner(),
        };
        let Ok(handle) = statement_of(&info) else {
            // Metadata: its FlightInfo is complete at once.
            return Ok(PollInfo {
                info: Some(info),
                flight_descriptor: None,
                progress: Some(1.0),
                expiration_time: None,
            });
        };
        let phase = self.sql.queries().phase(handle, &key)?;
        let report = self.report(handle, phase).await;
        let descriptor = (!report.finished).then(|| {
            let mut cmd = POLL_PREFIX.to_vec();
            cmd.extend(info.encode_to_vec());
            FlightDescriptor::new_cmd(cmd)
        });
        Ok(PollInfo {
            info: Some(info.with_app_metadata(report.json.to_string())),
            flight_descriptor: descriptor,
            progress: report.progress,
            expiration_time: None,
        })
    }

    async fn report(&self, handle: QueryHandle, phase: Phase) -> Report {
        match phase {
            Phase::Planned => Report::new(serde_json::json!({"state": "planned"}), Some(0.0)),
            Phase::Finished => Report {
                finished: true,
                ..Report::new(serde_json::json!({"state": "finished"}), Some(1.0))
            },
            Phase::Running { ticket, runner } => {
                if let Some(position) = self.sql.sessions().admission().position(ticket) {
                    let json = serde_json::json!({"state": "queued", "queue_position": position});
                    return Report::new(json, Some(0.0));
                }
                let tag = statement_tag(handle);
                let job = match runner.driver() {
                    Some(driver) => driver.progress().await.ok().and_then(|jobs| {
                        jobs.into_iter()
                            .find(|job| job.label.as_ref().is_some_and(|label| label.tag == tag))
                    }),
                    None => None,
                };
                let Some(job) = job else {
                    return Report::new(serde_json::json!({"state": "running"}), None);
                };
                let total: usize = job.stages.iter().map(|s| s.total).sum();
                let done: usize = job.stages.iter().map(|s| s.done).sum();
                let running: usize = job.stages.iter().map(|s| s.running).sum();
                let json = serde_json::json!({
                    "state": "running",
                    "job": job.job,
                    "tasks_done": done,
                    "tasks_total": total,
                    "tasks_running": running,
                    "retries": job.retries,
                    "line": job.line(),
                });
                let progress = (total > 0).then(|| done as f64 / total as f64);
                Report::new(json, progress)
            }
        }
    }
}

/// What one poll says about a statement.
struct Report {
    json: serde_json::Value,
    progress: Option<f64>,
    finished: bool,
}

impl Report {
    fn new(json: serde_json::Value, progress: Option<f64>) -> Self {
        Self {
            json,
            progress,
            finished: false,
        }
    }
}

/// The statement `info`'s ticket fetches (for `CancelFlightInfo` and polls); an error says why it
/// is not a statement's ticket.
pub(crate) fn statement_of(info: &FlightInfo) -> Result<QueryHandle, Status> {
    let ticket = info
        .endpoint
        .first()
        .and_then(|endpoint| endpoint.ticket.as_ref())
        .ok_or_else(|| Status::invalid_argument("the FlightInfo to cancel has no ticket"))?;
    let not_a_statement = |e: &dyn std::fmt::Display| {
        Status::invalid_argument(format!("not a statement ticket: {e}"))
    };
    let any =
        arrow_flight::sql::Any::decode(ticket.ticket.as_ref()).map_err(|e| not_a_statement(&e))?;
    let command = Command::try_from(any).map_err(|e| not_a_statement(&e))?;
    let Command::TicketStatementQuery(TicketStatementQuery { statement_handle }) = command else {
        return Err(Status::invalid_argument(
            "only statements can be cancelled (metadata answers at once)",
        ));
    };
    QueryHandle::from_bytes(&statement_handle)
}

/// The statement ticket of `handle` (as `GetFlightInfo` hands it out).
pub(crate) fn statement_ticket(handle: QueryHandle) -> Ticket {
    let ticket = TicketStatementQuery {
        statement_handle: handle.to_bytes().into(),
    };
    Ticket::new(ticket.as_any().encode_to_vec())
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl FlightService for SluiceFlightService {
    type HandshakeStream = Boxed<HandshakeResponse>;
    type ListFlightsStream = Boxed<FlightInfo>;
    type DoGetStream = Boxed<FlightData>;
    type DoPutStream = Boxed<PutResult>;
    type DoExchangeStream = Boxed<FlightData>;
    type DoActionStream = Boxed<arrow_flight::Result>;
    type ListActionsStream = Boxed<ActionType>;

    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        FlightService::handshake(&self.sql, request).await
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        FlightService::list_flights(&self.sql, request).await
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        FlightService::get_flight_info(&self.sql, request).await
    }

    async fn poll_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        self.poll(request).await.map(Response::new)
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        FlightService::get_schema(&self.sql, request).await
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        FlightService::do_get(&self.sql, request).await
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        FlightService::do_put(&self.sql, request).await
    }

    async fn do_exchange(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        FlightService::do_exchange(&self.sql, request).await
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        FlightService::do_action(&self.sql, request).await
    }

    async fn list_actions(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        FlightService::list_actions(&self.sql, request).await
    }
}
