//! `sluice worker`: one worker process. It cleans its work directory, serves `WorkerService` and
//! Flight, registers with the driver, prints one line once registered, and runs until it is told to
//! stop or loses its driver.
//!
//! ```text
//!   start ─► clean work dir ─► serve ─► RegisterWorker ─► "sluice worker 2 (127.0.0.1:40113) joined …"
//!     │ SIGTERM            ─► drain: refuse new tasks, finish the running ones, deregister, exit 0
//!     │ stop (SIGINT, or its parent's pipe closing) ─► exit at once
//!     │ driver silent for the driver timeout ─► exit 1, saying so
//!     │ the driver answers "not registered" (it declared this worker lost, e.g. after SIGSTOP)
//!     │                    ─► drop every task and stream, RegisterWorker again (a new id)
//! ```
//!
//! Invariant: the worker's files live in `<work dir>/sluice-work`, which it empties when it starts
//! and removes when it ends (nothing else in the work directory is touched).

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::{DataFusionError, Result};
use sluice_runtime::WorkerOptions;

use crate::auth::ClusterSecret;
use crate::worker_server::{Departure, WorkerServer};

/// How a worker process runs.
#[derive(Debug, Clone)]
pub struct WorkerProcessOptions {
    /// The driver's `host:port`.
    pub driver: String,
    /// Where to listen (`host:port`; port 0 picks one).
    pub listen: String,
    /// The address to register, where the driver and other workers reach this one (default: the
    /// address it listens on).
    pub advertise: Option<String>,
    /// Slots, memory pool and work directory.
    pub worker: WorkerOptions,
    /// Arrow IPC compression of the streams it serves.
    pub compression: Option<CompressionType>,
    /// How often it sends a heartbeat.
    pub heartbeat_interval: Duration,
    /// How long the driver may stay silent before the worker gives up and exits.
    pub driver_timeout: Duration,
    /// How long a drain may take before the worker exits anyway.
    pub drain_grace: Duration,
    /// The cluster's secret, which every call carries.
    pub secret: ClusterSecret,
}

/// How a worker process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerExit {
    /// It drained (or was stopped) and left.
    Stopped,
    /// Its driver went silent; the message says for how long.
    DriverGone(String),
}

/// What tells a running worker to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopRequest {
    /// Finish what runs, then leave (SIGTERM).
    Drain,
    /// Leave now (SIGINT, or the parent is gone).
    Now,
}

/// The default work directory of this process.
pub fn default_work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("sluice-worker-{}", std::process::id()))
}

/// Runs a worker until `stop` resolves or its driver is gone; `say` receives the lines to print
/// (each time it registered, and why it joins again).
pub async fn run_worker_process(
    mut options: WorkerProcessOptions,
    stop: impl Future<Output = StopRequest>,
    say: impl FnMut(String),
) -> Result<WorkerExit> {
    let work_dir = options
        .worker
        .work_dir
        .clone()
        .unwrap_or_else(default_work_dir)
        .join("sluice-work");
    clean_dir(&work_dir)?;
    options.worker.work_dir = Some(work_dir.clone());
    let result = serve(options, stop, say).await;
    let _ = std::fs::remove_dir_all(&work_dir);
    result
}

async fn serve(
    options: WorkerProcessOptions,
    stop: impl Future<Output = StopRequest>,
    mut say: impl FnMut(String),
) -> Result<WorkerExit> {
    let name = format!("sluice worker (pid {})", std::process::id());
    let mut server = WorkerServer::start_on(
        name,
        &options.listen,
        options.advertise.clone(),
        options.worker.clone(),
        options.compression,
        options.secret.clone(),
    )
    .await?;
    let mut stop = std::pin::pin!(stop);
    loop {
        let id = server
            .join(
                &options.driver,
                options.heartbeat_interval,
                options.driver_timeout,
            )
            .await?;
        say(format!(
            "sluice {id} ({}) joined the driver at {}",
            server.worker().address(),
            options.driver
        ));
        let mut departure = server.departure();
        let gone = async {
            loop {
                if departure.changed().await.is_err() {
                    return Departure::Serving;
                }
                let now = departure.borrow().clone();
                if now != Departure::Serving {
                    return now;
                }
            }
        };
        let why = tokio::select! {
            request = &mut stop => {
                if request == StopRequest::Drain {
                    server.drain(options.drain_grace).await;
                }
                return Ok(WorkerExit::Stopped);
            }
            why = gone => why,
        };
        match why {
            // The driver declared this worker lost (it was paused, or cut off, for longer than the
            // heartbeat timeout) but still runs: nothing held here will be read again, so drop it
            // all and join afresh under a new id.
            Departure::Dropped => {
                say(format!(
                    "sluice {id}: the driver at {} declared this worker lost; its tasks and \
                     streams are dropped and it joins again",
                    options.driver
                ));
                server.worker().clean_up_all()?;
            }
            Departure::DriverLost(silence) => {
                return Ok(WorkerExit::DriverGone(format!(
                    "the driver at {} did not answer for {:.1} s",
                    options.driver,
                    silence.as_secs_f64()
                )));
            }
            Departure::Serving => {
                return Ok(WorkerExit::DriverGone(
                    "the heartbeat task ended".to_string(),
                ));
            }
        }
    }
}

/// Empties (or creates) `dir`.
fn clean_dir(dir: &PathBuf) -> Result<()> {
    let error = |e: std::io::Error| {
        DataFusionError::Execution(format!(
            "cannot prepare the work directory {}: {e}",
            dir.display()
        ))
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(error)?;
    }
    std::fs::create_dir_all(dir).map_err(error)
}
