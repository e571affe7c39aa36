//! What `--cluster-manager kubernetes` is told: where worker pods come from. Compiled in every
//! build (the front end fills it in); only a build with the `kubernetes` feature can act on it,
//! and another refuses it when the cluster starts.

use std::path::PathBuf;

/// Where worker pods come from (`--cluster-manager kubernetes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesOptions {
    /// The namespace of the worker pods (`None`: the one `kube` infers: the driver pod's, or the
    /// kubeconfig context's).
    pub namespace: Option<String>,
    /// The worker image.
    pub image: String,
    /// The service account of the worker pods.
    pub service_account: Option<String>,
    /// A pod template file (YAML or JSON), merged under Sluice's own fields.
    pub pod_template: Option<PathBuf>,
    /// The Kubernetes Secret (key `secret`) holding the cluster secret.
    pub secret: String,
    /// The driver's address as workers reach it (`None`: `$SLUICE_POD_IP` and the driver's port,
    /// else the address it listens on).
    pub driver_address: Option<String>,
}
