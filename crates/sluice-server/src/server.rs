//! [`FlightSqlEndpoint`]: the Flight SQL service served on a TCP address until stopped.
//!
//! Invariant: [`FlightSqlEndpoint::stop`] stops accepting calls and lets calls in flight end;
//! dropping the endpoint aborts the serving task (a `SpawnedTask`), calls included.

use std::net::SocketAddr;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;

use crate::poll::SluiceFlightService;
use datafusion::common::runtime::SpawnedTask;
use sluice_engine::{Result, SluiceError};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::queries::{PreparedLimits, Queries};
use crate::service::SluiceFlightSql;
use crate::sessions::Sessions;
use crate::tls::FrontDoorTls;

/// Where the Flight SQL endpoint listens unless told otherwise.
pub const DEFAULT_FLIGHT_SQL_LISTEN: &str = "127.0.0.1:50051";

/// The largest message a client may send (a `DoPut` batch, bound parameters): tonic decodes a
/// message before any handler checks the caller's session, so this bounds what a stranger can make
/// the server hold.
pub const MAX_REQUEST_MESSAGE: usize = 64 * 1024 * 1024;

/// How the endpoint serves.
#[derive(Debug, Clone)]
pub struct FlightSqlOptions {
    /// `host:port` to listen on (port 0 picks a free one).
    pub listen: String,
    /// Serve `grpc+tls://` with this certificate (`None`: plain gRPC, loopback only).
    pub tls: Option<FrontDoorTls>,
}

impl Default for FlightSqlOptions {
    fn default() -> Self {
        Self {
            listen: DEFAULT_FLIGHT_SQL_LISTEN.to_string(),
            tls: None,
        }
    }
}

/// Binds a front door (`door`, e.g. "Flight SQL") to `listen`. A loopback address always serves; any
/// other only with `tls` (else `what`, credentials and rows, would cross a network in clear text) and
/// with user accounts (`logins`; else anyone who reaches it runs SQL as the server).
pub(crate) async fn bind_front_door(
    listen: &str,
    door: &str,
    what: &str,
    tls: bool,
    logins: bool,
) -> Result<(TcpListener, SocketAddr)> {
    let listen_error = |e: std::io::Error| {
        SluiceError::invalid(format!(
            "the {door} endpoint cannot listen on {listen}: {e}"
        ))
    };
    let listener = TcpListener::bind(listen).await.map_err(listen_error)?;
    let address = listener.local_addr().map_err(listen_error)?;
    if address.ip().is_loopback() {
        return Ok((listener, address));
    }
    if !tls {
        return Err(SluiceError::invalid(format!(
            "the {door} endpoint would send {what} in clear text on {address}: listen on a \
             loopback address, or serve TLS (--serve-tls-cert FILE --serve-tls-key FILE) with \
             user accounts (--users FILE)"
        )));
    }
    if !logins {
        return Err(SluiceError::invalid(format!(
            "the {door} endpoint on {address} would let anyone who reaches it run SQL as the \
             server: give it user accounts (--users FILE)"
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
    /// Closes idle prepared statements; ends with the endpoint.
    _sweeper: SpawnedTask<()>,
}

impl FlightSqlEndpoint {
    /// Serves `sessions` on `options.listen`: plain gRPC on a loopback address, or `grpc+tls://`
    /// (`options.tls`) on any address when the server has user accounts (see [`bind_front_door`]).
    pub async fn start(sessions: Arc<Sessions>, options: &FlightSqlOptions) -> Result<Self> {
        let (listener, address) = bind_front_door(
            &options.listen,
            "Flight SQL",
            "passwords and session tokens",
            options.tls.is_some(),
            sessions.requires_login(),
        )
        .await?;
        let mut builder = Server::builder();
        if let Some(tls) = &options.tls {
            builder = builder.tls_config(tls.grpc()).map_err(|e| {
                SluiceError::invalid(format!("TLS with {}: {e}", tls.cert.display()))
            })?;
        }
        let limits = sessions.limits();
        let queries = Arc::new(Queries::with_prepared_limits(PreparedLimits {
            per_session: limits.prepared_per_session,
            idle: limits.prepared_idle,
        }));
        // Prepared statements nobody uses are closed even when no client opens another.
        let sweeper = {
            let queries = Arc::clone(&queries);
            let every = (limits.prepared_idle / 4).max(std::time::Duration::from_millis(50));
            SpawnedTask::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    queries.expire_prepared();
                }
            })
        };
        let service = SluiceFlightSql::new(sessions.clone(), queries.clone())
            .map_err(|status| SluiceError::invalid(status.message().to_string()))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let serving = SpawnedTask::spawn(
            builder
                .add_service(
                    FlightServiceServer::new(SluiceFlightService::new(service))
                        .max_decoding_message_size(MAX_REQUEST_MESSAGE)
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
            _sweeper: sweeper,
        })
    }

    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Prepared statements open now.
    pub fn prepared_statements(&self) -> usize {
        self.queries.prepared_count()
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
