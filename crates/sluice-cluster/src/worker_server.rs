//! A cluster worker: the runtime's `Worker` behind `WorkerService` (control) and Arrow Flight (its
//! stream store) on one address, registered with a driver over `DriverService`, reporting task
//! status and sending heartbeats.
//!
//! ```text
//!   RunTask(bytes) ─► wire::decode_definition ─► Worker::run_task ─► (task runtime)
//!   StopTask / ReleaseOutput / CleanUpJob / ApplyRuntimeFilter ─► Worker
//!   DoGet(TaskStreamKey) ─► the worker's StreamStore
//!   task reports ─► ReportTaskStatus (DriverService), resent until the driver answers
//!   every heartbeat interval ─► Heartbeat(known attempts, RunTasks accepted, driver epoch);
//!                               no answer for the driver timeout ─► departure (the process
//!                               exits); "not registered" ─► departure (the process drops its
//!                               tasks and streams and joins again)
//! ```
//!
//! Invariants: a malformed request gets `InvalidArgument` naming what was wrong; nothing a request
//! carries can stop the worker from serving the next one; a draining worker refuses new tasks with a
//! transport error in the status details (an answer, so the driver keeps the worker, and retryable,
//! so the task runs elsewhere) and finishes the others; a status report is resent (with backoff)
//! until the driver acknowledges it, refuses it, or the driver timeout passes: reports are
//! idempotent by sequence, so a resent one the driver already had changes nothing.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use datafusion::arrow::ipc::CompressionType;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::WorkerId;
use sluice_runtime::transport::StatusReporter;
use sluice_runtime::{TaskStatusReport, Worker, WorkerOptions};
use tokio::net::TcpListener;
use tokio::sync::watch;

use tonic::{Request, Response, Status};

use crate::auth::{ClusterLink, SecretChannel, guarded, with_secret};
use crate::flight::{FlightFetcher, StreamFlightService};
use crate::net::{bind, incoming};
use crate::proto;
use crate::proto::driver_service_client::DriverServiceClient;
use crate::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use crate::wire::{
    attempt_from_proto, attempt_to_proto, decode_definition, peer_answered, remote_to_status,
    report_to_proto, to_status, to_u32,
};
use sluice_runtime::error::{ErrorKind, RemoteError};
use sluice_runtime::faults::{FaultPoint, FaultPoints};

/// Why a worker's connection to its driver ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Departure {
    /// Still serving.
    Serving,
    /// No heartbeat was answered for this long.
    DriverLost(Duration),
    /// The driver answered that it no longer counts this worker.
    Dropped,
}

/// The driver this worker registered with.
struct Joined {
    id: WorkerId,
    epoch: u64,
    client: DriverServiceClient<SecretChannel>,
}

/// A worker serving on its own address; dropping it stops its server, its heartbeats and its tasks.
pub(crate) struct WorkerServer {
    worker: Worker,
    draining: Arc<AtomicBool>,
    joined: Option<Joined>,
    link: ClusterLink,
    departure: watch::Receiver<Departure>,
    departure_tx: Arc<watch::Sender<Departure>>,
    _server: SpawnedTask<()>,
    _heartbeats: Option<SpawnedTask<()>>,
}

impl WorkerServer {
    /// Starts a worker named `name` on `127.0.0.1` at an ephemeral port.
    pub async fn start(
        name: String,
        options: WorkerOptions,
        compression: Option<CompressionType>,
        link: ClusterLink,
    ) -> Result<Self> {
        Self::start_on(name, "127.0.0.1:0", None, options, compression, link).await
    }

    /// Starts a worker listening on `listen`; it registers as `advertise` (default: the address it
    /// got), where the driver and other workers reach it. Every call to it, and from it, carries
    /// `link` (its secret, and TLS when set).
    pub async fn start_on(
        name: String,
        listen: &str,
        advertise: Option<String>,
        options: WorkerOptions,
        compression: Option<CompressionType>,
        link: ClusterLink,
    ) -> Result<Self> {
        let (listener, bound) = bind(&name, listen).await?;
        let address = advertise.unwrap_or(bound);
        let fetcher = Arc::new(FlightFetcher::with_faults(
            link.clone(),
            options.faults.clone(),
        ));
        let worker = Worker::new(name, address, options, fetcher)?;
        let draining = Arc::new(AtomicBool::new(false));
        let server = serve_worker(
            listener,
            worker.clone(),
            draining.clone(),
            compression,
            &link,
        )?;
        let (departure_tx, departure) = watch::channel(Departure::Serving);
        Ok(Self {
            worker,
            draining,
            joined: None,
            link,
            departure,
            departure_tx: Arc::new(departure_tx),
            _server: server,
            _heartbeats: None,
        })
    }

    /// The runtime worker.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Registers with the driver at `driver_address`, then reports there and sends a heartbeat
    /// every `heartbeat`; when none is answered for `driver_timeout` (or the driver drops this
    /// worker), [`Self::departure`] says so. Joining again (after a drop) registers afresh.
    pub async fn join(
        &mut self,
        driver_address: &str,
        heartbeat: Duration,
        driver_timeout: Duration,
    ) -> Result<WorkerId> {
        let id = self.register(driver_address, driver_timeout).await?;
        self.start_heartbeats(heartbeat, driver_timeout)?;
        Ok(id)
    }

    /// Registers with the driver at `driver_address` and reports there from now on (a report
    /// given up after `driver_timeout`); heartbeats start with [`Self::start_heartbeats`], so a
    /// caller can say it joined before anything a heartbeat does (a fault armed at the first
    /// heartbeat) can end the process.
    pub async fn register(
        &mut self,
        driver_address: &str,
        driver_timeout: Duration,
    ) -> Result<WorkerId> {
        let channel = self
            .link
            .endpoint(driver_address)?
            .connect()
            .await
            .map_err(|e| {
                sluice_runtime::error::transport_error(format!(
                    "{} cannot reach the driver at {driver_address}: {e}",
                    self.worker.name()
                ))
            })?;
        let client = DriverServiceClient::new(with_secret(channel, &self.link)?);
        let response = client
            .clone()
            .register_worker(proto::RegisterWorkerRequest {
                address: self.worker.address().to_string(),
                slots: to_u32(self.worker.slots(), "task slots")?,
                build: crate::wire::build(),
            })
            .await
            .map_err(|status| {
                DataFusionError::Execution(format!(
                    "{} could not register with the driver at {driver_address}: {}",
                    self.worker.name(),
                    status.message()
                ))
            })?;
        let response = response.into_inner();
        let id = WorkerId(response.worker_id);
        let epoch = response.driver_epoch;
        self.worker.set_reporter(
            id,
            Arc::new(RemoteReporter {
                client: client.clone(),
                epoch,
                give_up_after: driver_timeout,
                faults: self.worker.faults().cloned(),
            }),
        )?;
        self.joined = Some(Joined { id, epoch, client });
        self._heartbeats = None;
        self.departure_tx.send_replace(Departure::Serving);
        Ok(id)
    }

    /// Sends a heartbeat every `heartbeat` to the driver this worker registered with (see
    /// [`Self::join`]).
    pub fn start_heartbeats(
        &mut self,
        heartbeat: Duration,
        driver_timeout: Duration,
    ) -> Result<()> {
        let Some(joined) = &self.joined else {
            return Err(DataFusionError::Internal(format!(
                "{} sends heartbeats only once registered",
                self.worker.name()
            )));
        };
        let departure = Arc::clone(&self.departure_tx);
        self._heartbeats = Some(SpawnedTask::spawn(beat(
            joined.client.clone(),
            Registered {
                id: joined.id,
                epoch: joined.epoch,
                worker: self.worker.clone(),
            },
            heartbeat,
            driver_timeout,
            departure,
        )));
        Ok(())
    }

    /// Changes when the connection to the driver ends (see [`Departure`]).
    pub fn departure(&self) -> watch::Receiver<Departure> {
        self.departure.clone()
    }

    /// Drains: refuses new tasks, tells the driver, waits (at most `grace`) until no task runs
    /// and no job's streams are held here, then leaves the driver. `false` when the grace ran out.
    pub async fn drain(&self, grace: Duration) -> bool {
        self.draining.store(true, Ordering::SeqCst);
        let Some(Joined { id, client, .. }) = &self.joined else {
            return true;
        };
        let _ = client
            .clone()
            .deregister_worker(proto::DeregisterWorkerRequest {
                worker_id: id.0,
                drain: true,
            })
            .await;
        let deadline = Instant::now() + grace;
        let mut done = false;
        while Instant::now() < deadline {
            let (running, store) = self.worker.counts();
            if running == 0 && store.outputs == 0 {
                done = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = client
            .clone()
            .deregister_worker(proto::DeregisterWorkerRequest {
                worker_id: id.0,
                drain: false,
            })
            .await;
        done
    }
}

/// A worker's registration with one driver instance.
struct Registered {
    id: WorkerId,
    epoch: u64,
    worker: Worker,
}

impl Registered {
    /// A heartbeat listing what the worker knows now.
    fn heartbeat(&self) -> Result<proto::HeartbeatRequest> {
        let (known, accepted) = self.worker.known_attempts()?;
        Ok(proto::HeartbeatRequest {
            worker_id: self.id.0,
            driver_epoch: self.epoch,
            attempts: known
                .into_iter()
                .map(attempt_to_proto)
                .collect::<Result<Vec<_>>>()?,
            accepted,
        })
    }
}

/// Sends heartbeats until the driver is lost or drops this worker, then says why.
async fn beat(
    mut client: DriverServiceClient<SecretChannel>,
    registered: Registered,
    interval: Duration,
    driver_timeout: Duration,
    departure: Arc<watch::Sender<Departure>>,
) {
    let mut ticks = tokio::time::interval(interval);
    let mut last_answer = Instant::now();
    let faults = registered.worker.faults().cloned();
    loop {
        ticks.tick().await;
        let prepared = async {
            if let Some(faults) = &faults {
                faults.fire(FaultPoint::Heartbeat).await?;
            }
            registered.heartbeat()
        };
        let request = match AssertUnwindSafe(prepared).catch_unwind().await {
            Ok(Ok(request)) => request,
            // This heartbeat is skipped (a panic included: the heartbeats must go on); the
            // driver notices only if the next ones are skipped too.
            Ok(Err(_)) | Err(_) => continue,
        };
        match tokio::time::timeout(
            interval.max(Duration::from_millis(100)),
            client.heartbeat(request),
        )
        .await
        {
            Ok(Ok(response)) if response.get_ref().registered => last_answer = Instant::now(),
            Ok(Ok(_)) => {
                let _ = departure.send(Departure::Dropped);
                return;
            }
            _ if last_answer.elapsed() > driver_timeout => {
                let _ = departure.send(Departure::DriverLost(last_answer.elapsed()));
                return;
            }
            _ => {}
        }
    }
}

/// Serves `WorkerService` and Flight for `worker` on `listener`.
fn serve_worker(
    listener: TcpListener,
    worker: Worker,
    draining: Arc<AtomicBool>,
    compression: Option<CompressionType>,
    link: &ClusterLink,
) -> Result<SpawnedTask<()>> {
    let flight = guarded(
        StreamFlightService::new(Arc::clone(worker.store()), compression),
        link,
    )?;
    let service = guarded(
        WorkerServiceServer::new(WorkerEndpoint { worker, draining })
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX),
        link,
    )?;
    let mut server = link.server()?;
    Ok(SpawnedTask::spawn(async move {
        // A transport error ends serving; the driver then sees a lost worker.
        let _ = server
            .add_service(service)
            .add_service(flight)
            .serve_with_incoming(incoming(listener))
            .await;
    }))
}

/// Status reports of a worker go to the driver over `DriverService`, resent until acknowledged.
struct RemoteReporter {
    client: DriverServiceClient<SecretChannel>,
    /// The driver instance the worker registered with.
    epoch: u64,
    /// How long to keep resending a report the driver does not answer.
    give_up_after: Duration,
    faults: Option<Arc<FaultPoints>>,
}

/// The first wait before a report is resent; it doubles up to [`RESEND_MAX`].
const RESEND_FIRST: Duration = Duration::from_millis(50);
const RESEND_MAX: Duration = Duration::from_secs(1);

impl RemoteReporter {
    /// One sending of `report`: `Ok(true)` once the driver acknowledged it, `Ok(false)` when it
    /// should be sent again, `Err` when the driver refused it (resending cannot help).
    async fn send_once(
        client: &mut DriverServiceClient<SecretChannel>,
        report: &proto::TaskStatusReport,
        faults: Option<&FaultPoints>,
    ) -> std::result::Result<bool, Status> {
        if let Some(faults) = faults
            && faults.fire(FaultPoint::ReportBeforeSend).await.is_err()
        {
            return Ok(false);
        }
        match client.report_task_status(report.clone()).await {
            Ok(_) => {}
            Err(status) if peer_answered(&status) => return Err(status),
            Err(_) => return Ok(false),
        }
        if let Some(faults) = faults
            && faults.fire(FaultPoint::ReportAfterSend).await.is_err()
        {
            // The acknowledgement is lost: the driver gets the report again (a duplicate).
            return Ok(false);
        }
        Ok(true)
    }
}

impl StatusReporter for RemoteReporter {
    fn report(&self, report: TaskStatusReport) -> BoxFuture<'static, ()> {
        let mut client = self.client.clone();
        let epoch = self.epoch;
        let give_up_after = self.give_up_after;
        let faults = self.faults.clone();
        async move {
            let Ok(mut message) = report_to_proto(&report) else {
                return;
            };
            message.driver_epoch = epoch;
            let started = Instant::now();
            let mut wait = RESEND_FIRST;
            loop {
                match Self::send_once(&mut client, &message, faults.as_deref()).await {
                    Ok(true) => return,
                    // Refused (another driver instance, a malformed report): the heartbeats
                    // tell the driver what this worker knows.
                    Err(_) => return,
                    Ok(false) if started.elapsed() > give_up_after => {
                        tracing::warn!(
                            target: "sluice::worker",
                            attempt = %report.attempt,
                            "the driver did not acknowledge a status report within {:.1} s; \
                             giving it up",
                            give_up_after.as_secs_f64()
                        );
                        return;
                    }
                    Ok(false) => {
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(RESEND_MAX);
                    }
                }
            }
        }
        .boxed()
    }
}

struct WorkerEndpoint {
    worker: Worker,
    draining: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl WorkerService for WorkerEndpoint {
    async fn run_task(
        &self,
        request: Request<proto::RunTaskRequest>,
    ) -> Result<Response<proto::RunTaskResponse>, Status> {
        if self.draining.load(Ordering::SeqCst) {
            // A transport error, so the task is retried on another worker; with its details, so
            // the driver knows this worker answered (it is alive and finishing its tasks).
            return Err(remote_to_status(&RemoteError::new(
                ErrorKind::Transport,
                format!("{} is draining and takes no new task", self.worker.name()),
            )));
        }
        let bytes = request.into_inner().task;
        let definition = decode_definition(&bytes, self.worker.function_context())
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", self.worker.name())))?;
        let accepted = self
            .worker
            .run_task(definition)
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::RunTaskResponse { accepted }))
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

    async fn apply_runtime_filter(
        &self,
        request: Request<proto::ApplyRuntimeFilterRequest>,
    ) -> Result<Response<proto::ApplyRuntimeFilterResponse>, Status> {
        let update = crate::wire::decode_filter_update(request.into_inner());
        let updated = self
            .worker
            .apply_runtime_filter(&update)
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(proto::ApplyRuntimeFilterResponse {
            updated: updated as u64,
        }))
    }

    async fn get_state(
        &self,
        _request: Request<proto::GetStateRequest>,
    ) -> Result<Response<proto::GetStateResponse>, Status> {
        let (running, store) = self.worker.counts();
        Ok(Response::new(proto::GetStateResponse {
            running_tasks: running as u64,
            live_attempts: self.worker.live_attempts() as u64,
            stream_outputs: store.outputs as u64,
            memory_used: self.worker.memory_used() as u64,
            memory_limit: self.worker.memory_limit().map_or(0, |limit| limit as u64),
        }))
    }
}
