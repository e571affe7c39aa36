//! [`RemoteSession`]: a session on a `sluice server`, reached over Flight SQL — what the CLI's
//! `--connect` uses. It opens a session of its own (handshake) so its `SET`s and DDL stay its own, and
//! runs one statement at a time: `PollFlightInfo` (`GetFlightInfo` on servers without it), then
//! `DoGet` on each endpoint, in order, polling for progress while the rows come.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow_flight::error::FlightError;
use arrow_flight::sql::client::FlightSqlServiceClient;
use arrow_flight::sql::{CommandStatementQuery, ProstMessageExt};
use arrow_flight::{FlightDescriptor, FlightInfo, PollInfo};
use futures::TryStreamExt;
use prost::Message;
use tonic::Status;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

/// The user name a remote session opens with (the server accepts any while it has no accounts).
pub const REMOTE_USER: &str = "sluice";

/// A session on a remote server.
#[derive(Debug)]
pub struct RemoteSession {
    client: FlightSqlServiceClient<Channel>,
    url: String,
}

/// What a remote statement returned.
#[derive(Debug, Clone)]
pub struct RemoteOutput {
    /// The schema the server announced (nullability included).
    pub schema: SchemaRef,
    /// The batches, in order.
    pub batches: Vec<RecordBatch>,
}

impl RemoteSession {
    /// Connects to `url` (`grpc://host:port`) and opens a session.
    pub async fn connect(url: &str) -> Result<Self, Status> {
        Self::connect_with_ca(url, None).await
    }

    /// Connects to `url` (`grpc://host:port`, or `grpc+tls://host:port` checked against the PEM CA
    /// certificate `ca`) and opens a session.
    pub async fn connect_with_ca(url: &str, ca: Option<&[u8]>) -> Result<Self, Status> {
        let bad = |e: &dyn std::fmt::Display| Status::invalid_argument(format!("'{url}': {e}"));
        let endpoint = match (url.split_once("://"), ca) {
            (Some(("grpc", rest)), _) => {
                Channel::from_shared(format!("http://{rest}")).map_err(|e| bad(&e))?
            }
            (Some(("grpc+tls", rest)), Some(ca)) => {
                sluice_runtime::install_default_crypto_provider();
                let host = rest.rsplit_once(':').map_or(rest, |(host, _)| host);
                let tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca))
                    .domain_name(host.trim_start_matches('[').trim_end_matches(']'));
                Channel::from_shared(format!("https://{rest}"))
                    .map_err(|e| bad(&e))?
                    .tls_config(tls)
                    .map_err(|e| bad(&e))?
            }
            (Some(("grpc+tls", _)), None) => {
                return Err(Status::invalid_argument(format!(
                    "'{url}': grpc+tls:// needs the CA certificate that signed the server's \
                     (--server-ca FILE)"
                )));
            }
            _ => {
                return Err(Status::invalid_argument(format!(
                    "'{url}' is not a server address: expected grpc://HOST:PORT or \
                     grpc+tls://HOST:PORT"
                )));
            }
        };
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| Status::unavailable(format!("cannot reach {url}: {e}")))?;
        let mut client = FlightSqlServiceClient::new(channel);
        client
            .handshake(REMOTE_USER, "")
            .await
            .map_err(|e| to_status(e, url))?;
        Ok(Self {
            client,
            url: url.to_string(),
        })
    }

    /// The server's address.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs one statement and collects its result.
    pub async fn execute(&self, sql: &str) -> Result<RemoteOutput, Status> {
        self.execute_with_progress(sql, &|_| {}).await
    }

    /// Runs one statement and collects its result, handing `show` the server's progress line
    /// (`PollFlightInfo`, every [`POLL_EVERY`]) while it runs. A server without `PollFlightInfo`
    /// runs it all the same, without progress.
    pub async fn execute_with_progress(
        &self,
        sql: &str,
        show: &(dyn Fn(&str) + Sync),
    ) -> Result<RemoteOutput, Status> {
        let command = CommandStatementQuery {
            query: sql.to_string(),
            transaction_id: None,
        };
        let descriptor = FlightDescriptor::new_cmd(command.as_any().encode_to_vec());
        let (info, mut next) = match self.poll(descriptor).await {
            Ok(polled) => {
                let info = polled
                    .info
                    .ok_or_else(|| Status::internal("the server's PollInfo has no FlightInfo"))?;
                (info, polled.flight_descriptor)
            }
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                let mut client = self.client.clone();
                let info = client
                    .execute(sql.to_string(), None)
                    .await
                    .map_err(|e| to_status(e, &self.url))?;
                (info, None)
            }
            Err(status) => return Err(status),
        };
        let schema = std::sync::Arc::new(
            info.clone()
                .try_decode_schema()
                .map_err(|e| Status::internal(format!("the server's schema: {e}")))?,
        );
        let fetch = std::pin::pin!(self.fetch(info));
        let progress = std::pin::pin!(async {
            while let Some(descriptor) = next.take() {
                tokio::time::sleep(POLL_EVERY).await;
                // Progress is a courtesy: a failed poll only ends the progress line.
                let Ok(polled) = self.poll(descriptor).await else {
                    break;
                };
                if let Some(line) = polled.info.as_ref().and_then(progress_line) {
                    show(&line);
                }
                next = polled.flight_descriptor;
            }
        });
        // The rows decide the outcome; once polling ends the fetch goes on alone.
        let batches = match futures::future::select(fetch, progress).await {
            futures::future::Either::Left((batches, _)) => batches?,
            futures::future::Either::Right(((), fetch)) => fetch.await?,
        };
        Ok(RemoteOutput { schema, batches })
    }

    /// Every endpoint's rows, in order.
    async fn fetch(&self, info: FlightInfo) -> Result<Vec<RecordBatch>, Status> {
        let mut client = self.client.clone();
        let mut batches = Vec::new();
        for endpoint in info.endpoint {
            let Some(ticket) = endpoint.ticket else {
                continue;
            };
            let stream = client
                .do_get(ticket)
                .await
                .map_err(|e| to_status(e, &self.url))?;
            let fetched: Vec<RecordBatch> = stream
                .try_collect()
                .await
                .map_err(|e| to_status(e, &self.url))?;
            batches.extend(fetched.into_iter().filter(|batch| batch.num_rows() > 0));
        }
        Ok(batches)
    }

    /// The server's state (its `sluice.state` action): sessions, statements, jobs, workers.
    pub async fn state(&self) -> Result<serde_json::Value, Status> {
        let mut client = self.client.clone();
        let action = arrow_flight::Action::new(crate::service::STATE_ACTION, "");
        let mut results = client
            .do_action(action)
            .await
            .map_err(|e| to_status(e, &self.url))?;
        let result = results
            .message()
            .await?
            .ok_or_else(|| Status::internal("sluice.state returned nothing"))?;
        serde_json::from_slice(&result.body)
            .map_err(|e| Status::internal(format!("sluice.state is not JSON: {e}")))
    }

    /// One `PollFlightInfo`, with the session's token.
    async fn poll(&self, descriptor: FlightDescriptor) -> Result<PollInfo, Status> {
        let mut request = tonic::Request::new(descriptor);
        if let Some(token) = self.client.token() {
            let value = format!("Bearer {token}")
                .parse()
                .map_err(|_| Status::internal("a session token is not a header value"))?;
            request.metadata_mut().insert("authorization", value);
        }
        let mut raw = self.client.inner().clone();
        Ok(raw.poll_flight_info(request).await?.into_inner())
    }
}

/// How often a running statement's progress is asked for.
pub const POLL_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// The progress line a poll's FlightInfo carries (see [`crate::poll`]), if any.
fn progress_line(info: &FlightInfo) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(&info.app_metadata).ok()?;
    match json["state"].as_str()? {
        "queued" => Some(format!(
            "queued on the server (position {})",
            json["queue_position"]
        )),
        "running" => json["line"].as_str().map(str::to_string),
        _ => None,
    }
}

fn to_status(error: FlightError, url: &str) -> Status {
    match error {
        FlightError::Tonic(status) => *status,
        other => Status::internal(format!("{url}: {other}")),
    }
}
