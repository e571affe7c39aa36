//! `sluice`: the command-line front end.
//!
//! Every command builds one [`SluiceConfig`] from the layers (defaults, `--config`, `SLUICE_*`, flags),
//! opens a [`sluice_engine::SluiceSession`] for the configured mode, and prints results to stdout and
//! timings and progress to stderr. Errors print as one `error: …` line with a non-zero exit code.

mod cancel;
mod commands;
mod logging;
mod output;
mod progress;
mod remote;
mod runners;
mod shell;

/// mimalloc keeps freed batch buffers for reuse; glibc's allocator hands large ones back to the OS and
/// faults them in again, which dominates shuffle-heavy work on a VM (see BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use sluice_cluster::TlsFiles;
use sluice_engine::config::{ClusterManagerKind, ExchangeMode, FlightCompression};
use sluice_engine::config::{
    ConfigLayer, parse_duration, parse_memory_limit, parse_setting, parse_task_attempts,
};
use sluice_engine::joins::JoinStrategy;
use sluice_engine::{ExecutionMode, SluiceConfig, SluiceError};

use crate::commands::{
    ConfigArgs, DemoArgs, ExplainArgs, ServerArgs, SimulateArgs, SltArgs, SqlArgs, TpchCommand,
    WorkerArgs,
};

/// Sluice: a distributed SQL query engine on Apache DataFusion.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// Flags every command accepts; they override the config file and the environment.
#[derive(Debug, Args)]
struct GlobalArgs {
    /// TOML configuration file (keys: mode, memory_limit, workers, flight_compression, exchange,
    /// joins, driver_listen, min_workers, max_workers, worker_idle_timeout, slots,
    /// cluster_manager, kubernetes_namespace, kubernetes_image, kubernetes_pod_template,
    /// kubernetes_secret, kubernetes_service_account, kubernetes_driver_address, capacity_wait,
    /// max_task_attempts, read_roots,
    /// write_roots, result_buffer, max_parameter_bytes, max_prepared_statements,
    /// prepared_statement_idle, max_sessions_per_user, max_failed_logins, [session]; see
    /// `sluice config`).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Execution mode: local (in-process DataFusion, the default), local-graph (the job graph in
    /// this process), local-cluster (a driver and workers over gRPC and Arrow Flight on loopback),
    /// cluster (the driver here, workers in processes of their own).
    #[arg(long, global = true, value_name = "MODE")]
    mode: Option<ExecutionMode>,
    /// Workers of a local cluster (default 4), or worker processes to start in cluster mode
    /// (default 2; 0 with --min-workers waits for workers started elsewhere).
    #[arg(long, global = true, value_name = "N", value_parser = parse_workers_flag)]
    workers: Option<usize>,
    /// How stage outputs move between stages: pipelined (default: all stages run at once) or
    /// blocking (a stage finishes before its readers start; a retried reader re-reads its inputs).
    #[arg(long, global = true, value_name = "MODE")]
    exchange: Option<ExchangeMode>,
    /// Partitioned equi-joins: auto (default: sort-merge joins, which spill, when --memory-limit is
    /// set, else hash joins), hash or sort-merge. Joins with a small side stay broadcast hash joins.
    #[arg(long, global = true, value_name = "ALGORITHM")]
    joins: Option<JoinStrategy>,
    /// Cluster mode: where the driver listens for workers (default 127.0.0.1 on a free port).
    #[arg(long, global = true, value_name = "ADDR")]
    driver_listen: Option<String>,
    /// Cluster mode: workers that must have joined before the first query runs, and the fewest
    /// kept when idle (default: --workers).
    #[arg(long, global = true, value_name = "N")]
    min_workers: Option<usize>,
    /// Cluster mode: the most workers started while task regions wait for task slots (default: the
    /// larger of --workers and --min-workers; workers started elsewhere may join beyond it).
    #[arg(long, global = true, value_name = "N", value_parser = parse_workers_flag)]
    max_workers: Option<usize>,
    /// Cluster mode: how long a started worker may stay idle (no task running, no output of a
    /// running job held) before it is let go, down to --min-workers (default 60s).
    #[arg(long, global = true, value_name = "DURATION", value_parser = parse_duration)]
    worker_idle_timeout: Option<Duration>,
    /// Task slots of each worker: `sluice worker`'s own, or each worker cluster mode starts
    /// (default 64: a pipelined task region runs all its tasks at once).
    #[arg(long, global = true, value_name = "N", value_parser = parse_slots_flag)]
    slots: Option<usize>,
    /// Cluster mode: where workers come from: process (children of this process, the default) or
    /// kubernetes (worker pods; needs a build with the `kubernetes` feature, as the container
    /// image has; the kubernetes_* configuration keys say which image, namespace and template).
    #[arg(long, global = true, value_name = "MANAGER")]
    cluster_manager: Option<ClusterManagerKind>,
    /// Distributed modes: how long a task region that needs more task slots than the live workers
    /// have waits for workers to join or be replaced before its job fails (default 60s).
    #[arg(long, global = true, value_name = "DURATION", value_parser = parse_duration)]
    capacity_wait: Option<Duration>,
    /// Distributed modes: attempts of a task region before its job fails (default 4; a task whose
    /// worker process died counts, one cut off by the network does not).
    #[arg(long, global = true, value_name = "N", value_parser = parse_task_attempts)]
    max_task_attempts: Option<usize>,
    /// Cluster mode and `sluice worker`: the file holding the cluster secret every call between the
    /// driver and the workers carries (else the SLUICE_SECRET variable; cluster mode makes a random
    /// one when neither is given, enough for the workers it starts itself).
    #[arg(long, global = true, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// Cluster mode and `sluice worker`: mutual TLS on every call between the driver and the
    /// workers: this process's certificate (PEM; with --tls-key and --tls-ca).
    #[arg(long, global = true, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, global = true, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// The CA that signed every peer's certificate (PEM).
    #[arg(long, global = true, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// `--connect grpc+tls://…`: the CA certificate (PEM) that signed the server's certificate.
    #[arg(long, global = true, value_name = "FILE")]
    server_ca: Option<PathBuf>,
    /// Arrow IPC compression between workers: none (default), lz4 or zstd.
    #[arg(long, global = true, value_name = "CODEC")]
    flight_compression: Option<FlightCompression>,
    /// Memory budget for query execution, e.g. 4G, or 'unlimited'.
    #[arg(long, global = true, value_name = "SIZE")]
    memory_limit: Option<String>,
    /// Log lines on stderr: text (default) or json (one object per event, with its job, stage and
    /// task attempt ids). Which lines: the SLUICE_LOG filter (default warn; e.g. info).
    #[arg(long, global = true, value_name = "FORMAT", env = "SLUICE_LOG_FORMAT")]
    log_format: Option<logging::LogFormat>,
    /// Export the driver's and workers' spans (job, stage, task attempt) over OTLP/gRPC to this
    /// collector, e.g. http://127.0.0.1:4317 (needs a build with the `otlp` feature).
    #[arg(long, global = true, value_name = "URL", env = "SLUICE_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// A DataFusion setting, e.g. --set datafusion.execution.target_partitions=8 (repeatable).
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    settings: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run SQL: a query argument, a file (-f), statements on stdin, or an interactive shell.
    Sql(SqlArgs),
    /// Show how a query runs distributed: its job graph (stages, shuffles) and task regions.
    Explain(ExplainArgs),
    /// Generate TPC-H data and run the TPC-H queries.
    #[command(subcommand)]
    Tpch(TpchCommand),
    /// Generate TPC-H SF 0.1 into ./sluice-data (if absent) and run all 22 queries.
    Demo(DemoArgs),
    /// Run SQL logic test (.slt) files and report passed / failed / skipped records.
    Slt(SltArgs),
    /// Print the effective configuration and where each value came from.
    Config(ConfigArgs),
    /// Run a worker: register with a driver, run its tasks, serve their streams.
    Worker(WorkerArgs),
    /// Run the driver as a server: an Arrow Flight SQL endpoint over a cluster, until SIGTERM.
    Server(ServerArgs),
    /// Read a password line from stdin and print its verifier for `sluice server --users FILE`
    /// (`name:` + the verifier is one line of that file).
    HashPassword,
    /// Simulate the driver scheduling jobs on a fleet of fake workers (no processes) and report
    /// its transitions per second, region placement time and memory per task.
    Simulate(SimulateArgs),
}

impl GlobalArgs {
    /// The layered configuration: defaults, file, environment, flags.
    fn load_config(&self) -> Result<SluiceConfig, SluiceError> {
        let mut config = SluiceConfig::default();
        if let Some(path) = &self.config {
            config.apply(ConfigLayer::from_file(path)?, &path.display().to_string())?;
        }
        config.apply(ConfigLayer::from_env(std::env::vars())?, "environment")?;
        let flag_error = |flag: &str, message: String| SluiceError::Config {
            source_name: flag.to_string(),
            message,
        };
        let memory_limit = self
            .memory_limit
            .as_deref()
            .map(parse_memory_limit)
            .transpose()
            .map_err(|e| flag_error("--memory-limit", e))?;
        let session = self
            .settings
            .iter()
            .map(|s| parse_setting(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| flag_error("--set", e))?;
        let flags = ConfigLayer {
            mode: self.mode,
            memory_limit,
            workers: self.workers,
            flight_compression: self.flight_compression,
            exchange: self.exchange,
            joins: self.joins,
            driver_listen: self.driver_listen.clone().map(Some),
            min_workers: self.min_workers.map(Some),
            max_workers: self.max_workers.map(Some),
            worker_idle_timeout: self.worker_idle_timeout,
            slots: self.slots.map(Some),
            cluster_manager: self.cluster_manager,
            // The configuration file (as a Kubernetes ConfigMap) and the environment only.
            kubernetes_namespace: None,
            kubernetes_image: None,
            kubernetes_pod_template: None,
            kubernetes_secret: None,
            kubernetes_service_account: None,
            kubernetes_driver_address: None,
            capacity_wait: self.capacity_wait,
            max_task_attempts: self.max_task_attempts,
            // `sluice server --read-root/--write-root` take these over the configuration's.
            read_roots: None,
            write_roots: None,
            // Server limits: the configuration file and the environment only.
            result_buffer: None,
            max_parameter_bytes: None,
            max_prepared_statements: None,
            prepared_statement_idle: None,
            max_sessions_per_user: None,
            max_failed_logins: None,
            session,
        };
        config.apply(flags, "command line")?;
        if config.cluster_manager.value == ClusterManagerKind::Kubernetes {
            if !sluice_cluster::KUBERNETES {
                return Err(SluiceError::Config {
                    source_name: config.cluster_manager.source.clone(),
                    message: "this sluice was built without Kubernetes support: build it with \
                              --features sluice-cli/kubernetes (the Dockerfile does)"
                        .to_string(),
                });
            }
            // Worker pods serve the cluster mode.
            match (config.mode.value, config.mode.source.as_str()) {
                (ExecutionMode::Cluster, _) => {}
                (_, "default") => {
                    config.mode.value = ExecutionMode::Cluster;
                    config.mode.source = config.cluster_manager.source.clone();
                }
                (other, source) => {
                    return Err(SluiceError::Config {
                        source_name: source.to_string(),
                        message: format!(
                            "cluster_manager kubernetes runs worker pods for --mode cluster, \
                             not --mode {}",
                            other.name()
                        ),
                    });
                }
            }
        }
        if let (Some(max), Some(min)) = (config.max_workers.value, config.min_workers.value)
            && max < min
        {
            return Err(SluiceError::Config {
                source_name: config.max_workers.source.clone(),
                message: format!(
                    "max_workers ({max}) is below min_workers ({min}): the floor cannot be above \
                     the ceiling"
                ),
            });
        }
        Ok(config)
    }
}

fn parse_slots_flag(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "'{text}' is not a number of task slots (at least 1)"
        )),
    }
}

fn parse_workers_flag(text: &str) -> Result<usize, String> {
    text.trim()
        .parse::<usize>()
        .map_err(|_| format!("'{text}' is not a number of workers"))
}

/// Prints a command-line parsing outcome. `--help` and `--version` succeed; a bad flag or value exits
/// with 1 like every other bad input (clap's own default is 2).
fn usage_error(error: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let _ = error.print();
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// Exit code for a query stopped by Ctrl-C (128 + SIGINT), as shells expect.
const EXIT_CANCELLED: u8 = 130;

fn main() -> ExitCode {
    sluice_runtime::install_default_crypto_provider();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage_error(&error),
    };
    // The control runtime: the CLI, the driver actor, gRPC and Flight endpoints, Ctrl-C. Query work
    // runs on the task runtime (sluice_runtime::task_runtime), so this one always answers.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("sluice-control")
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let tls = match (
        &cli.global.tls_cert,
        &cli.global.tls_key,
        &cli.global.tls_ca,
    ) {
        (Some(cert), Some(key), Some(ca)) => Some(TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
        }),
        _ => None,
    };
    let logging = {
        let _in_runtime = runtime.enter();
        logging::install(
            cli.global.log_format.unwrap_or_default(),
            cli.global.otlp_endpoint.as_deref(),
        )
    };
    let logging = match logging {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runners::read_given_secret(cli.global.secret_file.as_deref())
        .and_then(|()| runners::read_given_tls(tls))
        .and_then(|()| remote::read_server_ca(cli.global.server_ca.as_deref()))
        .and_then(|()| cli.global.load_config())
        .and_then(|config| commands::run(cli.command, config, &runtime));
    // The trace export flushes while the runtime its connection lives on still runs.
    drop(logging);
    // A cancelled write's staging is removed, and a commit that began before the cancel ends,
    // before the process does (at most half a minute)...
    runtime.block_on(sluice_runtime::write::finish_detached_work(
        std::time::Duration::from_secs(30),
    ));
    // ... but nothing else still unwinding after a cancellation is waited for.
    runtime.shutdown_background();
    match result {
        Ok(code) => code,
        Err(SluiceError::Cancelled) => {
            eprintln!("cancelled");
            ExitCode::from(EXIT_CANCELLED)
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
