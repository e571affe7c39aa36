//! One Postgres connection: its own session (forked from the server's base session, with
//! `pg_catalog` added) and the simple and extended query protocols over it.
//!
//! ```text
//!  Query(sql) ─► pg parser (pg_catalog idioms rewritten) ─► hooks (SET/SHOW, BEGIN/COMMIT)
//!                     │ not Postgres SQL (CREATE EXTERNAL TABLE, EXPLAIN DISTRIBUTED)
//!                     └─► Sluice's parser
//!             ─► session.plan ─► session.run (the JobRunner: the cluster) ─► rows while the job runs
//!  Parse/Bind/Execute ─► datafusion-postgres's parser (logical plan, parameter types)
//!             ─► parameters bound ─► session.plan_logical ─► session.run ─► rows
//! ```
//!
//! Invariants: every statement runs through the session's [`sluice_runtime::JobRunner`], as the
//! CLI's and Flight SQL's do (plans the workers cannot take, such as `pg_catalog` scans, run on the
//! driver by the job graph's own rule); a `CancelRequest` for this connection ends the running
//! statement with `57014` and drops its stream, which cancels its job on every worker; a dropped
//! connection does the same.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use async_trait::async_trait;
use datafusion::arrow::array::{Array, UInt64Array};
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::ParamValues;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::Statement;
use datafusion_postgres::arrow_pg::datatypes::df::deserialize_parameters_with_server_types;
use datafusion_postgres::arrow_pg::datatypes::{arrow_schema_to_pg_fields, encode_recordbatch};
use datafusion_postgres::datafusion_pg_catalog::sql::PostgresCompatibilityParser;
use datafusion_postgres::hooks::QueryHook;
use datafusion_postgres::hooks::set_show::SetShowHook;
use datafusion_postgres::hooks::transactions::TransactionStatementHook;
use datafusion_postgres::{DfSessionService, Parser};
use futures::{FutureExt, Sink, Stream, StreamExt, TryStreamExt, stream};
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{QueryResponse, Response, Tag};
use pgwire::api::stmt::QueryParser;
use pgwire::api::store::PortalStore;
use pgwire::api::{ClientInfo, ClientPortalStore, Type};
use pgwire::error::{PgWireError, PgWireResult};
use pgwire::messages::PgWireBackendMessage;
use pgwire::types::format::FormatOptions;
use sluice_engine::{PlannedStatement, SluiceSession, SluiceStatement};
use tokio::sync::watch;

use super::cancel::{self, CancelSignal, Cancels};
use super::errors::{cancelled, pg_datafusion_error, pg_error};

/// A statement as the extended protocol keeps it between Parse and Execute: the text, and the
/// parsed statement with its logical plan (datafusion-postgres's form, which its hooks expect).
pub type PgStatement = (String, Option<(Statement, LogicalPlan)>);

/// The statements of one connection.
pub struct PgConnection {
    session: Arc<SluiceSession>,
    context: Arc<SessionContext>,
    parser: Arc<PgParser>,
    sql: PostgresCompatibilityParser,
    hooks: Vec<Arc<dyn QueryHook>>,
    cancels: Arc<Cancels>,
    /// Moves on with every `CancelRequest` for this connection.
    generation: Arc<watch::Sender<u64>>,
    /// Set once the connection is listed in `cancels`.
    listed: OnceLock<()>,
}

impl PgConnection {
    /// A connection over `session` (its own fork): `pg_catalog` is registered in it.
    pub fn new(session: SluiceSession, cancels: Arc<Cancels>) -> sluice_engine::Result<Self> {
        let context = Arc::new(session.context().clone());
        datafusion_postgres::datafusion_pg_catalog::pg_catalog::setup_pg_catalog(
            &context,
            "datafusion",
            datafusion_postgres::datafusion_pg_catalog::pg_catalog::context::EmptyContextProvider,
        )
        .map_err(|e| sluice_engine::SluiceError::DataFusion(*e))?;
        let hooks: Vec<Arc<dyn QueryHook>> =
            vec![Arc::new(SetShowHook), Arc::new(TransactionStatementHook)];
        let service = DfSessionService::new_with_hooks(context.clone(), hooks.clone());
        let parser = Arc::new(PgParser {
            inner: ExtendedQueryHandler::query_parser(&service),
            context: context.clone(),
            sql: PostgresCompatibilityParser::new(),
        });
        Ok(Self {
            session: Arc::new(session),
            context,
            parser,
            sql: PostgresCompatibilityParser::new(),
            hooks,
            cancels,
            generation: Arc::new(watch::Sender::new(0)),
            listed: OnceLock::new(),
        })
    }

    /// The cancel signal of a statement starting now; the first statement lists the connection
    /// for `CancelRequest`s (its process id and secret key are known once it has logged in).
    fn cancel_signal<C: ClientInfo + ?Sized>(&self, client: &C) -> CancelSignal {
        if self.listed.set(()).is_ok() {
            let (pid, secret) = client.pid_and_secret_key();
            self.cancels.register(pid, &secret, &self.generation);
        }
        cancel::signal(&self.generation)
    }

    /// Runs a planned statement: its rows as they come, or its command tag once it is done.
    async fn respond<C: ClientInfo + ?Sized>(
        &self,
        client: &C,
        tag: String,
        planned: PlannedStatement,
        format: &Format,
        cancel: CancelSignal,
    ) -> PgWireResult<Response> {
        let schema = planned.schema();
        let rows = self.session.run(planned).map_err(|e| pg_error(&e))?;
        let rows = Cancellable {
            rows: Some(rows),
            cancel,
        };
        if tag == "INSERT" {
            let batches: Vec<RecordBatch> = rows.try_collect().await?;
            return Ok(Response::Execution(
                Tag::new("INSERT").with_oid(0).with_rows(inserted(&batches)),
            ));
        }
        if schema.fields().is_empty() {
            let _: Vec<RecordBatch> = rows.try_collect().await?;
            return Ok(Response::Execution(Tag::new(&tag)));
        }
        let options = Arc::new(FormatOptions::from_client_metadata(client.metadata()));
        let fields = Arc::new(arrow_schema_to_pg_fields(&schema, format, Some(options))?);
        let encoding = fields.clone();
        let rows = rows
            .map(move |batch| -> Box<dyn Iterator<Item = _> + Send> {
                match batch {
                    Ok(batch) => encode_recordbatch(encoding.clone(), batch),
                    Err(error) => Box::new(std::iter::once(Err(error))),
                }
            })
            .flat_map(stream::iter);
        Ok(Response::Query(QueryResponse::new(fields, rows)))
    }

    /// Runs one simple-protocol statement that Sluice's own parser read.
    async fn run_sluice_statement<C: ClientInfo + ?Sized>(
        &self,
        client: &C,
        statement: SluiceStatement,
        cancel: CancelSignal,
    ) -> PgWireResult<Response> {
        let tag = match &statement {
            SluiceStatement::Sql(DfStatement::Statement(statement)) => command_tag(statement),
            SluiceStatement::Sql(DfStatement::CreateExternalTable(_)) => {
                "CREATE EXTERNAL TABLE".to_string()
            }
            SluiceStatement::Sql(DfStatement::CopyTo(_)) => "COPY".to_string(),
            SluiceStatement::Sql(_) | SluiceStatement::ExplainDistributed { .. } => {
                "SELECT".to_string()
            }
        };
        let planned = self
            .session
            .plan(statement)
            .await
            .map_err(|e| pg_error(&e))?;
        self.respond(client, tag, planned, &Format::UnifiedText, cancel)
            .await
    }
}

/// Whether `statement` is `SHOW datafusion.…`.
fn shows_a_datafusion_setting(statement: &Statement) -> bool {
    match statement {
        Statement::ShowVariable { variable } => variable
            .first()
            .is_some_and(|name| name.value.eq_ignore_ascii_case("datafusion")),
        _ => false,
    }
}

/// The extended protocol's parser: datafusion-postgres's, except that `SHOW datafusion.…` is
/// planned by DataFusion (whose answer is the setting's name and value).
pub struct PgParser {
    inner: Arc<Parser>,
    context: Arc<SessionContext>,
    sql: PostgresCompatibilityParser,
}

#[async_trait]
impl QueryParser for PgParser {
    type Statement = PgStatement;

    async fn parse_sql<C>(
        &self,
        client: &C,
        sql: &str,
        types: &[Option<Type>],
    ) -> PgWireResult<Option<Self::Statement>>
    where
        C: ClientInfo + Unpin + Send + Sync,
    {
        if let Ok(mut statements) = self.sql.parse(sql)
            && statements.len() == 1
            && shows_a_datafusion_setting(&statements[0])
        {
            let statement = statements.remove(0);
            let plan = self
                .context
                .state()
                .statement_to_plan(DfStatement::Statement(Box::new(statement.clone())))
                .await
                .map_err(pg_datafusion_error)?;
            return Ok(Some((sql.to_string(), Some((statement, plan)))));
        }
        self.inner.parse_sql(client, sql, types).await
    }

    fn get_parameter_types(&self, statement: &Self::Statement) -> PgWireResult<Vec<Type>> {
        self.inner.get_parameter_types(statement)
    }

    fn get_result_schema(
        &self,
        statement: &Self::Statement,
        format: Option<&Format>,
    ) -> PgWireResult<Vec<pgwire::api::results::FieldInfo>> {
        self.inner.get_result_schema(statement, format)
    }
}

/// The rows an `INSERT`'s one `count` row says it wrote.
fn inserted(batches: &[RecordBatch]) -> usize {
    batches
        .iter()
        .filter_map(|batch| batch.column_by_name("count"))
        .filter_map(|column| column.as_any().downcast_ref::<UInt64Array>())
        .filter(|column| !column.is_empty())
        .map(|column| usize::try_from(column.value(0)).unwrap_or(usize::MAX))
        .sum()
}

/// The command tag Postgres gives a statement that returns no rows.
fn command_tag(statement: &Statement) -> String {
    match statement {
        Statement::Insert(_) => "INSERT".to_string(),
        Statement::CreateTable(_) => "CREATE TABLE".to_string(),
        Statement::CreateView { .. } => "CREATE VIEW".to_string(),
        Statement::CreateSchema { .. } => "CREATE SCHEMA".to_string(),
        Statement::Drop { object_type, .. } => format!("DROP {object_type}"),
        Statement::Set(_) => "SET".to_string(),
        _ => "SELECT".to_string(),
    }
}

/// A statement's record batches until its connection cancels it: then one `57014` error, and the
/// stream (so the job) is dropped at once.
struct Cancellable {
    rows: Option<SendableRecordBatchStream>,
    cancel: CancelSignal,
}

impl Stream for Cancellable {
    type Item = PgWireResult<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let Some(rows) = this.rows.as_mut() else {
            return Poll::Ready(None);
        };
        if this.cancel.poll_unpin(cx).is_ready() {
            this.rows = None;
            return Poll::Ready(Some(Err(cancelled())));
        }
        match rows.poll_next_unpin(cx) {
            Poll::Ready(Some(Err(error))) => {
                this.rows = None;
                Poll::Ready(Some(Err(pg_datafusion_error(error))))
            }
            Poll::Ready(None) => {
                this.rows = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(batch))) => Poll::Ready(Some(Ok(batch))),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[async_trait]
impl SimpleQueryHandler for PgConnection {
    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let cancel = self.cancel_signal(client);
        let statements = match self.sql.parse(query) {
            Ok(statements) => statements,
            // Not Postgres SQL: Sluice's own statements, with local mode's errors.
            Err(_) => {
                let statements = self.session.parse_sql(query).map_err(|e| pg_error(&e))?;
                let mut responses = Vec::with_capacity(statements.len());
                for statement in statements {
                    responses.push(
                        self.run_sluice_statement(client, statement, cancel.clone())
                            .await?,
                    );
                }
                return Ok(responses);
            }
        };
        if statements.is_empty() {
            return Ok(vec![Response::EmptyQuery]);
        }
        let mut responses = Vec::with_capacity(statements.len());
        'statements: for statement in statements {
            for hook in self.hooks_for(&statement) {
                if let Some(response) = hook
                    .handle_simple_query(&statement, &self.context, client)
                    .await
                {
                    responses.push(response?);
                    continue 'statements;
                }
            }
            let statement = SluiceStatement::Sql(DfStatement::Statement(Box::new(statement)));
            responses.push(
                self.run_sluice_statement(client, statement, cancel.clone())
                    .await?,
            );
        }
        Ok(responses)
    }
}

#[async_trait]
impl ExtendedQueryHandler for PgConnection {
    type Statement = PgStatement;
    type QueryParser = PgParser;

    fn query_parser(&self) -> Arc<Self::QueryParser> {
        self.parser.clone()
    }

    async fn do_query<C>(
        &self,
        client: &mut C,
        portal: &Portal<Self::Statement>,
        _max_rows: usize,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let (_, Some((statement, plan))) = &portal.statement.statement else {
            return Ok(Response::EmptyQuery);
        };
        let parameters = self.parameters(portal, plan)?;
        for hook in self.hooks_for(statement) {
            if let Some(response) = hook
                .handle_extended_query(statement, plan, &parameters, &self.context, client)
                .await
            {
                return response;
            }
        }
        let cancel = self.cancel_signal(client);
        let logical = plan
            .clone()
            .replace_params_with_values(&parameters)
            .map_err(pg_datafusion_error)?;
        let wrapped = DfStatement::Statement(Box::new(statement.clone()));
        let planned = self
            .session
            .plan_logical(&wrapped, logical)
            .await
            .map_err(|e| pg_error(&e))?;
        self.respond(
            client,
            command_tag(statement),
            planned,
            &portal.result_column_format,
            cancel,
        )
        .await
    }
}

impl PgConnection {
    /// The hooks that may answer `statement`: none for `SHOW datafusion.…`, which DataFusion answers
    /// (the hooks know Postgres's variables only).
    fn hooks_for(&self, statement: &Statement) -> &[Arc<dyn QueryHook>] {
        if shows_a_datafusion_setting(statement) {
            &[]
        } else {
            &self.hooks
        }
    }

    /// The values a portal binds to its statement's parameters, typed as the plan infers them.
    fn parameters(
        &self,
        portal: &Portal<PgStatement>,
        plan: &LogicalPlan,
    ) -> PgWireResult<ParamValues> {
        let wire_types: Vec<Type> = self
            .parser
            .get_parameter_types(&portal.statement.statement)?;
        let mut inferred: Vec<(usize, Option<DataType>)> = plan
            .get_parameter_types()
            .map_err(pg_datafusion_error)?
            .into_iter()
            .map(|(name, data_type)| {
                let position = name.trim_start_matches('$').parse().unwrap_or(usize::MAX);
                (position, data_type)
            })
            .collect();
        inferred.sort_by_key(|(position, _)| *position);
        let inferred: Vec<Option<&DataType>> = inferred
            .iter()
            .map(|(_, data_type)| data_type.as_ref())
            .collect();
        let wire_types: Vec<Option<&Type>> = wire_types.iter().map(Some).collect();
        deserialize_parameters_with_server_types(portal, &inferred, &wire_types)
    }
}
