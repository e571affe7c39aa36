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
//!                                  tasks done, rows, retries), checked every EVENTS_EVERY; a
//!                                  stream opened with a session token ends with the session
//!  GET  /metrics                   Prometheus text format (`crate::prometheus`)
//!  POST /api/v1/login              {"user", "password"} (or Basic credentials) ─► {"token", "user",
//!                                  "role"} and the `sluice_token` cookie · 401 wrong · 429 locked out
//!  POST /api/v1/logout             ends the session of the request's token, clears the cookie
//!  GET  /                          the web UI (`crate::ui`)
//! ```
//!
//! Every request passes [`crate::rest_guard`] first: its Host must be a listed name, a
//! state-changing one must not come from another site, and on a server with accounts everything
//! but the UI's files and the login needs credentials (`/metrics` too, unless `--metrics-public`).
//! A user who is not an admin sees only their own jobs (another's is 404, as an unknown one) and
//! cancels only their own (403 for another's).
//!
//! A job: `id`, `state` (`running` / `succeeded` / `failed` / `cancelled`), `sql`, `user`, `tag` (the
//! front door's name for the statement; all three `null` for jobs not submitted through a front
//! door), `submitted_ms` / `ended_ms` (Unix epoch ms), `elapsed_ms`, `stages`, `tasks`,
//! `tasks_done` (tasks that succeeded), `rows` (the final stage's, once succeeded), `retries`,
//! `error`.
//!
//! Invariants: read-only except cancel and login; a cancel ends the job's result stream with
//! `Cancelled` (the client sees why) and stops its tasks on every worker; the endpoint listens on
//! a loopback address unless it serves TLS and the server has accounts (as the other doors).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, middleware};
use datafusion::common::runtime::SpawnedTask;
use serde_json::{Value, json};
use sluice_engine::Result;
use sluice_planner::JobId;
use sluice_runtime::analyze::{TASK_METRICS, TaskMetrics};
use sluice_runtime::{DriverHandle, JobRecord, StageSummary, TaskRecord, stage_summaries};
use tokio::sync::watch;

use crate::rest_guard::{Caller, Guard, GuardState, SessionToken, basic_credentials, token_of};
use crate::service::workers_json;
use crate::sessions::Sessions;
use crate::tls::FrontDoorTls;

/// Where the REST API listens unless told otherwise.
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:8080";

/// How often `/api/v1/events` looks for changed jobs.
pub const EVENTS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// How the REST endpoint serves.
#[derive(Debug, Clone)]
pub struct RestOptions {
    /// Where it listens: a loopback address, unless it serves TLS and the server has accounts.
    pub listen: String,
    /// Host names it answers to besides its address, `localhost` and the loopback addresses.
    pub allowed_hosts: Vec<String>,
    /// Whether `/metrics` is served without credentials.
    pub metrics_public: bool,
    /// The certificate and key to serve HTTPS with.
    pub tls: Option<FrontDoorTls>,
}

impl Default for RestOptions {
    fn default() -> Self {
        Self {
            listen: DEFAULT_HTTP_LISTEN.to_string(),
            allowed_hosts: Vec::new(),
            metrics_public: false,
            tls: None,
        }
    }
}

/// The largest request body the API reads (a login's JSON).
const MAX_BODY_BYTES: usize = 16 * 1024;

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
    guard: Arc<Guard>,
}

impl axum::extract::FromRef<RestState> for Arc<Sessions> {
    fn from_ref(state: &RestState) -> Self {
        Arc::clone(&state.sessions)
    }
}

impl RestEndpoint {
    /// Serves `sessions`' driver as `options` say.
    pub async fn start(sessions: Arc<Sessions>, options: &RestOptions) -> Result<Self> {
        // Counting starts with the endpoint; without a recorder `/metrics` says why.
        let _ = crate::prometheus::install();
        let (listener, address) = crate::server::bind_front_door(
            &options.listen,
            "REST",
            "job details",
            options.tls.is_some(),
            sessions.requires_login(),
        )
        .await?;
        let guard = Arc::new(Guard::new(
            address,
            &options.allowed_hosts,
            options.metrics_public,
            options.tls.is_some(),
        ));
        let checks = GuardState {
            guard: Arc::clone(&guard),
            sessions: Arc::clone(&sessions),
        };
        let app = Router::new()
            .route("/api/v1/jobs", get(jobs))
            .route("/api/v1/jobs/{id}", get(job))
            .route("/api/v1/jobs/{id}/cancel", post(cancel))
            .route("/api/v1/workers", get(workers))
            .route("/api/v1/events", get(events))
            .route("/api/v1/login", post(login))
            .route("/api/v1/logout", post(logout))
            .route("/metrics", get(metrics))
            .merge(crate::ui::routes());
        let (stop, stopping) = watch::channel(false);
        let app = app
            .with_state(RestState {
                sessions,
                stopping: stopping.clone(),
                guard,
            })
            .layer(middleware::from_fn_with_state(
                checks,
                crate::rest_guard::guard,
            ))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .into_make_service_with_connect_info::<SocketAddr>();
        let serving = match &options.tls {
            None => SpawnedTask::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(stopped(stopping))
                    .await
            }),
            Some(tls) => {
                use axum::serve::ListenerExt;
                // `tap_io` gives the listener axum's connect info (the client's address).
                let listener =
                    crate::tls::TlsListener::new(listener, tls.acceptor()).tap_io(|_| {});
                SpawnedTask::spawn(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(stopped(stopping))
                        .await
                })
            }
        };
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

/// The user who submitted `job` (`None`: no front door did).
fn owner(job: &JobRecord) -> Option<&str> {
    job.label.as_deref().map(|label| label.user.as_str())
}

/// The refusal of a job `caller` may not see.
fn foreign(id: u64) -> Reply {
    failure(
        StatusCode::FORBIDDEN,
        format!("job {id} belongs to another user"),
    )
}

async fn jobs(
    State(sessions): State<Arc<Sessions>>,
    Extension(caller): Extension<Caller>,
) -> Reply {
    match records(&sessions).await {
        Ok(records) => (
            StatusCode::OK,
            Json(Value::Array(
                records
                    .iter()
                    .filter(|job| caller.may_see(owner(job)))
                    .map(job_json)
                    .collect(),
            )),
        ),
        Err(reply) => reply,
    }
}

async fn job(
    State(sessions): State<Arc<Sessions>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<u64>,
) -> Reply {
    let records = match records(&sessions).await {
        Ok(records) => records,
        Err(reply) => return reply,
    };
    let Some(record) = records.iter().find(|r| r.job == id) else {
        return failure(StatusCode::NOT_FOUND, format!("no job {id}"));
    };
    // Another user's job is not there for this caller.
    if !caller.may_see(owner(record)) {
        return failure(StatusCode::NOT_FOUND, format!("no job {id}"));
    }
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

async fn cancel(
    State(sessions): State<Arc<Sessions>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<u64>,
) -> Reply {
    let Some(driver) = driver(&sessions) else {
        return failure(StatusCode::NOT_FOUND, format!("no job {id}"));
    };
    if !caller.is_admin() {
        match records(&sessions).await {
            Ok(records) => match records.iter().find(|r| r.job == id) {
                None => return failure(StatusCode::NOT_FOUND, format!("no job {id}")),
                Some(record) if !caller.may_see(owner(record)) => return foreign(id),
                Some(_) => {}
            },
            Err(reply) => return reply,
        }
    }
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

/// `POST /api/v1/login`: checks the credentials (a JSON body `{"user", "password"}`, or Basic
/// credentials) and opens a session; its token comes back in the body and in the cookie.
async fn login(
    State(state): State<RestState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let sessions = &state.sessions;
    if !sessions.requires_login() {
        return failure(
            StatusCode::BAD_REQUEST,
            "this server has no user accounts: there is nothing to log in to",
        )
        .into_response();
    }
    let credentials = match basic_credentials(&headers) {
        Some(credentials) => credentials,
        None => credentials_of_json(&body),
    };
    let (user, password) = match credentials {
        Ok(credentials) => credentials,
        Err(message) => return failure(StatusCode::BAD_REQUEST, message).into_response(),
    };
    match sessions.open_from(&user, &password, Some(peer.ip())).await {
        Ok(token) => {
            let role = sessions
                .users()
                .and_then(|users| users.role(&user))
                .map(|role| role.name());
            (
                StatusCode::OK,
                [(header::SET_COOKIE, state.guard.cookie(&token))],
                Json(json!({ "token": token, "user": user, "role": role })),
            )
                .into_response()
        }
        Err(status) => {
            let code = match status.code() {
                tonic::Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
                tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            failure(code, status.message()).into_response()
        }
    }
}

/// `{"user": "...", "password": "..."}`.
pub(crate) fn credentials_of_json(body: &[u8]) -> std::result::Result<(String, String), String> {
    let expected = "expected a JSON body {\"user\": ..., \"password\": ...} or Basic credentials";
    let value: Value = serde_json::from_slice(body).map_err(|_| expected.to_string())?;
    match (value.get("user"), value.get("password")) {
        (Some(Value::String(user)), Some(Value::String(password))) => {
            Ok((user.clone(), password.clone()))
        }
        _ => Err(expected.to_string()),
    }
}

/// `POST /api/v1/logout`: ends the request's session and clears the cookie.
async fn logout(State(state): State<RestState>, headers: HeaderMap) -> axum::response::Response {
    let closed = token_of(&headers).is_some_and(|token| state.sessions.close(&token));
    (
        StatusCode::OK,
        [(header::SET_COOKIE, state.guard.cookie(""))],
        Json(json!({ "logged_out": closed })),
    )
        .into_response()
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
    State(RestState {
        sessions, stopping, ..
    }): State<RestState>,
    Extension(caller): Extension<Caller>,
    token: Option<Extension<SessionToken>>,
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
        move |(sessions, mut seen, first)| {
            let caller = caller.clone();
            let token = token.clone();
            async move {
                if !first {
                    tokio::time::sleep(EVENTS_EVERY).await;
                }
                // A stream opened with a session's token ends with the session (logout, expiry).
                if let Some(Extension(SessionToken(token))) = &token
                    && sessions.user_of_token(token).is_none()
                {
                    return None;
                }
                let mut jobs = records(&sessions).await.unwrap_or_default();
                jobs.retain(|job| caller.may_see(owner(job)));
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
            }
        },
    )
    .flatten()
    .take_until(stopped(stopping))
    .map(Ok);
    Sse::new(changes).keep_alive(KeepAlive::default())
}
