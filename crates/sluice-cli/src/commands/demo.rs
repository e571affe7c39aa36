//! `sluice demo`: the README's first command. Generates TPC-H SF 0.1 into `./sluice-data` unless it is
//! already there, then runs the 22 queries on a local cluster (4 workers unless `--workers` says
//! otherwise; the mode given with `--mode`, if any) and checks each result against local mode.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use sluice_engine::config::Sourced;
use sluice_engine::{ExecutionMode, Result, SluiceConfig, SluiceSession};
use sluice_tpch::bench::{BenchOptions, open_tpch_data};
use sluice_tpch::{GenOptions, QUERY_NUMBERS};
use tokio::runtime::Runtime;

use super::tpch::{default_threads, generate_with_progress, local_reference, run_and_report};

/// Arguments of `sluice demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Where the TPC-H data lives (generated if absent).
    #[arg(long, value_name = "DIR", default_value = "sluice-data")]
    pub data: PathBuf,
    /// Scale factor of the generated data.
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub scale: f64,
    /// Runs per query.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub iterations: usize,
}

/// Runs the demo.
pub fn run(args: DemoArgs, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    let gen_options = GenOptions {
        scale_factor: args.scale,
        out: args.data.clone(),
        parts: None,
        force: false,
        threads: default_threads(),
    };
    generate_with_progress(&gen_options)?;
    let mut config = config.clone();
    if config.mode.source == "default" {
        config.mode = Sourced::new(ExecutionMode::LocalCluster, "sluice demo");
    }
    let mut session = SluiceSession::new(&config, crate::runners::runner_for(&config))?;
    let scale_factor = runtime.block_on(open_tpch_data(&mut session, &args.data, None))?;
    let reference = if config.mode.value == ExecutionMode::Local {
        None
    } else {
        Some(local_reference(&config, &args.data, runtime)?)
    };
    let options = BenchOptions {
        queries: QUERY_NUMBERS.collect(),
        iterations: args.iterations.max(1),
        verify: false,
        answers: None,
        save_answers: None,
        scale_factor,
    };
    run_and_report(
        &session,
        session.runner(),
        reference.as_ref(),
        &options,
        None,
        runtime,
    )
}
