//! Sluice's cluster transport: the runtime's driver and workers over the wire — tonic gRPC for
//! control, Arrow Flight for data — and the local cluster that runs them on loopback.
//!
//! ```text
//!   caller ─► LocalClusterRunner / LocalCluster::execute(JobGraph)
//!               │
//!               ▼
//!   ClusterDriver: runtime Driver ──GrpcWorkerClient: RunTask/StopTask/ReleaseOutput/CleanUpJob/
//!                                                     ApplyRuntimeFilter──►
//!     ▲   DriverService + executor Flight                                     WorkerServer 1..N
//!     │                                                                         runtime Worker
//!     └──────────── ReportTaskStatus / Heartbeat (gRPC) ◄──────────────────────  WorkerService + Flight
//!   job output ◄── FlightFetcher (final stage) ── worker stores ◄── FlightFetcher ── consumer tasks
//! ```
//!
//! Modules: [`proto`] (generated messages and services), `wire` (runtime values to and from
//! protobuf, error kinds to and from status codes), `client` (the driver's `WorkerClient` over
//! gRPC), `flight` (the Flight service over a stream store and the `StreamFetcher` over Flight), `flight_ipc`
//! (the stream's Arrow IPC encoding),
//! `worker_server` and `driver_server` (the services), `net` (listening and connecting),
//! [`LocalCluster`] and [`LocalClusterRunner`] (in-process), [`ProcessCluster`],
//! [`ProcessClusterRunner`] and `worker_process` (`sluice worker`: separate processes), whose
//! workers come from `process_workers` (child processes) or, with the `kubernetes` feature,
//! `kubernetes` (worker pods).

pub mod proto;

mod auth;
mod client;
mod driver_server;
mod flight;
mod flight_ipc;
mod flight_pool;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
mod kubernetes_options;
mod local_cluster;
mod net;
mod process_cluster;
mod process_workers;
mod runner;
mod wire;
#[cfg(test)]
mod wire_fuzz;
mod worker_process;
mod worker_server;

pub use auth::{ClusterLink, ClusterSecret, ClusterTls, TlsFiles};
pub use flight::{FlightFetcher, serve_on_loopback};
pub use flight_ipc::encode_stream;
pub use kubernetes_options::KubernetesOptions;
pub use local_cluster::{ClusterOptions, ClusterSnapshot, LocalCluster};

/// Whether this build can run worker pods on Kubernetes (the `kubernetes` feature).
pub const KUBERNETES: bool = cfg!(feature = "kubernetes");
pub use process_cluster::{ProcessCluster, ProcessClusterOptions};
pub use process_workers::{DRAIN_LINE, ProcessWorkers};
pub use runner::{LocalClusterRunner, ProcessClusterRunner};
pub use wire::build;
pub use worker_process::{
    StopRequest, WorkerExit, WorkerProcessOptions, default_work_dir, run_worker_process,
};
