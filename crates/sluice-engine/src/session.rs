//! A Sluice session: one DataFusion `SessionContext` (catalog, settings, functions) plus the job runner
//! of the configured mode.
//!
//! SQL text may hold several statements. Each is planned against the context, so DDL and `SET` take
//! effect in the session; the resulting physical plan then runs through the [`JobRunner`], the single
//! path by which any query executes. Errors raised while reading data are annotated with the tables the
//! statement reads, so that "incorrect number of fields" says which CSV table it came from.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::error::DataFusionError;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParserBuilder, Statement};
use datafusion::sql::sqlparser::dialect::dialect_from_str;
use futures::{StreamExt, TryStreamExt};

use crate::catalog::{TableSource, register_table};
use crate::config::SluiceConfig;
use crate::error::{Result, SluiceError};
use crate::runner::{JobRunner, runner_for};
use sluice_planner::{JobGraph, JobTopology};

/// The output of one statement, fully collected.
#[derive(Debug, Clone)]
pub struct StatementOutput {
    /// The schema of the result (also meaningful when there are no rows).
    pub schema: SchemaRef,
    /// The result batches in order.
    pub batches: Vec<RecordBatch>,
}

impl StatementOutput {
    /// Number of rows over all batches.
    pub fn row_count(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

/// A session: a DataFusion context, the registered tables and the job runner.
pub struct SluiceSession {
    ctx: SessionContext,
    runner: Arc<dyn JobRunner>,
    tables: BTreeMap<String, TableSource>,
}

impl std::fmt::Debug for SluiceSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SluiceSession")
            .field("session_id", &self.ctx.session_id())
            .field("runner", &self.runner)
            .field("tables", &self.tables.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl SluiceSession {
    /// A session with `config`'s settings, memory budget and mode.
    pub fn new(config: &SluiceConfig) -> Result<Self> {
        let session_config = config.session_config()?;
        let mut runtime = RuntimeEnvBuilder::new();
        if let Some(limit) = config.memory_limit.value {
            let bytes = usize::try_from(limit.0).unwrap_or(usize::MAX);
            runtime = runtime.with_memory_limit(bytes, 1.0);
        }
        let ctx = SessionContext::new_with_config_rt(session_config, runtime.build_arc()?);
        Ok(Self {
            ctx,
            runner: runner_for(config),
            tables: BTreeMap::new(),
        })
    }

    /// The DataFusion context (catalog, settings, functions).
    pub fn context(&self) -> &SessionContext {
        &self.ctx
    }

    /// Replaces the runner (for a runner with non-default options, such as a local cluster with a
    /// fault hook in tests); the session's settings stay those of its configured mode.
    pub fn set_runner(&mut self, runner: Arc<dyn JobRunner>) {
        self.runner = runner;
    }

    /// The runner that executes this session's queries.
    pub fn runner(&self) -> &Arc<dyn JobRunner> {
        &self.runner
    }

    /// The tables registered from files, by name.
    pub fn tables(&self) -> &BTreeMap<String, TableSource> {
        &self.tables
    }

    /// Registers a file-backed table; a second table of the same name is an error.
    pub async fn register_table(&mut self, source: TableSource) -> Result<()> {
        if let Some(previous) = self.tables.get(&source.name) {
            return Err(SluiceError::invalid(format!(
                "table '{}' is given twice ({} and {})",
                source.name,
                previous.path.display(),
                source.path.display()
            )));
        }
        register_table(&self.ctx, &source).await?;
        self.tables.insert(source.name.clone(), source);
        Ok(())
    }

    /// Splits SQL text into statements using the session's SQL dialect.
    pub fn parse_sql(&self, sql: &str) -> Result<Vec<Statement>> {
        let state = self.ctx.state();
        let options = state.config_options();
        let dialect_name = options.sql_parser.dialect.to_string();
        let dialect = dialect_from_str(&dialect_name).ok_or_else(|| {
            SluiceError::invalid(format!("unsupported SQL dialect '{dialect_name}'"))
        })?;
        let statements = DFParserBuilder::new(sql)
            .with_dialect(dialect.as_ref())
            .with_recursion_limit(options.sql_parser.recursion_limit.get())
            .build()?
            .parse_statements()?;
        Ok(statements.into_iter().collect())
    }

    /// Plans one statement to a physical plan. DDL and `SET` take effect here.
    pub async fn plan_statement(&self, statement: Statement) -> Result<Arc<dyn ExecutionPlan>> {
        let state = self.ctx.state();
        let logical = state.statement_to_plan(statement).await?;
        let frame = self.ctx.execute_logical_plan(logical).await?;
        Ok(frame.create_physical_plan().await?)
    }

    /// Plans and starts one statement; the stream does the work as it is polled.
    pub async fn execute_statement(
        &self,
        statement: Statement,
    ) -> Result<SendableRecordBatchStream> {
        let sources = self.sources_read_by(&statement);
        let plan = self.plan_statement(statement).await?;
        let stream = self.runner.execute(plan, self.ctx.task_ctx())?;
        if sources.is_empty() {
            return Ok(stream);
        }
        let schema = stream.schema();
        let annotated = stream.map_err(move |error| annotate_read_error(error, &sources));
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, annotated)))
    }

    /// Plans one query and cuts it into a job graph and its task regions (EXPLAIN DISTRIBUTED).
    pub async fn job_graph(&self, sql: &str) -> Result<(JobGraph, JobTopology)> {
        let mut statements = self.parse_sql(sql)?;
        let statement = match (statements.pop(), statements.is_empty()) {
            (Some(statement), true) => statement,
            (None, _) => return Err(SluiceError::invalid("no SQL statement to explain")),
            (Some(_), false) => {
                return Err(SluiceError::invalid(
                    "EXPLAIN DISTRIBUTED takes exactly one statement",
                ));
            }
        };
        let plan = self.plan_statement(statement).await?;
        let graph = JobGraph::try_new(plan)?;
        let topology = JobTopology::try_new(&graph)?;
        Ok((graph, topology))
    }

    /// Runs every statement in `sql` and collects each one's output.
    pub async fn run_sql(&self, sql: &str) -> Result<Vec<StatementOutput>> {
        let mut outputs = Vec::new();
        for statement in self.parse_sql(sql)? {
            let stream = self.execute_statement(statement).await?;
            outputs.push(collect_stream(stream).await?);
        }
        Ok(outputs)
    }

    /// "name (path)" for each file-backed table the statement reads.
    fn sources_read_by(&self, statement: &Statement) -> String {
        let Ok(references) = self.ctx.state().resolve_table_references(statement) else {
            return String::new();
        };
        references
            .iter()
            .filter_map(|reference| self.tables.get(reference.table()))
            .map(|source| format!("'{}' ({})", source.name, source.path.display()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Collects a stream into a [`StatementOutput`].
pub async fn collect_stream(stream: SendableRecordBatchStream) -> Result<StatementOutput> {
    let schema = stream.schema();
    let batches = stream
        .filter_map(|batch| async move {
            match batch {
                Ok(batch) if batch.num_rows() == 0 => None,
                other => Some(other),
            }
        })
        .try_collect()
        .await?;
    Ok(StatementOutput { schema, batches })
}

/// Adds the tables a statement reads to errors that come from reading data.
fn annotate_read_error(error: DataFusionError, sources: &str) -> DataFusionError {
    let from_data = matches!(
        error.find_root(),
        DataFusionError::ArrowError(..)
            | DataFusionError::ParquetError(..)
            | DataFusionError::IoError(..)
            | DataFusionError::ObjectStore(..)
    );
    if from_data {
        error.context(format!("reading table {sources}"))
    } else {
        error
    }
}

/// The query after a leading `EXPLAIN DISTRIBUTED` (any case), if `sql` starts with it.
pub fn strip_explain_distributed(sql: &str) -> Option<&str> {
    let mut rest = sql.trim_start();
    for word in ["explain", "distributed"] {
        let head = rest.get(..word.len())?;
        let next = rest[word.len()..].chars().next();
        if !head.eq_ignore_ascii_case(word) || !next.is_some_and(char::is_whitespace) {
            return None;
        }
        rest = rest[word.len()..].trim_start();
    }
    Some(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_several_statements_in_order() {
        let session = SluiceSession::new(&SluiceConfig::default()).unwrap();
        let outputs = session
            .run_sql("create view v as select 1 as a union all select 2; select sum(a) from v;")
            .await
            .unwrap();
        assert_eq!(outputs.len(), 2);
        assert_eq!(outputs[1].row_count(), 1);
        let formatted = arrow::util::pretty::pretty_format_batches(&outputs[1].batches)
            .unwrap()
            .to_string();
        assert!(formatted.contains("| 3 "), "{formatted}");
    }

    #[test]
    fn explain_distributed_prefix_is_recognised() {
        assert_eq!(
            strip_explain_distributed("  EXPLAIN\n distributed select 1"),
            Some("select 1")
        );
        assert_eq!(strip_explain_distributed("explain select 1"), None);
        assert_eq!(strip_explain_distributed("explaindistributed x"), None);
    }

    #[tokio::test]
    async fn syntax_errors_are_errors() {
        let session = SluiceSession::new(&SluiceConfig::default()).unwrap();
        let error = session.run_sql("selec 1").await.unwrap_err();
        assert!(error.to_string().contains("SQL error"), "{error}");
    }

    #[tokio::test]
    async fn set_statements_change_the_session() {
        let session = SluiceSession::new(&SluiceConfig::default()).unwrap();
        session
            .run_sql("set datafusion.execution.batch_size = 77")
            .await
            .unwrap();
        assert_eq!(session.context().state().config().batch_size(), 77);
    }
}
