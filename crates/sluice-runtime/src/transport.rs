//! The three seams between the driver, its workers and the data they move, and their in-process
//! implementations. The cluster implements the same traits over tonic gRPC (control) and Arrow
//! Flight (data); everything above them (the driver actor, the worker's task runner) is the same
//! code in every distributed mode.
//!
//! ```text
//!   driver actor ── WorkerClient (RunTask, StopTask, ReleaseOutput, CleanUpJob,
//!                                 ApplyRuntimeFilter) ──────────────────────────► worker
//!   worker ──────── StatusReporter (task status reports) ─────────────────────────► driver actor
//!   task / job output ── StreamFetcher (read a stream held at an address) ────────► a worker's store
//! ```
//!
//! In-process, a [`WorkerClient`] call is a direct call on the [`Worker`], and [`InProcessNetwork`]
//! finds a stream's store by its holder's address. Invariant: nothing here blocks; every call
//! returns a future that is ready at once in-process and does the RPC in the cluster.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream;
use sluice_planner::{AttemptKey, JobId, StreamId};

use crate::definition::{RuntimeFilterUpdate, TaskDefinition, TaskStatusReport};
use crate::error::{ErrorKind, RemoteError, transport_error};
use crate::worker::Worker;

/// Why a worker did not start a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunTaskError {
    /// The worker answered and refused the task (it is certainly not running). `false` when the
    /// outcome is unknown (the request or its reply was lost): the task may be running.
    pub refused: bool,
    /// What went wrong.
    pub error: RemoteError,
}

/// How the driver reaches one worker's control plane.
pub trait WorkerClient: Send + Sync + fmt::Debug {
    /// Starts a task attempt; answers how many `RunTask`s the worker accepted so far, this one
    /// included (its heartbeats say the same of the attempts they list).
    fn run_task(&self, definition: TaskDefinition)
    -> BoxFuture<'static, Result<u64, RunTaskError>>;
    /// Stops a task attempt (its output is removed).
    fn stop_task(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>>;
    /// No consumer will read more of `attempt`'s output: drop what is left of it.
    fn release_output(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>>;
    /// Stops every attempt of `job` and removes its streams.
    fn clean_up_job(&self, job: JobId) -> BoxFuture<'static, Result<()>>;
    /// A runtime filter's key summary for the running tasks of its target stage on this worker
    /// (and those it starts later).
    fn apply_runtime_filter(&self, update: RuntimeFilterUpdate) -> BoxFuture<'static, Result<()>>;
}

/// How a task or the job output reads a stream held by the worker at an address.
pub trait StreamFetcher: Send + Sync + fmt::Debug {
    /// Stream `stream` from `address`, as a lazy record-batch stream of `schema`: it connects on its
    /// first poll, and dropping it ends the read.
    fn fetch(
        &self,
        address: &str,
        stream: StreamId,
        schema: SchemaRef,
    ) -> SendableRecordBatchStream;

    /// [`Self::fetch`] for a task that counts its reads: calls that failed before they reached
    /// the holder and were made again are recorded in `retries`. Fetchers that never retry
    /// (in-process) keep this default.
    fn fetch_counted(
        &self,
        address: &str,
        stream: StreamId,
        schema: SchemaRef,
        retries: Arc<FetchRetries>,
    ) -> SendableRecordBatchStream {
        let _ = retries;
        self.fetch(address, stream, schema)
    }
}

/// The reads of one task attempt that failed before they reached the worker holding their stream
/// (no connection, a call that never arrived) and were made again: how many, and the last such
/// failure, for the attempt's metrics and the driver's notice.
#[derive(Debug, Default)]
pub struct FetchRetries {
    count: AtomicU64,
    last: Mutex<Option<String>>,
}

impl FetchRetries {
    /// One read is made again after `failure`.
    pub fn record(&self, failure: String) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = self.last.lock() {
            *last = Some(failure);
        }
    }

    /// How many reads were made again.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The last failure that made a read try again.
    pub fn last(&self) -> Option<String> {
        self.last.lock().ok().and_then(|last| last.clone())
    }
}

/// Where a worker sends its task status reports.
pub trait StatusReporter: Send + Sync {
    /// Delivers one report (a lost report is a lost worker, which the driver detects itself).
    fn report(&self, report: TaskStatusReport) -> BoxFuture<'static, ()>;
}

/// Workers of this process by address: the in-process data plane.
#[derive(Debug, Default, Clone)]
pub struct InProcessNetwork {
    workers: Arc<Mutex<HashMap<String, Worker>>>,
}

impl InProcessNetwork {
    /// Makes `worker`'s streams readable at its address.
    pub fn add(&self, worker: &Worker) {
        if let Ok(mut workers) = self.workers.lock() {
            workers.insert(worker.address().to_string(), worker.clone());
        }
    }

    fn worker(&self, address: &str) -> Option<Worker> {
        self.workers.lock().ok()?.get(address).cloned()
    }
}

impl StreamFetcher for InProcessNetwork {
    fn fetch(
        &self,
        address: &str,
        stream: StreamId,
        schema: SchemaRef,
    ) -> SendableRecordBatchStream {
        match self.worker(address) {
            Some(worker) => worker.store().take_stream(stream, schema),
            None => {
                let error = transport_error(format!(
                    "reading {stream}: no worker at {address} in this process"
                ));
                Box::pin(RecordBatchStreamAdapter::new(
                    schema,
                    stream::once(async move { Err(error) }),
                ))
            }
        }
    }
}

/// A [`WorkerClient`] that calls a worker of this process directly.
#[derive(Debug, Clone)]
pub struct InProcessClient(pub Worker);

impl WorkerClient for InProcessClient {
    fn run_task(
        &self,
        definition: TaskDefinition,
    ) -> BoxFuture<'static, Result<u64, RunTaskError>> {
        let result = self.0.run_task(definition).map_err(|error| RunTaskError {
            refused: true,
            error: RemoteError::of(&error),
        });
        async move { result }.boxed()
    }

    fn stop_task(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>> {
        let result = self.0.stop_task(attempt).map(|_| ());
        async move { result }.boxed()
    }

    fn release_output(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>> {
        let result = self.0.store().release(attempt);
        async move { result }.boxed()
    }

    fn clean_up_job(&self, job: JobId) -> BoxFuture<'static, Result<()>> {
        let result = self.0.clean_up_job(job);
        async move { result }.boxed()
    }

    fn apply_runtime_filter(&self, update: RuntimeFilterUpdate) -> BoxFuture<'static, Result<()>> {
        let result = self.0.apply_runtime_filter(&update).map(|_| ());
        async move { result }.boxed()
    }
}

/// A [`RunTaskError`] for a worker that could not be reached.
pub fn unreachable(message: impl Into<String>) -> RunTaskError {
    RunTaskError {
        refused: false,
        error: RemoteError::new(ErrorKind::Transport, message),
    }
}
