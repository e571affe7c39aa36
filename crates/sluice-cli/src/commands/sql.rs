//! `sluice sql`: run SQL from an argument, a file, stdin or the interactive shell.

use std::io::{BufWriter, IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use sluice_engine::catalog::{TableSource, discover_tables_at, resolve_table_arg};
use sluice_engine::{
    ExplainFormat, Result, SluiceConfig, SluiceError, SluiceSession, SluiceStatement,
};
use tokio::runtime::Runtime;

use crate::cancel::until_ctrl_c;
use crate::output::{OutputFormat, ResultWriter};
use crate::remote::Remote;
use crate::runners::runner_for;
use crate::shell;

/// Where tables come from.
#[derive(Debug, Clone, Args)]
pub struct TableArgs {
    /// Directory whose *.parquet / *.csv files and sub-directories become tables named after them;
    /// or an object store's prefix (s3://, gs://, az://, abfss://, http(s)://).
    #[arg(long, value_name = "DIR|URL")]
    pub data: Option<PathBuf>,
    /// One table from a file or a directory of files, or an object store's URL (repeatable).
    #[arg(long = "table", value_name = "NAME=PATH|URL")]
    pub tables: Vec<String>,
}

impl TableArgs {
    /// Registers every table these arguments name.
    pub async fn register(&self, session: &mut SluiceSession) -> Result<()> {
        for source in self.sources(session.context()).await? {
            session.register_table(source).await?;
        }
        Ok(())
    }

    /// The tables these arguments name, listed with `ctx`'s object stores where a location is a
    /// URL; a directory or prefix that cannot be listed is an error.
    pub async fn sources(&self, ctx: &SessionContext) -> Result<Vec<TableSource>> {
        let mut sources = Vec::new();
        if let Some(dir) = &self.data {
            sources.extend(discover_tables_at(ctx, &dir.to_string_lossy()).await?);
        }
        for arg in &self.tables {
            sources.push(resolve_table_arg(ctx, arg).await?);
        }
        Ok(sources)
    }

    /// A session for `config` with these tables registered.
    pub async fn open_session(&self, config: &SluiceConfig) -> Result<SluiceSession> {
        let mut session = SluiceSession::new(config, runner_for(config))?;
        self.register(&mut session).await?;
        Ok(session)
    }
}

/// Arguments of `sluice sql`.
#[derive(Debug, Args)]
pub struct SqlArgs {
    /// SQL to run; several statements are separated by ';'. Without it (and without -f) statements are
    /// read from stdin, or an interactive shell starts when stdin is a terminal.
    pub query: Option<String>,
    /// Read SQL from this file.
    #[arg(
        short = 'f',
        long = "file",
        value_name = "FILE",
        conflicts_with = "query"
    )]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub tables: TableArgs,
    /// Result format on stdout.
    #[arg(long, value_enum, default_value_t)]
    pub format: OutputFormat,
    /// Run the statements on the `sluice server` at this address (`grpc://HOST:PORT`), in a session
    /// of their own, instead of in this process (its tables, not `--data`'s).
    #[arg(long, value_name = "URL", conflicts_with_all = ["data", "tables"])]
    pub connect: Option<String>,
}

/// Runs `sluice sql`.
pub fn run(args: SqlArgs, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    if let Some(url) = &args.connect {
        let remote = runtime.block_on(Remote::connect(url))?;
        let sql = match (&args.query, &args.file) {
            (Some(query), _) => query.clone(),
            (None, Some(path)) => {
                std::fs::read_to_string(path).map_err(|e| SluiceError::io(path, e))?
            }
            (None, None) if std::io::stdin().is_terminal() => {
                shell::run(
                    &shell::Target::Remote(Box::new(remote)),
                    runtime,
                    args.format,
                )?;
                return Ok(ExitCode::SUCCESS);
            }
            (None, None) => read_stdin()?,
        };
        runtime.block_on(until_ctrl_c(run_remote(&remote, &sql, args.format)))?;
        return Ok(ExitCode::SUCCESS);
    }
    let session = runtime.block_on(args.tables.open_session(config))?;
    let sql = match (&args.query, &args.file) {
        (Some(query), _) => query.clone(),
        (None, Some(path)) => {
            std::fs::read_to_string(path).map_err(|e| SluiceError::io(path, e))?
        }
        (None, None) if std::io::stdin().is_terminal() => {
            shell::run(&shell::Target::Local(&session), runtime, args.format)?;
            return Ok(ExitCode::SUCCESS);
        }
        (None, None) => read_stdin()?,
    };
    runtime.block_on(until_ctrl_c(run_statements(&session, &sql, args.format)))?;
    Ok(ExitCode::SUCCESS)
}

fn read_stdin() -> Result<String> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(|e| SluiceError::io("<stdin>", e))?;
    Ok(text)
}

/// Runs each statement of `sql` on the server `remote` is connected to, printing results and the
/// progress line as local mode does. Statements are split here (with a local parser) and sent one
/// by one.
pub async fn run_remote(remote: &Remote, sql: &str, format: OutputFormat) -> Result<()> {
    let parser = SluiceSession::new(
        &SluiceConfig::default(),
        std::sync::Arc::new(sluice_runtime::LocalRunner),
    )?;
    let statements = parser.parse_sql(sql)?;
    if statements.is_empty() {
        return Err(SluiceError::invalid("no SQL statement given"));
    }
    for statement in statements {
        let text = match statement {
            SluiceStatement::Sql(statement) => statement.to_string(),
            SluiceStatement::ExplainDistributed { statement, format } => {
                let format = match format {
                    ExplainFormat::Text => "TEXT",
                    ExplainFormat::Json => "JSON",
                };
                format!("EXPLAIN DISTRIBUTED FORMAT {format} {statement}")
            }
        };
        let start = Instant::now();
        let line = crate::progress::job_line();
        let show = |text: &str| line.set_message(text.to_string());
        let say = |text: &str| line.suspend(|| eprintln!("{text}"));
        let output =
            crate::progress::with_job_progress(remote, &show, &say, remote.run(&text)).await;
        line.finish_and_clear();
        let output = output?;
        let mut writer = ResultWriter::new(
            format,
            output.schema.clone(),
            BufWriter::new(std::io::stdout()),
        );
        let mut rows = 0usize;
        for batch in output.batches {
            rows += batch.num_rows();
            writer.write(batch)?;
        }
        writer.finish()?;
        let noun = if rows == 1 { "row" } else { "rows" };
        eprintln!("{rows} {noun} in {:.3}s", start.elapsed().as_secs_f64());
    }
    Ok(())
}

/// Runs one statement, streaming its result to stdout; returns the row count.
/// `before_output` runs once, before anything is written.
async fn write_statement(
    session: &SluiceSession,
    statement: SluiceStatement,
    format: OutputFormat,
    before_output: &dyn Fn(),
) -> Result<usize> {
    let mut stream = session.execute_statement(statement).await?;
    let mut writer = ResultWriter::new(format, stream.schema(), BufWriter::new(std::io::stdout()));
    let mut rows = 0usize;
    let mut first = true;
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        if std::mem::take(&mut first) {
            before_output();
        }
        rows += batch.num_rows();
        writer.write(batch)?;
    }
    if first {
        before_output();
    }
    writer.finish()?;
    Ok(rows)
}

/// Runs each statement in `sql` in order, streaming its result to stdout and its row count and time
/// to stderr. Stops at the first error.
pub async fn run_statements(
    session: &SluiceSession,
    sql: &str,
    format: OutputFormat,
) -> Result<()> {
    let statements = session.parse_sql(sql)?;
    if statements.is_empty() {
        return Err(SluiceError::invalid("no SQL statement given"));
    }
    for statement in statements {
        // The job graph prints as it is, not as a one-cell table; JSON output asks for JSON.
        if let SluiceStatement::ExplainDistributed {
            statement,
            format: explain_format,
        } = statement
        {
            let explain_format = match format {
                OutputFormat::Json | OutputFormat::Ndjson => ExplainFormat::Json,
                _ => explain_format,
            };
            print!(
                "{}",
                session
                    .explain_distributed(statement, explain_format)
                    .await?
            );
            continue;
        }
        let start = Instant::now();
        let line = crate::progress::job_line();
        // Once rows are written the progress line is gone for good: drawn between them, or left
        // above them, it would be a stale line in the terminal.
        let writing = std::sync::atomic::AtomicBool::new(false);
        let show = |text: &str| {
            if !writing.load(std::sync::atomic::Ordering::Acquire) {
                line.set_message(text.to_string());
            }
        };
        let say = |text: &str| line.suspend(|| eprintln!("{text}"));
        let before_output = || {
            writing.store(true, std::sync::atomic::Ordering::Release);
            line.finish_and_clear();
        };
        let rows = crate::progress::with_job_progress(
            session.runner(),
            &show,
            &say,
            write_statement(session, statement, format, &before_output),
        )
        .await;
        line.finish_and_clear();
        let rows = rows?;
        let noun = if rows == 1 { "row" } else { "rows" };
        eprintln!("{rows} {noun} in {:.3}s", start.elapsed().as_secs_f64());
    }
    Ok(())
}
