//! The driver's gRPC client of one worker: the runtime's `WorkerClient` over `WorkerService`.
//!
//! Invariant: a `RunTask` the worker answered with an error is `refused` (the task is certainly not
//! running); one that failed in transport (no answer) is not, since the request may have arrived.

use datafusion::common::Result;
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::{AttemptKey, JobId};
use sluice_runtime::error::{ErrorKind, RemoteError};
use sluice_runtime::runner::WorkerState;
use sluice_runtime::transport::{RunTaskError, WorkerClient};
use sluice_runtime::{RuntimeFilterUpdate, TaskDefinition};

use crate::auth::{ClusterLink, SecretChannel, connect_lazy};
use crate::proto;
use crate::proto::worker_service_client::WorkerServiceClient;
use crate::wire::{attempt_to_proto, encode_definition, from_status, peer_answered};

/// A worker reached over gRPC.
#[derive(Debug, Clone)]
pub(crate) struct GrpcWorkerClient {
    address: String,
    client: WorkerServiceClient<SecretChannel>,
}

impl GrpcWorkerClient {
    /// A client of the worker at `address` (connected lazily), carrying the link's secret; an address that
    /// is not `host:port` is an error.
    pub fn new(address: &str, link: &ClusterLink) -> Result<Self> {
        let client = WorkerServiceClient::new(connect_lazy(address, link)?)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        Ok(Self {
            address: address.to_string(),
            client,
        })
    }
}

impl GrpcWorkerClient {
    /// What the worker holds now.
    pub async fn state(&self) -> Result<WorkerState> {
        let mut client = self.client.clone();
        let state = client
            .get_state(proto::GetStateRequest {})
            .await
            .map_err(|status| {
                RemoteError::new(
                    ErrorKind::Transport,
                    format!("GetState of {}: {}", self.address, status.message()),
                )
                .to_error()
            })?
            .into_inner();
        let count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        Ok(WorkerState {
            address: self.address.clone(),
            id: None,
            state: String::new(),
            started_ms: None,
            running_tasks: count(state.running_tasks),
            live_attempts: count(state.live_attempts),
            stream_outputs: count(state.stream_outputs),
            memory_used: count(state.memory_used),
            memory_limit: (state.memory_limit > 0).then(|| count(state.memory_limit)),
        })
    }
}

impl WorkerClient for GrpcWorkerClient {
    fn run_task(
        &self,
        definition: TaskDefinition,
    ) -> BoxFuture<'static, Result<u64, RunTaskError>> {
        let mut client = self.client.clone();
        let address = self.address.clone();
        async move {
            let task = encode_definition(&definition).map_err(|error| RunTaskError {
                refused: true,
                error: RemoteError::of(&error),
            })?;
            match client.run_task(proto::RunTaskRequest { task }).await {
                Ok(response) => Ok(response.into_inner().accepted),
                Err(status) => Err(RunTaskError {
                    refused: peer_answered(&status),
                    error: from_status(
                        &status,
                        &format!("worker {address} did not start {}", definition.attempt),
                    ),
                }),
            }
        }
        .boxed()
    }

    fn stop_task(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>> {
        let mut client = self.client.clone();
        async move {
            let task = Some(attempt_to_proto(attempt)?);
            client
                .stop_task(proto::StopTaskRequest { task })
                .await
                .map_err(|status| from_status(&status, "StopTask").to_error())?;
            Ok(())
        }
        .boxed()
    }

    fn release_output(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>> {
        let mut client = self.client.clone();
        async move {
            let task = Some(attempt_to_proto(attempt)?);
            client
                .release_output(proto::ReleaseOutputRequest { task })
                .await
                .map_err(|status| from_status(&status, "ReleaseOutput").to_error())?;
            Ok(())
        }
        .boxed()
    }

    fn apply_runtime_filter(&self, update: RuntimeFilterUpdate) -> BoxFuture<'static, Result<()>> {
        let mut client = self.client.clone();
        async move {
            let request = crate::wire::encode_filter_update(&update)?;
            client
                .apply_runtime_filter(request)
                .await
                .map_err(|status| from_status(&status, "ApplyRuntimeFilter").to_error())?;
            Ok(())
        }
        .boxed()
    }

    fn clean_up_job(&self, job: JobId) -> BoxFuture<'static, Result<()>> {
        let mut client = self.client.clone();
        async move {
            client
                .clean_up_job(proto::CleanUpJobRequest { job: job.0 })
                .await
                .map_err(|status| {
                    RemoteError::new(
                        ErrorKind::Transport,
                        format!("CleanUpJob: {}", status.message()),
                    )
                    .to_error()
                })?;
            Ok(())
        }
        .boxed()
    }
}
