//! `WorkerService`, the worker's control endpoint: thin handlers over [`WorkerShared`].
//!
//! Invariant: a malformed request gets `InvalidArgument` naming what was wrong; nothing a request
//! carries can stop the worker from serving the next one.

use std::sync::Arc;

use prost::Message;
use tonic::{Request, Response, Status};

use super::WorkerShared;
use crate::proto;
use crate::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use crate::wire::{AttemptKey, to_status};

struct WorkerEndpoint {
    shared: Arc<WorkerShared>,
}

/// The gRPC service of a worker.
pub(crate) fn worker_service(shared: Arc<WorkerShared>) -> WorkerServiceServer<impl WorkerService> {
    WorkerServiceServer::new(WorkerEndpoint { shared })
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

#[tonic::async_trait]
impl WorkerService for WorkerEndpoint {
    async fn run_task(
        &self,
        request: Request<proto::RunTaskRequest>,
    ) -> Result<Response<proto::RunTaskResponse>, Status> {
        let bytes = request.into_inner().task;
        let definition = proto::TaskDefinition::decode(bytes.as_slice()).map_err(|e| {
            Status::invalid_argument(format!(
                "{}: malformed task definition ({} bytes): {e}",
                self.shared.name,
                bytes.len()
            ))
        })?;
        if definition.plan.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{}: task definition of {} has no plan",
                self.shared.name,
                AttemptKey::of_definition(&definition)
            )));
        }
        self.shared
            .start_task(definition, None)
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::RunTaskResponse {}))
    }

    async fn stop_task(
        &self,
        request: Request<proto::StopTaskRequest>,
    ) -> Result<Response<proto::StopTaskResponse>, Status> {
        let Some(task) = request.into_inner().task else {
            return Err(Status::invalid_argument("StopTask without a task"));
        };
        self.shared
            .stop_task(AttemptKey::from_proto(&task))
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::StopTaskResponse {}))
    }

    async fn clean_up_job(
        &self,
        request: Request<proto::CleanUpJobRequest>,
    ) -> Result<Response<proto::CleanUpJobResponse>, Status> {
        let job = sluice_runtime::JobId(request.into_inner().job);
        self.shared.clean_up_job(job).map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::CleanUpJobResponse {}))
    }

    async fn stop_worker(
        &self,
        _request: Request<proto::StopWorkerRequest>,
    ) -> Result<Response<proto::StopWorkerResponse>, Status> {
        self.shared.shut_down();
        Ok(Response::new(proto::StopWorkerResponse {}))
    }
}
