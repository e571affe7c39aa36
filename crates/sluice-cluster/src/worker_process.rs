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
//! Invariant: the worker's files (spills, blocking outputs) live in `<work dir>/sluice-work-<pid>`,
//! which it creates empty and removes when it ends; at start it also removes the directories that
//! workers no longer running left there (SIGKILLed ones). Nothing else in the work directory is
//! touched.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::{DataFusionError, Result};
use sluice_planner::WorkerId;
use sluice_runtime::WorkerOptions;
use sluice_runtime::error::{ErrorKind, RemoteError};

use crate::auth::ClusterLink;
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
    /// The cluster's secret, which every call carries, and TLS when set.
    pub link: ClusterLink,
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

/// Where a worker's work directory goes when `--work-dir` is not given: the system's temporary
/// directory.
pub fn default_work_dir() -> PathBuf {
    std::env::temp_dir()
}

/// The prefix of every worker's own directory inside a work directory.
const OWN_DIR: &str = "sluice-work-";

/// This process's own directory inside `base`: workers sharing a work directory never touch each
/// other's files.
fn own_dir(base: &Path) -> PathBuf {
    base.join(format!("{OWN_DIR}{}", std::process::id()))
}

/// Removes what processes that are gone (killed before they could clean up) left in `base`: the
/// directories named `<prefix><pid>` or `<prefix><pid>-<anything>` of process ids that no longer
/// run. Only where `/proc` says which ids run.
pub(crate) fn remove_stale(base: &Path, prefix: &str) {
    if !cfg!(target_os = "linux") {
        return;
    }
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let pid = rest.split_once('-').map_or(rest, |(pid, _)| pid);
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Removes the worker's own directory when it is dropped, however the worker ends.
struct OwnDir(PathBuf);

impl Drop for OwnDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a worker until `stop` resolves or its driver is gone; `say` receives the lines to print
/// (each time it registered, and why it joins again).
pub async fn run_worker_process(
    mut options: WorkerProcessOptions,
    stop: impl Future<Output = StopRequest>,
    say: impl FnMut(String),
) -> Result<WorkerExit> {
    let base = options
        .worker
        .work_dir
        .clone()
        .unwrap_or_else(default_work_dir);
    remove_stale(&base, OWN_DIR);
    let work_dir = own_dir(&base);
    clean_dir(&work_dir)?;
    let _own = OwnDir(work_dir.clone());
    options.worker.work_dir = Some(work_dir);
    serve(options, stop, say).await
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
        options.link.clone(),
    )
    .await?;
    let mut stop = std::pin::pin!(stop);
    loop {
        // Joining waits at most the driver timeout (a driver that is not up yet is tried again
        // meanwhile), and a stop request ends it.
        let mut unreachable = None;
        let joining = tokio::time::timeout(
            options.driver_timeout,
            join_patiently(&mut server, &options, &mut unreachable),
        );
        let id = tokio::select! {
            _ = &mut stop => return Ok(WorkerExit::Stopped),
            joined = joining => match joined {
                Ok(id) => id?,
                Err(_) => {
                    return Ok(WorkerExit::DriverGone(format!(
                        "the driver at {} did not accept the registration within {:.1} s{}",
                        options.driver,
                        options.driver_timeout.as_secs_f64(),
                        unreachable.map(|e| format!(" ({e})")).unwrap_or_default()
                    )));
                }
            },
        };
        say(format!(
            "sluice {id} ({}) joined the driver at {}",
            server.worker().address(),
            options.driver
        ));
        // Only now: whoever waits for the line above sees it even if the first heartbeat ends
        // this process (a fault armed there).
        server.start_heartbeats(options.heartbeat_interval, options.driver_timeout)?;
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

/// Registers with the driver, trying again (100 ms doubling to 1 s) while it cannot be reached,
/// as when workers start before their driver; `unreachable` keeps the last such failure. Any other
/// failure (a refused secret, say) ends it at once.
async fn join_patiently(
    server: &mut WorkerServer,
    options: &WorkerProcessOptions,
    unreachable: &mut Option<String>,
) -> Result<WorkerId> {
    let mut pause = Duration::from_millis(100);
    loop {
        let joined = server
            .register(&options.driver, options.driver_timeout)
            .await;
        match joined {
            Err(error) if RemoteError::of(&error).kind == ErrorKind::Transport => {
                *unreachable = Some(error.to_string());
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

/// Empties (or creates) `dir`.
fn clean_dir(dir: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn only_directories_of_workers_no_longer_running_are_removed() {
        let base = std::env::temp_dir().join(format!("sluice-stale-test-{}", std::process::id()));
        let gone = base.join(format!("{OWN_DIR}999999999")); // above any pid_max
        let mine = own_dir(&base);
        let other = base.join("user-data");
        for dir in [&gone, &mine, &other] {
            std::fs::create_dir_all(dir).unwrap();
        }
        remove_stale(&base, OWN_DIR);
        let left = |dir: &PathBuf| dir.exists();
        assert_eq!(
            (left(&gone), left(&mine), left(&other)),
            (false, true, true)
        );
        drop(OwnDir(mine.clone()));
        assert!(!mine.exists());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
