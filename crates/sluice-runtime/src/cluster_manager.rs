//! The cluster manager seam: where a driver's workers come from. One implementation per way of
//! running workers: processes this process starts (`--mode cluster`), workers started by someone
//! else that join the driver's address ([`ExternalWorkers`]), and Kubernetes pods.
//!
//! ```text
//!   autoscaler (crate::scaling) ── start_workers, drain, manages ──► manager
//!   cluster shutdown ── stop ──► manager
//!   manager ── starts processes / pods ──► sluice worker ── RegisterWorker ──► driver (registry)
//! ```
//!
//! Invariants: a manager only supplies workers; how many, and which to let go, is the
//! autoscaler's policy; membership and liveness stay with the driver's worker registry (a started
//! worker counts once it registered); `stop` returns only after every worker the manager started
//! has exited; a manager that cannot start workers says so in its error instead of waiting.

use std::fmt;

use datafusion::common::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::WorkerId;

/// Where workers come from; see the module docs.
pub trait ClusterManager: Send + Sync + fmt::Debug {
    /// Its name in logs and errors (`process`, `external`).
    fn name(&self) -> &'static str;
    /// How many workers it aims to keep.
    fn desired_workers(&self) -> usize;
    /// Starts `count` more workers (they register with the driver once up).
    fn start_workers(&self, count: usize) -> BoxFuture<'static, Result<()>>;
    /// Whether it started `worker` (only those are let go when idle).
    fn manages(&self, worker: WorkerId) -> bool;
    /// Asks `worker` to drain (finish its tasks, hand over its outputs) and leave.
    fn drain(&self, worker: WorkerId) -> BoxFuture<'static, Result<()>>;
    /// Stops every worker it started and waits until they exited.
    fn stop(&self) -> BoxFuture<'static, Result<()>>;
}

/// Workers started outside Sluice (`sluice worker --driver ADDR`) that join by themselves: the
/// driver waits for `min_workers` of them and cannot start or stop any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExternalWorkers {
    /// Workers that must join before the first query runs.
    pub min_workers: usize,
}

impl ClusterManager for ExternalWorkers {
    fn name(&self) -> &'static str {
        "external"
    }

    fn desired_workers(&self) -> usize {
        self.min_workers
    }

    fn start_workers(&self, count: usize) -> BoxFuture<'static, Result<()>> {
        futures::future::ready(Err(DataFusionError::Execution(format!(
            "{count} more worker(s) are needed, but workers are started outside Sluice here: \
             start them with `sluice worker --driver <this driver's address>`"
        ))))
        .boxed()
    }

    fn manages(&self, _worker: WorkerId) -> bool {
        false
    }

    fn drain(&self, worker: WorkerId) -> BoxFuture<'static, Result<()>> {
        futures::future::ready(Err(DataFusionError::Execution(format!(
            "{worker} was started outside Sluice: drain it with SIGTERM to its process"
        ))))
        .boxed()
    }

    /// Nothing to stop: external workers exit when their driver is gone for their timeout.
    fn stop(&self) -> BoxFuture<'static, Result<()>> {
        futures::future::ready(Ok(())).boxed()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[tokio::test]
    async fn external_workers_cannot_be_started_or_drained_and_say_how() {
        let manager = ExternalWorkers { min_workers: 3 };
        assert_eq!((manager.name(), manager.desired_workers()), ("external", 3));
        let start = manager.start_workers(2).await.unwrap_err().to_string();
        assert_eq!(
            start,
            "Execution error: 2 more worker(s) are needed, but workers are started outside \
             Sluice here: start them with `sluice worker --driver <this driver's address>`"
        );
        let drain = manager.drain(WorkerId(4)).await.unwrap_err().to_string();
        assert_eq!(
            drain,
            "Execution error: worker 4 was started outside Sluice: drain it with SIGTERM to its \
             process"
        );
        assert!(!manager.manages(WorkerId(4)));
        manager.stop().await.unwrap();
    }
}
