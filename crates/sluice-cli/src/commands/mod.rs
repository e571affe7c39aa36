//! The `sluice` sub-commands, one module each. `run` dispatches.

mod config;
mod demo;
mod explain;
mod server;
mod simulate;
mod slt;
mod sql;
mod tpch;
mod worker;

use std::process::ExitCode;

use sluice_engine::{Result, SluiceConfig};
use tokio::runtime::Runtime;

pub use config::ConfigArgs;
pub use demo::DemoArgs;
pub use explain::ExplainArgs;
pub use server::ServerArgs;
pub use simulate::SimulateArgs;
pub use slt::SltArgs;
pub use sql::{SqlArgs, run_remote, run_statements};
pub use tpch::TpchCommand;
pub use worker::WorkerArgs;

use crate::Command;

/// Runs one command to completion.
pub fn run(command: Command, config: SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    match command {
        Command::Sql(args) => sql::run(args, &config, runtime),
        Command::Explain(args) => explain::run(args, &config, runtime),
        Command::Tpch(command) => tpch::run(command, &config, runtime),
        Command::Demo(args) => demo::run(args, &config, runtime),
        Command::Slt(args) => slt::run(args, &config, runtime),
        Command::Config(args) => config::run(args, &config),
        Command::Worker(args) => worker::run(args, &config, runtime),
        Command::Server(args) => server::run(args, &config, runtime),
        Command::HashPassword => server::hash_password(),
        Command::Simulate(args) => simulate::run(args, &config),
    }
}
