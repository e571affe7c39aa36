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

use sluice_runtime::JobLabel;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use datafusion::arrow::array::{Array, UInt64Array};
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::ParamValues;
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
use futures::{Sink, StreamExt, TryStreamExt, stream};
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{QueryResponse, Response, Tag};
use pgwire::api::stmt::QueryParser;
use pgwire::api::store::PortalStore;
use pgwire::api::{ClientInfo, ClientPortalStore, Type};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::PgWireBackendMessage;
use pgwire::messages::response::TransactionStatus;
use pgwire::types::format::FormatOptions;
use sluice_engine::{PlannedStatement, SluiceSession, SluiceStatement};
use tokio::sync::watch;

use super::cancel::{self, CancelSignal, Cancels};
use super::errors::{cancelled, pg_datafusion_error, pg_error};
use super::login::LoggedIn;
use crate::admission::{Admission, into_datafusion};
use crate::cancellable::UntilCancelled;

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
    /// The server has accounts: nothing runs before a login succeeded.
    requires_login: bool,
    /// Where statements wait for a slot (the server's, shared with Flight SQL).
    admission: Arc<Admission>,
    /// The most a statement followed by others in one query string may hold (`result_buffer`).
    result_buffer: usize,
}

impl PgConnection {
    /// A connection over `session` (its own fork): `pg_catalog` is registered in it.
    pub fn new(
        session: SluiceSession,
        cancels: Arc<Cancels>,
        requires_login: bool,
        admission: Arc<Admission>,
        result_buffer: usize,
    ) -> sluice_engine::Result<Self> {
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
            requires_login,
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
            requires_login,
            admission,
            result_buffer,
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

    /// Runs a planned statement (`what` names it: its command tag, and its SQL for the job's
    /// label): its rows as they come, or its command tag once it is done.
    async fn respond<C: ClientInfo + ?Sized>(
        &self,
        client: &C,
        what: Described,
        planned: PlannedStatement,
        format: &Format,
        cancel: CancelSignal,
        materialize: bool,
    ) -> PgWireResult<Response> {
        let Described { tag, sql } = what;
        let schema = planned.schema();
        let session = self.session.clone();
        let (pid, _) = client.pid_and_secret_key();
        let label = JobLabel {
            tag: format!("postgres connection {pid}"),
            sql,
            user: client
                .metadata()
                .get(pgwire::api::METADATA_USER)
                .cloned()
                .unwrap_or_default(),
        };
        let rows = self.admission.run(schema.clone(), move || {
            session
                .run_labelled(planned, label)
                .map_err(into_datafusion)
        });
        let rows = UntilCancelled::new(rows.map_err(pg_datafusion_error), cancel, cancelled());
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
        // A statement followed by others in the same simple query runs to the end before the next
        // is planned, as Postgres runs them: a later INSERT must not change an earlier SELECT.
        let rows = if materialize {
            let batches = held_result(rows, self.result_buffer).await?;
            stream::iter(batches.into_iter().map(Ok)).boxed()
        } else {
            rows.boxed()
        };
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
        materialize: bool,
    ) -> PgWireResult<Response> {
        let writes = match &statement {
            SluiceStatement::Sql(DfStatement::Statement(statement)) => writes(statement),
            SluiceStatement::Sql(DfStatement::Explain(_))
            | SluiceStatement::ExplainDistributed { .. } => false,
            SluiceStatement::Sql(_) => true,
        };
        if writes {
            refuse_in_transaction(client)?;
        }
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
        let sql = match &statement {
            SluiceStatement::Sql(statement) => statement.to_string(),
            SluiceStatement::ExplainDistributed { statement, .. } => {
                format!("EXPLAIN DISTRIBUTED {statement}")
            }
        };
        let planned = self
            .session
            .plan(statement)
            .await
            .map_err(|e| pg_error(&e))?;
        self.respond(
            client,
            Described { tag, sql },
            planned,
            &Format::UnifiedText,
            cancel,
            materialize,
        )
        .await
    }
}

/// Refuses a connection of a server with accounts that has not logged in.
fn admit<C: ClientInfo + ?Sized>(client: &C, requires_login: bool) -> PgWireResult<()> {
    if requires_login && client.session_extensions().get::<LoggedIn>().is_none() {
        return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
            "FATAL".to_string(),
            "28000".to_string(),
            "log in first: this server has accounts".to_string(),
        ))));
    }
    Ok(())
}

/// Whether `statement` changes anything (tables, views, files): everything but queries,
/// `EXPLAIN` and `SHOW`.
fn writes(statement: &Statement) -> bool {
    !matches!(
        statement,
        Statement::Query(_)
            | Statement::Explain { .. }
            | Statement::ExplainTable { .. }
            | Statement::ShowVariable { .. }
            | Statement::ShowTables { .. }
            | Statement::ShowColumns { .. }
            | Statement::ShowFunctions { .. }
    )
}

/// Sluice applies every write at once and cannot roll it back, so a write inside `BEGIN … COMMIT`
/// is refused rather than let a later `ROLLBACK` pretend to undo it.
fn refuse_in_transaction<C: ClientInfo + ?Sized>(client: &C) -> PgWireResult<()> {
    if client.transaction_status() == TransactionStatus::Idle {
        return Ok(());
    }
    Err(PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        "0A000".to_string(),
        "Sluice has no transactions, so it cannot take a write inside BEGIN … COMMIT (it could \
         not be rolled back): run it in autocommit mode"
            .to_string(),
    ))))
}

/// Whether `namespace` holds session settings the session plans (DataFusion's and Sluice's own).
fn is_session_namespace(namespace: &str) -> bool {
    namespace.eq_ignore_ascii_case("datafusion") || namespace.eq_ignore_ascii_case("sluice")
}

/// Whether `statement` is `SHOW datafusion.…` (or `sluice.…`).
fn shows_a_datafusion_setting(statement: &Statement) -> bool {
    match statement {
        Statement::ShowVariable { variable } => variable
            .first()
            .is_some_and(|name| is_session_namespace(&name.value)),
        _ => false,
    }
}

/// Whether `statement` is `SET datafusion.… = …` (or `sluice.…`): planned by the session (so its access decides
/// whether the user may change it), never answered by datafusion-postgres's `SET` hook, which
/// would execute it in the context directly.
fn sets_a_datafusion_setting(statement: &Statement) -> bool {
    use datafusion::sql::sqlparser::ast::Set;
    match statement {
        Statement::Set(Set::SingleAssignment { variable, .. }) => variable
            .to_string()
            .split_once('.')
            .is_some_and(|(namespace, _)| is_session_namespace(namespace)),
        Statement::Set(Set::MultipleAssignments { assignments }) => assignments.iter().any(|a| {
            a.name
                .to_string()
                .split_once('.')
                .is_some_and(|(namespace, _)| is_session_namespace(namespace))
        }),
        _ => false,
    }
}

/// The extended protocol's parser: datafusion-postgres's, except that `SHOW datafusion.…` is
/// planned by DataFusion (whose answer is the setting's name and value).
pub struct PgParser {
    inner: Arc<Parser>,
    context: Arc<SessionContext>,
    sql: PostgresCompatibilityParser,
    requires_login: bool,
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
        admit(client, self.requires_login)?;
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
        if let Ok(mut statements) = self.sql.parse(sql)
            && statements.len() == 1
            && copies_to(&statements[0])
        {
            // DataFusion's COPY ... TO, planned by DataFusion's own parser.
            let plan = self
                .context
                .state()
                .create_logical_plan(sql)
                .await
                .map_err(pg_datafusion_error)?;
            return Ok(Some((sql.to_string(), Some((statements.remove(0), plan)))));
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

/// SQLSTATE of a result larger than the server holds (Postgres's `program_limit_exceeded`).
pub const PROGRAM_LIMIT_EXCEEDED: &str = "54000";

/// Every batch of `rows`, held until the statement ends, at most `limit` bytes of them: past it
/// the statement stops (its job is cancelled as the stream drops) with one error.
async fn held_result<S>(mut rows: S, limit: usize) -> PgWireResult<Vec<RecordBatch>>
where
    S: futures::Stream<Item = PgWireResult<RecordBatch>> + Unpin,
{
    let mut held = 0usize;
    let mut batches = Vec::new();
    while let Some(batch) = rows.try_next().await? {
        held = held.saturating_add(batch.get_array_memory_size());
        if held > limit {
            return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                "ERROR".to_string(),
                PROGRAM_LIMIT_EXCEEDED.to_string(),
                format!(
                    "a statement followed by others in one query string is held until it ends, \
                     and its result is larger than result_buffer ({}): send it on its own",
                    crate::limits::human_bytes(limit)
                ),
            ))));
        }
        batches.push(batch);
    }
    Ok(batches)
}

/// Whether `statement` is a `COPY ... TO`: DataFusion's statement (to a file), which Sluice's
/// own parser plans.
fn copies_to(statement: &Statement) -> bool {
    matches!(statement, Statement::Copy { to: true, .. })
}

/// The command tag Postgres gives a statement that returns no rows.
fn command_tag(statement: &Statement) -> String {
    match statement {
        Statement::Copy { .. } => "COPY".to_string(),
        Statement::Insert(_) => "INSERT".to_string(),
        Statement::CreateTable(_) => "CREATE TABLE".to_string(),
        Statement::CreateView { .. } => "CREATE VIEW".to_string(),
        Statement::CreateSchema { .. } => "CREATE SCHEMA".to_string(),
        Statement::Drop { object_type, .. } => format!("DROP {object_type}"),
        Statement::Set(_) => "SET".to_string(),
        _ => "SELECT".to_string(),
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
        admit(client, self.requires_login)?;
        let cancel = self.cancel_signal(client);
        let statements = match self.sql.parse(query) {
            Ok(statements) if !statements.iter().any(copies_to) => statements,
            // Not Postgres SQL (or DataFusion's COPY ... TO, which Postgres's parser reads as its
            // own COPY): Sluice's own statements, with local mode's errors.
            _ => {
                let statements = self.session.parse_sql(query).map_err(|e| pg_error(&e))?;
                let last = statements.len().saturating_sub(1);
                let mut responses = Vec::with_capacity(statements.len());
                for (index, statement) in statements.into_iter().enumerate() {
                    responses.push(
                        self.run_sluice_statement(client, statement, cancel.clone(), index < last)
                            .await?,
                    );
                }
                return Ok(responses);
            }
        };
        if statements.is_empty() {
            return Ok(vec![Response::EmptyQuery]);
        }
        let last = statements.len() - 1;
        let mut responses = Vec::with_capacity(statements.len());
        'statements: for (index, statement) in statements.into_iter().enumerate() {
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
                self.run_sluice_statement(client, statement, cancel.clone(), index < last)
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
        admit(client, self.requires_login)?;
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
        if writes(statement) {
            refuse_in_transaction(client)?;
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
        let what = Described {
            tag: command_tag(statement),
            sql: statement.to_string(),
        };
        self.respond(
            client,
            what,
            planned,
            &portal.result_column_format,
            cancel,
            false,
        )
        .await
    }
}

impl PgConnection {
    /// The hooks that may answer `statement`: none for `SHOW datafusion.…`, which DataFusion answers
    /// (the hooks know Postgres's variables only).
    fn hooks_for(&self, statement: &Statement) -> &[Arc<dyn QueryHook>] {
        if shows_a_datafusion_setting(statement) || sets_a_datafusion_setting(statement) {
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

/// What a statement is, for its response and its job's label.
struct Described {
    /// Its command tag (`SELECT`, `INSERT`, …).
    tag: String,
    /// Its SQL text.
    sql: String,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
    use datafusion::sql::sqlparser::parser::Parser;

    use super::*;

    fn statement(sql: &str) -> Statement {
        Parser::parse_sql(&PostgreSqlDialect {}, sql)
            .unwrap()
            .pop()
            .unwrap()
    }

    #[test]
    fn datafusion_and_sluice_settings_are_the_session_s_postgres_variables_are_not() {
        for sql in [
            "SET datafusion.execution.batch_size = 10",
            "SET sluice.skew_join_split = false",
            "SET SLUICE.skew_join_factor TO 3",
        ] {
            assert!(sets_a_datafusion_setting(&statement(sql)), "{sql}");
        }
        for sql in [
            "SHOW datafusion.execution.batch_size",
            "SHOW sluice.skew_join_split",
        ] {
            assert!(shows_a_datafusion_setting(&statement(sql)), "{sql}");
        }
        for sql in [
            "SET search_path = public",
            "SET sluicer.x = 1",
            "SHOW search_path",
        ] {
            let parsed = statement(sql);
            assert!(
                !sets_a_datafusion_setting(&parsed) && !shows_a_datafusion_setting(&parsed),
                "{sql}"
            );
        }
    }
}
