//! The worker processes a process cluster starts, as its [`ClusterManager`]: each a `sluice
//! worker` child of this process with its stdin piped and its stderr relayed.
//!
//! ```text
//!   ProcessWorkers ── spawn ──► sluice worker --exit-with-stdin (child)
//!      stdin:  "SLUICE WORKER <n> <secret>", then held open; "DRAIN" asks it to drain; EOF stops it
//!      stderr: its own lines ("sluice worker 3 (…) joined …", why it exits) go to the log
//!              (target sluice::cluster, info); anything else is relayed as "[worker process n] …";
//!              its join line gives its worker id; its end tells the driver (the process ended)
//!              and the reaper
//! ```
//!
//! Invariants: a child never outlives this process (its stdin closes however this process ends);
//! `stop` closes every stdin and returns only after every child exited (killed after 2 s); once
//! stopping, nothing more is started; a child that exits before it printed its join line is kept
//! listed (the start reports it with what it printed) when it is one of the first, and reaped
//! otherwise; replacing a child that died is the autoscaler's decision (`sluice_runtime::scaling`),
//! not this module's.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::WorkerId;
use sluice_runtime::DriverHandle;
use sluice_runtime::cluster_manager::ClusterManager;

use crate::auth::ClusterLink;
use crate::process_cluster::ProcessClusterOptions;

/// The line on a spawned worker's stdin that asks it to drain.
pub const DRAIN_LINE: &str = "DRAIN";

/// One spawned worker process.
struct Spawned {
    /// Its label: `[worker process N]`.
    index: usize,
    child: Child,
    /// Held open: the child exits when it closes.
    stdin: Option<ChildStdin>,
    /// The worker's registration line, once printed.
    joined: Arc<std::sync::Mutex<Option<String>>>,
    /// Everything else it printed (for errors).
    output: Arc<std::sync::Mutex<Vec<String>>>,
    /// Set once its stderr reached its end: `joined` and `output` are final.
    output_ended: Arc<AtomicBool>,
}

impl Spawned {
    /// The worker id it registered under, once its join line is in.
    fn registered_as(&self) -> Option<WorkerId> {
        self.joined
            .lock()
            .ok()
            .and_then(|line| line.as_deref().and_then(registered_id))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        // End of file on its stdin makes it exit; wait briefly, then make sure.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The spawned worker processes, shared with the reaper.
struct Children {
    /// Live (or not yet reaped) children.
    spawned: Vec<Spawned>,
    /// The label of the next child (`[worker process N]`).
    next_index: usize,
    /// The cluster is being dropped: start nothing more.
    stopping: bool,
}

/// What it takes to start a worker process.
pub(crate) struct SpawnContext {
    pub options: ProcessClusterOptions,
    pub driver_address: String,
    pub handle: DriverHandle,
    pub link: ClusterLink,
    pub work_dir: PathBuf,
    /// Where relays say that a child ended, by its index.
    pub ended: tokio::sync::mpsc::UnboundedSender<usize>,
}

/// The worker processes of a process cluster; see the module docs. Clones share the children.
#[derive(Clone)]
pub struct ProcessWorkers {
    children: Arc<Mutex<Children>>,
    context: Arc<SpawnContext>,
}

impl std::fmt::Debug for ProcessWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessWorkers")
            .field(
                "spawned",
                &self.children.lock().map_or(0, |c| c.spawned.len()),
            )
            .finish()
    }
}

impl ProcessWorkers {
    /// Starts `context.options.workers` worker processes.
    pub(crate) fn start(context: SpawnContext) -> Result<Self> {
        let count = context.options.workers;
        let workers = Self {
            children: Arc::new(Mutex::new(Children {
                spawned: Vec::new(),
                next_index: 1,
                stopping: false,
            })),
            context: Arc::new(context),
        };
        for _ in 0..count {
            workers.spawn_one()?;
        }
        Ok(workers)
    }

    /// Starts one more worker process.
    fn spawn_one(&self) -> Result<usize> {
        let mut children = self.children.lock().map_err(|_| poisoned())?;
        if children.stopping {
            return Err(DataFusionError::Execution(
                "the cluster is stopping: no worker process is started".to_string(),
            ));
        }
        let index = children.next_index;
        children.next_index += 1;
        let spawned = spawn_worker(&self.context, index)?;
        children.spawned.push(spawned);
        Ok(index)
    }

    /// Whether `min_workers` joined: `registered` ones, or spawned ones that joined at least once
    /// (each counted once, also if it joined again or was lost since). A spawned worker that
    /// exited before it joined is an error, with what it printed.
    pub(crate) fn enough_joined(&self, registered: usize, min_workers: usize) -> Result<bool> {
        let mut children = self.children.lock().map_err(|_| poisoned())?;
        let spawned_joined = children
            .spawned
            .iter()
            .filter(|s| s.joined.lock().map(|j| j.is_some()).unwrap_or(false))
            .count();
        if registered.max(spawned_joined) >= min_workers {
            return Ok(true);
        }
        for spawned in children.spawned.iter_mut() {
            // Only once its output ended: a worker that printed its join line and then exited
            // is replaced by the autoscaler, not an error of the start.
            if !spawned.output_ended.load(Ordering::Acquire) {
                continue;
            }
            let never_joined = spawned.joined.lock().map(|j| j.is_none()).unwrap_or(true);
            if never_joined && let Ok(Some(status)) = spawned.child.try_wait() {
                let output = spawned
                    .output
                    .lock()
                    .map(|lines| lines.join("\n"))
                    .unwrap_or_default();
                return Err(DataFusionError::Execution(format!(
                    "worker process {} exited ({status}) before it registered: {output}",
                    spawned.index
                )));
            }
        }
        Ok(false)
    }

    /// The process ids of the spawned workers (replacements included).
    pub fn pids(&self) -> Vec<u32> {
        self.children
            .lock()
            .map(|c| c.spawned.iter().map(|s| s.child.id()).collect())
            .unwrap_or_default()
    }

    /// The registration lines the spawned workers printed.
    pub fn lines(&self) -> Vec<String> {
        self.children
            .lock()
            .map(|c| {
                c.spawned
                    .iter()
                    .filter_map(|s| s.joined.lock().ok().and_then(|line| line.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Stops replacing, closes every child's stdin, then waits for each to exit (blocking, at
    /// most 2 s per child before it is killed).
    pub(crate) fn stop_now(&self) {
        let mut spawned = match self.children.lock() {
            Ok(mut children) => {
                children.stopping = true;
                std::mem::take(&mut children.spawned)
            }
            Err(_) => Vec::new(),
        };
        // Each child exits once its stdin closes: close them all, then wait for every one.
        for child in &mut spawned {
            drop(child.stdin.take());
        }
        drop(spawned);
    }
}

impl ClusterManager for ProcessWorkers {
    fn name(&self) -> &'static str {
        "process"
    }

    fn desired_workers(&self) -> usize {
        self.context.options.workers
    }

    fn start_workers(&self, count: usize) -> BoxFuture<'static, Result<()>> {
        let started = (0..count).try_for_each(|_| self.spawn_one().map(|_| ()));
        futures::future::ready(started).boxed()
    }

    fn manages(&self, worker: WorkerId) -> bool {
        self.children.lock().is_ok_and(|children| {
            children
                .spawned
                .iter()
                .any(|s| s.registered_as() == Some(worker))
        })
    }

    fn drain(&self, worker: WorkerId) -> BoxFuture<'static, Result<()>> {
        let asked = (|| {
            let mut children = self.children.lock().map_err(|_| poisoned())?;
            let spawned = children
                .spawned
                .iter_mut()
                .find(|s| s.registered_as() == Some(worker))
                .ok_or_else(|| {
                    DataFusionError::Execution(format!("no worker process registered as {worker}"))
                })?;
            let pipe = spawned.stdin.as_mut().ok_or_else(|| {
                DataFusionError::Execution(format!("{worker} is stopping already"))
            })?;
            writeln!(pipe, "{DRAIN_LINE}")
                .and_then(|_| pipe.flush())
                .map_err(|e| {
                    DataFusionError::Execution(format!("cannot ask {worker} to drain: {e}"))
                })?;
            Ok(())
        })();
        futures::future::ready(asked).boxed()
    }

    fn stop(&self) -> BoxFuture<'static, Result<()>> {
        let workers = self.clone();
        async move {
            SpawnedTask::spawn_blocking(move || workers.stop_now())
                .await
                .map_err(|e| DataFusionError::Execution(format!("stopping the workers: {e}")))
        }
        .boxed()
    }
}

/// The worker id in a registration line ("sluice worker 3 (127.0.0.1:40113) joined …").
fn registered_id(line: &str) -> Option<WorkerId> {
    let rest = line.split_once("sluice worker ")?.1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().map(WorkerId)
}

fn poisoned() -> DataFusionError {
    DataFusionError::Internal("the cluster's list of worker processes is poisoned".to_string())
}

/// Reaps each spawned worker whose process ended, until the cluster stops. One of the first
/// workers that exits before it joined stays listed (the start reports it with what it printed).
pub(crate) async fn reap(
    workers: ProcessWorkers,
    mut ended: tokio::sync::mpsc::UnboundedReceiver<usize>,
) {
    while let Some(index) = ended.recv().await {
        let exited = {
            let Ok(mut children) = workers.children.lock() else {
                return;
            };
            if children.stopping {
                return;
            }
            let Some(position) = children.spawned.iter().position(|s| s.index == index) else {
                continue;
            };
            let spawned = &children.spawned[position];
            let joined = spawned.joined.lock().map(|j| j.is_some()).unwrap_or(false);
            if !joined && index <= workers.context.options.workers {
                continue;
            }
            if !joined {
                tracing::warn!(
                    target: "sluice::cluster",
                    index,
                    "worker process {index} exited before it registered"
                );
            }
            children.spawned.remove(position)
        };
        // Reaped outside the lock (its process has ended: its stderr closed).
        drop(exited);
    }
}

fn spawn_worker(context: &SpawnContext, index: usize) -> Result<Spawned> {
    let SpawnContext {
        options,
        driver_address: driver,
        handle,
        link,
        work_dir,
        ended,
    } = context;
    let mut command = Command::new(&options.executable);
    command
        .arg("worker")
        .args(["--driver", driver])
        .arg("--work-dir")
        .arg(work_dir)
        .args(["--slots", &options.slots.to_string()])
        .args(crate::process_cluster::worker_flags(options))
        .arg("--exit-with-stdin")
        .envs(options.worker_env.iter().map(|(name, value)| (name, value)))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(tls) = link.tls() {
        command
            .arg("--tls-cert")
            .arg(&tls.files.cert)
            .arg("--tls-key")
            .arg(&tls.files.key)
            .arg("--tls-ca")
            .arg(&tls.files.ca);
    }
    if let Some(limit) = options.memory_limit {
        command.args(["--memory-limit", &limit.to_string()]);
    }
    let mut child = command.spawn().map_err(|e| {
        DataFusionError::Execution(format!(
            "cannot start worker process {index} ({}): {e}",
            options.executable.display()
        ))
    })?;
    let mut stdin = child.stdin.take();
    if let Some(pipe) = stdin.as_mut() {
        // The hand-over: the cluster secret travels here, not on the command line. The pipe
        // stays open; its end tells the worker to stop.
        let _ = writeln!(pipe, "SLUICE WORKER {index} {}", link.secret().expose());
        let _ = pipe.flush();
    }
    let joined = Arc::new(std::sync::Mutex::new(None));
    let output = Arc::new(std::sync::Mutex::new(Vec::new()));
    let output_ended = Arc::new(AtomicBool::new(false));
    if let Some(stderr) = child.stderr.take() {
        let (joined, output) = (joined.clone(), output.clone());
        let output_ended = output_ended.clone();
        let (handle, pid, ended) = (handle.clone(), child.id(), ended.clone());
        std::thread::spawn(move || {
            let mut registered = None;
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                let is_join = line.contains(") joined the driver at ");
                if is_join && let Ok(mut first) = joined.lock() {
                    registered = registered_id(&line);
                    *first = Some(line.clone());
                }
                if line.starts_with("sluice ") {
                    // The worker's own lines (joined, declared lost, exits): workers come and go
                    // with the load, so these belong in the log, not in the user's terminal.
                    tracing::info!(
                        target: "sluice::cluster",
                        process = index,
                        "worker process {index}: {line}"
                    );
                } else {
                    // Not eprintln!: a closed stderr must not end this relay (it reports the
                    // exit).
                    let _ = writeln!(std::io::stderr().lock(), "[worker process {index}] {line}");
                }
                if let Ok(mut lines) = output.lock() {
                    lines.push(line);
                }
            }
            output_ended.store(true, Ordering::Release);
            // Its stderr closed: the process ended (killed, crashed, or it left). The driver hears
            // it now rather than after the heartbeat timeout; a driver already gone ignores it.
            if let Some(worker) = registered {
                let _ = handle.worker_gone(worker, format!("its process (pid {pid}) ended"));
            }
            let _ = ended.send(index);
        });
    }
    Ok(Spawned {
        index,
        child,
        stdin,
        joined,
        output,
        output_ended,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worker_id_is_read_from_its_registration_line() {
        let line = "sluice worker 12 (127.0.0.1:40113) joined the driver at 127.0.0.1:1";
        assert_eq!(registered_id(line), Some(WorkerId(12)));
        assert_eq!(
            registered_id("[worker process 1] sluice worker x joined"),
            None
        );
    }
}
