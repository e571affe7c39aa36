//! The cluster's driver: the runtime's `Driver` with `DriverService` (worker registration,
//! heartbeats, task status reports) and the Arrow Flight service of the driver's own executor (the
//! streams of driver-placed stages, which workers read like any other) on one address.
//!
//! ```text
//!   RegisterWorker(address, slots, build) ─► GrpcWorkerClient ─► Driver (registration; answers its epoch)
//!   Heartbeat(worker id, epoch, known attempts) ───────► Driver (liveness, reconciliation)
//!   ReportTaskStatus(epoch) ─► wire::report_from_proto ► Driver
//!   DoGet ─► the driver executor's StreamStore
//! ```
//!
//! Invariants: a request the driver cannot use (no address, no slots, an address that is not
//! `host:port`, a malformed report) gets `InvalidArgument` and changes nothing; a heartbeat or a
//! report carrying another driver instance's epoch changes nothing either: the heartbeat is
//! answered "not registered" (the worker registers afresh) and the report `FailedPrecondition`; a
//! worker of another version (`wire::build`) is refused with `FailedPrecondition` and not added.

use std::sync::Arc;

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::Result;
use datafusion::common::runtime::SpawnedTask;
use sluice_planner::WorkerId;
use sluice_runtime::driver::{
    DriverHandle, ExecutorEndpoint, Liveness, WorkerBeat, WorkerRegistration,
};
use sluice_runtime::runner::{ClusterState, WorkerState};
use sluice_runtime::transport::InProcessClient;
use sluice_runtime::{Driver, DriverOptions, Worker, WorkerOptions};

use tonic::{Request, Response, Status};

use crate::auth::{ClusterLink, guarded};
use crate::client::GrpcWorkerClient;
use crate::flight::{FlightFetcher, StreamFlightService};
use crate::net::{bind, incoming};
use crate::proto;
use crate::proto::driver_service_server::{DriverService, DriverServiceServer};
use crate::wire::{attempt_from_proto, report_from_proto};

/// A driver serving on its own address; dropping it stops its server, actor and executor.
pub(crate) struct ClusterDriver {
    driver: Driver,
    executor: Worker,
    address: String,
    _server: SpawnedTask<()>,
}

impl ClusterDriver {
    /// Starts a driver on `127.0.0.1` at an ephemeral port.
    pub async fn start(
        options: DriverOptions,
        executor_options: WorkerOptions,
        compression: Option<CompressionType>,
        link: ClusterLink,
    ) -> Result<Self> {
        Self::start_on("127.0.0.1:0", options, executor_options, compression, link).await
    }

    /// Starts a driver listening on `listen` (`host:port`, port 0 picks one); every call to it, and
    /// from it, goes over `link` (its secret, and TLS when set).
    pub async fn start_on(
        listen: &str,
        options: DriverOptions,
        executor_options: WorkerOptions,
        compression: Option<CompressionType>,
        link: ClusterLink,
    ) -> Result<Self> {
        let (listener, address) = bind("the driver", listen).await?;
        let executor = Worker::new(
            "the driver",
            address.clone(),
            executor_options,
            Arc::new(FlightFetcher::new(link.clone())),
        )?;
        let driver = Driver::start(
            options,
            ExecutorEndpoint {
                address: address.clone(),
                client: Arc::new(InProcessClient(executor.clone())),
            },
            Arc::new(FlightFetcher::new(link.clone())),
        );
        executor.set_reporter(WorkerId::DRIVER, driver.reporter())?;
        let service = guarded(
            DriverServiceServer::new(DriverEndpoint {
                driver: driver.handle().clone(),
                link: link.clone(),
            }),
            &link,
        )?;
        let flight = guarded(
            StreamFlightService::new(Arc::clone(executor.store()), compression),
            &link,
        )?;
        let mut server_builder = link.server()?;
        let server = SpawnedTask::spawn(async move {
            let _ = server_builder
                .add_service(service)
                .add_service(flight)
                .serve_with_incoming(incoming(listener))
                .await;
        });
        Ok(Self {
            driver,
            executor,
            address,
            _server: server,
        })
    }

    /// The address serving `DriverService` and the executor's Flight.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The runtime driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The driver's own executor.
    pub fn executor(&self) -> &Worker {
        &self.executor
    }

    /// The driver's view and each worker's own (asked over gRPC, carrying `link`'s secret); the
    /// driver's in-process executor (driver-placed tasks) comes first, as worker `driver`.
    pub async fn state(&self, link: &ClusterLink) -> Result<ClusterState> {
        let driver = self.driver().snapshot().await?;
        let mut workers = vec![WorkerState::of("driver", self.executor())];
        for worker in &driver.workers {
            workers.push(
                GrpcWorkerClient::new(&worker.address, link)?
                    .state()
                    .await?
                    .seen_by_driver(worker),
            );
        }
        Ok(ClusterState { driver, workers })
    }
}

/// `DriverService`: turns each request into a driver event.
struct DriverEndpoint {
    driver: DriverHandle,
    /// How the driver calls the workers that register.
    link: ClusterLink,
}

fn shutting_down(_: datafusion::common::DataFusionError) -> Status {
    Status::unavailable("the driver is shutting down")
}

#[tonic::async_trait]
impl DriverService for DriverEndpoint {
    async fn register_worker(
        &self,
        request: Request<proto::RegisterWorkerRequest>,
    ) -> Result<Response<proto::RegisterWorkerResponse>, Status> {
        let request = request.into_inner();
        if request.address.is_empty() || request.slots == 0 {
            return Err(Status::invalid_argument(
                "RegisterWorker needs an address and at least one task slot",
            ));
        }
        let build = crate::wire::build();
        if request.build != build {
            return Err(Status::failed_precondition(format!(
                "the worker at {} runs {}, the driver {build}: a cluster runs one version (plans \
                 and settings travel in its encoding)",
                request.address,
                if request.build.is_empty() {
                    "a build that does not say which"
                } else {
                    &request.build
                },
            )));
        }
        let client = GrpcWorkerClient::new(&request.address, &self.link).map_err(|e| {
            Status::invalid_argument(format!(
                "cannot register a worker at '{}': {e}",
                request.address
            ))
        })?;
        let id = self
            .driver
            .register_worker(WorkerRegistration {
                address: request.address,
                slots: request.slots as usize,
                client: Arc::new(client),
                liveness: Liveness::Heartbeats,
            })
            .await
            .map_err(shutting_down)?;
        Ok(Response::new(proto::RegisterWorkerResponse {
            worker_id: id.0,
            driver_epoch: self.driver.epoch(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        let request = request.into_inner();
        if request.driver_epoch != self.driver.epoch() {
            // Registered with another driver instance: whatever it holds belongs to that one.
            return Ok(Response::new(proto::HeartbeatResponse {
                registered: false,
            }));
        }
        let beat = WorkerBeat {
            known: request.attempts.iter().map(attempt_from_proto).collect(),
            accepted: request.accepted,
        };
        let registered = self
            .driver
            .heartbeat_reporting(WorkerId(request.worker_id), Some(beat))
            .await
            .map_err(shutting_down)?;
        Ok(Response::new(proto::HeartbeatResponse { registered }))
    }

    async fn deregister_worker(
        &self,
        request: Request<proto::DeregisterWorkerRequest>,
    ) -> Result<Response<proto::DeregisterWorkerResponse>, Status> {
        let request = request.into_inner();
        let worker = WorkerId(request.worker_id);
        let sent = if request.drain {
            self.driver.drain(worker)
        } else {
            self.driver.deregister(worker)
        };
        sent.map_err(shutting_down)?;
        Ok(Response::new(proto::DeregisterWorkerResponse {}))
    }

    async fn report_task_status(
        &self,
        request: Request<proto::TaskStatusReport>,
    ) -> Result<Response<proto::ReportTaskStatusResponse>, Status> {
        let request = request.into_inner();
        let report =
            report_from_proto(&request).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if request.driver_epoch != self.driver.epoch() {
            return Err(Status::failed_precondition(format!(
                "a report for another driver instance (epoch {}); this worker must register again",
                request.driver_epoch
            )));
        }
        self.driver.report(report).map_err(shutting_down)?;
        Ok(Response::new(proto::ReportTaskStatusResponse {}))
    }
}
