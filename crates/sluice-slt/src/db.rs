//! The sqllogictest database: one [`SluiceSession`] per test file.
//!
//! Each record's SQL is planned against the session's context (so `SET`, DDL and DML take effect there)
//! and its physical plan runs through the session's job runner, the same path `sluice sql` uses. Errors
//! are worded as DataFusion's own runner words them (`DataFusion error: …`), because the files' expected
//! error patterns match that text.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::error::DataFusionError;
use sluice_engine::session::collect_stream;
use sluice_engine::{SluiceConfig, SluiceError, SluiceSession};
use sluice_runtime::JobRunner;
use sluice_server::RemoteSession;
use sqllogictest::{AsyncDB, DBOutput};

use crate::format::{SltColumnType, batch_rows, column_types};

/// An error as a test file expects to see it.
#[derive(Debug, thiserror::Error)]
pub enum SltError {
    /// Raised by DataFusion.
    #[error("DataFusion error: {}", .0.strip_backtrace())]
    DataFusion(DataFusionError),
    /// Raised by Arrow while formatting.
    #[error("Arrow error: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// Anything else.
    #[error("Other Error: {0}")]
    Other(String),
    /// Raised by a remote server: its message is the text local mode gives, so it reads as
    /// DataFusion's runner words it.
    #[error("DataFusion error: {0}")]
    Remote(String),
}

impl From<SluiceError> for SltError {
    fn from(error: SluiceError) -> Self {
        match error {
            SluiceError::DataFusion(error) => SltError::DataFusion(error),
            SluiceError::Arrow(error) => SltError::Arrow(error),
            other => SltError::Other(other.to_string()),
        }
    }
}

/// What DataFusion's files print in place of the directory its runner works in.
const WORKING_DIR_ALIAS: &str = "WORKSPACE_ROOT/datafusion/sqllogictest";

/// Where a connection's statements run.
#[derive(Debug)]
enum Backend {
    /// A session in this process, through its job runner.
    Local(SluiceSession),
    /// A session on a `sluice server` (`--connect`).
    Remote(RemoteSession),
}

/// A sqllogictest connection backed by a Sluice session, here or on a server.
#[derive(Debug)]
pub struct SltDb {
    backend: Backend,
    /// The working directory as it appears in file paths of results (object-store style, no leading
    /// `/`), replaced by [`WORKING_DIR_ALIAS`] so that expected paths match.
    working_dir: Option<String>,
}

impl SltDb {
    /// A fresh session with `config`, running queries through `runner`.
    pub fn new(config: &SluiceConfig, runner: Arc<dyn JobRunner>) -> Result<Self, SltError> {
        Ok(Self {
            backend: Backend::Local(SluiceSession::new(config, runner)?),
            working_dir: working_dir(),
        })
    }

    /// A fresh session on the server at `url`, with `config`'s settings replayed as `SET`s (those
    /// not at their defaults), so the files see what a local session would.
    pub async fn connect(url: &str, config: &SluiceConfig) -> Result<Self, SltError> {
        let session = RemoteSession::connect(url)
            .await
            .map_err(|status| SltError::Other(format!("{url}: {}", status.message())))?;
        for (key, value) in &config.session {
            if value.source != "default" {
                let text = value.value.replace('\'', "''");
                session
                    .execute(&format!("SET {key} = '{text}'"))
                    .await
                    .map_err(|status| {
                        SltError::Other(format!("{url}: setting {key}: {}", status.message()))
                    })?;
            }
        }
        Ok(Self {
            backend: Backend::Remote(session),
            working_dir: working_dir(),
        })
    }

    /// Runs `sql` on the server: one statement, its announced schema's column types.
    async fn run_remote(
        session: &mut RemoteSession,
        sql: &str,
    ) -> Result<(Vec<SltColumnType>, Vec<arrow::array::RecordBatch>), SltError> {
        let output = session.execute(sql).await.map_err(|status| {
            // Statement failures read as local ones; failures to reach or use the server do not.
            match status.code() {
                tonic::Code::Unavailable
                | tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied
                | tonic::Code::Unimplemented => {
                    SltError::Other(format!("{}: {}", session.url(), status.message()))
                }
                _ => SltError::Remote(status.message().to_string()),
            }
        })?;
        Ok((column_types(output.schema.fields()), output.batches))
    }

    fn normalize_paths(&self, rows: &mut [Vec<String>]) {
        let Some(dir) = &self.working_dir else {
            return;
        };
        for cell in rows.iter_mut().flatten() {
            if cell.contains(dir.as_str()) {
                *cell = cell.replace(dir.as_str(), WORKING_DIR_ALIAS);
            }
        }
    }
}

impl SltDb {
    /// A statement's result as the runner compares it.
    fn output(
        &self,
        types: Vec<SltColumnType>,
        batches: &[arrow::array::RecordBatch],
    ) -> Result<DBOutput<SltColumnType>, SltError> {
        let mut rows = batch_rows(batches)?;
        self.normalize_paths(&mut rows);
        if rows.is_empty() && types.is_empty() {
            Ok(DBOutput::StatementComplete(0))
        } else {
            Ok(DBOutput::Rows { types, rows })
        }
    }
}

/// The working directory as result paths show it (object-store style, no leading `/`).
fn working_dir() -> Option<String> {
    std::env::current_dir()
        .ok()
        .map(|dir| dir.to_string_lossy().trim_start_matches('/').to_string())
        .filter(|dir| !dir.is_empty())
}

#[async_trait]
impl AsyncDB for SltDb {
    type Error = SltError;
    type ColumnType = SltColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<SltColumnType>, SltError> {
        let session = match &mut self.backend {
            Backend::Local(session) => session,
            Backend::Remote(remote) => {
                let (types, batches) = Self::run_remote(remote, sql).await?;
                return self.output(types, &batches);
            }
        };
        let mut statements = session.parse_sql(sql)?;
        // Like DataFusion's `SessionContext::sql`: exactly one statement per record.
        let statement = match (statements.pop(), statements.is_empty()) {
            (Some(statement), true) => statement,
            (Some(_), false) => {
                return Err(SltError::DataFusion(DataFusionError::NotImplemented(
                    "The context currently only supports a single SQL statement".into(),
                )));
            }
            (None, _) => {
                return Err(SltError::DataFusion(DataFusionError::Plan(
                    "No SQL statements were provided in the query string".into(),
                )));
            }
        };
        let stream = session.execute_statement(statement).await?;
        let types = column_types(stream.schema().fields());
        let output = collect_stream(stream).await?;
        self.output(types, &output.batches)
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "sluice"
    }

    async fn sleep(duration: Duration) {
        tokio::time::sleep(duration).await;
    }
}
