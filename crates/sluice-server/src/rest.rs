//! The REST API of `sluice server` (`--http-listen`, default `127.0.0.1:8080`): the driver's jobs and
//! workers as JSON, and a cancel button, for scripts, dashboards and the coming web UI.
//!
//! ```text
//!  GET  /api/v1/jobs               [job, …] by id: running ones and the last ended ones
//!  GET  /api/v1/jobs/{id}          job + "graph" (per stage: tasks, root operator, inputs with
//!                                  their mode) + "stage_details" (per stage: tasks, attempts, succeeded,
//!                                  running, task time and rows: median and max, and every
//!                                  `TASK_METRICS` counter summed over its succeeded tasks) +
//!                                  "totals" (those summed over the stages) +
//!                                  "attempts" (every task attempt: where, when, state, and its
//!                                  `TASK_METRICS` counters)
//!                                  + "progress" (per stage: total, running, done, rows) while it runs
//!  POST /api/v1/jobs/{id}/cancel   {"cancelled": true} · 404 unknown job · 409 not running
//!  GET  /api/v1/workers            [{address, slots, busy_slots, last_heartbeat_ms_ago (the
//!                                  driver's view; null for its own executor), running_tasks,
//!                                  live_attempts, stream_outputs, memory_used, memory_limit
//!                                  (null: unlimited)}, …]
//!  GET  /api/v1/events             Server-Sent Events: `event: job`, `data:` a job as in the list,
//!                                  for every job on connect, then each time one changes (state,
//!                                  tasks done, rows, retries), checked every EVENTS_EVERY
//!  GET  /metrics                   Prometheus text format (`crate::prometheus`)
//!  GET  /                          the web UI (`crate::ui`)
//! ```
//!
//! A job: `id`, `state` (`running` / `succeeded` / `failed` / `cancelled`), `sql`, `user`, `tag` (the
//! front door's name for the statement; all three `null` for jobs not submitted through a front
//! door), `submitted_ms` / `ended_ms` (Unix epoch ms), `elapsed_ms`, `stages`, `tasks`,
//! `tasks_done` (tasks that succeeded), `rows` (the final stage's, once succeeded), `retries`,
//! `error`.
//!
//! Invariants: read-only except cancel; a cancel ends the job's result stream with `Cancelled`
//! (the client sees why) and stops its tasks on every worker; the API has no login, so it listens
//! on loopback addresses only.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use datafusion::common::runtime::SpawnedTask;
use serde_json::{Value, json};
use sluice_engine::Result;
use sluice_planner::JobId;
use sluice_runtime::analyze::{TASK_METRICS, TaskMetrics};
use sluice_runtime::{DriverHandle, JobRecord, StageSummary, TaskRecord, stage_summaries};
use tokio::sync::watch;

use crate::service::workers_json;
use crate::sessions::Sessions;

/// Where the REST API listens unless told otherwise.
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:8080";

/// How often `/api/v1/events` looks for changed jobs.
pub const EVENTS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// A running REST endpoint.
#[derive(Debug)]
pub struct RestEndpoint {
    address: SocketAddr,
    stop: watch::Sender<bool>,
    serving: Option<SpawnedTask<std::io::Result<()>>>,
}

type Reply = (StatusCode, Json<Value>);

/// What the handlers share: the sessions (whose base session's runner is the driver), and whether
/// the endpoint is stopping (event streams end then, so a stop never waits on a subscriber).
#[derive(Clone)]
struct RestState {
    sessions: Arc<Sessions>,
    stopping: watch::Receiver<bool>,
}

impl axum::extract::FromRef<RestState> for Arc<Sessions> {
    fn from_ref(state: &RestState) -> Self {
        Arc::clone(&state.sessions)
    }
}

impl RestEndpoint {
    /// Serves `sessions`' driver on `listen` (a loopback address).
    pub async fn start(sessions: Arc<Sessions>, listen: &str) -> Result<Self> {
        // Counting starts with the endpoint; without a recorder `/metrics` says why.
        let _ = crate::prometheus::install();
        let (listener, address) =
            crate::server::bind_front_door(listen, "REST", "job details", false, false).await?;
        let app = Router::new()
            .route("/api/v1/jobs", get(jobs))
            .route("/api/v1/jobs/{id}", get(job))
            .route("/api/v1/jobs/{id}/cancel", post(cancel))
            .route("/api/v1/workers", get(workers))
            .route("/api/v1/events", get(events))
            .route("/metrics", get(metrics))
            .merge(crate::ui::routes());
        let (stop, stopping) = watch::channel(false);
        let app = app.with_state(RestState {
            sessions,
            stopping: stopping.clone(),
        });
        let serving = SpawnedTask::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stopped(stopping))
                .await
        });
        Ok(Self {
            address,
            stop,
            serving: Some(serving),
        })
    }

    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops accepting requests and lets those in flight end.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(serving) = self.serving.take() {
            let _ = serving.join().await;
        }
    }
}

fn driver(sessions: &Sessions) -> Option<DriverHandle> {
    sessions.base().runner().driver()
}

fn failure(status: StatusCode, message: impl Into<String>) -> Reply {
    (status, Json(json!({ "error": message.into() })))
}

/// `job` as the API shows it.
pub fn job_json(job: &JobRecord) -> Value {
    let label = job.label.as_deref();
    json!({
        "id": job.job,
        "state": job.state.name(),
        "sql": label.map(|l| l.sql.clone()),
        "user": label.map(|l| l.user.clone()),
        "tag": label.map(|l| l.tag.clone()),
        "submitted_ms": job.submitted_ms,
        "ended_ms": job.ended_ms,
        "elapsed_ms": job.elapsed_ms(),
        "stages": job.stages(),
        "tasks": job.tasks(),
        "rows": job.rows,
        "retries": job.retries,
        "error": job.error,
        "tasks_done": job.tasks_done,
    })
}

/// Every [`TASK_METRICS`] counter of `metrics` added to the object `into`.
fn with_metrics(mut into: Value, metrics: &TaskMetrics) -> Value {
    if let Value::Object(fields) = &mut into {
        for (name, value) in TASK_METRICS {
            fields.insert((*name).to_string(), json!(value(metrics)));
        }
    }
    into
}

/// One stage's summary, as `/api/v1/jobs/{id}` shows it.
fn stage_json(stage: usize, s: &StageSummary) -> Value {
    let summary = json!({
        "stage": stage,
        "tasks": s.tasks,
        "attempts": s.attempts,
        "succeeded": s.succeeded,
        "running": s.running,
        "task_ms_median": s.task_ms.map(|t| t.0),
        "task_ms_max": s.task_ms.map(|t| t.1),
        "task_rows_median": s.task_rows.map(|t| t.0),
        "task_rows_max": s.task_rows.map(|t| t.1),
    });
    with_metrics(summary, &s.totals)
}

/// One task attempt, as `/api/v1/jobs/{id}` shows it.
fn attempt_json(a: &TaskRecord) -> Value {
    let attempt = json!({
        "stage": a.attempt.task.stage.0,
        "partition": a.attempt.task.partition,
        "attempt": a.attempt.attempt,
        "worker_id": a.worker.map(|w| w.0),
        "address": a.address,
        "state": a.state.name(),
        "started_ms": a.started_ms,
        "ended_ms": a.ended_ms,
        "elapsed_ms": a.elapsed_ms(),
        "error": a.error,
    });
    with_metrics(attempt, &a.metrics)
}

async fn records(sessions: &Sessions) -> std::result::Result<Vec<JobRecord>, Reply> {
    match driver(sessions) {
        None => Ok(Vec::new()),
        Some(driver) => driver
            .jobs()
            .await
            .map_err(|e| failure(StatusCode::SERVICE_UNAVAILABLE, e.to_string())),
    }
}

async fn jobs(State(sessions): State<Arc<Sessions>>) -> Reply {
    match records(&sessions).await {
        Ok(records) => (
            StatusCode::OK,
            Json(Value::Array(records.iter().map(job_json).collect())),
        ),
        Err(reply) => reply,
    }
}

async fn job(State(sessions): State<Arc<Sessions>>, Path(id): Path<u64>) -> Reply {
    let records = match records(&sessions).await {
        Ok(records) => records,
        Err(reply) => return reply,
    };
    let Some(record) = records.iter().find(|r| r.job == id) else {
        return failure(StatusCode::NOT_FOUND, format!("no job {id}"));
    };
    let mut body = job_json(record);
    let summaries = stage_summaries(&record.stage_tasks, &record.attempts);
    body["stage_details"] = summaries
        .iter()
        .enumerate()
        .map(|(stage, s)| stage_json(stage, s))
        .collect();
    let totals: TaskMetrics = summaries.iter().map(|s| &s.totals).sum();
    body["totals"] = with_metrics(json!({}), &totals);
    body["attempts"] = record.attempts.iter().map(attempt_json).collect();
    body["graph"] = record
        .stage_tasks
        .iter()
        .zip(&record.stage_inputs)
        .zip(&record.stage_roots)
        .enumerate()
        .map(|(stage, ((tasks, inputs), root))| {
            let inputs: Vec<Value> = inputs
                .iter()
                .map(|(input, mode)| json!({"stage": input, "mode": mode}))
                .collect();
            json!({"stage": stage, "tasks": tasks, "root": root, "inputs": inputs})
        })
        .collect();
    let progress = match driver(&sessions) {
        Some(driver) => driver.progress().await.unwrap_or_default(),
        None => Vec::new(),
    };
    if let Some(job) = progress.iter().find(|p| p.job == id) {
        body["progress"] = job
            .stages
            .iter()
            .enumerate()
            .map(|(stage, s)| {
                json!({"stage": stage, "total": s.total, "running": s.running, "done": s.done, "rows": s.rows})
            })
            .collect();
    }
    (StatusCode::OK, Json(body))
}

async fn cancel(State(sessions): State<Arc<Sessions>>, Path(id): Path<u64>) -> Reply {
    let Some(driver) = driver(&sessions) else {
        return failure(StatusCode::NOT_FOUND, format!("no job {id}"));
    };
    match driver.cancel_job(JobId(id), "REST API").await {
        Ok(true) => (StatusCode::OK, Json(json!({ "cancelled": true }))),
        Ok(false) => match records(&sessions).await {
            Ok(records) if records.iter().any(|r| r.job == id) => {
                failure(StatusCode::CONFLICT, format!("job {id} is not running"))
            }
            Ok(_) => failure(StatusCode::NOT_FOUND, format!("no job {id}")),
            Err(reply) => reply,
        },
        Err(e) => failure(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn workers(State(sessions): State<Arc<Sessions>>) -> Reply {
    match sessions.base().runner().cluster_state().await {
        Ok(Some(state)) => (StatusCode::OK, Json(Value::Array(workers_json(&state)))),
        Ok(None) => (StatusCode::OK, Json(Value::Array(Vec::new()))),
        Err(e) => failure(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn metrics(State(sessions): State<Arc<Sessions>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match crate::prometheus::render(sessions.base().runner().as_ref()).await {
        Ok(text) => (
            StatusCode::OK,
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(message) => failure(StatusCode::SERVICE_UNAVAILABLE, message).into_response(),
    }
}

/// What makes a job worth a new event: it ended, a task finished, rows arrived, a region retried.
type Fingerprint = (&'static str, usize, u64, usize);

fn fingerprint(job: &JobRecord) -> Fingerprint {
    (job.state.name(), job.tasks_done, job.rows, job.retries)
}

/// Resolves once the endpoint is stopping (or gone).
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stopping| *stopping).await;
}

/// `/api/v1/events`: every job once, then each job again whenever its fingerprint changes. The
/// stream lives as long as the client's connection (axum drops it when the client goes away) or
/// until the endpoint stops.
async fn events(
    State(RestState { sessions, stopping }): State<RestState>,
) -> axum::response::sse::Sse<
    impl futures::Stream<
        Item = std::result::Result<axum::response::sse::Event, std::convert::Infallible>,
    >,
> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use futures::StreamExt;
    let seen: std::collections::HashMap<u64, Fingerprint> = std::collections::HashMap::new();
    let changes = futures::stream::unfold(
        (sessions, seen, true),
        |(sessions, mut seen, first)| async move {
            if !first {
                tokio::time::sleep(EVENTS_EVERY).await;
            }
            let jobs = records(&sessions).await.unwrap_or_default();
            seen.retain(|id, _| jobs.iter().any(|job| job.job == *id));
            let changed: Vec<Event> = jobs
                .iter()
                .filter(|job| {
                    let print = fingerprint(job);
                    seen.insert(job.job, print) != Some(print)
                })
                .map(|job| {
                    Event::default()
                        .event("job")
                        .data(job_json(job).to_string())
                })
                .collect();
            Some((futures::stream::iter(changed), (sessions, seen, false)))
        },
    )
    .flatten()
    .take_until(stopped(stopping))
    .map(Ok);
    Sse::new(changes).keep_alive(KeepAlive::default())
}
