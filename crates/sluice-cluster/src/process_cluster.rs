//! A cluster of processes: the driver in this process, N `sluice worker` processes of the same
//! executable started by it, and any worker started elsewhere that joins the driver's address.
//!
//! ```text
//!   this process: ClusterDriver (listens on --driver-listen) ◄── RegisterWorker ── sluice worker × N
//!                 ProcessWorkers (its ClusterManager) ── spawns, stdin piped ──►  (children)
//! ```
//!
//! The children and their pipes belong to `process_workers`; how many there are, to the
//! autoscaler (`sluice_runtime::scaling`) over them: `workers` at the start, more (up to
//! `max_workers`) while task regions wait for slots, idle ones let go after `idle_timeout` down to
//! `min_workers`.
//!
//! Invariants: a spawned worker never outlives this process: it exits when its stdin reaches end of
//! file, which the kernel delivers however this process ends (exit, panic, SIGKILL); the cluster
//! starts only once `min_workers` workers registered, and a child that exits before that fails the
//! start with what it printed; while fewer than the floor (the smaller of `min_workers` and
//! `workers`) are live, a new process is started
//! in place of one that died (so a task that kills its workers fails its job by its attempt
//! limit, not by running out of workers), at most one a second; with `workers` 0 the cluster only
//! waits for workers started elsewhere and starts none; dropping the cluster stops the autoscaler
//! first and then ends every child, waiting for each to exit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use sluice_planner::{JobGraph, OutputMode};
use sluice_runtime::cluster_manager::ClusterManager;
use sluice_runtime::runner::ClusterState;
use sluice_runtime::scaling::{ScalingLimits, autoscale};
use sluice_runtime::{DriverHandle, DriverOptions, DriverSnapshot, JobProgress, WorkerOptions};

use crate::auth::{ClusterLink, ClusterSecret, ClusterTls};
use crate::driver_server::ClusterDriver;
use crate::process_workers::{ProcessWorkers, SpawnContext, reap};
use crate::worker_process::remove_stale;

/// How to start a cluster of processes.
#[derive(Debug, Clone)]
pub struct ProcessClusterOptions {
    /// The `sluice` executable to start workers from.
    pub executable: PathBuf,
    /// Worker processes to start.
    pub workers: usize,
    /// Workers that must have registered before the first job runs (spawned or external), and
    /// the floor the autoscaler keeps.
    pub min_workers: usize,
    /// The most worker processes the autoscaler keeps (workers started elsewhere may join beyond).
    pub max_workers: usize,
    /// How long a spawned worker stays idle before it is let go (down to `min_workers`).
    pub idle_timeout: Duration,
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
    /// Workers as Kubernetes pods instead of child processes (`--cluster-manager kubernetes`;
    /// a build without the `kubernetes` feature refuses it).
    pub kubernetes: Option<crate::KubernetesOptions>,
}

impl ProcessClusterOptions {
    /// Options for `workers` workers of `executable`, the rest default.
    pub fn new(executable: PathBuf, workers: usize) -> Self {
        Self {
            executable,
            workers,
            min_workers: workers,
            max_workers: workers,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
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
            kubernetes: None,
        }
    }
}

/// The default [`ProcessClusterOptions::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The driver and its worker processes; see the module docs.
pub struct ProcessCluster {
    driver: ClusterDriver,
    /// How the driver reaches the workers (secret, TLS).
    link: ClusterLink,
    /// Its cluster manager: the worker processes it started.
    workers: ProcessWorkers,
    /// Starts and lets go of workers (none with `workers` 0); stopped first when the cluster
    /// drops.
    autoscaler: Option<SpawnedTask<()>>,
    /// Reaps children that ended.
    reaper: Option<SpawnedTask<()>>,
    /// The worker pods, with the task watching them (`--cluster-manager kubernetes`).
    #[cfg(feature = "kubernetes")]
    pods: Option<(crate::kubernetes::KubernetesWorkers, SpawnedTask<()>)>,
    /// The spawned workers' work directory; dropped after them (fields drop in order).
    _work_dir: WorkDir,
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        drop(self.autoscaler.take());
        drop(self.reaper.take());
        #[cfg(feature = "kubernetes")]
        if let Some((pods, watch)) = self.pods.take() {
            drop(watch);
            pods.delete_all_blocking();
        }
        self.workers.stop_now();
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
            .field("workers", &self.workers)
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
        if options.kubernetes.is_some() && !crate::KUBERNETES {
            return Err(DataFusionError::Configuration(
                "this build has no Kubernetes support (the `kubernetes` feature)".to_string(),
            ));
        }
        let mut process_options = options.clone();
        if options.kubernetes.is_some() {
            // Pods instead of child processes.
            process_options.workers = 0;
        }
        let workers = ProcessWorkers::start(SpawnContext {
            options: process_options,
            driver_address: local_address(driver.address()),
            handle: driver.driver().handle().clone(),
            link: link.clone(),
            work_dir: work_dir.0.clone(),
            ended,
        })?;
        let reaper = SpawnedTask::spawn(reap(workers.clone(), ended_rx));
        let mut cluster = Self {
            driver,
            link: link.clone(),
            workers,
            autoscaler: None,
            reaper: Some(reaper),
            #[cfg(feature = "kubernetes")]
            pods: None,
            _work_dir: work_dir,
        };
        #[cfg(feature = "kubernetes")]
        let manager: Arc<dyn ClusterManager> = match &options.kubernetes {
            Some(kubernetes) => Arc::new(cluster.start_pods(kubernetes, &options).await?),
            None => Arc::new(cluster.workers.clone()),
        };
        #[cfg(not(feature = "kubernetes"))]
        let manager: Arc<dyn ClusterManager> = Arc::new(cluster.workers.clone());
        // The autoscaler runs from the start: a worker that dies while the others are still
        // joining is replaced like any other.
        if options.workers > 0 {
            let limits = ScalingLimits {
                // The floor it restores is what it started: with --workers 1 --min-workers 2 the
                // second worker is one started elsewhere, waited for, not started here.
                min_workers: options.min_workers.min(options.workers),
                max_workers: options.max_workers.max(options.min_workers),
                slots_per_worker: options.slots,
                idle_timeout: options.idle_timeout,
                start_timeout: options.startup_timeout,
                restart_interval: Duration::from_secs(1),
            };
            let handle = cluster.driver.driver().handle().clone();
            cluster.autoscaler = Some(SpawnedTask::spawn(autoscale(
                handle,
                manager,
                limits,
                options.workers,
            )));
        }
        cluster.wait_for_workers(&options).await?;
        Ok(cluster)
    }

    /// Connects to Kubernetes, creates the first `workers` pods and starts watching them.
    #[cfg(feature = "kubernetes")]
    async fn start_pods(
        &mut self,
        kubernetes: &crate::KubernetesOptions,
        options: &ProcessClusterOptions,
    ) -> Result<crate::kubernetes::KubernetesWorkers> {
        use crate::kubernetes::{KubernetesWorkers, ManagerContext};
        let bound = self.driver.address().to_string();
        let driver_port = bound
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse().ok())
            .unwrap_or(0);
        let context = ManagerContext {
            slots: options.slots,
            memory_limit: options.memory_limit,
            extra_args: worker_flags(options),
            env: options.worker_env.clone(),
            driver_port,
            driver_local: local_address(&bound),
            // Half the capacity wait: a region waiting for the pod fails with its reason.
            pending_limit: options.driver.capacity_wait / 2,
        };
        let pods = KubernetesWorkers::connect(kubernetes, context).await?;
        let watch = SpawnedTask::spawn(pods.clone().watch(self.driver().clone()));
        self.pods = Some((pods.clone(), watch));
        pods.start_workers(options.workers).await?;
        Ok(pods)
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
            // A worker pod that ended before it registered fails the start, as a worker process
            // does.
            #[cfg(feature = "kubernetes")]
            if let Some(ended) = self
                .pods
                .as_ref()
                .and_then(|(pods, _)| pods.ended_unregistered())
            {
                return Err(DataFusionError::Execution(format!("kubernetes: {ended}")));
            }
            if Instant::now() > deadline {
                #[cfg(feature = "kubernetes")]
                let why = self
                    .pods
                    .as_ref()
                    .and_then(|(pods, _)| pods.problem())
                    .map(|problem| format!(": {problem}"))
                    .unwrap_or_default();
                #[cfg(not(feature = "kubernetes"))]
                let why = "";
                return Err(sluice_runtime::error::transport_error(format!(
                    "{registered} of {} workers registered with the driver at {} within {} s{why}",
                    options.min_workers,
                    self.driver.address(),
                    options.startup_timeout.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn enough_joined(&self, registered: usize, min_workers: usize) -> Result<bool> {
        self.workers.enough_joined(registered, min_workers)
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
        self.workers.pids()
    }

    /// The registration lines the spawned workers printed.
    pub fn worker_lines(&self) -> Vec<String> {
        self.workers.lines()
    }

    /// Its cluster manager: the worker processes it started.
    pub fn manager(&self) -> &ProcessWorkers {
        &self.workers
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

/// The `sluice worker` flags every started worker gets besides its driver, address and slots.
pub(crate) fn worker_flags(options: &ProcessClusterOptions) -> Vec<String> {
    let mut flags = vec![
        "--heartbeat-interval-ms".to_string(),
        options.heartbeat_interval.as_millis().to_string(),
    ];
    if let Some(compression) = options.compression {
        let name = match compression {
            CompressionType::ZSTD => "zstd",
            _ => "lz4",
        };
        flags.extend(["--flight-compression".to_string(), name.to_string()]);
    }
    flags
}

/// The address a worker on this machine reaches the driver at.
fn local_address(bound: &str) -> String {
    match bound.rsplit_once(':') {
        Some(("0.0.0.0" | "[::]", port)) => format!("127.0.0.1:{port}"),
        _ => bound.to_string(),
    }
}
