//! Sluice's distributed runtime: a driver that schedules a job graph's tasks on workers, workers that
//! run them and keep their output streams, and the wire between them — tonic gRPC for control, Arrow
//! Flight for data.
//!
//! ```text
//!   caller ─► LocalCluster::execute(JobGraph)
//!               │
//!               ▼
//!   driver actor (JobScheduler shell) ──RunTask/StopTask/CleanUpJob (gRPC)──► worker 0..N
//!     ▲   │                                                                     │ task: readers ─► plan ─► writer
//!     │   └─ driver executor (driver-placed stages, same task code)            │ stream store (channels × replicas)
//!     │                                                                         │
//!     └──────────── ReportTaskStatus (gRPC) ◄───────────────────────────────────┘
//!   job output ◄── Flight DoGet (final stage channels) ── worker stream stores ◄── Flight DoGet ── consumer tasks
//! ```
//!
//! Modules: [`proto`] (generated messages and services), `wire` (task definitions to and from
//! protobuf), `store` (a worker's stream store), `flight` (the data plane), `worker` (the task
//! runner and `WorkerService`), `driver` (the `DriverService`, the scheduler shell, task placement
//! and the job output), [`LocalCluster`] (a driver and N workers in one process on loopback).

pub mod proto;

mod driver;
mod flight;
mod local_cluster;
mod net;
mod progress;
mod store;
mod wire;
mod worker;

pub use driver::{DriverOptions, DriverSnapshot};
pub use local_cluster::{ClusterOptions, ClusterSnapshot, LocalCluster};
pub use progress::{JobProgress, StageProgress};
pub use worker::{FaultHook, TaskAttemptRef, WorkerOptions};
