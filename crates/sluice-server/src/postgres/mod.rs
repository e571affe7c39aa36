//! The Postgres wire protocol of `sluice server` (pgwire, with datafusion-postgres's `pg_catalog`,
//! SQL rewrites and value encoding): `psql`, psycopg and BI tools reach the same sessions, tables
//! and cluster as Flight SQL clients.
//!
//! ```text
//!  TCP accept ─► connection task (in the endpoint's JoinSet)
//!                 ├─ login: open door, or SCRAM-SHA-256 against `--users`   (login.rs)
//!                 ├─ a session forked from the base session + pg_catalog     (connection.rs)
//!                 └─ queries ─► session ─► JobRunner ─► rows while the job runs
//!  CancelRequest(pid, key) ─► registry ─► that connection's running statement ends (57014)
//! ```
//!
//! Invariants: a connection's session is its own (settings, views, tables it creates); errors carry
//! the SQLSTATE of their kind ([`crate::status::Failure`]); like the Flight SQL endpoint this door
//! listens on loopback addresses only unless it has TLS (then it refuses connections that do not
//! ask for it) and the server has accounts; with accounts, nothing runs on a
//! connection before its SCRAM login succeeded; stopping (or dropping) the endpoint stops accepting
//! and closes every connection (their statements' jobs are cancelled).

pub mod cancel;
pub mod connection;
pub mod errors;
pub mod login;

use std::fmt::Debug;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use datafusion::common::runtime::SpawnedTask;
use futures::Sink;
use pgwire::api::auth::StartupHandler;
use pgwire::api::{ClientInfo, PgWireServerHandlers};
use pgwire::error::{PgWireError, PgWireResult};
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use pgwire::tokio::process_socket;
use sluice_engine::Result;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::sessions::Sessions;
use crate::tls::{FrontDoorTls, fatal_error, opens_with_tls_or_cancel};
use cancel::PgCancel;
use connection::PgConnection;
use errors::PgErrors;
use login::{OpenLogin, Registry, ScramLogin};

/// Where the Postgres endpoint listens unless told otherwise.
pub const DEFAULT_PG_LISTEN: &str = "127.0.0.1:5433";

/// How the Postgres endpoint serves.
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// `host:port` to listen on (port 0 picks a free one).
    pub listen: String,
    /// Accept `SSLRequest` with this certificate, and refuse connections that do not ask for TLS
    /// (`None`: no TLS, loopback only).
    pub tls: Option<FrontDoorTls>,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            listen: DEFAULT_PG_LISTEN.to_string(),
            tls: None,
        }
    }
}

/// A running Postgres endpoint.
#[derive(Debug)]
pub struct PgEndpoint {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    serving: Option<SpawnedTask<()>>,
}

impl PgEndpoint {
    /// Serves `sessions`' base session (each connection forks it) on `options.listen` (a loopback
    /// address unless TLS and accounts), with `sessions`' accounts.
    pub async fn start(sessions: Arc<Sessions>, options: &PgOptions) -> Result<Self> {
        let (listener, address) = crate::server::bind_front_door(
            &options.listen,
            "Postgres",
            "passwords and rows",
            options.tls.is_some(),
            sessions.requires_login(),
        )
        .await?;
        let (stop, stopped) = oneshot::channel::<()>();
        let accept = Acceptor {
            sessions,
            registry: Arc::new(Registry::default()),
            tls: options.tls.clone(),
        };
        let serving = SpawnedTask::spawn(accept.serve(listener, stopped));
        Ok(Self {
            address,
            stop: Some(stop),
            serving: Some(serving),
        })
    }

    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops accepting connections and closes the open ones (cancelling what they run).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(serving) = self.serving.take() {
            let _ = serving.join().await;
        }
    }
}

impl Drop for PgEndpoint {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Accepts connections and gives each its handlers.
struct Acceptor {
    sessions: Arc<Sessions>,
    registry: Arc<Registry>,
    tls: Option<FrontDoorTls>,
}

impl Acceptor {
    async fn serve(self, listener: TcpListener, mut stopped: oneshot::Receiver<()>) {
        let this = Arc::new(self);
        let mut running = JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                accepted = listener.accept() => {
                    let Ok((socket, peer)) = accepted else {
                        // A failed accept (out of file descriptors) must not spin.
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    };
                    let _ = socket.set_nodelay(true);
                    let open = Open::new(this.sessions.postgres_connections().clone());
                    let acceptor = this.clone();
                    // The session is made in the connection's own task, so a slow fork never holds
                    // up the accept loop (or a CancelRequest's connection).
                    running.spawn(async move {
                        let _open = open;
                        let tls = acceptor.tls.as_ref().map(FrontDoorTls::acceptor);
                        if tls.is_some() && !opens_with_tls_or_cancel(&socket).await {
                            let refusal = fatal_error(
                                "28000",
                                "this server takes Postgres connections over TLS only: connect \
                                 with sslmode=require (or verify-full)",
                            );
                            let mut socket = socket;
                            let _ = tokio::io::AsyncWriteExt::write_all(&mut socket, &refusal).await;
                            return;
                        }
                        match acceptor.handlers().await {
                            Ok(handlers) => {
                                let _ = process_socket(socket, tls, handlers).await;
                            }
                            Err(error) => eprintln!(
                                "sluice server: Postgres connection from {peer} refused: {error}"
                            ),
                        }
                    });
                }
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
        }
        // Stopping: no new connections; the open ones (idle psql sessions included) are closed and
        // their running statements' jobs cancelled as the JoinSet drops them.
        drop(listener);
        running.abort_all();
        while running.join_next().await.is_some() {}
    }

    /// The handlers of a new connection: its own session, the server's login.
    async fn handlers(&self) -> Result<PgHandlers> {
        let session = self.sessions.fork().await?;
        let login = if self.sessions.requires_login() {
            Login::Scram(ScramLogin::new(
                self.registry.clone(),
                self.sessions.clone(),
                session.access_slot(),
            ))
        } else {
            Login::Open(OpenLogin {
                registry: self.registry.clone(),
            })
        };
        let connection = PgConnection::new(
            session,
            self.registry.cancels.clone(),
            self.sessions.requires_login(),
            self.sessions.admission().clone(),
            self.sessions.limits().result_buffer,
        )?;
        Ok(PgHandlers {
            connection: Arc::new(connection),
            login: Arc::new(login),
            cancel: Arc::new(PgCancel {
                manager: self.registry.connections.clone(),
                cancels: self.registry.cancels.clone(),
            }),
        })
    }
}

/// Counts a connection while it is open.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The handlers of one connection.
struct PgHandlers {
    connection: Arc<PgConnection>,
    login: Arc<Login>,
    cancel: Arc<PgCancel>,
}

impl PgWireServerHandlers for PgHandlers {
    fn simple_query_handler(&self) -> Arc<impl pgwire::api::query::SimpleQueryHandler> {
        self.connection.clone()
    }

    fn extended_query_handler(&self) -> Arc<impl pgwire::api::query::ExtendedQueryHandler> {
        self.connection.clone()
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        self.login.clone()
    }

    fn error_handler(&self) -> Arc<impl pgwire::api::ErrorHandler> {
        Arc::new(PgErrors)
    }

    fn cancel_handler(&self) -> Arc<impl pgwire::api::cancel::CancelHandler> {
        self.cancel.clone()
    }
}

/// The login of a connection: open door or SCRAM.
enum Login {
    Open(OpenLogin),
    Scram(ScramLogin),
}

#[async_trait]
impl StartupHandler for Login {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        match self {
            Self::Open(login) => login.on_startup(client, message).await,
            Self::Scram(login) => login.on_startup(client, message).await,
        }
    }
}
