//! `sluice explain`: how a query runs distributed — its job graph (stages, distributions, inputs) and
//! task regions — as text or JSON. `EXPLAIN DISTRIBUTED <query>` in `sluice sql` prints the same.

use std::process::ExitCode;

use clap::{Args, ValueEnum};
use sluice_engine::{Result, SluiceConfig, SluiceError, SluiceSession};
use sluice_planner::explain::{explain_json, explain_text};
use tokio::runtime::Runtime;

use super::sql::TableArgs;

/// How `explain` prints.
#[derive(Debug, Clone, Copy, Default, ValueEnum)]
pub enum ExplainFormat {
    /// Indented stages and regions.
    #[default]
    Text,
    /// One JSON document.
    Json,
}

/// Arguments of `sluice explain`.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The query to explain.
    pub query: String,
    #[command(flatten)]
    pub tables: TableArgs,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    pub format: ExplainFormat,
}

/// Runs `sluice explain`. In every mode the query is planned with the settings a distributed run
/// requires, since that is the plan the job graph is cut from.
pub fn run(args: ExplainArgs, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    let session = runtime.block_on(args.tables.open_session(config))?;
    print!(
        "{}",
        runtime.block_on(explain(&session, &args.query, args.format))?
    );
    Ok(ExitCode::SUCCESS)
}

/// The job graph of `sql` in `format`.
pub async fn explain(session: &SluiceSession, sql: &str, format: ExplainFormat) -> Result<String> {
    let graph = session.job_graph(sql).await?;
    Ok(match format {
        ExplainFormat::Text => explain_text(&graph),
        ExplainFormat::Json => {
            let json = serde_json::to_string_pretty(&explain_json(&graph))
                .map_err(|e| SluiceError::invalid(format!("cannot print the job graph: {e}")))?;
            json + "\n"
        }
    })
}
