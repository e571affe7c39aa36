//! A fake Kubernetes API server for the Kubernetes cluster manager's tests: the pod calls the
//! `kube` client makes (create, get, list by label, delete) over plain HTTP, and a "kubelet" that
//! runs each pod as a real `sluice worker` process.
//!
//! ```text
//!   driver (kube client) ── POST/GET/DELETE /api/v1/namespaces/{ns}/pods ──► FakeKube (axum)
//!   kubelet: pod IP 127.<b>.<c>.<n> (its own per pod), env resolved (value, secretKeyRef from
//!            the test's secrets, fieldRef status.podIP), $(VAR) expanded in the arguments,
//!            command `sluice` = the built binary ─► process; Running, then Failed/Succeeded when
//!            it exits; a delete sends SIGTERM and the pod goes once the process is gone
//!   pull_fails(true): pods created from then on stay Pending with ErrImagePull
//! ```

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use serde_json::{Value, json};

/// How many fake API servers this process has started: each gets its own block of pod IPs.
static SERVERS_STARTED: AtomicUsize = AtomicUsize::new(0);

struct FakePod {
    pod: Value,
    pid: Option<u32>,
}

struct Shared {
    pods: Mutex<BTreeMap<String, FakePod>>,
    /// Every pod name ever created, in order.
    created: Mutex<Vec<String>>,
    secrets: BTreeMap<(String, String), String>,
    /// Pod IPs are 127.<prefix>.<n>.
    prefix: String,
    next_ip: AtomicUsize,
    pull_fails: AtomicBool,
    logs: PathBuf,
    /// The most pods that existed at once.
    peak: AtomicUsize,
    /// Each pod whose process ended, with the phase it turned to.
    ended: Mutex<Vec<(String, String)>>,
    /// Every process a pod ran.
    started: Mutex<Vec<u32>>,
}

/// The fake API server; dropping it kills every process it still runs.
pub struct FakeKube {
    shared: Arc<Shared>,
    pub address: String,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        for pid in self.pids() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl FakeKube {
    /// Starts the server; `secrets` are (secret name, key, value); pod logs go to `logs`.
    pub fn start(secrets: &[(&str, &str, &str)], logs: &Path) -> FakeKube {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let address = listener.local_addr().unwrap().to_string();
        // Pod IPs never repeat within one test binary: the third octet counts the servers this process
        // started, and the second comes from the process id, so binaries side by side differ as well.
        let b = 10 + std::process::id() as usize % 200;
        let c = 1 + SERVERS_STARTED.fetch_add(1, Ordering::Relaxed) % 250;
        let shared = Arc::new(Shared {
            pods: Mutex::new(BTreeMap::new()),
            created: Mutex::new(Vec::new()),
            secrets: secrets
                .iter()
                .map(|(n, k, v)| ((n.to_string(), k.to_string()), v.to_string()))
                .collect(),
            prefix: format!("127.{b}.{c}"),
            next_ip: AtomicUsize::new(2),
            pull_fails: AtomicBool::new(false),
            logs: logs.to_path_buf(),
            peak: AtomicUsize::new(0),
            ended: Mutex::new(Vec::new()),
            started: Mutex::new(Vec::new()),
        });
        let app = axum::Router::new()
            .route(
                "/api/v1/namespaces/{namespace}/pods",
                get(list_pods).post(create_pod),
            )
            .route(
                "/api/v1/namespaces/{namespace}/pods/{name}",
                get(get_pod).delete(delete_pod),
            )
            .with_state(Arc::clone(&shared));
        runtime.spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeKube {
            shared,
            address,
            runtime: Some(runtime),
        }
    }

    /// A kubeconfig file in `dir` pointing at this server, namespace `namespace`.
    pub fn kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: \
             http://{}\nusers:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  \
             context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\n",
            self.address
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// From now on, created pods cannot pull their image.
    pub fn pull_fails(&self, fails: bool) {
        self.shared.pull_fails.store(fails, Ordering::SeqCst);
    }

    /// The pods there now: name → phase.
    pub fn pods(&self) -> BTreeMap<String, String> {
        self.shared
            .pods
            .lock()
            .unwrap()
            .iter()
            .map(|(name, p)| {
                let phase = p.pod["status"]["phase"].as_str().unwrap_or("").to_string();
                (name.clone(), phase)
            })
            .collect()
    }

    /// The pod `name` as the API serves it.
    pub fn pod(&self, name: &str) -> Option<Value> {
        let pods = self.shared.pods.lock().unwrap();
        pods.get(name).map(|p| p.pod.clone())
    }

    /// Every pod name ever created, in order.
    pub fn created(&self) -> Vec<String> {
        self.shared.created.lock().unwrap().clone()
    }

    /// The most pods that existed at once.
    pub fn peak(&self) -> usize {
        self.shared.peak.load(Ordering::SeqCst)
    }

    /// The process id of each running pod.
    pub fn pids(&self) -> Vec<u32> {
        let pods = self.shared.pods.lock().unwrap();
        pods.values().filter_map(|p| p.pid).collect()
    }

    /// Each pod whose process ended by itself (not deleted), with the phase it turned to.
    pub fn ended(&self) -> Vec<(String, String)> {
        self.shared.ended.lock().unwrap().clone()
    }

    /// Every process a pod ever ran.
    pub fn all_pids(&self) -> Vec<u32> {
        self.shared.started.lock().unwrap().clone()
    }

    /// The process of pod `name`.
    pub fn pid_of(&self, name: &str) -> Option<u32> {
        self.shared
            .pods
            .lock()
            .unwrap()
            .get(name)
            .and_then(|p| p.pid)
    }
}

#[derive(serde::Deserialize)]
struct ListQuery {
    #[serde(rename = "labelSelector")]
    label_selector: Option<String>,
}

async fn list_pods(
    State(shared): State<Arc<Shared>>,
    UrlPath(namespace): UrlPath<String>,
    Query(query): Query<ListQuery>,
) -> Json<Value> {
    let wanted: Vec<(String, String)> = query
        .label_selector
        .unwrap_or_default()
        .split(',')
        .filter_map(|term| term.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let pods = shared.pods.lock().unwrap();
    let items: Vec<Value> = pods
        .values()
        .map(|p| p.pod.clone())
        .filter(|pod| pod["metadata"]["namespace"] == namespace.as_str())
        .filter(|pod| {
            wanted
                .iter()
                .all(|(k, v)| pod["metadata"]["labels"][k] == v.as_str())
        })
        .collect();
    Json(json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {"resourceVersion": "1"},
        "items": items,
    }))
}

async fn get_pod(
    State(shared): State<Arc<Shared>>,
    UrlPath((_, name)): UrlPath<(String, String)>,
) -> (StatusCode, Json<Value>) {
    match shared.pods.lock().unwrap().get(&name) {
        Some(pod) => (StatusCode::OK, Json(pod.pod.clone())),
        None => not_found(&name),
    }
}

fn not_found(name: &str) -> (StatusCode, Json<Value>) {
    (
        StatusCode::NOT_FOUND,
        Json(json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure",
            "message": format!("pods \"{name}\" not found"), "reason": "NotFound", "code": 404,
        })),
    )
}

async fn create_pod(
    State(shared): State<Arc<Shared>>,
    UrlPath(namespace): UrlPath<String>,
    Json(mut pod): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if shared.pods.lock().unwrap().contains_key(&name) {
        return (
            StatusCode::CONFLICT,
            Json(
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "AlreadyExists", "code": 409,
                        "message": format!("pods \"{name}\" already exists")}),
            ),
        );
    }
    pod["metadata"]["namespace"] = json!(namespace);
    pod["metadata"]["uid"] = json!(format!("uid-{name}"));
    pod["metadata"]["resourceVersion"] = json!("1");
    pod["status"] = json!({"phase": "Pending"});
    let n = shared.next_ip.fetch_add(1, Ordering::SeqCst);
    let ip = format!("{}.{n}", shared.prefix);
    let started = if shared.pull_fails.load(Ordering::SeqCst) {
        let image = pod["spec"]["containers"][0]["image"].clone();
        pod["status"]["containerStatuses"] = json!([{
            "name": pod["spec"]["containers"][0]["name"], "image": image, "imageID": "",
            "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ErrImagePull",
                                  "message": format!("failed to pull image {image}: not found")}},
        }]);
        None
    } else {
        match kubelet_start(&shared, &pod, &ip) {
            Ok(child) => {
                pod["status"] = json!({"phase": "Running", "podIP": ip});
                Some(child)
            }
            Err(reason) => {
                pod["status"]["containerStatuses"] = json!([{
                    "name": "sluice-worker", "image": "", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": "CreateContainerConfigError", "message": reason}},
                }]);
                None
            }
        }
    };
    let pid = started.as_ref().map(Child::id);
    shared.started.lock().unwrap().extend(pid);
    {
        let mut pods = shared.pods.lock().unwrap();
        pods.insert(
            name.clone(),
            FakePod {
                pod: pod.clone(),
                pid,
            },
        );
        shared.peak.fetch_max(pods.len(), Ordering::SeqCst);
    }
    shared.created.lock().unwrap().push(name.clone());
    if let Some(child) = started {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || watch_process(shared, name, child));
    }
    (StatusCode::CREATED, Json(pod))
}

async fn delete_pod(
    State(shared): State<Arc<Shared>>,
    UrlPath((_, name)): UrlPath<(String, String)>,
) -> (StatusCode, Json<Value>) {
    let mut pods = shared.pods.lock().unwrap();
    let Some(entry) = pods.get_mut(&name) else {
        return not_found(&name);
    };
    entry.pod["metadata"]["deletionTimestamp"] = json!("2026-12-06T00:00:00Z");
    let pod = entry.pod.clone();
    match entry.pid {
        // The kubelet stops the container: SIGTERM; the pod goes when the process has exited.
        Some(pid) => {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        None => {
            pods.remove(&name);
        }
    }
    (StatusCode::OK, Json(pod))
}

/// Waits for the pod's process: the pod turns Failed (or Succeeded), or goes if it was deleted.
fn watch_process(shared: Arc<Shared>, name: String, mut child: Child) {
    let status = child.wait().unwrap();
    let mut pods = shared.pods.lock().unwrap();
    let Some(entry) = pods.get_mut(&name) else {
        return;
    };
    if entry.pod["metadata"].get("deletionTimestamp").is_some() {
        pods.remove(&name);
        return;
    }
    entry.pid = None;
    let code = status.code().unwrap_or(137);
    let phase = if code == 0 { "Succeeded" } else { "Failed" };
    entry.pod["status"]["phase"] = json!(phase);
    shared
        .ended
        .lock()
        .unwrap()
        .push((name.clone(), phase.to_string()));
    // What the container printed last, as a pod with `FallbackToLogsOnError` reports it.
    let log = std::fs::read_to_string(shared.logs.join(format!("{name}.log"))).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(3).collect();
    let message: Vec<&str> = tail.into_iter().rev().collect();
    entry.pod["status"]["containerStatuses"] = json!([{
        "name": "sluice-worker", "image": "", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": code,
                                 "reason": if code == 0 { "Completed" } else { "Error" },
                                 "message": message.join("\n")}},
    }]);
}

/// Runs the pod's container as a process: its environment resolved, `$(VAR)` expanded, `sluice`
/// the built binary.
fn kubelet_start(shared: &Shared, pod: &Value, ip: &str) -> Result<Child, String> {
    let container = &pod["spec"]["containers"][0];
    let mut env: Vec<(String, String)> = Vec::new();
    for var in container["env"].as_array().cloned().unwrap_or_default() {
        let name = var["name"].as_str().unwrap_or_default().to_string();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_string()
        } else if let Some(reference) = var["valueFrom"].get("secretKeyRef") {
            let key = (
                reference["name"].as_str().unwrap_or_default().to_string(),
                reference["key"].as_str().unwrap_or_default().to_string(),
            );
            shared
                .secrets
                .get(&key)
                .cloned()
                .ok_or_else(|| format!("secret \"{}\" not found", key.0))?
        } else if var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" {
            ip.to_string()
        } else {
            return Err(format!("the fake cannot resolve {var}"));
        };
        env.push((name, value));
    }
    let expand = |text: &str| {
        let mut out = text.to_string();
        for (name, value) in &env {
            out = out.replace(&format!("$({name})"), value);
        }
        out
    };
    let command: Vec<String> = container["command"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .chain(
            container["args"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter(),
        )
        .map(|v| expand(v.as_str().unwrap_or_default()))
        .collect();
    let program = match command.first().map(String::as_str) {
        Some("sluice") => PathBuf::from(env!("CARGO_BIN_EXE_sluice")),
        other => return Err(format!("the fake runs only sluice, not {other:?}")),
    };
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let log = std::fs::File::create(shared.logs.join(format!("{name}.log"))).unwrap();
    let child = crate::common::without_sluice_env(&mut Command::new(program))
        .args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {command:?}: {e}"))?;
    let _ = writeln!(
        std::io::stderr(),
        "fake kubelet: pod {name} at {ip} runs pid {}",
        child.id()
    );
    Ok(child)
}
