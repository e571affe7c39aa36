//! [`FlightSqlEndpoint`]: the Flight SQL service served on a TCP address until stopped.
//!
//! Invariant: [`FlightSqlEndpoint::stop`] stops accepting calls and lets calls in flight end;
//! dropping the endpoint aborts the serving task (a `SpawnedTask`), calls included.

use std::net::SocketAddr;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use datafusion::common::runtime::SpawnedTask;
use sluice_engine::{Result, SluiceError};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::queries::Queries;
use crate::service::SluiceFlightSql;
use crate::sessions::Sessions;

/// Where the Flight SQL endpoint listens unless told otherwise.
pub const DEFAULT_FLIGHT_SQL_LISTEN: &str = "127.0.0.1:50051";

/// How the endpoint serves.
#[derive(Debug, Clone)]
pub struct FlightSqlOptions {
    /// `host:port` to listen on (port 0 picks a free one).
    pub listen: String,
}

impl Default for FlightSqlOptions {
    fn default() -> Self {
        Self {
            listen: DEFAULT_FLIGHT_SQL_LISTEN.to_string(),
        }
    }
}

/// Binds a front door (`door`, e.g. "Flight SQL") to `listen`, refusing any address but loopback:
/// the doors have no TLS yet, and `what` (credentials, rows) must not cross a network in clear text.
pub(crate) async fn bind_loopback(
    listen: &str,
    door: &str,
    what: &str,
) -> Result<(TcpListener, SocketAddr)> {
    let listen_error = |e: std::io::Error| {
        SluiceError::invalid(format!(
            "the {door} endpoint cannot listen on {listen}: {e}"
        ))
    };
    let listener = TcpListener::bind(listen).await.map_err(listen_error)?;
    let address = listener.local_addr().map_err(listen_error)?;
    if !address.ip().is_loopback() {
        return Err(SluiceError::invalid(format!(
            "the {door} endpoint would send {what} in clear text on {address}: listen on a \
             loopback address (TLS on the front door is not built yet)"
        )));
    }
    Ok((listener, address))
}

/// A running Flight SQL endpoint.
#[derive(Debug)]
pub struct FlightSqlEndpoint {
    address: SocketAddr,
    queries: Arc<Queries>,
    sessions: Arc<Sessions>,
    stop: Option<oneshot::Sender<()>>,
    /// The serving task; dropping it (with the endpoint) aborts the server.
    serving: Option<SpawnedTask<std::result::Result<(), tonic::transport::Error>>>,
}

impl FlightSqlEndpoint {
    /// Serves `sessions` on `options.listen`. The endpoint speaks plain gRPC (no TLS yet), so only a
    /// loopback address is allowed: credentials and tokens never cross a network in clear text.
    pub async fn start(sessions: Arc<Sessions>, options: &FlightSqlOptions) -> Result<Self> {
        let (listener, address) = bind_loopback(
            &options.listen,
            "Flight SQL",
            "passwords and session tokens",
        )
        .await?;
        let queries = Arc::new(Queries::default());
        let service = SluiceFlightSql::new(sessions.clone(), queries.clone())
            .map_err(|status| SluiceError::invalid(status.message().to_string()))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let serving = SpawnedTask::spawn(
            Server::builder()
                .add_service(
                    FlightServiceServer::new(service)
                        .max_decoding_message_size(usize::MAX)
                        .max_encoding_message_size(usize::MAX),
                )
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stopped.await;
                }),
        );
        Ok(Self {
            address,
            queries,
            sessions,
            stop: Some(stop),
            serving: Some(serving),
        })
    }

    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Statements planned and not fetched yet.
    pub fn pending_statements(&self) -> usize {
        self.queries.pending_count()
    }

    /// Statements whose `DoGet` is streaming now.
    pub fn running_statements(&self) -> usize {
        self.queries.running_count()
    }

    /// Statements waiting for a slot (`--max-concurrent-jobs`).
    pub fn queued_statements(&self) -> usize {
        self.sessions.admission().queued()
    }

    /// The sessions it serves.
    pub fn sessions(&self) -> &Arc<Sessions> {
        &self.sessions
    }

    /// Stops accepting calls and waits for the server to end.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(serving) = self.serving.take() {
            let _ = serving.join().await;
        }
    }
}

impl Drop for FlightSqlEndpoint {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
