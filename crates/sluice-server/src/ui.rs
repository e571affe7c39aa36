//! The web UI of `sluice server`, served by the REST endpoint: three files compiled into the binary
//! (`ui/index.html`, `ui/app.js`, `ui/app.css`; no build step, nothing fetched from elsewhere) that
//! draw the REST API's JSON.
//!
//! ```text
//!  /              index.html ─► app.js ─┬─ #/          jobs (newest 500, live progress, 1 s refresh)
//!  /ui/app.js                           ├─ #/jobs/ID   job: stage DAG (SVG), task timeline per worker
//!  /ui/app.css                          │              (SVG Gantt), skew per stage, cancel button
//!                                       └─ #/workers   workers: running tasks, outputs, memory
//! ```
//!
//! Invariant: the UI only reads the REST API and posts its cancel; it holds no state of its own.

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;

const INDEX: &str = include_str!("ui/index.html");
const APP_JS: &str = include_str!("ui/app.js");
const APP_CSS: &str = include_str!("ui/app.css");

/// The UI's routes, to merge into the REST endpoint's router.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|| file("text/html; charset=utf-8", INDEX)))
        .route("/ui/", get(|| file("text/html; charset=utf-8", INDEX)))
        .route(
            "/ui/app.js",
            get(|| file("text/javascript; charset=utf-8", APP_JS)),
        )
        .route(
            "/ui/app.css",
            get(|| file("text/css; charset=utf-8", APP_CSS)),
        )
}

async fn file(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    ([(CONTENT_TYPE, content_type)], body)
}
