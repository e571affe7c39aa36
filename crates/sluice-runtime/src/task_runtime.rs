//! The task runtime: a tokio runtime of its own for executing task plans, apart from the runtime that
//! serves the control plane (the driver actor, gRPC and Flight endpoints, the CLI's Ctrl-C).
//!
//! DataFusion operators can hold a thread for a long time between yields (a nested-loop join over a
//! large build side). On a shared runtime that starves the control plane: a stop request, a
//! heartbeat or Ctrl-C waits behind the work it should cancel. Tasks spawned here leave the caller's
//! runtime free to answer at once.
//!
//! Invariant: the runtime is created once per process, on first use, with one thread per CPU, and
//! never shut down (its threads end with the process); work on it is always owned by a `JoinSet`
//! somewhere, so dropping the owner cancels the work at its next yield.

use std::sync::OnceLock;

use datafusion::common::{DataFusionError, Result};
use tokio::runtime::{Builder, Handle, Runtime};

static TASK_RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// The handle of the process's task runtime, starting it on first use.
pub fn task_runtime() -> Result<Handle> {
    let runtime = TASK_RUNTIME.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("sluice-task")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    });
    match runtime {
        Ok(runtime) => Ok(runtime.handle().clone()),
        Err(error) => Err(DataFusionError::ResourcesExhausted(format!(
            "cannot start the task runtime: {error}"
        ))),
    }
}
