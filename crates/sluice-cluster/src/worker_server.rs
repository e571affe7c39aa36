//! A cluster worker: the runtime's `Worker` behind `WorkerService` (control) and Arrow Flight (its
//! stream store) on one address, registered with a driver over `DriverService`, reporting task
//! status and sending heartbeats.
//!
//! ```text
//!   RunTask(bytes) ─► wire::decode_definition ─► Worker::run_task ─► (task runtime)
//!   StopTask / ReleaseOutput / CleanUpJob ─► Worker
//!   DoGet(TaskStreamKey) ─► the worker's StreamStore
//!   task reports ─► ReportTaskStatus (DriverService)      heartbeat every interval ─► Heartbeat
//! ```
//!
//! Invariant: a malformed request gets `InvalidArgument` naming what was wrong; nothing a request
//! carries can stop the worker from serving the next one.

use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::WorkerId;
use sluice_runtime::transport::StatusReporter;
use sluice_runtime::{TaskStatusReport, Worker, WorkerOptions};
use tokio::net::TcpListener;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

use crate::flight::{FlightFetcher, StreamFlightService};
use crate::net::{bind_loopback, endpoint, incoming};
use crate::proto;
use crate::proto::driver_service_client::DriverServiceClient;
use crate::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use crate::wire::{attempt_from_proto, decode_definition, report_to_proto, to_status, to_u32};

/// A worker serving on its own address; dropping it stops its server, its heartbeats and its tasks.
pub(crate) struct WorkerServer {
    worker: Worker,
    _server: SpawnedTask<()>,
    _heartbeats: Option<SpawnedTask<()>>,
}

impl WorkerServer {
    /// Starts a worker named `name` on `127.0.0.1` at an ephemeral port.
    pub async fn start(
        name: String,
        options: WorkerOptions,
        compression: Option<CompressionType>,
    ) -> Result<Self> {
        let (listener, address) = bind_loopback(&name).await?;
        let worker = Worker::new(name, address, options, Arc::new(FlightFetcher));
        let server = serve_worker(listener, worker.clone(), compression);
        Ok(Self {
            worker,
            _server: server,
            _heartbeats: None,
        })
    }

    /// The runtime worker.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Registers with the driver at `driver_address`, then reports and sends heartbeats there.
    pub async fn join(&mut self, driver_address: &str, heartbeat: Duration) -> Result<WorkerId> {
        let channel = endpoint(driver_address)?.connect().await.map_err(|e| {
            sluice_runtime::error::transport_error(format!(
                "{} cannot reach the driver at {driver_address}: {e}",
                self.worker.name()
            ))
        })?;
        let client = DriverServiceClient::new(channel);
        let response = client
            .clone()
            .register_worker(proto::RegisterWorkerRequest {
                address: self.worker.address().to_string(),
                slots: to_u32(self.worker.slots(), "task slots")?,
            })
            .await
            .map_err(|status| {
                DataFusionError::Execution(format!(
                    "{} could not register with the driver at {driver_address}: {}",
                    self.worker.name(),
                    status.message()
                ))
            })?;
        let id = WorkerId(response.into_inner().worker_id);
        self.worker
            .set_reporter(id, Arc::new(RemoteReporter(client.clone())))?;
        let mut beat = client;
        self._heartbeats = Some(SpawnedTask::spawn(async move {
            let mut interval = tokio::time::interval(heartbeat);
            loop {
                interval.tick().await;
                let _ = beat
                    .heartbeat(proto::HeartbeatRequest { worker_id: id.0 })
                    .await;
            }
        }));
        Ok(id)
    }
}

/// Serves `WorkerService` and Flight for `worker` on `listener`.
fn serve_worker(
    listener: TcpListener,
    worker: Worker,
    compression: Option<CompressionType>,
) -> SpawnedTask<()> {
    let flight = StreamFlightService::new(Arc::clone(worker.store()), compression);
    let service = WorkerServiceServer::new(WorkerEndpoint { worker })
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    SpawnedTask::spawn(async move {
        // A transport error ends serving; the driver then sees a lost worker.
        let _ = Server::builder()
            .add_service(service)
            .add_service(flight)
            .serve_with_incoming(incoming(listener))
            .await;
    })
}

/// Status reports of a worker go to the driver over `DriverService`.
struct RemoteReporter(DriverServiceClient<Channel>);

impl StatusReporter for RemoteReporter {
    fn report(&self, report: TaskStatusReport) -> BoxFuture<'static, ()> {
        let mut client = self.0.clone();
        async move {
            // A report that cannot be delivered means the driver is gone, or will find this
            // worker lost; nothing to do here.
            if let Ok(report) = report_to_proto(&report) {
                let _ = client.report_task_status(report).await;
            }
        }
        .boxed()
    }
}

struct WorkerEndpoint {
    worker: Worker,
}

#[tonic::async_trait]
impl WorkerService for WorkerEndpoint {
    async fn run_task(
        &self,
        request: Request<proto::RunTaskRequest>,
    ) -> Result<Response<proto::RunTaskResponse>, Status> {
        let bytes = request.into_inner().task;
        let definition = decode_definition(&bytes, self.worker.function_context())
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", self.worker.name())))?;
        self.worker
            .run_task(definition)
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
        self.worker
            .stop_task(attempt_from_proto(&task))
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::StopTaskResponse {}))
    }

    async fn release_output(
        &self,
        request: Request<proto::ReleaseOutputRequest>,
    ) -> Result<Response<proto::ReleaseOutputResponse>, Status> {
        let Some(task) = request.into_inner().task else {
            return Err(Status::invalid_argument("ReleaseOutput without a task"));
        };
        self.worker
            .store()
            .release(attempt_from_proto(&task))
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::ReleaseOutputResponse {}))
    }

    async fn clean_up_job(
        &self,
        request: Request<proto::CleanUpJobRequest>,
    ) -> Result<Response<proto::CleanUpJobResponse>, Status> {
        let job = sluice_planner::JobId(request.into_inner().job);
        self.worker.clean_up_job(job).map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::CleanUpJobResponse {}))
    }
}
