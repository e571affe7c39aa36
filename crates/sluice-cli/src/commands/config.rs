//! `sluice config`: the effective configuration, with the layer each value came from.

use std::process::ExitCode;

use clap::Args;
use sluice_engine::{Result, SluiceConfig};

/// Arguments of `sluice config`.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// List every DataFusion setting, not only those Sluice's layers set.
    #[arg(long)]
    all: bool,
}

/// Prints the configuration as TOML.
pub fn run(args: ConfigArgs, config: &SluiceConfig) -> Result<ExitCode> {
    print!("{}", config.to_toml(args.all)?);
    Ok(ExitCode::SUCCESS)
}
