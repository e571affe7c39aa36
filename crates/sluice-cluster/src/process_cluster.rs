//! A cluster of processes: the driver in this process, N `sluice worker` processes of the same
//! executable started by it, and any worker started elsewhere that joins the driver's address.
//!
//! ```text
//!   this process: ClusterDriver (listens on --driver-listen) ◄── RegisterWorker ── sluice worker × N
//!                      │ spawns, stdin piped                                       (children)
//!                      └─ child stdin: "SECRET …\n" (if any), then held open ─► EOF when we exit
//! ```
//!
//! Invariants: a spawned worker never outlives this process: it exits when its stdin reaches end of
//! file, which the kernel delivers however this process ends (exit, panic, SIGKILL); the cluster
//! starts only once `min_workers` workers registered, and a child that exits before that fails the
//! start with what it printed; a spawned worker that dies after it joined is replaced by a new
//! process (so the cluster keeps its worker count, and a task that kills its workers fails its job
//! by its attempt limit, not by running out of workers), at most one replacement a second; dropping
//! the cluster stops replacing and ends every child, waiting for each to exit.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use sluice_planner::{JobGraph, OutputMode, WorkerId};
use sluice_runtime::runner::ClusterState;
use sluice_runtime::{DriverHandle, DriverOptions, DriverSnapshot, JobProgress, WorkerOptions};

use crate::auth::{ClusterLink, ClusterSecret, ClusterTls};
use crate::driver_server::ClusterDriver;
use crate::worker_process::remove_stale;

/// How to start a cluster of processes.
#[derive(Debug, Clone)]
pub struct ProcessClusterOptions {
    /// The `sluice` executable to start workers from.
    pub executable: PathBuf,
    /// Worker processes to start.
    pub workers: usize,
    /// Workers that must have registered before the first job runs (spawned or external).
    pub min_workers: usize,
    /// Where the driver listens (`host:port`; port 0 picks one).
    pub driver_listen: String,
    /// The driver's options.
    pub driver: DriverOptions,
    /// Task slots of each spawned worker.
    pub slots: usize,
    /// Memory pool of each spawned worker.
    pub memory_limit: Option<u64>,
    /// Arrow IPC compression on the Flight data plane.
    pub compression: Option<CompressionType>,
    /// How often workers send a heartbeat.
    pub heartbeat_interval: Duration,
    /// How long to wait for `min_workers` to register.
    pub startup_timeout: Duration,
    /// The output mode of every exchange.
    pub exchange: OutputMode,
    /// The secret every call carries (`None`: a random one per run). Spawned workers get it on
    /// their stdin; workers started elsewhere need it too (`--secret-file`, `SLUICE_SECRET`).
    pub secret: Option<ClusterSecret>,
    /// Mutual TLS on every call; spawned workers get the same files.
    pub tls: Option<ClusterTls>,
    /// Environment variables set on each spawned worker, over those it inherits (the client's
    /// log format and trace export).
    pub worker_env: Vec<(String, String)>,
}

impl ProcessClusterOptions {
    /// Options for `workers` workers of `executable`, the rest default.
    pub fn new(executable: PathBuf, workers: usize) -> Self {
        Self {
            executable,
            workers,
            min_workers: workers,
            driver_listen: "127.0.0.1:0".to_string(),
            driver: DriverOptions::default(),
            slots: WorkerOptions::default().slots,
            memory_limit: None,
            compression: None,
            heartbeat_interval: Duration::from_secs(1),
            startup_timeout: Duration::from_secs(60),
            exchange: OutputMode::Pipelined,
            secret: None,
            tls: None,
            worker_env: Vec::new(),
        }
    }
}

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

/// The spawned worker processes, shared with the supervisor that replaces dead ones.
struct Children {
    /// Live (or not yet reaped) children.
    spawned: Vec<Spawned>,
    /// The label of the next child (`[worker process N]`).
    next_index: usize,
    /// The cluster is being dropped: replace nothing more.
    stopping: bool,
}

/// What the supervisor needs to start a worker process.
struct SpawnContext {
    options: ProcessClusterOptions,
    driver_address: String,
    handle: DriverHandle,
    link: ClusterLink,
    work_dir: PathBuf,
    /// Where relays say that a child ended, by its index.
    ended: tokio::sync::mpsc::UnboundedSender<usize>,
}

/// The driver and its worker processes; see the module docs.
pub struct ProcessCluster {
    driver: ClusterDriver,
    /// How the driver reaches the workers (secret, TLS).
    link: ClusterLink,
    children: Arc<std::sync::Mutex<Children>>,
    /// Replaces children that died after they joined; stopped first when the cluster drops.
    supervisor: Option<SpawnedTask<()>>,
    /// The spawned workers' work directory; dropped after them (fields drop in order).
    _work_dir: WorkDir,
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        if let Ok(mut children) = self.children.lock() {
            children.stopping = true;
        }
        drop(self.supervisor.take());
        // Each child exits once its stdin closes: close them all, then wait for every one.
        let mut spawned = self
            .children
            .lock()
            .map(|mut children| std::mem::take(&mut children.spawned))
            .unwrap_or_default();
        for child in &mut spawned {
            drop(child.stdin.take());
        }
        drop(spawned);
    }
}

/// The work directory the spawned workers share (each keeps its files in its own sub-directory),
/// removed with the cluster: what a SIGKILLed worker left there goes too.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create() -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = std::env::temp_dir();
        // What clients that were killed (no drop ran) left behind.
        remove_stale(&base, "sluice-cluster-");
        let dir = base.join(format!("sluice-cluster-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| {
            DataFusionError::Execution(format!(
                "cannot create the workers' directory {}: {e}",
                dir.display()
            ))
        })?;
        Ok(Self(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl std::fmt::Debug for ProcessCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessCluster")
            .field("driver", &self.driver.address())
            .field(
                "spawned",
                &self.children.lock().map_or(0, |c| c.spawned.len()),
            )
            .finish()
    }
}

impl ProcessCluster {
    /// Starts the driver and the worker processes, and waits for `min_workers` registrations.
    pub async fn start(options: ProcessClusterOptions) -> Result<Self> {
        if options.min_workers == 0 {
            return Err(DataFusionError::Configuration(
                "a cluster needs at least one worker: start some (--workers) or wait for external \
                 ones (--min-workers)"
                    .to_string(),
            ));
        }
        let link = ClusterLink::for_cluster(options.secret.as_ref(), options.tls.as_ref())?;
        let driver = ClusterDriver::start_on(
            &options.driver_listen,
            options.driver.clone(),
            WorkerOptions::default(),
            options.compression,
            link.clone(),
        )
        .await?;
        let work_dir = WorkDir::create()?;
        let (ended, ended_rx) = tokio::sync::mpsc::unbounded_channel();
        let context = Arc::new(SpawnContext {
            options: options.clone(),
            driver_address: local_address(driver.address()),
            handle: driver.driver().handle().clone(),
            link: link.clone(),
            work_dir: work_dir.0.clone(),
            ended,
        });
        let spawned = (1..=options.workers)
            .map(|index| spawn_worker(&context, index))
            .collect::<Result<Vec<_>>>()?;
        let children = Arc::new(std::sync::Mutex::new(Children {
            spawned,
            next_index: options.workers + 1,
            stopping: false,
        }));
        let supervisor = SpawnedTask::spawn(supervise(Arc::clone(&children), context, ended_rx));
        let mut cluster = Self {
            driver,
            link: link.clone(),
            children,
            supervisor: Some(supervisor),
            _work_dir: work_dir,
        };
        cluster.wait_for_workers(&options).await?;
        Ok(cluster)
    }

    /// Waits until `min_workers` registered. A spawned worker that registered counts even if it
    /// is lost since (the cluster runs on with the others); one that exits before registering
    /// fails the start, with what it printed.
    async fn wait_for_workers(&mut self, options: &ProcessClusterOptions) -> Result<()> {
        let deadline = Instant::now() + options.startup_timeout;
        loop {
            let registered = self.driver.driver().snapshot().await?.workers.len();
            if self.enough_joined(registered, options.min_workers)? {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(sluice_runtime::error::transport_error(format!(
                    "{registered} of {} workers registered with the driver at {} within {} s",
                    options.min_workers,
                    self.driver.address(),
                    options.startup_timeout.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether `min_workers` joined: `registered` ones, or spawned ones that joined at least once
    /// (each counted once, also if it joined again or was lost since). A spawned worker that
    /// exited before it joined is an error, with what it printed.
    fn enough_joined(&self, registered: usize, min_workers: usize) -> Result<bool> {
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
            // is replaced by the supervisor, not an error of the start.
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

    /// What the driver and every worker hold now.
    pub async fn state(&self) -> Result<ClusterState> {
        self.driver.state(&self.link).await
    }

    /// The driver's address (where external workers join).
    pub fn driver_address(&self) -> &str {
        self.driver.address()
    }

    /// The process ids of the spawned workers (replacements included).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.children
            .lock()
            .map(|c| c.spawned.iter().map(|s| s.child.id()).collect())
            .unwrap_or_default()
    }

    /// The registration lines the spawned workers printed.
    pub fn worker_lines(&self) -> Vec<String> {
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

    /// Runs `graph`; the stream is lazy and cancels the job when dropped.
    pub fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        self.driver.driver().execute(graph, context)
    }

    /// The driver's state.
    pub async fn snapshot(&self) -> Result<DriverSnapshot> {
        self.driver.driver().snapshot().await
    }

    /// The progress of every running job.
    pub async fn progress(&self) -> Result<Vec<JobProgress>> {
        self.driver.driver().progress().await
    }

    /// The driver's handle (progress, notices, snapshots).
    pub fn driver(&self) -> &DriverHandle {
        self.driver.driver().handle()
    }
}

/// The worker id in a registration line ("sluice worker 3 (127.0.0.1:40113) joined …").
fn registered_id(line: &str) -> Option<WorkerId> {
    let rest = line.split_once("sluice worker ")?.1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().map(WorkerId)
}

/// The address a worker on this machine reaches the driver at.
fn local_address(bound: &str) -> String {
    match bound.rsplit_once(':') {
        Some(("0.0.0.0" | "[::]", port)) => format!("127.0.0.1:{port}"),
        _ => bound.to_string(),
    }
}

fn poisoned() -> DataFusionError {
    DataFusionError::Internal("the cluster's list of worker processes is poisoned".to_string())
}

/// How long the supervisor waits between two replacements.
const REPLACEMENT_INTERVAL: Duration = Duration::from_secs(1);

/// Replaces each spawned worker that dies after it joined with a new process, until the cluster
/// stops. A child that dies before it joined is not replaced (the start reports it).
async fn supervise(
    children: Arc<std::sync::Mutex<Children>>,
    context: Arc<SpawnContext>,
    mut ended: tokio::sync::mpsc::UnboundedReceiver<usize>,
) {
    while let Some(index) = ended.recv().await {
        let (exited, index) = {
            let Ok(mut children) = children.lock() else {
                return;
            };
            if children.stopping {
                return;
            }
            let Some(position) = children.spawned.iter().position(|s| s.index == index) else {
                continue;
            };
            // One that never joined stays listed: the start reports it with what it printed.
            let joined = children.spawned[position]
                .joined
                .lock()
                .map(|j| j.is_some())
                .unwrap_or(false);
            if !joined {
                continue;
            }
            let exited = children.spawned.remove(position);
            let next = children.next_index;
            children.next_index += 1;
            (exited, next)
        };
        // Reaped outside the lock (its process has ended: its stderr closed).
        drop(exited);
        tokio::time::sleep(REPLACEMENT_INTERVAL).await;
        let Ok(mut children) = children.lock() else {
            return;
        };
        if children.stopping {
            return;
        }
        match spawn_worker(&context, index) {
            Ok(spawned) => {
                tracing::info!(
                    target: "sluice::cluster",
                    index,
                    "started worker process {index} to replace one that died"
                );
                children.spawned.push(spawned);
            }
            Err(error) => tracing::warn!(
                target: "sluice::cluster",
                %error,
                "cannot start a replacement worker process"
            ),
        }
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
        .args([
            "--heartbeat-interval-ms",
            &options.heartbeat_interval.as_millis().to_string(),
        ])
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
    if let Some(compression) = options.compression {
        let name = match compression {
            CompressionType::ZSTD => "zstd",
            _ => "lz4",
        };
        command.args(["--flight-compression", name]);
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
                // Not eprintln!: a closed stderr must not end this relay (it reports the exit).
                let _ = writeln!(std::io::stderr().lock(), "[worker process {index}] {line}");
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
