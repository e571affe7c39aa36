//! [`RemoteSession`]: a session on a `sluice server`, reached over Flight SQL — what the CLI's
//! `--connect` uses. It opens a session of its own (handshake) so its `SET`s and DDL stay its own, and
//! runs one statement at a time: `GetFlightInfo`, then `DoGet` on each endpoint, in order.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow_flight::error::FlightError;
use arrow_flight::sql::client::FlightSqlServiceClient;
use futures::TryStreamExt;
use tonic::Status;
use tonic::transport::Channel;

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
        let address = match url.split_once("://") {
            Some(("grpc", rest)) => format!("http://{rest}"),
            Some(("grpc+tls", _)) => {
                return Err(Status::unimplemented(
                    "grpc+tls:// is not supported yet: the server serves plain gRPC on loopback",
                ));
            }
            _ => {
                return Err(Status::invalid_argument(format!(
                    "'{url}' is not a server address: expected grpc://HOST:PORT"
                )));
            }
        };
        let channel = Channel::from_shared(address)
            .map_err(|e| Status::invalid_argument(format!("'{url}': {e}")))?
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
    pub async fn execute(&mut self, sql: &str) -> Result<RemoteOutput, Status> {
        let info = self
            .client
            .execute(sql.to_string(), None)
            .await
            .map_err(|e| to_status(e, &self.url))?;
        let schema = std::sync::Arc::new(
            info.clone()
                .try_decode_schema()
                .map_err(|e| Status::internal(format!("the server's schema: {e}")))?,
        );
        let mut batches = Vec::new();
        for endpoint in info.endpoint {
            let Some(ticket) = endpoint.ticket else {
                continue;
            };
            let stream = self
                .client
                .do_get(ticket)
                .await
                .map_err(|e| to_status(e, &self.url))?;
            let fetched: Vec<RecordBatch> = stream
                .try_collect()
                .await
                .map_err(|e| to_status(e, &self.url))?;
            batches.extend(fetched.into_iter().filter(|batch| batch.num_rows() > 0));
        }
        Ok(RemoteOutput { schema, batches })
    }
}

fn to_status(error: FlightError, url: &str) -> Status {
    match error {
        FlightError::Tonic(status) => *status,
        other => Status::internal(format!("{url}: {other}")),
    }
}
