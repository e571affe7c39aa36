//! The worker pod the Kubernetes manager creates: the user's pod template (any field of a Pod),
//! deep-merged under Sluice's own labels, owner, container command, arguments and environment.
//! Pure: values in, a `Pod` out.
//!
//! ```text
//!   template (file, YAML or JSON)  ──┐
//!                                    ├─ merge: objects key by key, lists of named objects
//!   Sluice's part (WorkerPod::own) ──┘          (containers, env, ports) name by name, Sluice's
//!                                               scalars and other lists win ─► Pod
//! ```
//!
//! Invariants: whatever the template says, the pod carries Sluice's labels (so the manager finds
//! it), `restartPolicy: Never` (a dead worker is replaced by the autoscaler, not restarted in
//! place with stale state), the `sluice-worker` container's command, arguments and the
//! environment the worker needs (its pod IP through the downward API, the cluster secret through a
//! `secretKeyRef`: the secret's value never appears in the spec).

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Map, Value, json};

/// Label every worker pod carries: `sluice`.
pub const NAME_LABEL: &str = "app.kubernetes.io/name";
/// Label every worker pod carries: `worker`.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// Label naming the driver that made the pod (the manager lists its pods by it).
pub const DRIVER_LABEL: &str = "sluice.dev/driver";
/// The worker container's name.
pub const CONTAINER: &str = "sluice-worker";
/// The variable holding the pod's IP (downward API `status.podIP`).
pub const POD_IP_VAR: &str = "SLUICE_POD_IP";
/// The port each worker serves gRPC and Flight on.
pub const WORKER_PORT: u16 = 7071;

/// The driver pod that owns the workers (when the driver runs in one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerPod {
    pub name: String,
    pub uid: String,
}

/// Everything Sluice itself puts into a worker pod.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerPod {
    /// The pod's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// The driver's name (the value of [`DRIVER_LABEL`]).
    pub driver: String,
    /// The driver pod, when the driver runs in one.
    pub owner: Option<OwnerPod>,
    /// The container image.
    pub image: String,
    /// The service account the pod runs as (`None`: the template's, else the namespace default).
    pub service_account: Option<String>,
    /// The driver's address as workers reach it (`host:port`).
    pub driver_address: String,
    /// Task slots of the worker.
    pub slots: usize,
    /// The worker's memory pool (also the container's memory request; its limit adds 1 GiB for
    /// what the pool does not count).
    pub memory_limit: Option<u64>,
    /// Further `sluice worker` arguments (compression, heartbeat interval).
    pub extra_args: Vec<String>,
    /// The Kubernetes Secret and key holding the cluster secret.
    pub secret: (String, String),
    /// Plain environment variables (log format, trace export).
    pub env: Vec<(String, String)>,
}

impl WorkerPod {
    /// Sluice's part of the pod, as JSON.
    pub fn own(&self) -> Value {
        let mut labels = Map::new();
        labels.insert(NAME_LABEL.into(), json!("sluice"));
        labels.insert(COMPONENT_LABEL.into(), json!("worker"));
        labels.insert(DRIVER_LABEL.into(), json!(self.driver));
        let mut metadata = json!({
            "name": self.name,
            "namespace": self.namespace,
            "labels": labels,
        });
        if let Some(owner) = &self.owner {
            metadata["ownerReferences"] = json!([{
                "apiVersion": "v1",
                "kind": "Pod",
                "name": owner.name,
                "uid": owner.uid,
                "controller": true,
                "blockOwnerDeletion": true,
            }]);
        }
        let endpoint = format!("$({POD_IP_VAR}):{WORKER_PORT}");
        let mut args = vec![
            "worker".to_string(),
            "--driver".to_string(),
            self.driver_address.clone(),
            "--listen".to_string(),
            endpoint.clone(),
            "--advertise".to_string(),
            endpoint,
            "--slots".to_string(),
            self.slots.to_string(),
        ];
        if let Some(limit) = self.memory_limit {
            args.extend(["--memory-limit".to_string(), limit.to_string()]);
        }
        args.extend(self.extra_args.iter().cloned());
        let mut env = vec![
            json!({
                "name": POD_IP_VAR,
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            }),
            json!({
                "name": "SLUICE_SECRET",
                "valueFrom": {"secretKeyRef": {"name": self.secret.0, "key": self.secret.1}},
            }),
        ];
        env.extend(
            self.env
                .iter()
                .map(|(name, value)| json!({"name": name, "value": value})),
        );
        let mut container = json!({
            "name": CONTAINER,
            "image": self.image,
            "command": ["sluice"],
            "args": args,
            "env": env,
            "ports": [{"name": "worker", "containerPort": WORKER_PORT}],
        });
        if let Some(limit) = self.memory_limit {
            container["resources"] = json!({
                "requests": {"memory": limit.to_string()},
                "limits": {"memory": (limit + (1 << 30)).to_string()},
            });
        }
        let mut spec = json!({
            "restartPolicy": "Never",
            "containers": [container],
        });
        if let Some(account) = &self.service_account {
            spec["serviceAccountName"] = json!(account);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": spec,
        })
    }

    /// The pod: `template` (a Pod's fields, or nothing) with Sluice's part merged over it.
    pub fn build(&self, template: Option<&Value>) -> Result<Pod, String> {
        let mut pod = template.cloned().unwrap_or_else(|| json!({}));
        if !pod.is_object() {
            return Err("the pod template is not a mapping of a Pod's fields".to_string());
        }
        merge(&mut pod, self.own());
        serde_json::from_value(pod)
            .map_err(|e| format!("the pod template does not make a Pod: {e}"))
    }
}

/// Merges `over` into `base`: objects key by key; a list whose items are all objects with a
/// `name` item by item (same name merged, new names appended; an `env` variable of the same name
/// replaced whole, so a template's `value` cannot sit beside Sluice's `valueFrom`); anything else
/// replaced by `over`.
pub fn merge(base: &mut Value, over: Value) {
    merge_at(base, over, "");
}

fn merge_at(base: &mut Value, over: Value, key: &str) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (key, value) in over {
                match base.get_mut(&key) {
                    Some(existing) => merge_at(existing, value, &key),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (Value::Array(base), Value::Array(over)) if named(base) && named(&over) => {
            for item in over {
                let name = item.get("name").cloned();
                match base.iter_mut().find(|b| b.get("name") == name.as_ref()) {
                    Some(existing) if key == "env" => *existing = item,
                    Some(existing) => merge_at(existing, item, ""),
                    None => base.push(item),
                }
            }
        }
        (base, over) => *base = over,
    }
}

/// Whether every item is an object with a string `name`.
fn named(items: &[Value]) -> bool {
    items
        .iter()
        .all(|item| item.get("name").is_some_and(Value::is_string))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// The pod of a driver running in a pod, with a template that sets a node selector,
    /// tolerations, resources, an extra container variable and a label.
    fn example() -> (WorkerPod, Value) {
        let pod = WorkerPod {
            name: "sluice-driver-worker-3".into(),
            namespace: "analytics".into(),
            driver: "sluice-driver".into(),
            owner: Some(OwnerPod {
                name: "sluice-driver-7d9f".into(),
                uid: "0b7c5a8e-1111-4222-8333-944455556666".into(),
            }),
            image: "registry.example/sluice:0.1.0".into(),
            service_account: Some("sluice-worker".into()),
            driver_address: "10.1.2.3:7070".into(),
            slots: 8,
            memory_limit: Some(4 << 30),
            extra_args: vec!["--flight-compression".into(), "lz4".into()],
            secret: ("sluice-cluster-secret".into(), "secret".into()),
            env: vec![("SLUICE_LOG_FORMAT".into(), "json".into())],
        };
        let template = json!({
            "metadata": {"labels": {"team": "data", NAME_LABEL: "not-sluice"},
                         "annotations": {"example.com/owner": "data-eng"}},
            "spec": {
                "nodeSelector": {"pool": "compute"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "sluice",
                                 "effect": "NoSchedule"}],
                "restartPolicy": "Always",
                "containers": [{
                    "name": CONTAINER,
                    "image": "ignored:latest",
                    "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "4"}},
                    "env": [{"name": "TZ", "value": "UTC"},
                            {"name": "SLUICE_SECRET", "value": "leaked"}],
                }],
            },
        });
        (pod, template)
    }

    #[test]
    fn the_worker_pod_spec_is_pinned_by_its_golden_file() {
        let (pod, template) = example();
        let built = pod.build(Some(&template)).unwrap();
        let text = serde_json::to_string_pretty(&built).unwrap() + "\n";
        let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/kubernetes/worker_pod.golden.json");
        if std::env::var_os("SLUICE_BLESS").is_some() {
            std::fs::write(&golden, &text).unwrap();
        }
        let expected = std::fs::read_to_string(&golden).unwrap();
        assert_eq!(
            text,
            expected,
            "SLUICE_BLESS=1 rewrites {}",
            golden.display()
        );
    }

    #[test]
    fn sluice_wins_over_the_template_where_it_must_and_keeps_the_rest() {
        let (pod, template) = example();
        let built = serde_json::to_value(pod.build(Some(&template)).unwrap()).unwrap();
        assert_eq!(built["metadata"]["labels"][NAME_LABEL], "sluice");
        assert_eq!(built["metadata"]["labels"]["team"], "data");
        assert_eq!(built["spec"]["restartPolicy"], "Never");
        assert_eq!(built["spec"]["nodeSelector"]["pool"], "compute");
        let container = &built["spec"]["containers"][0];
        assert_eq!(container["image"], "registry.example/sluice:0.1.0");
        assert_eq!(container["resources"]["requests"]["cpu"], "2");
        assert_eq!(container["resources"]["requests"]["memory"], "4294967296");
        assert_eq!(container["resources"]["limits"]["memory"], "5368709120");
        let env: Vec<String> = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            env,
            ["TZ", "SLUICE_SECRET", POD_IP_VAR, "SLUICE_LOG_FORMAT"]
        );
        // The template's value of the secret variable gave way to the Secret reference.
        assert_eq!(container["env"][1].get("value"), None);
        assert_eq!(
            container["env"][1]["valueFrom"]["secretKeyRef"]["name"],
            "sluice-cluster-secret"
        );
    }

    #[test]
    fn a_template_that_is_not_a_pod_is_refused_with_what_is_wrong() {
        let (pod, _) = example();
        assert_eq!(
            pod.build(Some(&json!(["a list"]))).unwrap_err(),
            "the pod template is not a mapping of a Pod's fields"
        );
        let error = pod
            .build(Some(&json!({"spec": {"nodeSelector": "not a map"}})))
            .unwrap_err();
        assert!(
            error.starts_with("the pod template does not make a Pod: invalid type: string"),
            "{error}"
        );
    }
}
