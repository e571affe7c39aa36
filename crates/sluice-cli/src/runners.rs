//! The runner of each execution mode: the one place the front end turns `--mode` into a
//! `JobRunner` (the engine knows only the trait).

use std::sync::Arc;

use datafusion::arrow::ipc::CompressionType;
use sluice_cluster::LocalClusterRunner;
use sluice_engine::config::FlightCompression;
use sluice_engine::{ExecutionMode, SluiceConfig};
use sluice_runtime::{JobRunner, LocalGraphRunner, LocalRunner};
use sluice_slt::RunnerFactory;

/// The runner for `config`'s mode (`workers` and `flight_compression` size a local cluster).
pub fn runner_for(config: &SluiceConfig) -> Arc<dyn JobRunner> {
    match config.mode.value {
        ExecutionMode::Local => Arc::new(LocalRunner),
        ExecutionMode::LocalGraph => Arc::new(LocalGraphRunner::default()),
        ExecutionMode::LocalCluster => {
            let compression = match config.flight_compression.value {
                FlightCompression::None => None,
                FlightCompression::Lz4 => Some(CompressionType::LZ4_FRAME),
                FlightCompression::Zstd => Some(CompressionType::ZSTD),
            };
            Arc::new(LocalClusterRunner::new(config.workers.value, compression))
        }
    }
}

/// [`runner_for`] as the SQL logic test runner takes it (a fresh runner per file's session).
pub fn runner_factory() -> Arc<RunnerFactory> {
    Arc::new(runner_for)
}
