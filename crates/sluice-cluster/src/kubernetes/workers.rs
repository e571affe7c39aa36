//! The Kubernetes cluster manager: worker pods, created from the pod template through the API
//! server `kube` finds (in-cluster service account, else `KUBECONFIG`), watched, and deleted.
//!
//! ```text
//!   autoscaler ── start_workers(n) ──► create pod <driver>-worker-<k> (pod_spec)
//!              ── drain(worker) ─────► delete its pod: SIGTERM, the worker drains and leaves
//!   pod watch (every 500 ms: list pods labelled sluice.dev/driver=<driver>, driver snapshot)
//!      Running ─► its IP names the worker that registered from it
//!      Failed / Succeeded ─► the driver hears the worker is gone (its attempts are retried), the
//!                            pod is deleted; the autoscaler starts another when one is needed
//!      Pending with an image pull or config error, or longer than capacity_wait ─► the driver's
//!                            capacity note: a region short of slots fails with the pod's reason
//!   stop ── delete every pod labelled with the driver, wait until the list is empty (30 s)
//! ```
//!
//! Invariants: the manager touches pods only, and only those labelled with its driver's name;
//! every pod it made is deleted when the cluster stops (also on SIGTERM to the driver); a pod that
//! cannot start never makes a job wait silently: its reason reaches the driver's capacity error.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use datafusion::common::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::Value;
use sluice_planner::WorkerId;
use sluice_runtime::DriverHandle;
use sluice_runtime::cluster_manager::ClusterManager;
use tokio::time::Instant;

use super::pod_spec::{DRIVER_LABEL, OwnerPod, WorkerPod};
use crate::kubernetes_options::KubernetesOptions;

/// One pod the manager made.
#[derive(Debug)]
struct PodEntry {
    created: Instant,
    ip: Option<String>,
    worker: Option<WorkerId>,
    deleting: bool,
}

#[derive(Debug, Default)]
struct Pods {
    next: usize,
    known: BTreeMap<String, PodEntry>,
    stopping: bool,
    /// Why a pod cannot start, as the last watch saw it.
    problem: Option<String>,
    /// A pod that ended before its worker registered, and why.
    ended_unregistered: Option<String>,
}

struct Inner {
    api: Api<Pod>,
    /// The client's configuration, for the stop that runs outside the control runtime.
    config: kube::Config,
    namespace: String,
    /// Sluice's part of every pod (the name set per pod).
    pod: WorkerPod,
    template: Option<Value>,
    /// How long a pod may stay Pending before the driver hears why.
    pending_limit: Duration,
    pods: Mutex<Pods>,
}

/// The Kubernetes cluster manager; see the module docs. Clones share the pods.
#[derive(Clone)]
pub struct KubernetesWorkers {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for KubernetesWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesWorkers")
            .field("namespace", &self.inner.namespace)
            .field("driver", &self.inner.pod.driver)
            .finish()
    }
}

/// What the cluster tells the manager about itself.
pub(crate) struct ManagerContext {
    pub slots: usize,
    pub memory_limit: Option<u64>,
    pub extra_args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// The port the driver listens on (for `$SLUICE_POD_IP:port`).
    pub driver_port: u16,
    /// The address it listens on, as a worker on this machine reaches it.
    pub driver_local: String,
    pub pending_limit: Duration,
}

fn k8s_error(what: String) -> impl FnOnce(kube::Error) -> DataFusionError {
    move |e| DataFusionError::Execution(format!("kubernetes: {what}: {e}"))
}

impl KubernetesWorkers {
    /// Connects to the API server `kube` infers and checks the pod template.
    pub(crate) async fn connect(
        options: &KubernetesOptions,
        context: ManagerContext,
    ) -> Result<Self> {
        let config = kube::Config::infer().await.map_err(|e| {
            DataFusionError::Configuration(format!(
                "kubernetes: no API server found (neither in a pod with a service account nor \
                 through KUBECONFIG): {e}"
            ))
        })?;
        let namespace = options
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config.clone())
            .map_err(k8s_error("cannot make a client".to_string()))?;
        let template = options
            .pod_template
            .as_ref()
            .map(|path| read_template(path))
            .transpose()?;
        let env_var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let driver =
            env_var("SLUICE_POD_NAME").unwrap_or_else(|| format!("sluice-{}", std::process::id()));
        let owner = match (env_var("SLUICE_POD_NAME"), env_var("SLUICE_POD_UID")) {
            (Some(name), Some(uid)) => Some(OwnerPod { name, uid }),
            _ => None,
        };
        let driver_address =
            options
                .driver_address
                .clone()
                .unwrap_or_else(|| match env_var("SLUICE_POD_IP") {
                    Some(ip) => format!("{ip}:{}", context.driver_port),
                    None => context.driver_local.clone(),
                });
        let pod = WorkerPod {
            name: String::new(),
            namespace: namespace.clone(),
            driver,
            owner,
            image: options.image.clone(),
            service_account: options.service_account.clone(),
            driver_address,
            slots: context.slots,
            memory_limit: context.memory_limit,
            extra_args: context.extra_args,
            secret: (options.secret.clone(), "secret".to_string()),
            env: context.env,
        };
        // A template that cannot make a pod fails the start, not the first scale-up.
        pod.build(template.as_ref())
            .map_err(|e| DataFusionError::Configuration(format!("kubernetes: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                api: Api::namespaced(client, &namespace),
                config,
                namespace,
                pod,
                template,
                pending_limit: context.pending_limit,
                pods: Mutex::new(Pods::default()),
            }),
        })
    }

    /// The label selector of this driver's pods.
    fn selector(&self) -> String {
        format!("{DRIVER_LABEL}={}", self.inner.pod.driver)
    }

    /// The names of the pods it made that are not being deleted.
    pub fn pod_names(&self) -> Vec<String> {
        self.inner
            .pods
            .lock()
            .map(|pods| {
                pods.known
                    .iter()
                    .filter(|(_, p)| !p.deleting)
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A pod that ended before its worker registered, and why.
    pub fn ended_unregistered(&self) -> Option<String> {
        self.inner
            .pods
            .lock()
            .ok()
            .and_then(|p| p.ended_unregistered.clone())
    }

    /// Why a pod cannot start, as the watch saw it last.
    pub fn problem(&self) -> Option<String> {
        self.inner.pods.lock().ok().and_then(|p| p.problem.clone())
    }

    /// [`Self::delete_all`] from synchronous code (the cluster's drop): on a thread of its own,
    /// with a client and runtime of its own, waited for.
    pub(crate) fn delete_all_blocking(&self) {
        let workers = self.clone();
        let stop = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let runtime =
                runtime.map_err(|e| DataFusionError::Execution(format!("a runtime: {e}")))?;
            runtime.block_on(async {
                // Made inside the runtime: the client's buffer runs a task on it.
                let client = kube::Client::try_from(workers.inner.config.clone())
                    .map_err(k8s_error("cannot make a client".to_string()))?;
                let api = Api::namespaced(client, &workers.inner.namespace);
                workers.delete_all_with(&api).await
            })
        });
        match stop.join() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(
                target: "sluice::cluster",
                %error,
                "kubernetes: the worker pods may not all be deleted"
            ),
            Err(_) => tracing::warn!(
                target: "sluice::cluster",
                "kubernetes: deleting the worker pods panicked"
            ),
        }
    }

    /// Creates one pod.
    async fn create_one(&self) -> Result<()> {
        let name = {
            let mut pods = self.inner.pods.lock().map_err(|_| poisoned())?;
            if pods.stopping {
                return Err(DataFusionError::Execution(
                    "the cluster is stopping: no worker pod is created".to_string(),
                ));
            }
            pods.next += 1;
            format!("{}-worker-{}", self.inner.pod.driver, pods.next)
        };
        let mut spec = self.inner.pod.clone();
        spec.name = name.clone();
        let pod = spec
            .build(self.inner.template.as_ref())
            .map_err(|e| DataFusionError::Configuration(format!("kubernetes: {e}")))?;
        self.inner
            .api
            .create(&PostParams::default(), &pod)
            .await
            .map_err(k8s_error(format!(
                "cannot create pod {name} in namespace {}",
                self.inner.namespace
            )))?;
        if let Ok(mut pods) = self.inner.pods.lock() {
            pods.known.insert(
                name.clone(),
                PodEntry {
                    created: Instant::now(),
                    ip: None,
                    worker: None,
                    deleting: false,
                },
            );
        }
        tracing::info!(target: "sluice::cluster", pod = %name, "created worker pod {name}");
        Ok(())
    }

    async fn delete(&self, name: &str) -> Result<()> {
        delete_pod(&self.inner.api, name).await
    }

    /// Watches the pods until the future is dropped; see the module docs.
    pub(crate) async fn watch(self, driver: DriverHandle) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut note: Option<String> = None;
        loop {
            tick.tick().await;
            let listed = self
                .inner
                .api
                .list(&ListParams::default().labels(&self.selector()))
                .await;
            let pods = match listed {
                Ok(list) => list.items,
                Err(error) => {
                    tracing::warn!(target: "sluice::cluster", %error, "kubernetes: cannot list pods");
                    continue;
                }
            };
            let Ok(snapshot) = driver.snapshot().await else {
                return;
            };
            let mut problems = Vec::new();
            let mut ended = Vec::new();
            {
                let Ok(mut known) = self.inner.pods.lock() else {
                    return;
                };
                let listed: Vec<String> = pods
                    .iter()
                    .filter_map(|p| p.metadata.name.clone())
                    .collect();
                known.known.retain(|name, _| listed.contains(name));
                for pod in &pods {
                    let Some(name) = pod.metadata.name.clone() else {
                        continue;
                    };
                    let entry = known.known.entry(name.clone()).or_insert(PodEntry {
                        created: Instant::now(),
                        ip: None,
                        worker: None,
                        deleting: false,
                    });
                    let status = pod.status.clone().unwrap_or_default();
                    if let Some(ip) = status.pod_ip.clone() {
                        // The newest live registration from the pod's IP (an IP may be reused).
                        entry.worker = snapshot
                            .workers
                            .iter()
                            .filter(|w| !w.draining)
                            .filter(|w| {
                                w.address.rsplit_once(':').map(|(host, _)| host) == Some(&ip)
                            })
                            .map(|w| w.id)
                            .max()
                            .or(entry.worker);
                        entry.ip = Some(ip);
                    }
                    match status.phase.as_deref() {
                        Some(phase @ ("Failed" | "Succeeded")) if !entry.deleting => {
                            ended.push((name, phase.to_string(), ended_reason(pod), entry.worker));
                            entry.deleting = true;
                        }
                        Some("Pending") | None if !entry.deleting => {
                            if let Some(reason) = waiting_reason(pod) {
                                problems.push(format!("pod {name} cannot start: {reason}"));
                            } else if entry.created.elapsed() > self.inner.pending_limit {
                                problems.push(format!(
                                    "pod {name} is still Pending after {:.0} s{}",
                                    entry.created.elapsed().as_secs_f64(),
                                    scheduling_reason(pod)
                                        .map(|r| format!(": {r}"))
                                        .unwrap_or_default()
                                ));
                            }
                        }
                        _ => {}
                    }
                }
            }
            for (name, phase, reason, worker) in ended {
                if worker.is_none()
                    && let Ok(mut pods) = self.inner.pods.lock()
                {
                    pods.ended_unregistered = Some(format!(
                        "pod {name} {phase} before its worker registered: {reason}"
                    ));
                }
                tracing::info!(
                    target: "sluice::cluster",
                    pod = %name,
                    "worker pod {name} {phase} ({reason}): deleted"
                );
                if let Some(worker) = worker {
                    let _ =
                        driver.worker_gone(worker, format!("its pod {name} {phase} ({reason})"));
                }
                if let Err(error) = self.delete(&name).await {
                    tracing::warn!(target: "sluice::cluster", %error, "kubernetes");
                }
            }
            let now = problems.into_iter().next();
            if let Ok(mut pods) = self.inner.pods.lock() {
                pods.problem = now.clone();
            }
            if now != note {
                if let Some(problem) = &now {
                    tracing::warn!(target: "sluice::cluster", "kubernetes: {problem}");
                }
                if driver.capacity_note(now.clone()).is_err() {
                    return;
                }
                note = now;
            }
        }
    }

    /// Deletes every pod labelled with this driver and waits (at most 30 s) until none is left.
    pub(crate) async fn delete_all(&self) -> Result<()> {
        let api = self.inner.api.clone();
        self.delete_all_with(&api).await
    }

    async fn delete_all_with(&self, api: &Api<Pod>) -> Result<()> {
        if let Ok(mut pods) = self.inner.pods.lock() {
            pods.stopping = true;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let list = api
                .list(&ListParams::default().labels(&self.selector()))
                .await
                .map_err(k8s_error("cannot list the worker pods".to_string()))?;
            if list.items.is_empty() {
                if let Ok(mut pods) = self.inner.pods.lock() {
                    pods.known.clear();
                }
                tracing::info!(target: "sluice::cluster", "kubernetes: every worker pod is deleted");
                return Ok(());
            }
            for pod in &list.items {
                let deleting = pod.metadata.deletion_timestamp.is_some();
                if let (Some(name), false) = (&pod.metadata.name, deleting) {
                    delete_pod(api, name).await?;
                }
            }
            if Instant::now() > deadline {
                return Err(DataFusionError::Execution(format!(
                    "kubernetes: {} worker pod(s) still there 30 s after they were deleted",
                    list.items.len()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl ClusterManager for KubernetesWorkers {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn desired_workers(&self) -> usize {
        self.pod_names().len()
    }

    fn start_workers(&self, count: usize) -> BoxFuture<'static, Result<()>> {
        let workers = self.clone();
        async move {
            for _ in 0..count {
                workers.create_one().await?;
            }
            Ok(())
        }
        .boxed()
    }

    fn manages(&self, worker: WorkerId) -> bool {
        self.inner
            .pods
            .lock()
            .is_ok_and(|pods| pods.known.values().any(|p| p.worker == Some(worker)))
    }

    /// Deletes its pod: the worker gets SIGTERM, drains and leaves.
    fn drain(&self, worker: WorkerId) -> BoxFuture<'static, Result<()>> {
        let workers = self.clone();
        async move {
            let name = {
                let mut pods = workers.inner.pods.lock().map_err(|_| poisoned())?;
                let (name, entry) = pods
                    .known
                    .iter_mut()
                    .find(|(_, p)| p.worker == Some(worker))
                    .ok_or_else(|| {
                        DataFusionError::Execution(format!("no worker pod registered as {worker}"))
                    })?;
                entry.deleting = true;
                name.clone()
            };
            workers.delete(&name).await
        }
        .boxed()
    }

    fn stop(&self) -> BoxFuture<'static, Result<()>> {
        let workers = self.clone();
        async move { workers.delete_all().await }.boxed()
    }
}

/// Deletes pod `name` (one already gone is fine).
async fn delete_pod(api: &Api<Pod>, name: &str) -> Result<()> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(k8s_error(format!("cannot delete pod {name}"))(e)),
    }
}

/// Why a pending pod's container cannot start, when it is a reason that will not pass by itself.
fn waiting_reason(pod: &Pod) -> Option<String> {
    const STUCK: [&str; 6] = [
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    ];
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|status| {
        let waiting = status.state.as_ref()?.waiting.as_ref()?;
        let reason = waiting.reason.as_deref()?;
        STUCK.contains(&reason).then(|| match &waiting.message {
            Some(message) => format!("{reason}: {message}"),
            None => reason.to_string(),
        })
    })
}

/// Why the scheduler has not placed a pod (its `PodScheduled` condition).
fn scheduling_reason(pod: &Pod) -> Option<String> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let scheduled = conditions.iter().find(|c| c.type_ == "PodScheduled")?;
    (scheduled.status != "True").then(|| {
        [scheduled.reason.as_deref(), scheduled.message.as_deref()]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(": ")
    })
}

/// Why a pod ended: its status reason, else its container's exit.
fn ended_reason(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    if let Some(reason) = status.and_then(|s| s.reason.clone()) {
        return reason;
    }
    let terminated = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    match terminated {
        Some(t) => format!(
            "exit code {}{}{}",
            t.exit_code,
            t.reason
                .as_ref()
                .map(|r| format!(", {r}"))
                .unwrap_or_default(),
            t.message
                .as_ref()
                .filter(|m| !m.trim().is_empty())
                .map(|m| format!(": {}", m.trim().replace('\n', " / ")))
                .unwrap_or_default()
        ),
        None => "no reason given".to_string(),
    }
}

/// Reads a pod template file (YAML, of which JSON is a part).
fn read_template(path: &std::path::Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        DataFusionError::Configuration(format!(
            "kubernetes: cannot read the pod template {}: {e}",
            path.display()
        ))
    })?;
    serde_saphyr::from_str(&text).map_err(|e| {
        DataFusionError::Configuration(format!(
            "kubernetes: the pod template {} is not YAML: {e}",
            path.display()
        ))
    })
}

fn poisoned() -> DataFusionError {
    DataFusionError::Internal("the list of worker pods is poisoned".to_string())
}
