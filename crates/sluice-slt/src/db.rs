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

/// A sqllogictest connection backed by a Sluice session.
#[derive(Debug)]
pub struct SltDb {
    session: SluiceSession,
    /// The working directory as it appears in file paths of results (object-store style, no leading
    /// `/`), replaced by [`WORKING_DIR_ALIAS`] so that expected paths match.
    working_dir: Option<String>,
}

impl SltDb {
    /// A fresh session with `config`, running queries through `runner`.
    pub fn new(config: &SluiceConfig, runner: Arc<dyn JobRunner>) -> Result<Self, SltError> {
        let working_dir = std::env::current_dir()
            .ok()
            .map(|dir| dir.to_string_lossy().trim_start_matches('/').to_string())
            .filter(|dir| !dir.is_empty());
        Ok(Self {
            session: SluiceSession::new(config, runner)?,
            working_dir,
        })
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

#[async_trait]
impl AsyncDB for SltDb {
    type Error = SltError;
    type ColumnType = SltColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<SltColumnType>, SltError> {
        let mut statements = self.session.parse_sql(sql)?;
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
        let stream = self.session.execute_statement(statement).await?;
        let types = column_types(stream.schema().fields());
        let output = collect_stream(stream).await?;
        let mut rows = batch_rows(&output.batches)?;
        self.normalize_paths(&mut rows);
        if rows.is_empty() && types.is_empty() {
            Ok(DBOutput::StatementComplete(0))
        } else {
            Ok(DBOutput::Rows { types, rows })
        }
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "sluice"
    }

    async fn sleep(duration: Duration) {
        tokio::time::sleep(duration).await;
    }
}
