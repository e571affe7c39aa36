//! `sluice simulate`: the driver at cluster scale without a cluster. A real driver schedules seeded
//! jobs on a fleet of fake workers in this process (no worker processes, sockets or task plans)
//! and prints task transitions per second, how long placing each region took, and the resident
//! memory grown per task (`sluice_runtime::simulation`), on a runtime of one thread. It exits
//! non-zero if any job failed.

use std::process::ExitCode;

use clap::Args;
use sluice_engine::config::ExchangeMode;
use sluice_engine::{Result, SluiceConfig, SluiceError};
use sluice_runtime::simulation::{SimulationConfig, simulate};

/// Arguments of `sluice simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Fake workers (registered before the first job).
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub fake_workers: usize,
    /// Task slots of each fake worker.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub fake_slots: usize,
    /// Jobs to run in all.
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Jobs running at once.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub concurrent_jobs: usize,
    /// Stages of each job (a chain).
    #[arg(long, default_value_t = 100)]
    pub stages: usize,
    /// Tasks of each stage.
    #[arg(long, default_value_t = 1000)]
    pub width: usize,
    /// Simulated task time, in virtual milliseconds: `LOW-HIGH`.
    #[arg(long, default_value = "10-1000", value_name = "LOW-HIGH")]
    pub task_ms: String,
    /// Workers lost during the run, evenly spaced (each replaced by a new one).
    #[arg(long, default_value_t = 0)]
    pub losses: usize,
    /// Seed of the task times and of which workers are lost.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs the simulation and prints its report.
/// The global `--exchange` decides the regions: blocking makes every stage its own, pipelined makes
/// each job one.
pub fn run(args: SimulateArgs, config: &SluiceConfig) -> Result<ExitCode> {
    let task_ms = args
        .task_ms
        .split_once('-')
        .and_then(|(low, high)| Some((low.trim().parse().ok()?, high.trim().parse().ok()?)))
        .filter(|(low, high): &(u64, u64)| low <= high)
        .ok_or_else(|| {
            SluiceError::invalid(format!(
                "--task-ms {}: expected LOW-HIGH in milliseconds, LOW at most HIGH (e.g. 10-1000)",
                args.task_ms
            ))
        })?;
    let config = SimulationConfig {
        workers: args.fake_workers,
        slots: args.fake_slots,
        jobs: args.jobs,
        concurrent_jobs: args.concurrent_jobs,
        stages: args.stages,
        width: args.width,
        blocking: config.exchange.value == ExchangeMode::Blocking,
        task_ms,
        losses: args.losses,
        seed: args.seed,
    };
    // The driver and the fake fleet share one thread: what is measured is their work, not the
    // wake-ups of a report crossing between threads.
    let single = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| SluiceError::invalid(format!("starting the simulation's runtime: {e}")))?;
    let report = single.block_on(simulate(&config))?;
    print!("{report}");
    Ok(if report.job_errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
