//! Worker pods on Kubernetes (`--cluster-manager kubernetes`, the `kubernetes` feature): the
//! worker pod (`pod_spec`: Sluice's fields merged over the user's pod template) and the cluster
//! manager that creates, watches and deletes those pods (`workers`).
//!
//! ```text
//!   ProcessCluster (the driver) ── autoscaler ──► KubernetesWorkers ── kube ──► API server
//!                                                                              │ creates pods
//!   sluice worker (in each pod) ── RegisterWorker ($SLUICE_POD_IP:7071) ──► driver ◄┘
//! ```

pub mod pod_spec;
mod workers;

pub use workers::KubernetesWorkers;
pub(crate) use workers::ManagerContext;
