//! `sluice server`: the driver as a long-running server with an Arrow Flight SQL endpoint and a
//! Postgres wire endpoint.
//!
//! Start: tables from `--data` / `--table` (one whose files cannot be read is reported and left out;
//! it never stops the server), the cluster of the configured mode (`cluster` with 2 worker processes
//! unless `--mode` / `--workers` say otherwise), then one line per endpoint on stderr. Stop:
//! SIGTERM or Ctrl-C stops accepting calls, gives running calls a grace period, then stops the
//! workers (dropping the runner).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use sluice_engine::access::{Roots, listed};
use sluice_engine::{ExecutionMode, Result, SluiceConfig, SluiceSession};
use sluice_server::limits::ServerLimits;
use sluice_server::login_limit::LoginLimits;
use sluice_server::postgres::DEFAULT_PG_LISTEN;
use sluice_server::rest::{DEFAULT_HTTP_LISTEN, RestEndpoint, RestOptions};
use sluice_server::server::DEFAULT_FLIGHT_SQL_LISTEN;
use sluice_server::tls::FrontDoorTls;
use sluice_server::users::{Users, Verifier};
use sluice_server::{
    FlightSqlEndpoint, FlightSqlOptions, PgEndpoint, PgOptions, SessionFactory, Sessions,
};
use tokio::runtime::Runtime;

use crate::commands::sql::TableArgs;
use crate::runners::runner_for;

/// How long running calls may take to finish once the server is told to stop.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Arguments of `sluice server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    #[command(flatten)]
    pub tables: TableArgs,
    /// Where the Arrow Flight SQL endpoint listens (port 0 picks a free one).
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_FLIGHT_SQL_LISTEN)]
    pub flight_sql_listen: String,
    /// Where the REST API and the web UI listen (port 0 picks a free one): a loopback address,
    /// unless the server has TLS and user accounts.
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_HTTP_LISTEN)]
    pub http_listen: String,
    /// A host name the REST API answers to besides its address, `localhost` and the loopback
    /// addresses (repeatable): requests whose Host is another name are refused (403).
    #[arg(long = "http-allowed-host", value_name = "NAME")]
    pub http_allowed_hosts: Vec<String>,
    /// Serve `/metrics` without credentials (for a Prometheus scraper) on a server with --users.
    #[arg(long)]
    pub metrics_public: bool,
    /// Where the Postgres wire endpoint listens (port 0 picks a free one).
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_PG_LISTEN)]
    pub pg_listen: String,
    /// At most this many statements run at once (over both front doors); later ones wait in a
    /// first-come, first-served queue. Unlimited by default.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_jobs: Option<u32>,
    /// With --users: failed logins allowed per user name and per client address within a minute,
    /// on every door; past them that name or address is refused for a minute, before any
    /// password is checked (config `max_failed_logins`, default 5).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_failed_logins: Option<u32>,
    /// User accounts, one `name:verifier [role]` line each (`sluice hash-password` prints a
    /// verifier; the role is reader, writer or admin, reader if left out): every client must log
    /// in. Without it anyone on this machine may connect, as an admin.
    #[arg(long, value_name = "FILE")]
    pub users: Option<std::path::PathBuf>,
    /// With --users: where readers and writers may read files by path or URL, besides the
    /// registered tables (repeatable; config `read_roots`; default: --data's directory).
    #[arg(long = "read-root", value_name = "PATH|URL")]
    pub read_roots: Vec<String>,
    /// With --users: where writers may write (COPY, INSERT into files; repeatable; config
    /// `write_roots`; default: nowhere but the registered tables).
    #[arg(long = "write-root", value_name = "PATH|URL")]
    pub write_roots: Vec<String>,
    /// Serve every door over TLS with this certificate chain (PEM; with --serve-tls-key):
    /// Flight SQL as `grpc+tls://`, Postgres with `sslmode=require` only, REST as `https://`.
    /// With TLS and --users the doors may listen on any address, not only loopback.
    #[arg(long, value_name = "FILE", requires = "serve_tls_key")]
    pub serve_tls_cert: Option<std::path::PathBuf>,
    /// The private key of --serve-tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "serve_tls_cert")]
    pub serve_tls_key: Option<std::path::PathBuf>,
}

/// Runs `sluice server` until SIGTERM or Ctrl-C.
pub fn run(args: ServerArgs, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    let mut config = config.clone();
    if config.mode.source == "default" {
        config.mode.value = ExecutionMode::Cluster;
        config.mode.source = "sluice server's default".to_string();
    }
    runtime.block_on(serve(args, config))
}

async fn serve(args: ServerArgs, config: SluiceConfig) -> Result<ExitCode> {
    // Listening for SIGTERM before anything is printed: a client that signals as soon as it reads
    // the endpoint line must get the graceful stop, not the default (death by signal).
    let stop = StopSignal::listen();
    // Bad accounts fail before any worker starts.
    let users = args.users.as_deref().map(Users::load).transpose()?;
    let tls = match (&args.serve_tls_cert, &args.serve_tls_key) {
        (Some(cert), Some(key)) => Some(FrontDoorTls::from_files(cert, key)?),
        _ => None,
    };
    let runner = runner_for(&config);
    let mut base = SluiceSession::new(&config, runner.clone())?;
    for source in args.tables.sources(base.context()).await? {
        let name = source.name.clone();
        if let Err(error) = base.register_table(source).await {
            eprintln!("sluice server: table '{name}' left out: {error}");
        }
    }
    for line in runner.start_now().await? {
        eprintln!("sluice server: {line}");
    }
    let accounts = users.as_ref().map_or(0, Users::len);
    let roots = roots_of(&args, &config)?;
    match &users {
        Some(users) => {
            let readers = users.without_role();
            if !readers.is_empty() {
                eprintln!(
                    "sluice server: users without a role are readers: {}",
                    readers.join(", ")
                );
            }
            eprintln!(
                "sluice server: read roots: {}; write roots: {}",
                listed(roots.read()),
                listed(roots.write())
            );
        }
        None => eprintln!(
            "sluice server: no user accounts (--users): every client is an admin, on loopback only"
        ),
    }
    let limit = args
        .max_concurrent_jobs
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let sessions = Arc::new(
        Sessions::with_users(SessionFactory::new(base), users)
            .await?
            .with_max_concurrent_jobs(limit)
            .with_roots(roots)
            .with_limits(ServerLimits::of(&config))
            .with_login_limits(LoginLimits {
                failures: args
                    .max_failed_logins
                    .map_or(config.max_failed_logins.value, |n| {
                        usize::try_from(n).unwrap_or(usize::MAX)
                    }),
                ..LoginLimits::default()
            }),
    );
    let postgres = PgEndpoint::start(
        sessions.clone(),
        &PgOptions {
            listen: args.pg_listen.clone(),
            tls: tls.clone(),
        },
    )
    .await?;
    let rest = RestEndpoint::start(
        sessions.clone(),
        &RestOptions {
            listen: args.http_listen.clone(),
            allowed_hosts: args.http_allowed_hosts.clone(),
            metrics_public: args.metrics_public,
            tls: tls.clone(),
        },
    )
    .await?;
    let endpoint = FlightSqlEndpoint::start(
        sessions,
        &FlightSqlOptions {
            listen: args.flight_sql_listen.clone(),
            tls: tls.clone(),
        },
    )
    .await?;
    let login = if accounts > 0 {
        format!("login required, {accounts} users")
    } else {
        "no login".to_string()
    };
    let (grpc, ssl, http) = match tls {
        Some(_) => ("grpc+tls", ", TLS only", "https"),
        None => ("grpc", "", "http"),
    };
    eprintln!(
        "sluice server: REST API on {http}://{}/api/v1",
        rest.address()
    );
    eprintln!(
        "sluice server: Postgres on postgres://{} ({login}{ssl})",
        postgres.address()
    );
    eprintln!(
        "sluice server: Flight SQL on {grpc}://{} ({} mode, {} tables, {login})",
        endpoint.address(),
        runner.mode_name(),
        endpoint.sessions().base().tables().len()
    );
    let signal = stop.wait().await;
    eprintln!(
        "sluice server: {signal}: stopping (running calls get {} s)",
        STOP_GRACE.as_secs()
    );
    let stopping = async { tokio::join!(endpoint.stop(), postgres.stop(), rest.stop()) };
    if tokio::time::timeout(STOP_GRACE, stopping).await.is_err() {
        eprintln!("sluice server: calls still running after the grace period were cut off");
    }
    eprintln!("sluice server: stopped");
    Ok(ExitCode::SUCCESS)
}

/// The read and write roots: the flags', else the configuration's; the read roots default to
/// `--data`'s directory.
fn roots_of(args: &ServerArgs, config: &SluiceConfig) -> Result<Roots> {
    let pick = |flags: &[String], configured: &[String]| match flags.is_empty() {
        true => configured.to_vec(),
        false => flags.to_vec(),
    };
    let mut read = pick(&args.read_roots, &config.read_roots.value);
    if read.is_empty()
        && let Some(data) = &args.tables.data
    {
        read.push(data.to_string_lossy().into_owned());
    }
    let write = pick(&args.write_roots, &config.write_roots.value);
    Roots::parse(&read, &write)
}

/// SIGTERM (registered when made) or Ctrl-C.
struct StopSignal {
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

impl StopSignal {
    fn listen() -> Self {
        Self {
            #[cfg(unix)]
            terminate: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .ok(),
        }
    }

    /// Waits for either and says which came.
    async fn wait(mut self) -> &'static str {
        #[cfg(unix)]
        if let Some(terminate) = self.terminate.as_mut() {
            return tokio::select! {
                _ = terminate.recv() => "SIGTERM",
                _ = tokio::signal::ctrl_c() => "Ctrl-C",
            };
        }
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

/// `sluice hash-password`: reads one password line from stdin, prints its users-file verifier.
pub fn hash_password() -> Result<ExitCode> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| sluice_engine::SluiceError::io("<stdin>", e))?;
    let password = line.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(sluice_engine::SluiceError::invalid(
            "no password on stdin (give one line)",
        ));
    }
    println!("{}", Verifier::generate(password)?.to_text());
    Ok(ExitCode::SUCCESS)
}
