//! The REST API's JSON shapes, pinned: a job run through the driver (local-graph) as
//! `/api/v1/jobs` and `/api/v1/jobs/{id}` show it, with what varies from run to run (times,
//! addresses, byte counts) redacted, against `tests/golden/rest_*.json` (`SLUICE_BLESS=1` rewrites
//! them). A field added, renamed, retyped or dropped fails here first. `/api/v1/events` streams the
//! job's changes to a client subscribed before it ran. On a server with accounts, the API needs
//! credentials, checks Host and Origin, and shows each user only their own jobs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use sluice_engine::catalog::table_at;
use sluice_engine::config::ConfigLayer;
use sluice_engine::{SluiceConfig, SluiceSession};
use sluice_server::rest::{RestEndpoint, RestOptions};
use sluice_server::users::{Users, Verifier};
use sluice_server::{SessionFactory, Sessions};

fn loopback() -> RestOptions {
    RestOptions {
        listen: "127.0.0.1:0".into(),
        ..RestOptions::default()
    }
}

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
    subscribe_with(address, "")
}

/// [`subscribe`] with one more header line (`Name: value\r\n`).
fn subscribe_with(address: &str, header: &str) -> std::net::TcpStream {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /api/v1/events HTTP/1.1\r\nHost: {address}\r\n{header}Connection: close\r\n\r\n"
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
    // A job of stages (not one task, as so small a query would run by default) shows every shape.
    let mut config = SluiceConfig::default();
    let cut = ConfigLayer {
        session: vec![("sluice.single_task_bytes".into(), "0".into())],
        ..Default::default()
    };
    config.apply(cut, "test").unwrap();
    let mut base = SluiceSession::new(&config, runner).unwrap();
    base.register_table(table_at("t", &path).unwrap())
        .await
        .unwrap();
    base.run_sql("set datafusion.execution.target_partitions = 2")
        .await
        .unwrap();
    let sessions = Arc::new(Sessions::new(SessionFactory::new(base)).await.unwrap());
    let rest = RestEndpoint::start(sessions.clone(), &loopback())
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

/// One HTTP request with `headers` (besides Connection: close; a `Host` of the address unless
/// given): the status, the response's head and its JSON body (`Null` when it has none).
fn request(
    address: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, Value) {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        head += &format!("Host: {address}\r\n");
    }
    for (name, value) in headers {
        head += &format!("{name}: {value}\r\n");
    }
    head += &format!("Content-Length: {}\r\n\r\n{body}", body.len());
    stream.write_all(head.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head[9..12].parse().unwrap();
    (
        status,
        head.to_string(),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

fn basic(user: &str) -> String {
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:pw"));
    format!("Basic {encoded}")
}

fn job_ids(jobs: &Value) -> Vec<u64> {
    jobs.as_array()
        .unwrap()
        .iter()
        .map(|job| job["id"].as_u64().unwrap())
        .collect()
}

/// Runs `sql` in `session` as a front door would for `user` (its job labelled with the user): its
/// rows, or its error's text.
async fn run_as(session: &SluiceSession, user: &str, sql: &str) -> Result<usize, String> {
    let statement = session.parse_sql(sql).unwrap().pop().unwrap();
    let planned = session.plan(statement).await.unwrap();
    let label = sluice_runtime::JobLabel {
        tag: format!("test {user}"),
        sql: sql.to_string(),
        user: user.to_string(),
    };
    let stream = session.run_labelled(planned, label).unwrap();
    sluice_engine::session::collect_stream(stream)
        .await
        .map(|output| output.row_count())
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_accounts_the_api_needs_credentials_checks_host_and_origin_and_shows_own_jobs() {
    let verifier = Verifier::new("pw", b"some salt", 64).to_text();
    let users = Users::parse(&format!(
        "ann:{verifier}\nbob:{verifier} writer\nada:{verifier} admin"
    ))
    .unwrap();
    let runner = Arc::new(sluice_runtime::LocalGraphRunner::default());
    let base = SluiceSession::new(&SluiceConfig::default(), runner).unwrap();
    let sessions = Arc::new(
        Sessions::with_users(SessionFactory::new(base), Some(users))
            .await
            .unwrap(),
    );
    let options = RestOptions {
        allowed_hosts: vec!["sluice.test".into()],
        ..loopback()
    };
    let rest = RestEndpoint::start(sessions.clone(), &options)
        .await
        .unwrap();
    let address = rest.address().to_string();
    assert_eq!(run_as(sessions.base(), "ann", "select 1").await, Ok(1));
    assert_eq!(run_as(sessions.base(), "bob", "select 2").await, Ok(1));
    // bob's long query runs while the checks below try to cancel it (dropped with the test if
    // an assertion fails first, which cancels its job).
    let long = {
        let sessions = Arc::clone(&sessions);
        datafusion::common::runtime::SpawnedTask::spawn(async move {
            run_as(
                sessions.base(),
                "bob",
                "select count(distinct value % 1000003) from generate_series(1, 5000000000)",
            )
            .await
        })
    };
    let http = move |method: &'static str, path: String, headers: Vec<(&'static str, String)>| {
        let address = address.clone();
        tokio::task::spawn_blocking(move || {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            request(&address, method, &path, &headers, "")
        })
    };
    let jobs = |user: &str| vec![("Authorization", basic(user))];
    let (status, head, body) = http("GET", "/api/v1/jobs".into(), vec![]).await.unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(
        head.contains("www-authenticate: Bearer realm=\"sluice\""),
        "{head}"
    );
    let (status, _, body) = http("GET", "/metrics".into(), vec![]).await.unwrap();
    assert_eq!(status, 401, "{body}");
    let (status, _, body) = http(
        "GET",
        "/api/v1/jobs".into(),
        vec![("Authorization", "Basic YW5uOndyb25n".into())],
    )
    .await
    .unwrap();
    assert_eq!(
        (status, &body["error"]),
        (401, &json!("wrong user name or password for 'ann'"))
    );
    // The long query is job 3; wait until it runs.
    for _ in 0..100 {
        let (_, _, body) = http("GET", "/api/v1/jobs".into(), jobs("ada"))
            .await
            .unwrap();
        if body
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["id"] == 3 && j["state"] == "running")
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (status, _, body) = http("GET", "/api/v1/jobs".into(), jobs("ann"))
        .await
        .unwrap();
    assert_eq!((status, job_ids(&body)), (200, vec![1]));
    let (status, _, body) = http("GET", "/api/v1/jobs".into(), jobs("bob"))
        .await
        .unwrap();
    assert_eq!((status, job_ids(&body)), (200, vec![2, 3]));
    let (status, _, body) = http("GET", "/api/v1/jobs".into(), jobs("ada"))
        .await
        .unwrap();
    assert_eq!((status, job_ids(&body)), (200, vec![1, 2, 3]));
    let (status, _, body) = http("GET", "/api/v1/jobs/2".into(), jobs("ann"))
        .await
        .unwrap();
    assert_eq!((status, &body["error"]), (404, &json!("no job 2")));
    let (status, _, body) = http("POST", "/api/v1/jobs/3/cancel".into(), jobs("ann"))
        .await
        .unwrap();
    assert_eq!(
        (status, &body["error"]),
        (403, &json!("job 3 belongs to another user"))
    );
    // A foreign Host is refused even for a read with valid credentials; a listed one is served.
    let mut evil = jobs("ada");
    evil.push(("Host", "evil.example:8080".into()));
    let (status, _, body) = http("GET", "/api/v1/jobs".into(), evil).await.unwrap();
    assert_eq!(
        (status, &body["error"]),
        (
            403,
            &json!(
                "this server does not answer to the host 'evil.example:8080' (see --http-allowed-host)"
            )
        )
    );
    let mut listed = jobs("ada");
    listed.push(("Host", "sluice.test".into()));
    let (status, _, _) = http("GET", "/api/v1/jobs".into(), listed).await.unwrap();
    assert_eq!(status, 200);
    // A cancel from another site is refused, even an admin's; from the UI's own origin it runs.
    let mut cross = jobs("ada");
    cross.push(("Origin", "http://evil.example".into()));
    let (status, _, body) = http("POST", "/api/v1/jobs/3/cancel".into(), cross)
        .await
        .unwrap();
    assert_eq!(
        (status, &body["error"]),
        (
            403,
            &json!("a POST from another site (http://evil.example) is refused")
        )
    );
    // Another port of the same host is another site's page.
    let mut other_port = jobs("ada");
    other_port.push(("Origin", "http://127.0.0.1:1".into()));
    let (status, _, _) = http("POST", "/api/v1/jobs/3/cancel".into(), other_port)
        .await
        .unwrap();
    assert_eq!(status, 403);
    let mut same_site = jobs("ada");
    same_site.push(("Sec-Fetch-Site", "same-site".into()));
    let (status, _, _) = http("POST", "/api/v1/jobs/3/cancel".into(), same_site)
        .await
        .unwrap();
    assert_eq!(status, 403);
    let mut same = jobs("ada");
    same.push(("Origin", format!("http://{}", rest.address())));
    same.push(("Sec-Fetch-Site", "same-origin".into()));
    let (status, _, body) = http("POST", "/api/v1/jobs/3/cancel".into(), same)
        .await
        .unwrap();
    assert_eq!((status, &body), (200, &json!({"cancelled": true})));
    let ended = long.join().await.unwrap().unwrap_err();
    assert!(ended.contains("was cancelled (REST API)"), "{ended}");
    // Their event stream shows a user only their own jobs: every job once on connect.
    let events = {
        let address = rest.address().to_string();
        tokio::task::spawn_blocking(move || {
            let header = format!("Authorization: {}\r\n", basic("ann"));
            let mut stream = subscribe_with(&address, &header);
            stream
                .set_read_timeout(Some(std::time::Duration::from_secs(1)))
                .unwrap();
            let mut text = Vec::new();
            // Read until the stream goes quiet for a second (it stays open).
            let _ = stream.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let events = events.await.unwrap();
    let ids: Vec<u64> = events
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(|data| {
            serde_json::from_str::<Value>(data).unwrap()["id"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(ids, vec![1], "{events}");
    // The `sluice` system tables show a user who is not an admin only their own jobs too.
    let ann = sessions.fork().await.unwrap();
    ann.grant(sessions.access_of("ann"));
    let ada = sessions.fork().await.unwrap();
    ada.grant(sessions.access_of("ada"));
    let seen = |session: SluiceSession| async move {
        let outputs = session
            .run_sql("select count(*) as n from sluice.jobs where job_id <= 3")
            .await
            .unwrap();
        arrow::util::pretty::pretty_format_batches(&outputs[0].batches)
            .unwrap()
            .to_string()
    };
    assert_eq!(seen(ann).await, "+---+\n| n |\n+---+\n| 1 |\n+---+");
    assert_eq!(seen(ada).await, "+---+\n| n |\n+---+\n| 3 |\n+---+");

    // A login gives a token and a strict cookie; either one is a credential.
    let login = {
        let address = rest.address().to_string();
        tokio::task::spawn_blocking(move || {
            let body = r#"{"user": "ann", "password": "pw"}"#;
            let headers = [("Content-Type", "application/json")];
            request(&address, "POST", "/api/v1/login", &headers, body)
        })
    };
    let (status, head, body) = login.await.unwrap();
    assert_eq!(
        (status, &body["user"], &body["role"]),
        (200, &json!("ann"), &json!("reader"))
    );
    let token = body["token"].as_str().unwrap().to_string();
    assert!(
        head.contains(&format!(
            "set-cookie: sluice_token={token}; HttpOnly; SameSite=Strict; Path=/"
        )),
        "{head}"
    );
    let (status, _, body) = http(
        "GET",
        "/api/v1/jobs".into(),
        vec![("Cookie", format!("sluice_token={token}"))],
    )
    .await
    .unwrap();
    assert_eq!((status, job_ids(&body)), (200, vec![1]));
    // An event stream opened with the token ends when its session does.
    let stream = {
        let address = rest.address().to_string();
        let token = token.clone();
        tokio::task::spawn_blocking(move || {
            let mut stream = subscribe_with(&address, &format!("Cookie: sluice_token={token}\r\n"));
            let mut text = Vec::new();
            stream.read_to_end(&mut text).map(|_| text.len())
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (status, _, _) = http(
        "POST",
        "/api/v1/logout".into(),
        vec![("Authorization", format!("Bearer {token}"))],
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let (status, _, body) = http(
        "GET",
        "/api/v1/jobs".into(),
        vec![("Authorization", format!("Bearer {token}"))],
    )
    .await
    .unwrap();
    assert_eq!(
        (status, &body["error"]),
        (401, &json!("unknown or expired session token"))
    );
    let read = stream.await.unwrap();
    assert!(
        read.is_ok(),
        "the event stream outlived its session: {read:?}"
    );
    rest.stop().await;
}
