//! The driver: accepts jobs, schedules their tasks on workers, and streams each job's output back.
//!
//! ```text
//!   DriverService (gRPC: RegisterWorker, Heartbeat, ReportTaskStatus) ─┐
//!   LocalCluster::execute ─ Submit / Cancel ───────────────────────────┼─► events ─► actor (one task)
//!   job output forwarder ─ ApproveOutput / OutputDone ─────────────────┘        │
//!                                          JobScheduler (pure) ◄── events ──────┤
//!                                          actions ─► RunTask / StopTask / CleanUpJob (gRPC),
//!                                                     driver executor, output commands
//! ```
//!
//! Invariants: all driver state lives in the actor, which handles one event at a time (no locks);
//! handlers and RPC replies only send events; a job's streams are cleaned up on every worker once its
//! output was read, it failed, or its caller went away.

mod actor;
mod output;
mod placement;
mod shipping;

use std::sync::Arc;

use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::JobGraph;
use sluice_runtime::JobId;
use sluice_runtime::scheduler::TaskAttempt;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use crate::flight::FlightClients;
use crate::net::{bind_loopback, incoming};
use crate::proto;
use crate::proto::driver_service_server::{DriverService, DriverServiceServer};
use crate::worker::{StatusReporter, Worker, WorkerOptions};

pub use actor::DriverSnapshot;
use output::OutputCommand;

/// How the driver schedules.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// Times a task region runs before its job fails (at least 1).
    pub max_attempts: usize,
}

impl Default for DriverOptions {
    fn default() -> Self {
        Self { max_attempts: 3 }
    }
}

/// What the actor reacts to.
pub(crate) enum DriverEvent {
    RegisterWorker {
        address: String,
        slots: usize,
        reply: oneshot::Sender<u64>,
    },
    Heartbeat {
        worker: u64,
    },
    TaskStatus(proto::TaskStatusReport),
    Submit(Box<Submission>),
    Cancel(JobId),
    ApproveOutput {
        job: JobId,
        attempt: TaskAttempt,
        reply: oneshot::Sender<bool>,
    },
    OutputDone(JobId),
    TaskNotStarted {
        job: JobId,
        attempt: TaskAttempt,
        error: String,
    },
    Snapshot(oneshot::Sender<DriverSnapshot>),
    Progress(oneshot::Sender<Vec<crate::JobProgress>>),
}

/// A job handed to the actor.
pub(crate) struct Submission {
    graph: Arc<JobGraph>,
    context: Arc<TaskContext>,
    output: mpsc::UnboundedSender<OutputCommand>,
    reply: oneshot::Sender<Result<JobId>>,
}

/// A running driver; dropping it stops its server, its actor and its executor.
pub(crate) struct Driver {
    events: mpsc::UnboundedSender<DriverEvent>,
    address: String,
    flight: FlightClients,
    _server: SpawnedTask<()>,
    _actor: SpawnedTask<()>,
}

impl Driver {
    /// Starts a driver serving `DriverService` on `127.0.0.1` at an ephemeral port.
    pub async fn start(options: DriverOptions, executor_options: WorkerOptions) -> Result<Self> {
        let (listener, address) = bind_loopback("the driver").await?;
        let (events, inbox) = mpsc::unbounded_channel();
        let executor = Worker::start("driver executor".to_string(), executor_options).await?;
        executor.set_reporter(0, Arc::new(LocalReporter(events.clone())))?;
        let actor = actor::DriverActor::new(options, executor, events.clone());
        let actor = SpawnedTask::spawn(actor.run(inbox));
        let service = DriverServiceServer::new(DriverEndpoint {
            events: events.clone(),
        });
        let server = SpawnedTask::spawn(async move {
            let _ = Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming(listener))
                .await;
        });
        Ok(Self {
            events,
            address,
            flight: FlightClients::default(),
            _server: server,
            _actor: actor,
        })
    }

    /// The address serving `DriverService`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Runs `graph`; the stream is lazy and cancels the job when dropped.
    pub fn execute(&self, graph: JobGraph, context: Arc<TaskContext>) -> SendableRecordBatchStream {
        output::job_output(self.events.clone(), self.flight.clone(), graph, context)
    }

    /// The progress of every running job.
    pub async fn progress(&self) -> Result<Vec<crate::JobProgress>> {
        let (reply, answer) = oneshot::channel();
        self.events
            .send(DriverEvent::Progress(reply))
            .map_err(|_| driver_gone())?;
        answer.await.map_err(|_| driver_gone())
    }

    /// The actor's state, for tests and diagnostics.
    pub async fn snapshot(&self) -> Result<DriverSnapshot> {
        let (reply, answer) = oneshot::channel();
        self.events
            .send(DriverEvent::Snapshot(reply))
            .map_err(|_| driver_gone())?;
        answer.await.map_err(|_| driver_gone())
    }
}

pub(crate) fn driver_gone() -> DataFusionError {
    DataFusionError::Execution("the Sluice driver stopped".to_string())
}

/// Status reports of the driver's own executor go straight to the actor.
struct LocalReporter(mpsc::UnboundedSender<DriverEvent>);

impl StatusReporter for LocalReporter {
    fn report(&self, report: proto::TaskStatusReport) -> BoxFuture<'static, ()> {
        let _ = self.0.send(DriverEvent::TaskStatus(report));
        async {}.boxed()
    }
}

/// `DriverService`: turns each request into an actor event.
struct DriverEndpoint {
    events: mpsc::UnboundedSender<DriverEvent>,
}

impl DriverEndpoint {
    fn send(&self, event: DriverEvent) -> Result<(), Status> {
        self.events
            .send(event)
            .map_err(|_| Status::unavailable("the driver is shutting down"))
    }
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
        let (reply, answer) = oneshot::channel();
        self.send(DriverEvent::RegisterWorker {
            address: request.address,
            slots: request.slots as usize,
            reply,
        })?;
        let worker_id = answer
            .await
            .map_err(|_| Status::unavailable("the driver is shutting down"))?;
        Ok(Response::new(proto::RegisterWorkerResponse { worker_id }))
    }

    async fn heartbeat(
        &self,
        request: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        self.send(DriverEvent::Heartbeat {
            worker: request.into_inner().worker_id,
        })?;
        Ok(Response::new(proto::HeartbeatResponse {}))
    }

    async fn report_task_status(
        &self,
        request: Request<proto::TaskStatusReport>,
    ) -> Result<Response<proto::ReportTaskStatusResponse>, Status> {
        let report = request.into_inner();
        crate::wire::status_from_report(&report)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.send(DriverEvent::TaskStatus(report))?;
        Ok(Response::new(proto::ReportTaskStatusResponse {}))
    }
}

/// Status reports of a worker in another place go over `DriverService`.
pub(crate) struct RemoteReporter {
    client: proto::driver_service_client::DriverServiceClient<tonic::transport::Channel>,
}

impl RemoteReporter {
    pub fn new(
        client: proto::driver_service_client::DriverServiceClient<tonic::transport::Channel>,
    ) -> Self {
        Self { client }
    }
}

impl StatusReporter for RemoteReporter {
    fn report(&self, report: proto::TaskStatusReport) -> BoxFuture<'static, ()> {
        let mut client = self.client.clone();
        async move {
            // A report that cannot be delivered means the driver is gone; nothing to do here.
            let _ = client.report_task_status(report).await;
        }
        .boxed()
    }
}
