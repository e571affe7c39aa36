//! A Sluice session: one DataFusion `SessionContext` (catalog, settings, functions) plus the job runner
//! of the configured mode.
//!
//! SQL text may hold several statements. Each is planned against the context, so DDL and `SET` take
//! effect in the session; the resulting physical plan then runs through the [`JobRunner`], the single
//! path by which any query executes. Errors raised while reading data are annotated with the tables the
//! statement reads, so that "incorrect number of fields" says which CSV table it came from.
//!
//! Sluice adds one statement to DataFusion's SQL: `EXPLAIN DISTRIBUTED [FORMAT TEXT|JSON] <query>`,
//! which plans the query, cuts it into its job graph and returns the graph (stages, exchanges, task
//! regions) as one row of one `plan` column, in any mode.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{ParamValues, ScalarValue};
use datafusion::dataframe::DataFrame;
use datafusion::error::DataFusionError;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::Statement as LogicalStatement;
use datafusion::logical_expr::{LogicalPlan, LogicalPlanBuilder};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::memory::MemoryStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::SessionConfig;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParserBuilder, Statement};
use datafusion::sql::sqlparser::dialect::dialect_from_str;
use datafusion::sql::sqlparser::parser::ParserError;
use datafusion::sql::sqlparser::tokenizer::Token;
use futures::{StreamExt, TryStreamExt};
use sluice_runtime::object_stores::{ObjectStores, StoreLimits};

use crate::access::{Access, AccessSlot};
use crate::catalog::{TableSource, register_table};
use crate::config::SluiceConfig;
use crate::error::{Result, SluiceError};
use crate::join_fallback::{SortMergeFallback, first_run_context, with_fallback};
use crate::joins::physical_optimizer_rules;
use crate::scan_balance::balance_scans;
use crate::system_tables::register_system_tables;
use sluice_planner::JobGraph;
use sluice_planner::explain::{explain_json, explain_text};
use sluice_runtime::{JobLabel, JobRunner};

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

/// A statement planned by [`SluiceSession::plan`], ready to run.
#[derive(Debug)]
pub enum PlannedStatement {
    /// A physical plan for the runner, and the file-backed tables it reads (named in read errors).
    Plan {
        /// What runs.
        plan: Arc<dyn ExecutionPlan>,
        /// "'name' (path)" of each table it reads.
        sources: String,
        /// What runs instead if `plan`'s hash joins run out of memory (`joins = "auto"` under a
        /// memory limit).
        fallback: Option<SortMergeFallback>,
    },
    /// An answer known at planning time (`EXPLAIN DISTRIBUTED`).
    Ready(RecordBatch),
}

impl PlannedStatement {
    /// The schema the statement returns (nullability included).
    pub fn schema(&self) -> SchemaRef {
        match self {
            Self::Plan { plan, .. } => plan.schema(),
            Self::Ready(batch) => batch.schema(),
        }
    }
}

/// How `EXPLAIN DISTRIBUTED` prints the job graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExplainFormat {
    /// Indented stages and regions.
    #[default]
    Text,
    /// One JSON document.
    Json,
}

/// One statement of SQL text: DataFusion's, or one Sluice adds.
#[derive(Debug, Clone)]
pub enum SluiceStatement {
    /// A DataFusion statement (queries, DDL, `SET`, `EXPLAIN`, …).
    Sql(Statement),
    /// `EXPLAIN DISTRIBUTED [FORMAT TEXT|JSON] <statement>`: the statement's job graph.
    ExplainDistributed {
        /// The statement to explain.
        statement: Statement,
        /// How to print it.
        format: ExplainFormat,
    },
}

/// A session: a DataFusion context, the registered tables and the job runner.
pub struct SluiceSession {
    ctx: SessionContext,
    runner: Arc<dyn JobRunner>,
    tables: BTreeMap<String, TableSource>,
    /// The configuration's [`SluiceConfig::distributed_defaults`], each with the value the session
    /// started with: a distributed plan uses the default while the session still has that value.
    distributed_defaults: Vec<(&'static str, String, String)>,
    /// Whether a query whose hash joins run out of memory runs again with sort-merge joins.
    join_fallback: bool,
    /// Who may read and write what ([`crate::access`]); empty: everything.
    access: AccessSlot,
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
    /// A session with `config`'s settings and memory budget whose queries run through `runner` (the
    /// runner of `config`'s mode; the front end picks it).
    pub fn new(config: &SluiceConfig, runner: Arc<dyn JobRunner>) -> Result<Self> {
        let session_config = config.session_config()?;
        let distributed_defaults = config
            .distributed_defaults()
            .into_iter()
            .map(|(key, value)| (key, value, option_value(session_config.options(), key)))
            .collect();
        let mut runtime = RuntimeEnvBuilder::new()
            .with_object_store_registry(ObjectStores::new(StoreLimits::default()).into_registry());
        if let Some(limit) = config.memory_limit.value {
            let bytes = usize::try_from(limit.0).unwrap_or(usize::MAX);
            runtime = runtime.with_memory_limit(bytes, 1.0);
        }
        let access = AccessSlot::default();
        let ctx = new_context(
            session_config,
            runtime.build_arc()?,
            physical_optimizer_rules(config.sort_merge_joins()),
            access.clone(),
        );
        register_system_tables(&ctx, Arc::clone(&runner), access.clone())?;
        Ok(Self {
            ctx,
            runner,
            tables: BTreeMap::new(),
            distributed_defaults,
            join_fallback: config.join_fallback(),
            access,
        })
    }

    /// The DataFusion context (catalog, settings, functions).
    pub fn context(&self) -> &SessionContext {
        &self.ctx
    }

    /// Replaces the runner (for a runner with non-default options, such as a local cluster with a
    /// fault hook in tests); the session's settings stay those of its configured mode.
    pub fn set_runner(&mut self, runner: Arc<dyn JobRunner>) -> Result<()> {
        register_system_tables(&self.ctx, Arc::clone(&runner), self.access.clone())?;
        self.runner = runner;
        Ok(())
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
                source.name, previous.location, source.location
            )));
        }
        register_table(&self.ctx, &source).await?;
        self.tables.insert(source.name.clone(), source);
        Ok(())
    }

    /// Splits SQL text into statements using the session's SQL dialect; `EXPLAIN DISTRIBUTED` is
    /// recognised here.
    pub fn parse_sql(&self, sql: &str) -> Result<Vec<SluiceStatement>> {
        let state = self.ctx.state();
        let options = state.config_options();
        let dialect_name = options.sql_parser.dialect.to_string();
        let dialect = dialect_from_str(&dialect_name).ok_or_else(|| {
            SluiceError::invalid(format!("unsupported SQL dialect '{dialect_name}'"))
        })?;
        let mut parser = DFParserBuilder::new(sql)
            .with_dialect(dialect.as_ref())
            .with_recursion_limit(options.sql_parser.recursion_limit.get())
            .build()?;
        let mut statements = Vec::new();
        let mut expecting_delimiter = false;
        loop {
            while parser.parser.consume_token(&Token::SemiColon) {
                expecting_delimiter = false;
            }
            let next = parser.parser.peek_token();
            if next.token == Token::EOF {
                break;
            }
            if expecting_delimiter {
                let message = format!(
                    "Expected: end of statement, found: {next}{}",
                    next.span.start
                );
                return Err(DataFusionError::SQL(
                    Box::new(ParserError::ParserError(message)),
                    None,
                )
                .into());
            }
            let explain_distributed = is_word(&parser.parser.peek_nth_token(0).token, "explain")
                && is_word(&parser.parser.peek_nth_token(1).token, "distributed");
            let statement = if explain_distributed {
                parser.parser.next_token();
                parser.parser.next_token();
                let format = explain_format(&mut parser.parser)?;
                SluiceStatement::ExplainDistributed {
                    statement: parser.parse_statement()?,
                    format,
                }
            } else {
                SluiceStatement::Sql(parser.parse_statement()?)
            };
            statements.push(statement);
            expecting_delimiter = true;
        }
        Ok(statements)
    }

    /// Limits what this session may read and write from now on (`None`: nothing is checked);
    /// sessions forked from it later keep the same access.
    pub fn grant(&self, access: Option<Arc<Access>>) {
        self.access.set(access);
    }

    /// The slot holding this session's access, for a login that grants it later (a Postgres
    /// connection's session is made before its user logs in).
    pub fn access_slot(&self) -> AccessSlot {
        self.access.clone()
    }

    /// The access this session runs with (`None`: unrestricted).
    pub fn access(&self) -> Option<Arc<Access>> {
        self.access.get()
    }

    /// Executes `logical` in the session's context (DDL and `SET` take effect here) once the
    /// session's access allows it.
    async fn execute_checked(&self, logical: LogicalPlan) -> Result<DataFrame> {
        self.authorize(&logical)?;
        // DataFusion resets only its own settings: Sluice's go back to their defaults here.
        if let LogicalPlan::Statement(LogicalStatement::ResetVariable(reset)) = &logical
            && reset.variable.to_ascii_lowercase().starts_with("sluice.")
        {
            let default = sluice_runtime::options::sluice_default_of(&reset.variable)?;
            self.ctx
                .state_ref()
                .write()
                .config_mut()
                .options_mut()
                .set(&reset.variable.to_ascii_lowercase(), &default)?;
            let nothing = LogicalPlanBuilder::empty(false).build()?;
            return Ok(DataFrame::new(self.ctx.state(), nothing));
        }
        Ok(self.ctx.execute_logical_plan(logical).await?)
    }

    /// Whether the session's access allows `logical` ([`Access::authorize`]).
    fn authorize(&self, logical: &LogicalPlan) -> Result<()> {
        match self.access.get() {
            Some(access) => access.authorize(logical, &self.tables),
            None => Ok(()),
        }
    }

    /// Plans one statement to a physical plan. DDL and `SET` take effect here.
    pub async fn plan_statement(&self, statement: Statement) -> Result<Arc<dyn ExecutionPlan>> {
        let state = self.ctx.state();
        let logical = state.statement_to_plan(statement).await?;
        let frame = self.execute_checked(logical).await?;
        Ok(self.physical_plan(frame).await?.0)
    }

    /// `frame`'s physical plan, prepared for the session's runner (a runner of job graphs gets
    /// balanced scans, [`crate::scan_balance`]), and its sort-merge fallback if it has one.
    async fn physical_plan(
        &self,
        frame: DataFrame,
    ) -> Result<(Arc<dyn ExecutionPlan>, Option<SortMergeFallback>)> {
        let state = self.ctx.state();
        let logical = frame.logical_plan().clone();
        let mut plan = frame.create_physical_plan().await?;
        let balance = self.runner.runs_job_graphs();
        if balance {
            plan = balance_scans(plan, &self.ctx.runtime_env()).await?;
        }
        if !self.join_fallback {
            return Ok((plan, None));
        }
        // Distributed defaults the session still holds (not `SET` since): sort-merge plans keep
        // DataFusion's own values.
        let options = state.config().options();
        let resets: Vec<&str> = self
            .distributed_defaults
            .iter()
            .filter(|(key, value, _)| option_value(options, key) == *value)
            .map(|(key, _, _)| *key)
            .collect();
        let fallback = SortMergeFallback::of(&plan, logical, &state, &resets, balance)?;
        Ok((plan, fallback))
    }

    /// Plans and starts one statement; the stream does the work as it is polled.
    pub async fn execute_statement(
        &self,
        statement: SluiceStatement,
    ) -> Result<SendableRecordBatchStream> {
        let planned = self.plan(statement).await?;
        self.run(planned)
    }

    /// Plans one statement without running it: DDL and `SET` take effect now, a query's result
    /// schema is known (front ends answer "what will this return" before any work starts) and
    /// [`Self::run`] starts it later.
    pub async fn plan(&self, statement: SluiceStatement) -> Result<PlannedStatement> {
        let statement = match statement {
            SluiceStatement::Sql(statement) => statement,
            SluiceStatement::ExplainDistributed { statement, format } => {
                let text = self.explain_distributed(statement, format).await?;
                return Ok(PlannedStatement::Ready(explain_batch(text)?));
            }
        };
        let sources = self.sources_read_by(&statement);
        let logical = self.ctx.state().statement_to_plan(statement).await?;
        let frame = self.execute_checked(logical).await?;
        let (plan, fallback) = self.physical_plan(frame).await?;
        Ok(PlannedStatement::Plan {
            plan,
            sources,
            fallback,
        })
    }

    /// Starts a planned statement through the session's runner; the stream does the work as it is
    /// polled and cancels the job when dropped.
    pub fn run(&self, planned: PlannedStatement) -> Result<SendableRecordBatchStream> {
        self.run_with_context(planned, self.ctx.task_ctx())
    }

    /// [`Self::run`] for a front end that names the statement: the driver lists its job under
    /// `label` (in its progress, and so in a front end's progress reports).
    pub fn run_labelled(
        &self,
        planned: PlannedStatement,
        label: JobLabel,
    ) -> Result<SendableRecordBatchStream> {
        let context = TaskContext::from(&self.ctx.state());
        let config = label.attach(context.session_config().clone());
        let context = context.with_session_config(config);
        self.run_with_context(planned, Arc::new(context))
    }

    fn run_with_context(
        &self,
        planned: PlannedStatement,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let (plan, sources, fallback) = match planned {
            PlannedStatement::Ready(batch) => {
                let schema = batch.schema();
                return Ok(Box::pin(MemoryStream::try_new(vec![batch], schema, None)?));
            }
            PlannedStatement::Plan {
                plan,
                sources,
                fallback,
            } => (plan, sources, fallback),
        };
        let stream = match fallback {
            None => self.runner.execute(plan, context)?,
            Some(fallback) => {
                let first = self.runner.execute(plan, first_run_context(&context))?;
                with_fallback(first, fallback, Arc::clone(&self.runner), context)
            }
        };
        if sources.is_empty() {
            return Ok(stream);
        }
        let schema = stream.schema();
        let annotated = stream.map_err(move |error| annotate_read_error(error, &sources));
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, annotated)))
    }

    /// Plans the one statement `sql` holds with `parameters` bound to its `$1`, `$2`, …
    /// placeholders (none: planned as is).
    pub async fn plan_with_parameters(
        &self,
        sql: &str,
        parameters: Vec<ScalarValue>,
    ) -> Result<PlannedStatement> {
        let statement = self.one_sql_statement(sql)?;
        let sources = self.sources_read_by(&statement);
        let mut logical = self.ctx.state().statement_to_plan(statement).await?;
        if !parameters.is_empty() {
            logical = logical.with_param_values(ParamValues::from(parameters))?;
        }
        let frame = self.execute_checked(logical).await?;
        let (plan, fallback) = self.physical_plan(frame).await?;
        Ok(PlannedStatement::Plan {
            plan,
            sources,
            fallback,
        })
    }

    /// Plans `logical`, the plan a front end made of `statement` with its own SQL front end (the
    /// Postgres wire's, which rewrites `pg_catalog` idioms), parameters already bound: DDL and `SET`
    /// take effect now, as in [`Self::plan`].
    pub async fn plan_logical(
        &self,
        statement: &Statement,
        logical: LogicalPlan,
    ) -> Result<PlannedStatement> {
        let sources = self.sources_read_by(statement);
        let frame = self.execute_checked(logical).await?;
        let (plan, fallback) = self.physical_plan(frame).await?;
        Ok(PlannedStatement::Plan {
            plan,
            sources,
            fallback,
        })
    }

    /// What the one statement `sql` holds would return, and the parameters it takes (`$1`, `$2`, …
    /// in order; a type the planner cannot infer is `Null`), without running or changing anything.
    pub async fn describe(&self, sql: &str) -> Result<(Schema, Schema)> {
        let statement = self.one_sql_statement(sql)?;
        let logical = self.ctx.state().statement_to_plan(statement).await?;
        let mut parameters: Vec<(usize, String, DataType)> = logical
            .get_parameter_types()?
            .into_iter()
            .map(|(name, data_type)| {
                let position = name.trim_start_matches('$').parse().unwrap_or(usize::MAX);
                (position, name, data_type.unwrap_or(DataType::Null))
            })
            .collect();
        parameters.sort();
        let parameters = Schema::new(
            parameters
                .into_iter()
                .map(|(_, name, data_type)| Field::new(name, data_type, true))
                .collect::<Vec<_>>(),
        );
        Ok((logical.schema().as_arrow().clone(), parameters))
    }

    /// The single DataFusion statement `sql` holds.
    fn one_sql_statement(&self, sql: &str) -> Result<Statement> {
        let mut statements = self.parse_sql(sql)?;
        match (statements.pop(), statements.is_empty()) {
            (Some(SluiceStatement::Sql(statement)), true) => Ok(statement),
            (Some(SluiceStatement::ExplainDistributed { .. }), true) => Err(SluiceError::invalid(
                "EXPLAIN DISTRIBUTED cannot be prepared: run it as a statement",
            )),
            (None, _) => Err(SluiceError::invalid("no SQL statement given")),
            (Some(_), false) => Err(SluiceError::invalid(
                "a prepared statement holds exactly one statement",
            )),
        }
    }

    /// A new session over the same tables, runner and memory pool, with a copy of this session's
    /// settings (and its join rule): what it creates or sets afterwards (tables, views, `SET`) stays its own.
    pub async fn fork(&self) -> Result<SluiceSession> {
        let state = self.ctx.state();
        let access = AccessSlot::holding(self.access.get());
        let ctx = new_context(
            state.config().clone(),
            state.runtime_env().clone(),
            state.physical_optimizers().to_vec(),
            access.clone(),
        );
        for name in self.tables.keys() {
            let provider = self.ctx.table_provider(name.as_str()).await?;
            ctx.register_table(name.as_str(), provider)?;
        }
        register_system_tables(&ctx, Arc::clone(&self.runner), access.clone())?;
        Ok(Self {
            ctx,
            runner: self.runner.clone(),
            tables: self.tables.clone(),
            distributed_defaults: self.distributed_defaults.clone(),
            join_fallback: self.join_fallback,
            access,
        })
    }

    /// Plans one query as a distributed run would (see [`Self::explain_distributed`]) and cuts it
    /// into a job graph (with its task regions).
    pub async fn job_graph(&self, sql: &str) -> Result<JobGraph> {
        let mut statements = self.parse_sql(sql)?;
        let statement = match (statements.pop(), statements.is_empty()) {
            (Some(SluiceStatement::Sql(statement)), true) => statement,
            (Some(SluiceStatement::ExplainDistributed { statement, .. }), true) => statement,
            (None, _) => return Err(SluiceError::invalid("no SQL statement to explain")),
            (Some(_), false) => {
                return Err(SluiceError::invalid(
                    "EXPLAIN DISTRIBUTED takes exactly one statement",
                ));
            }
        };
        self.distributed_graph(statement).await
    }

    /// `statement` planned as a distributed run plans it (its defaults unless the session changed
    /// them, and the settings it forces) and cut into its job graph.
    async fn distributed_graph(&self, statement: Statement) -> Result<JobGraph> {
        let mut state = self.ctx.state();
        apply_distributed_defaults(state.config_mut().options_mut(), &self.distributed_defaults)?;
        for (key, value) in sluice_planner::DISTRIBUTED_SETTINGS {
            state.config_mut().options_mut().set(key, value)?;
        }
        let logical = state.statement_to_plan(statement).await?;
        self.authorize(&logical)?;
        let plan = state.create_physical_plan(&logical).await?;
        let plan = balance_scans(plan, state.runtime_env()).await?;
        let (plan, _staging) = sluice_runtime::write::stage_file_writes(plan)?;
        let options = sluice_runtime::codec::with_session_switches(
            self.runner.graph_options(),
            state.config().options(),
        );
        Ok(JobGraph::try_new_with(plan, &options)?)
    }

    /// The job graph of `statement` as text or JSON. The statement is planned with the settings a
    /// distributed run forces (`DISTRIBUTED_SETTINGS`), in every mode, since that is the plan the
    /// job graph is cut from; nothing is executed and the session is not changed.
    pub async fn explain_distributed(
        &self,
        statement: Statement,
        format: ExplainFormat,
    ) -> Result<String> {
        let graph = self.distributed_graph(statement).await?;
        Ok(match format {
            ExplainFormat::Text => explain_text(&graph),
            ExplainFormat::Json => {
                let json = serde_json::to_string_pretty(&explain_json(&graph)).map_err(|e| {
                    SluiceError::invalid(format!("cannot print the job graph: {e}"))
                })?;
                json + "\n"
            }
        })
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
            .map(|source| format!("'{}' ({})", source.name, source.location))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A context with DataFusion's default features, `config`, `runtime` and these physical optimizer
/// rules (DataFusion's own, with the join rule the configuration selects).
/// Sets each of `defaults` (key, distributed value, the session's starting value) in `options`
/// whose value is still the one the session started with (a `SET` since then wins).
fn apply_distributed_defaults(
    options: &mut datafusion::config::ConfigOptions,
    defaults: &[(&'static str, String, String)],
) -> Result<()> {
    for (key, value, started) in defaults {
        if option_value(options, key) == *started {
            options.set(key, value)?;
        }
    }
    Ok(())
}

/// The current value of DataFusion option `key` as text (empty when unset or unknown).
fn option_value(options: &datafusion::config::ConfigOptions, key: &str) -> String {
    options
        .entries()
        .into_iter()
        .find(|entry| entry.key == key)
        .and_then(|entry| entry.value)
        .unwrap_or_default()
}

fn new_context(
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
    rules: Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>>,
    access: AccessSlot,
) -> SessionContext {
    // A config taken from a context made here says not to create the default catalog (the
    // context it came from had one): every new context gets its own.
    let config = config.with_create_default_catalog_and_schema(true);
    let mut builder = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime)
        .with_default_features()
        .with_physical_optimizer_rules(rules);
    // A directory location reads only its format's files (`table_factory`).
    for format in ["PARQUET", "CSV", "JSON", "NDJSON", "ARROW"] {
        builder = builder.with_table_factory(
            format.to_string(),
            Arc::new(crate::table_factory::DataFilesFactory::default()),
        );
    }
    builder = builder.with_table_factory(
        "DELTA".to_string(),
        Arc::new(crate::delta_table::DeltaTableFactory),
    );
    // A quoted path or URL is a table (`select * from 's3://bucket/trips/'`), as in DuckDB.
    let state = builder.build();
    let factory = Arc::new(crate::table_factory::DataFilesUrlFactory::new(
        datafusion_session::SessionStore::new(),
        access,
    ));
    let catalogs = Arc::new(datafusion::catalog::DynamicFileCatalog::new(
        Arc::clone(state.catalog_list()),
        Arc::clone(&factory) as Arc<dyn datafusion::catalog::UrlTableFactory>,
    ));
    let ctx: SessionContext = SessionStateBuilder::new_from_existing(state)
        .with_catalog_list(catalogs)
        .build()
        .into();
    factory.session_store().with_state(ctx.state_weak_ref());
    ctx
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

/// Whether `token` is the (unquoted) word `word`, in any case.
fn is_word(token: &Token, word: &str) -> bool {
    matches!(token, Token::Word(w) if w.quote_style.is_none() && w.value.eq_ignore_ascii_case(word))
}

/// An optional `FORMAT TEXT | FORMAT JSON` after `EXPLAIN DISTRIBUTED`.
fn explain_format(
    parser: &mut datafusion::sql::sqlparser::parser::Parser<'_>,
) -> Result<ExplainFormat> {
    if !is_word(&parser.peek_token().token, "format") {
        return Ok(ExplainFormat::Text);
    }
    parser.next_token();
    let format = parser.next_token();
    if is_word(&format.token, "text") {
        Ok(ExplainFormat::Text)
    } else if is_word(&format.token, "json") {
        Ok(ExplainFormat::Json)
    } else {
        let message = format!("Expected: TEXT or JSON after FORMAT, found: {format}");
        Err(DataFusionError::SQL(Box::new(ParserError::ParserError(message)), None).into())
    }
}

/// The schema of `EXPLAIN DISTRIBUTED`'s output: one `plan` column.
pub fn explain_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("plan", DataType::Utf8, false)]))
}

fn explain_batch(text: String) -> Result<RecordBatch> {
    Ok(RecordBatch::try_new(
        explain_schema(),
        vec![Arc::new(StringArray::from(vec![text]))],
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_several_statements_in_order() {
        let session = session();
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

    #[tokio::test]
    async fn reset_puts_a_sluice_setting_back_to_its_default() {
        let session = session();
        let shown = |session: &SluiceSession| {
            let state = session.ctx.state();
            state
                .config_options()
                .extensions
                .get::<sluice_runtime::options::SluiceOptions>()
                .map(|o| (o.skew_join_factor, o.broadcast_join_switch))
        };
        session
            .run_sql("SET sluice.skew_join_factor = 9; SET sluice.broadcast_join_switch = false")
            .await
            .unwrap();
        assert_eq!(shown(&session), Some((9, false)));
        session
            .run_sql("RESET sluice.skew_join_factor; RESET SLUICE.BROADCAST_JOIN_SWITCH")
            .await
            .unwrap();
        assert_eq!(shown(&session), Some((4, true)));
        let error = session.run_sql("RESET sluice.nope").await.unwrap_err();
        assert!(
            error
                .to_string()
                .contains("there is no setting sluice.nope; Sluice's settings are "),
            "{error}"
        );
        // DataFusion's own still reset as before.
        session
            .run_sql(
                "SET datafusion.optimizer.max_passes = 7; RESET datafusion.optimizer.max_passes",
            )
            .await
            .unwrap();
        assert_eq!(session.ctx.state().config_options().optimizer.max_passes, 3);
    }

    fn session() -> SluiceSession {
        SluiceSession::new(
            &SluiceConfig::default(),
            Arc::new(sluice_runtime::LocalRunner),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn distributed_plans_of_a_local_session_use_the_distributed_defaults_until_a_set() {
        let key = "datafusion.optimizer.hash_join_single_partition_threshold";
        let session = session();
        assert_eq!(
            session.distributed_defaults,
            [(key, "10485760".to_string(), "1048576".to_string())]
        );
        let distributed = |session: &SluiceSession| {
            let mut options = session.ctx.state().config_options().as_ref().clone();
            apply_distributed_defaults(&mut options, &session.distributed_defaults).unwrap();
            options.optimizer.hash_join_single_partition_threshold
        };
        let local = |session: &SluiceSession| {
            let state = session.ctx.state();
            state
                .config_options()
                .optimizer
                .hash_join_single_partition_threshold
        };
        assert_eq!(
            (local(&session), distributed(&session)),
            (1 << 20, 10 << 20)
        );
        session
            .run_sql(&format!("SET {key} = 1048576"))
            .await
            .unwrap();
        assert_eq!(
            distributed(&session),
            10 << 20,
            "the same value as the start"
        );
        session.run_sql(&format!("SET {key} = 5000")).await.unwrap();
        assert_eq!((local(&session), distributed(&session)), (5000, 5000));
        // A fork starts from its parent's defaults.
        let forked = session.fork().await.unwrap();
        assert_eq!(forked.distributed_defaults, session.distributed_defaults);
    }

    #[test]
    fn explain_distributed_is_a_statement_of_its_own() {
        let session = session();
        let statements = session
            .parse_sql("select 1; EXPLAIN\n distributed FORMAT json select 2; explain select 3")
            .unwrap();
        assert_eq!(statements.len(), 3);
        assert!(matches!(statements[0], SluiceStatement::Sql(_)));
        assert!(matches!(
            statements[1],
            SluiceStatement::ExplainDistributed {
                format: ExplainFormat::Json,
                ..
            }
        ));
        // Plain EXPLAIN is DataFusion's.
        assert!(matches!(statements[2], SluiceStatement::Sql(_)));
        let error = session
            .parse_sql("explain distributed format yaml select 1")
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "SQL error: ParserError(\"Expected: TEXT or JSON after FORMAT, found: yaml\")"
        );
        let error = session.parse_sql("select 1 select 2").unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("SQL error: ParserError(\"Expected: end of statement, found: select"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn explain_distributed_returns_the_job_graph_as_one_row() {
        let session = session();
        let outputs = session
            .run_sql("explain distributed select count(*) from (values (1), (2)) t(a) group by a")
            .await
            .unwrap();
        let batch = &outputs[0].batches[0];
        assert_eq!(batch.schema(), explain_schema());
        assert_eq!(batch.num_rows(), 1);
        let text = batch
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap()
            .value(0);
        // Two rows of VALUES are far below sluice.single_task_bytes: one stage, the whole plan.
        assert!(text.starts_with("Single task: the scans read "), "{text}");
        assert_eq!(text.matches("\nStage ").count(), 1, "{text}");
        assert!(text.contains("\nStage 0 (final)"), "{text}");
        assert!(text.contains("Regions:"), "{text}");
    }

    #[tokio::test]
    async fn syntax_errors_are_errors() {
        let session = session();
        let error = session.run_sql("selec 1").await.unwrap_err();
        assert!(error.to_string().contains("SQL error"), "{error}");
    }

    #[tokio::test]
    async fn set_statements_change_the_session() {
        let session = session();
        session
            .run_sql("set datafusion.execution.batch_size = 77")
            .await
            .unwrap();
        assert_eq!(session.context().state().config().batch_size(), 77);
    }
}
