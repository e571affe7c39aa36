//! The REST API's JSON shapes, pinned: a job run through the driver (local-graph) as
//! `/api/v1/jobs` and `/api/v1/jobs/{id}` show it, with what varies from run to run (times,
//! addresses, byte counts) redacted, against `tests/golden/rest_*.json` (`SLUICE_BLESS=1` rewrites
//! them). A field added, renamed, retyped or dropped fails here first. `/api/v1/events` streams the
//! job's changes to a client subscribed before it ran.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use sluice_engine::catalog::table_at;
use sluice_engine::{SluiceConfig, SluiceSession};
use sluice_server::rest::RestEndpoint;
use sluice_server::{SessionFactory, Sessions};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// Replaces what changes between runs: times, addresses, byte counts.
fn redact(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, field) in map.iter_mut() {
                let varies = key.ends_with("_ms")
                    || key.starts_with("task_ms")
                    || key.ends_with("_bytes")
                    || key == "address";
                if varies && !field.is_null() {
                    *field = Value::String(format!("<{key}>"));
                } else {
                    redact(field);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

fn get(address: &str, path: &str) -> Value {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    serde_json::from_str(body).unwrap()
}

/// A connection subscribed to `/api/v1/events`, its reads waiting 10 s at most.
fn subscribe(address: &str) -> std::net::TcpStream {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /api/v1/events HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    stream
}

/// The `job` events of `/api/v1/events` about job `id`, read until one says it succeeded (10 s at
/// most).
fn job_events_until_succeeded(address: &str, id: u64) -> Vec<Value> {
    let mut reader = std::io::BufReader::new(subscribe(address));
    let mut events = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        let read = std::io::BufRead::read_line(&mut reader, &mut line)
            .unwrap_or_else(|e| panic!("no event said job {id} succeeded: {e}; {events:?}"));
        assert!(read > 0, "the event stream ended: {events:?}");
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        let job: Value = serde_json::from_str(data).unwrap();
        if job["id"] == id {
            let done = job["state"] == "succeeded";
            events.push(job);
            if done {
                return events;
            }
        }
    }
}

fn assert_golden(name: &str, mut value: Value) {
    redact(&mut value);
    let text = serde_json::to_string_pretty(&value).unwrap() + "\n";
    let path = golden(name);
    if std::env::var_os("SLUICE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (SLUICE_BLESS=1 writes it)", path.display()));
    assert_eq!(text, expected, "{name} differs from {}", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_shapes_of_the_rest_api_match_their_golden_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    std::fs::write(&path, "a,b\n1,x\n2,y\n3,z\n4,x\n").unwrap();
    let runner = Arc::new(sluice_runtime::LocalGraphRunner::default());
    let mut base = SluiceSession::new(&SluiceConfig::default(), runner).unwrap();
    base.register_table(table_at("t", &path).unwrap())
        .await
        .unwrap();
    base.run_sql("set datafusion.execution.target_partitions = 2")
        .await
        .unwrap();
    let sessions = Arc::new(Sessions::new(SessionFactory::new(base)).await.unwrap());
    let rest = RestEndpoint::start(sessions.clone(), "127.0.0.1:0")
        .await
        .unwrap();
    // Subscribed before the query runs: its events arrive as it changes.
    let address = rest.address().to_string();
    let events = std::thread::spawn(move || job_events_until_succeeded(&address, 2));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let outputs = sessions
        .base()
        .run_sql("select b, count(*) as n from t group by b order by b")
        .await
        .unwrap();
    assert_eq!(outputs[0].row_count(), 3);
    let address = rest.address().to_string();
    // Job 1 is the SET, job 2 the query.
    let (jobs, job) = tokio::task::spawn_blocking(move || {
        (
            get(&address, "/api/v1/jobs"),
            get(&address, "/api/v1/jobs/2"),
        )
    })
    .await
    .unwrap();
    let events = events.join().unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (&last["state"], &last["rows"], &last["tasks_done"]),
        (&json!("succeeded"), &json!(3), &json!(6)),
        "{events:?}"
    );
    for pair in events.windows(2) {
        assert_ne!(pair[0], pair[1], "an event repeats what the last said");
    }
    assert_golden("rest_jobs.json", jobs);
    assert_golden("rest_job.json", job);

    // A subscriber still connected does not hold up the stop: its event stream ends.
    let address = rest.address().to_string();
    let subscriber = std::thread::spawn(move || {
        let mut text = String::new();
        subscribe(&address).read_to_string(&mut text).map(|_| text)
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    tokio::time::timeout(std::time::Duration::from_secs(5), rest.stop())
        .await
        .expect("the stop waited for an event subscriber");
    let text = subscriber
        .join()
        .unwrap()
        .expect("the event stream never ended");
    assert_eq!(text.matches("event: job").count(), 2, "{text}");
}
