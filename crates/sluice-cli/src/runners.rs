//! The runner of each execution mode: the one place the front end turns `--mode` into a
//! `JobRunner` (the engine knows only the trait).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use datafusion::arrow::ipc::CompressionType;
use sluice_cluster::{
    ClusterOptions, ClusterSecret, ClusterTls, KubernetesOptions, LocalClusterRunner,
    ProcessClusterOptions, ProcessClusterRunner, TlsFiles,
};
use sluice_engine::config::{ClusterManagerKind, FlightCompression};
use sluice_engine::{ExecutionMode, Result, SluiceConfig, SluiceError};
use sluice_runtime::{
    DriverOptions, JobRunner, LocalGraphOptions, LocalGraphRunner, LocalRunner, WorkerOptions,
};
use sluice_slt::RunnerFactory;

/// Worker processes `--mode cluster` starts unless `--workers` says otherwise.
pub const DEFAULT_CLUSTER_WORKERS: usize = 2;

/// The runner for `config`'s mode (`workers`, `exchange`, `memory_limit` and
/// `flight_compression` shape a cluster).
pub fn runner_for(config: &SluiceConfig) -> Arc<dyn JobRunner> {
    let exchange = config.exchange.value.output_mode();
    let compression = compression_of(config.flight_compression.value);
    match config.mode.value {
        ExecutionMode::Local => Arc::new(LocalRunner),
        ExecutionMode::LocalGraph => Arc::new(LocalGraphRunner::with_options(LocalGraphOptions {
            exchange,
            driver: driver_options(config),
            ..LocalGraphOptions::default()
        })),
        ExecutionMode::LocalCluster => Arc::new(LocalClusterRunner::with_options(ClusterOptions {
            workers: config.workers.value,
            compression,
            exchange,
            driver: driver_options(config),
            worker: WorkerOptions {
                memory_limit: worker_memory_limit(config),
                ..WorkerOptions::default()
            },
            ..ClusterOptions::default()
        })),
        ExecutionMode::Cluster => {
            let workers = if config.workers.source == "default" {
                DEFAULT_CLUSTER_WORKERS
            } else {
                config.workers.value
            };
            let executable = std::env::current_exe().unwrap_or_else(|_| "sluice".into());
            let mut options = ProcessClusterOptions::new(executable, workers);
            options.driver = driver_options(config);
            options.min_workers = config.min_workers.value.unwrap_or(workers);
            options.max_workers = config
                .max_workers
                .value
                .unwrap_or(workers.max(options.min_workers));
            options.idle_timeout = config.worker_idle_timeout.value;
            if let Some(slots) = config.slots.value {
                options.slots = slots;
            }
            if let Some(listen) = &config.driver_listen.value {
                options.driver_listen = listen.clone();
            }
            options.memory_limit = config.memory_limit.value.map(|size| size.0);
            options.compression = compression;
            options.exchange = exchange;
            options.secret = given_secret();
            options.tls = given_tls();
            options.worker_env = crate::logging::worker_env();
            if config.cluster_manager.value == ClusterManagerKind::Kubernetes {
                options.kubernetes = Some(KubernetesOptions {
                    namespace: config.kubernetes_namespace.value.clone(),
                    image: config.kubernetes_image.value.clone(),
                    service_account: config.kubernetes_service_account.value.clone(),
                    pod_template: config.kubernetes_pod_template.value.clone().map(Into::into),
                    secret: config.kubernetes_secret.value.clone(),
                    driver_address: config.kubernetes_driver_address.value.clone(),
                });
            }
            Arc::new(ProcessClusterRunner::with_options(options))
        }
    }
}

/// The driver's options from `config`: attempts per task region, the capacity wait.
fn driver_options(config: &SluiceConfig) -> DriverOptions {
    DriverOptions {
        max_attempts: config.max_task_attempts.value,
        capacity_wait: config.capacity_wait.value,
        ..DriverOptions::default()
    }
}

/// The cluster secret this process was given (`--secret-file`, else `SLUICE_SECRET`), read once.
static GIVEN_SECRET: OnceLock<Option<ClusterSecret>> = OnceLock::new();

/// Reads the secret given to this process, if any; a file that cannot be read, or an empty or
/// malformed secret, is an error naming where it came from.
pub fn read_given_secret(file: Option<&Path>) -> Result<()> {
    let secret = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| SluiceError::io(path, e))?;
            Some(ClusterSecret::new(&text).map_err(|e| {
                SluiceError::invalid(format!("--secret-file {}: {e}", path.display()))
            })?)
        }
        None => match std::env::var("SLUICE_SECRET") {
            Ok(text) => Some(
                ClusterSecret::new(&text)
                    .map_err(|e| SluiceError::invalid(format!("SLUICE_SECRET: {e}")))?,
            ),
            Err(_) => None,
        },
    };
    let _ = GIVEN_SECRET.set(secret);
    Ok(())
}

/// The secret read by [`read_given_secret`].
pub fn given_secret() -> Option<ClusterSecret> {
    GIVEN_SECRET.get().cloned().flatten()
}

/// The TLS setup this process was given (`--tls-cert`, `--tls-key`, `--tls-ca`), read once.
static GIVEN_TLS: OnceLock<Option<ClusterTls>> = OnceLock::new();

/// Reads the TLS files given to this process, if any; an unreadable one is an error naming it.
pub fn read_given_tls(files: Option<TlsFiles>) -> Result<()> {
    let tls = files
        .map(ClusterTls::from_files)
        .transpose()
        .map_err(|e| SluiceError::invalid(e.to_string()))?;
    let _ = GIVEN_TLS.set(tls);
    Ok(())
}

/// The TLS setup read by [`read_given_tls`].
pub fn given_tls() -> Option<ClusterTls> {
    GIVEN_TLS.get().cloned().flatten()
}

/// The Arrow IPC compression `compression` names.
pub fn compression_of(compression: FlightCompression) -> Option<CompressionType> {
    match compression {
        FlightCompression::None => None,
        FlightCompression::Lz4 => Some(CompressionType::LZ4_FRAME),
        FlightCompression::Zstd => Some(CompressionType::ZSTD),
    }
}

/// Each worker's memory pool: the configured limit (saturating on 32-bit machines).
fn worker_memory_limit(config: &SluiceConfig) -> Option<usize> {
    config
        .memory_limit
        .value
        .map(|size| usize::try_from(size.0).unwrap_or(usize::MAX))
}

/// [`runner_for`] as the SQL logic test runner takes it (a fresh runner per file's session).
pub fn runner_factory() -> Arc<RunnerFactory> {
    Arc::new(runner_for)
}
