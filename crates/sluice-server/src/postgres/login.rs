//! Logging in on the Postgres wire. Without accounts the door is open (any user name, no password,
//! as `psql -h 127.0.0.1 -p 5433 -U sluice` expects); with `--users` every connection runs a
//! SCRAM-SHA-256 exchange ([`crate::scram`]) against the same verifiers the Flight SQL handshake
//! checks. Either way a logged-in connection is registered for `CancelRequest`s under its process id
//! and secret key.

use std::fmt::Debug;
use std::sync::Arc;

use async_trait::async_trait;
use futures::{Sink, SinkExt};
use pgwire::api::auth::noop::NoopStartupHandler;
use pgwire::api::auth::{
    DefaultServerParameterProvider, StartupHandler, finish_authentication, protocol_negotiation,
    save_startup_parameters_to_metadata,
};
use pgwire::api::{
    ClientInfo, ConnectionManager, METADATA_USER, PgWireConnectionState, PidSecretKeyGenerator,
    RandomPidSecretKeyGenerator,
};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::startup::Authentication;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::scram::{ScramError, ServerFirst, server_nonce};
use crate::sessions::Sessions;
use sluice_engine::access::AccessSlot;

/// What every connection's login shares: the cancel registry and the process-id generator.
#[derive(Debug, Default)]
pub struct Registry {
    /// Connections by process id and secret key, for `CancelRequest`.
    pub connections: Arc<ConnectionManager>,
    /// Process ids and secret keys of new connections.
    pub keys: RandomPidSecretKeyGenerator,
    /// Connections' cancel generations, for statements that stream.
    pub cancels: Arc<crate::postgres::cancel::Cancels>,
}

/// Set on a connection whose SCRAM login succeeded; without it a server with accounts runs
/// nothing (pgwire keeps reading a socket after a failed login).
#[derive(Debug)]
pub struct LoggedIn;

/// The login of a server without accounts.
#[derive(Debug)]
pub struct OpenLogin {
    pub(crate) registry: Arc<Registry>,
}

#[async_trait]
impl NoopStartupHandler for OpenLogin {
    fn connection_manager(&self) -> Option<Arc<ConnectionManager>> {
        Some(self.registry.connections.clone())
    }

    fn pid_secret_key_generator(&self) -> &dyn PidSecretKeyGenerator {
        &self.registry.keys
    }
}

enum Step {
    /// Waiting for the client-first message.
    Started,
    /// Server-first sent, waiting for the proof.
    Challenged(Box<ServerFirst>),
    /// Done (either way).
    Over,
}

/// The SCRAM-SHA-256 login of one connection to a server with accounts.
pub struct ScramLogin {
    registry: Arc<Registry>,
    /// The server's sessions, whose accounts the login checks.
    sessions: Arc<Sessions>,
    /// The connection's session's access, granted the user's once the login succeeds.
    access: AccessSlot,
    step: Mutex<Step>,
}

impl ScramLogin {
    pub(crate) fn new(
        registry: Arc<Registry>,
        sessions: Arc<Sessions>,
        access: AccessSlot,
    ) -> Self {
        Self {
            registry,
            sessions,
            access,
            step: Mutex::new(Step::Started),
        }
    }
}

fn scram_error(error: ScramError, user: &str) -> PgWireError {
    match error {
        ScramError::Malformed(message) => PgWireError::InvalidScramMessage(message),
        // Postgres's own words, so clients and their users recognise it.
        ScramError::Refused => PgWireError::UserError(Box::new(ErrorInfo::new(
            "FATAL".to_string(),
            "28P01".to_string(),
            format!("password authentication failed for user \"{user}\""),
        ))),
    }
}

/// A login refused for too many failed ones (`FATAL 28000`, as Postgres refuses a connection its
/// rules reject).
fn locked_out(refused: crate::login_limit::Refused) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "FATAL".to_string(),
        "28000".to_string(),
        refused.to_string(),
    )))
}

#[async_trait]
impl StartupHandler for ScramLogin {
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
        match message {
            PgWireFrontendMessage::Startup(ref startup) => {
                protocol_negotiation(client, startup).await?;
                save_startup_parameters_to_metadata(client, startup);
                client.set_state(PgWireConnectionState::AuthenticationInProgress);
                client
                    .send(PgWireBackendMessage::Authentication(Authentication::SASL(
                        vec!["SCRAM-SHA-256".to_string()],
                    )))
                    .await?;
            }
            PgWireFrontendMessage::PasswordMessageFamily(message) => {
                let user = client
                    .metadata()
                    .get(METADATA_USER)
                    .cloned()
                    .ok_or(PgWireError::UserNameRequired)?;
                let address = Some(client.socket_addr().ip());
                let logins = self.sessions.logins();
                let mut step = self.step.lock().await;
                match std::mem::replace(&mut *step, Step::Over) {
                    Step::Started => {
                        logins
                            .check(&user, address, Instant::now())
                            .map_err(locked_out)?;
                        let initial = message.into_sasl_initial_response()?;
                        if initial.auth_method != "SCRAM-SHA-256" {
                            return Err(PgWireError::UnsupportedSASLAuthMethod(
                                initial.auth_method,
                            ));
                        }
                        let data = initial.data.unwrap_or_default();
                        let client_first = std::str::from_utf8(&data).map_err(|_| {
                            PgWireError::InvalidScramMessage("client-first is not UTF-8".into())
                        })?;
                        let (verifier, known) = self
                            .sessions
                            .users()
                            .and_then(|users| users.verifier(&user))
                            .ok_or_else(|| scram_error(ScramError::Refused, &user))?;
                        let nonce = server_nonce().map_err(|e| scram_error(e, &user))?;
                        let first = ServerFirst::answer(client_first, &verifier, known, &nonce)
                            .map_err(|e| scram_error(e, &user))?;
                        client
                            .send(PgWireBackendMessage::Authentication(
                                Authentication::SASLContinue(first.message.clone().into()),
                            ))
                            .await?;
                        *step = Step::Challenged(Box::new(first));
                    }
                    Step::Challenged(first) => {
                        let response = message.into_sasl_response()?;
                        let client_final = std::str::from_utf8(&response.data).map_err(|_| {
                            PgWireError::InvalidScramMessage("client-final is not UTF-8".into())
                        })?;
                        // Checked again: a burst of connections all past their first message
                        // gets only the limit of proofs verified.
                        logins
                            .check(&user, address, Instant::now())
                            .map_err(locked_out)?;
                        let server_final = match first.finish(client_final) {
                            Ok(server_final) => server_final,
                            Err(error) => {
                                if matches!(error, ScramError::Refused) {
                                    logins.failed(&user, address, Instant::now());
                                }
                                return Err(scram_error(error, &user));
                            }
                        };
                        logins.succeeded(&user);
                        self.access.set(self.sessions.access_of(&user));
                        client
                            .send(PgWireBackendMessage::Authentication(
                                Authentication::SASLFinal(server_final.into()),
                            ))
                            .await?;
                        let (pid, secret_key) = self.registry.keys.generate(client);
                        client.set_pid_and_secret_key(pid, secret_key.clone());
                        let (handle, guard) = self.registry.connections.register(pid, secret_key);
                        client.session_extensions().insert(handle);
                        client.session_extensions().insert(guard);
                        client.session_extensions().insert(LoggedIn);
                        finish_authentication(client, &DefaultServerParameterProvider::default())
                            .await?;
                    }
                    Step::Over => return Err(PgWireError::InvalidSASLState),
                }
            }
            _ => {}
        }
        Ok(())
    }
}
