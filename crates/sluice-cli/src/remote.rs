//! The CLI as a client of a `sluice server` (`--connect grpc://HOST:PORT`): [`Remote`] runs
//! statements in a session of its own on the server, keeps the server's latest progress line for
//! the CLI's progress display, and turns server errors into the one-line errors local mode prints.
//!
//! Invariant: dropping a statement's future (Ctrl-C) drops its `DoGet`, which ends the statement's
//! stream on the server and with it the job on every worker.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use arrow::array::RecordBatch;
use futures::future::BoxFuture;
use sluice_engine::{Result, SluiceError};
use sluice_runtime::{DriverCounters, JobRunner};
use sluice_server::{RemoteOutput, RemoteSession, Status};
use sluice_tpch::bench::QueryTarget;

/// Where the CLI's progress display reads from: the runner of this process, or the server.
pub trait ProgressSource: Sync {
    /// The running job's progress line, if any.
    fn progress_line(&self) -> BoxFuture<'static, Option<String>>;
    /// Lines the user should read since the last call.
    fn take_notices(&self) -> BoxFuture<'static, Vec<String>>;
}

impl ProgressSource for Arc<dyn JobRunner> {
    fn progress_line(&self) -> BoxFuture<'static, Option<String>> {
        JobRunner::progress_line(self.as_ref())
    }

    fn take_notices(&self) -> BoxFuture<'static, Vec<String>> {
        JobRunner::take_notices(self.as_ref())
    }
}

/// A session on a server.
#[derive(Debug)]
pub struct Remote {
    session: RemoteSession,
    latest: Arc<Mutex<Option<String>>>,
    target_partitions: usize,
}

/// A server's error as the CLI prints it: its message on one line.
pub fn remote_error(status: Status) -> SluiceError {
    let message = status
        .message()
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    SluiceError::invalid(message)
}

/// The CA certificate (PEM) `grpc+tls://` servers are checked against (`--server-ca`), read once.
static SERVER_CA: OnceLock<Option<Vec<u8>>> = OnceLock::new();

/// Reads `--server-ca FILE`, if given; an unreadable file is an error naming it.
pub fn read_server_ca(file: Option<&Path>) -> Result<()> {
    let ca = file
        .map(|path| std::fs::read(path).map_err(|e| SluiceError::io(path, e)))
        .transpose()?;
    let _ = SERVER_CA.set(ca);
    Ok(())
}

impl Remote {
    /// Opens a session on the server at `url` (`grpc+tls://` checked against `--server-ca`).
    pub async fn connect(url: &str) -> Result<Self> {
        let ca = SERVER_CA.get().and_then(Option::as_deref);
        let session = RemoteSession::connect_with_ca(url, ca)
            .await
            .map_err(remote_error)?;
        let mut remote = Self {
            session,
            latest: Arc::new(Mutex::new(None)),
            target_partitions: 0,
        };
        let settings = remote
            .run("SHOW datafusion.execution.target_partitions")
            .await?;
        remote.target_partitions = first_value(&settings.batches)
            .and_then(|value| value.parse().ok())
            .unwrap_or(0);
        Ok(remote)
    }

    /// The server's address.
    pub fn url(&self) -> &str {
        self.session.url()
    }

    /// Runs one statement, keeping the server's progress line while it runs.
    pub async fn run(&self, sql: &str) -> Result<RemoteOutput> {
        // A statement cancelled with Ctrl-C left its last line behind.
        if let Ok(mut latest) = self.latest.lock() {
            *latest = None;
        }
        let latest = self.latest.clone();
        let keep = move |line: &str| {
            if let Ok(mut latest) = latest.lock() {
                *latest = Some(line.to_string());
            }
        };
        let output = self.session.execute_with_progress(sql, &keep).await;
        if let Ok(mut latest) = self.latest.lock() {
            *latest = None;
        }
        output.map_err(remote_error)
    }
}

/// The second column of the first row (`SHOW`'s value), as text.
fn first_value(batches: &[RecordBatch]) -> Option<String> {
    let batch = batches.iter().find(|batch| batch.num_rows() > 0)?;
    let column = batch.columns().last()?;
    arrow::util::display::array_value_to_string(column, 0).ok()
}

impl ProgressSource for Remote {
    fn progress_line(&self) -> BoxFuture<'static, Option<String>> {
        let line = self.latest.lock().ok().and_then(|latest| latest.clone());
        Box::pin(async move { line })
    }

    fn take_notices(&self) -> BoxFuture<'static, Vec<String>> {
        Box::pin(async { Vec::new() })
    }
}

impl QueryTarget for Remote {
    fn run_statement<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<Vec<RecordBatch>>> {
        Box::pin(async move { Ok(self.run(sql).await?.batches) })
    }

    fn counters(&self) -> BoxFuture<'_, DriverCounters> {
        // The server's driver counts for all its clients; this client cannot tell its own share.
        Box::pin(async { DriverCounters::default() })
    }

    fn mode_name(&self) -> String {
        format!("server {}", self.url())
    }

    fn target_partitions(&self) -> usize {
        self.target_partitions
    }
}
