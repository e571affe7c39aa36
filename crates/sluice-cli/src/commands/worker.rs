//! `sluice worker`: run one worker process that registers with a driver, runs its tasks and serves
//! their streams over Arrow Flight (the cluster crate's `run_worker_process` does the work).
//!
//! Stopping: SIGTERM drains (no new tasks, the running ones finish, then it deregisters); SIGINT
//! stops at once. With `--exit-with-stdin` (how `--mode cluster` starts its workers) the first line
//! of stdin is the parent's hand-over (the cluster secret, never on the command line) and the end of
//! stdin — the parent exiting however it exits — stops the worker.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use sluice_cluster::{
    ClusterLink, ClusterSecret, DRAIN_LINE, StopRequest, WorkerExit, WorkerProcessOptions,
    run_worker_process,
};
use sluice_engine::{Result, SluiceConfig, SluiceError};
use sluice_runtime::WorkerOptions;
use sluice_runtime::faults::{FAILPOINTS_VAR, FaultPoints};
use tokio::runtime::Runtime;

use crate::runners::compression_of;

/// Arguments of `sluice worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The driver's address (`host:port`, or `http://host:port`).
    #[arg(long, value_name = "URL")]
    pub driver: String,
    /// Where to listen for the driver and other workers (port 0 picks one).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The address to register, where others reach this worker (default: the listen address).
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Directory for spill files and blocking stage outputs; the worker keeps them in its own
    /// `sluice-work-<pid>` inside, removed when it exits (and by the next worker if it was killed)
    /// [default: the system's temporary directory].
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// How often to send a heartbeat to the driver.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub heartbeat_interval_ms: u64,
    /// Exit when the driver has not answered for this long.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub driver_timeout_ms: u64,
    /// How long a drain (SIGTERM) may take before the worker exits anyway.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    pub drain_grace_ms: u64,
    /// Read the parent's hand-over from the first line of stdin and exit when stdin ends (set by
    /// `--mode cluster` for the workers it starts).
    #[arg(long)]
    pub exit_with_stdin: bool,
}

/// Runs the worker until it is stopped or loses its driver.
pub fn run(args: WorkerArgs, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    let secret = if args.exit_with_stdin {
        // The first line is the parent's hand-over, "SLUICE WORKER <index> <secret>"; reading it
        // here keeps the secret off the command line.
        let mut first = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut first)
            .map_err(|e| SluiceError::io("stdin", e))?;
        match first.split_whitespace().nth(3) {
            Some(text) => Some(
                ClusterSecret::new(text)
                    .map_err(|e| SluiceError::invalid(format!("the hand-over on stdin: {e}")))?,
            ),
            None => crate::runners::given_secret(),
        }
    } else {
        crate::runners::given_secret()
    };
    let secret = secret.ok_or_else(|| {
        SluiceError::invalid(
            "sluice worker needs the cluster's secret: --secret-file FILE or SLUICE_SECRET \
             (the same as the driver's)",
        )
    })?;
    let memory_limit = match config.memory_limit.value {
        Some(size) => Some(usize::try_from(size.0).map_err(|_| {
            SluiceError::invalid(format!("memory limit {} does not fit this machine", size.0))
        })?),
        None => None,
    };
    let worker = WorkerOptions {
        slots: config.slots.value.unwrap_or(WorkerOptions::default().slots),
        memory_limit,
        work_dir: args.work_dir.clone(),
        faults: FaultPoints::from_env()
            .map_err(|e| SluiceError::invalid(format!("{FAILPOINTS_VAR}: {e}")))?
            .map(Arc::new),
        ..WorkerOptions::default()
    };
    let options = WorkerProcessOptions {
        driver: args.driver.trim_start_matches("http://").to_string(),
        listen: args.listen.clone(),
        advertise: args.advertise.clone(),
        worker,
        compression: compression_of(config.flight_compression.value),
        heartbeat_interval: Duration::from_millis(args.heartbeat_interval_ms.max(1)),
        driver_timeout: Duration::from_millis(args.driver_timeout_ms.max(1)),
        drain_grace: Duration::from_millis(args.drain_grace_ms),
        link: ClusterLink::new(secret, crate::runners::given_tls()),
    };
    let exit_with_stdin = args.exit_with_stdin;
    let exit = runtime.block_on(async move {
        let stop = stop_request(exit_with_stdin);
        run_worker_process(options, stop, |line| say(&line)).await
    })?;
    match exit {
        WorkerExit::Stopped => Ok(ExitCode::SUCCESS),
        WorkerExit::DriverGone(why) => {
            say(&format!("sluice worker exits: {why}"));
            Ok(ExitCode::FAILURE)
        }
    }
}

/// A line on stderr; a closed stderr (its parent gone) is not a reason to panic.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Resolves when the worker should stop: SIGTERM drains, SIGINT (or the end of stdin, when the
/// parent holds it) stops now.
async fn stop_request(exit_with_stdin: bool) -> StopRequest {
    // The parent's pipe: a `DRAIN` line asks for a drain (its cluster manager lets it go), its
    // end for a stop.
    let from_parent = async move {
        if !exit_with_stdin {
            return std::future::pending::<StopRequest>().await;
        }
        // A thread, not the runtime's blocking pool: it blocks on stdin for the whole run.
        let (tx, rx) = tokio::sync::oneshot::channel::<StopRequest>();
        let spawned = std::thread::Builder::new()
            .name("sluice-worker-stdin".to_string())
            .spawn(move || {
                let mut line = String::new();
                let mut stdin = std::io::stdin().lock();
                while matches!(stdin.read_line(&mut line), Ok(n) if n > 0) {
                    if line.trim() == DRAIN_LINE {
                        let _ = tx.send(StopRequest::Drain);
                        return;
                    }
                    line.clear();
                }
                let _ = tx.send(StopRequest::Now);
            });
        match spawned {
            Ok(_) => rx.await.unwrap_or(StopRequest::Now),
            // Without the thread the parent's end cannot be seen: stop rather than outlive it.
            Err(_) => StopRequest::Now,
        }
    };
    let terminate = async {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut sigterm) => {
                    sigterm.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await
    };
    tokio::select! {
        request = from_parent => request,
        _ = tokio::signal::ctrl_c() => StopRequest::Now,
        _ = terminate => StopRequest::Drain,
    }
}
