//! `sluice server` with real clients: two servers over TPC-H SF 0.01 (the cluster under test with two
//! worker processes, and local mode as the reference) and the Python suites in `tests/python` run
//! through ADBC's Flight SQL driver and psycopg on the Postgres wire, in a venv this test creates
//! (pinned `requirements.txt`; pip reads the package registry the first time, later runs reuse the
//! venv); `psql` describes the tables.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    PYTHON_DIR, Server, assert_pytest_passes, http, python_clients as python, sluice, tls_files,
    tpch_dir,
};

/// Each TPC-H query as `qNN.sql` (`sluice tpch queries`).
fn query_files() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tpch-queries-sf0.01");
    common::tpch_into("queries", "0.01", &dir);
    let q15 = std::fs::read_to_string(dir.join("q15.sql")).unwrap();
    assert_eq!(q15.matches("\n;\n").count(), 2, "{q15}");
    dir
}

#[test]
fn adbc_psycopg_and_psql_see_the_local_answers_through_a_two_worker_server() {
    let python = python();
    let data = tpch_dir();
    let cluster = Server::start(&["--workers", "2"], data);
    let local = Server::start(&["--mode", "local"], data);
    let dir = tempfile::tempdir().unwrap();
    let users = users_file(dir.path(), "ann", "s3cret");
    // The login tests fail more logins from this address within a minute than the default
    // allows (5); the limit itself is tested by sluice-server's flight_sql tests.
    let guarded = Server::start_in(
        &["--mode", "local"],
        &[
            "--users",
            users.to_str().unwrap(),
            "--max-failed-logins",
            "50",
        ],
        None,
        None,
    );
    assert!(
        guarded
            .started
            .last()
            .unwrap()
            .ends_with("(local mode, 0 tables, login required, 1 users)"),
        "{:?}",
        guarded.started
    );
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(Path::new(PYTHON_DIR).join("test_flight_sql.py"))
        .arg(Path::new(PYTHON_DIR).join("test_postgres.py"))
        .env("SLUICE_FLIGHT_SQL", &cluster.url)
        .env("SLUICE_PG", &cluster.pg)
        .env("SLUICE_PG_LOCAL", &local.pg)
        .env("SLUICE_PG_LOGIN", &guarded.pg)
        .env("SLUICE_FLIGHT_SQL_LOCAL", &local.url)
        .env("SLUICE_FLIGHT_SQL_LOGIN", &guarded.url)
        .env("SLUICE_TPCH_QUERIES", query_files())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "pytest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(summary.starts_with("61 passed"), "{stdout}");
    assert_sql_connect_prints_what_local_prints(&cluster.url, data);
    assert_psql_describes_the_tables(&cluster.pg);
    let stopping = cluster.stop();
    assert!(
        stopping.iter().any(|line| line == "sluice server: stopped"),
        "{stopping:?}"
    );
    local.stop();
    guarded.stop();
}

/// `psql -c '\dt'` lists the eight TPC-H tables and `psql -c '\d lineitem'` its sixteen columns
/// with their types, through the cluster server's `pg_catalog`.
fn assert_psql_describes_the_tables(address: &str) {
    let (host, port) = address.rsplit_once(':').unwrap();
    let psql = |command: &str| -> String {
        let output = Command::new("psql")
            .args([
                "-h", host, "-p", port, "-U", "sluice", "-d", "sluice", "-X", "-c", command,
            ])
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .expect("psql is needed for the client tests (.ci/run installs postgresql-client)");
        assert!(
            output.status.success(),
            "psql -c {command} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };
    let tables = psql("\\dt");
    let listed: Vec<&str> = tables
        .lines()
        .filter_map(|line| line.strip_prefix(" public | "))
        .map(|rest| rest.split('|').next().unwrap().trim())
        .collect();
    assert_eq!(
        listed,
        [
            "customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier"
        ],
        "{tables}"
    );
    assert!(tables.contains("(8 rows)"), "{tables}");
    let lineitem = psql("\\d lineitem");
    assert!(lineitem.contains("Table \"public.lineitem\""), "{lineitem}");
    let columns: Vec<(String, String)> = lineitem
        .lines()
        .filter(|line| line.starts_with(" l_"))
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            (cells[0].to_string(), cells[1].to_string())
        })
        .collect();
    let want = [
        ("l_orderkey", "bigint"),
        ("l_partkey", "bigint"),
        ("l_suppkey", "bigint"),
        ("l_linenumber", "integer"),
        ("l_quantity", "numeric"),
        ("l_extendedprice", "numeric"),
        ("l_discount", "numeric"),
        ("l_tax", "numeric"),
        ("l_returnflag", "text"),
        ("l_linestatus", "text"),
        ("l_shipdate", "date"),
        ("l_commitdate", "date"),
        ("l_receiptdate", "date"),
        ("l_shipinstruct", "text"),
        ("l_shipmode", "text"),
        ("l_comment", "text"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(name, kind)| (name.to_string(), kind.to_string()))
        .collect();
    assert_eq!(columns, want, "{lineitem}");
}

/// `sluice sql --connect` prints the same results as `sluice sql` in this process, and a server
/// error as local mode's one line.
fn assert_sql_connect_prints_what_local_prints(url: &str, data: &Path) {
    let sql = "select n_name, n_regionkey from nation where n_nationkey < 4 order by n_nationkey; \
               select count(*) as n from lineitem";
    let remote = sluice()
        .args(["sql", "--connect", url, sql])
        .output()
        .unwrap();
    let local = sluice()
        .args(["sql", "--data"])
        .arg(data)
        .arg(sql)
        .output()
        .unwrap();
    assert!(
        remote.status.success(),
        "{}",
        String::from_utf8_lossy(&remote.stderr)
    );
    let stdout = String::from_utf8(remote.stdout).unwrap();
    assert_eq!(stdout, String::from_utf8(local.stdout).unwrap());
    assert!(stdout.contains("| ALGERIA   | 0           |"), "{stdout}");
    let failed = sluice()
        .args(["sql", "--connect", url, "select * from no_such_table"])
        .output()
        .unwrap();
    assert!(!failed.status.success());
    assert_eq!(
        String::from_utf8(failed.stderr).unwrap(),
        "error: Error during planning: table 'datafusion.public.no_such_table' not found\n"
    );
}

/// A users file with one account, its verifier made by `sluice hash-password`.
fn users_file(dir: &Path, user: &str, password: &str) -> PathBuf {
    users_file_with(dir, &[(user, password, "")])
}

/// A users file with `(name, password, role)` accounts (an empty role: none given).
fn users_file_with(dir: &Path, accounts: &[(&str, &str, &str)]) -> PathBuf {
    let lines: Vec<String> = accounts
        .iter()
        .map(|(user, password, role)| {
            format!("{user}:{} {role}", verifier_of(password).trim())
                .trim_end()
                .to_string()
        })
        .collect();
    let path = dir.join("users");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// `sluice hash-password`'s verifier of `password`.
fn verifier_of(password: &str) -> String {
    let mut child = sluice()
        .arg("hash-password")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    writeln!(child.stdin.take().unwrap(), "{password}").unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    let verifier = String::from_utf8(output.stdout).unwrap();
    assert!(verifier.starts_with("SCRAM-SHA-256$4096:"), "{verifier}");
    assert!(!verifier.contains(password));
    verifier
}

#[test]
fn large_unread_results_keep_the_servers_memory_within_four_result_buffers() {
    let python = python();
    let server = Server::start_in(&["--mode", "local"], &[], None, None);
    let pid = server.pid().to_string();
    let env = [
        ("SLUICE_LIMITS_FLIGHT_SQL", server.url.as_str()),
        ("SLUICE_LIMITS_PG", server.pg.as_str()),
        ("SLUICE_LIMITS_PID", pid.as_str()),
    ];
    assert_pytest_passes(&python, "test_limits.py", &[], &env, 1);
    server.stop();
}

/// Runs the pytest file `file` of `tests/python` with `env`, asserting that exactly `passed`
/// tests ran and passed.
#[test]
fn roles_decide_what_each_user_reads_and_writes_through_both_doors() {
    let python = python();
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(dir.path().join("out")).unwrap();
    std::fs::write(data.join("t.csv"), "a,b\n1,x\n2,y\n3,z\n").unwrap();
    std::fs::write(dir.path().join("secret.csv"), "s\nhidden\n").unwrap();
    let users = users_file_with(
        dir.path(),
        &[
            ("rita", "s3cret-roles", ""),
            ("wes", "s3cret-roles", "writer"),
            ("ada", "s3cret-roles", "admin"),
        ],
    );
    let out = dir.path().join("out");
    let server = Server::start_in(
        &["--mode", "local"],
        &[
            "--users",
            users.to_str().unwrap(),
            "--write-root",
            out.to_str().unwrap(),
            "--max-failed-logins",
            "50",
        ],
        Some(&data),
        None,
    );
    let canonical = dir.path().canonicalize().unwrap();
    assert!(
        server
            .started
            .contains(&"sluice server: users without a role are readers: rita".to_string()),
        "{:?}",
        server.started
    );
    let roots = format!(
        "sluice server: read roots: {0}/data; write roots: {0}/out",
        canonical.display()
    );
    assert!(server.started.contains(&roots), "{:?}", server.started);
    let env = [
        ("SLUICE_ROLES_FLIGHT_SQL", server.url.as_str()),
        ("SLUICE_ROLES_PG", server.pg.as_str()),
        ("SLUICE_ROLES_DIR", dir.path().to_str().unwrap()),
        ("SLUICE_ROLES_ELSEWHERE", elsewhere.path().to_str().unwrap()),
    ];
    assert_pytest_passes(&python, "test_roles.py", &[], &env, 6);
    server.stop();
}

#[test]
fn a_table_that_cannot_be_read_is_reported_and_left_out() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.csv"), "a\n1\n").unwrap();
    std::fs::write(dir.path().join("bad.parquet"), b"not parquet at all").unwrap();
    let server = Server::start(&["--mode", "local"], dir.path());
    let left_out: Vec<_> = server
        .started
        .iter()
        .filter(|line| line.starts_with("sluice server: table 'bad' left out: table 'bad' ("))
        .collect();
    assert_eq!(left_out.len(), 1, "{:?}", server.started);
    assert!(
        server
            .started
            .last()
            .unwrap()
            .ends_with("(local mode, 1 tables, no login)"),
        "{:?}",
        server.started
    );
    let stopping = server.stop();
    assert_eq!(
        stopping.last().map(String::as_str),
        Some("sluice server: stopped")
    );
}

/// Minutes of work in many short steps (5 billion rows through a shuffle into a distinct count).
const LONG_QUERY: &str =
    "select count(distinct value % 1000003) from generate_series(1, 5000000000)";

/// Tasks running on the driver and on every worker, from the server's state.
fn tasks_running(state: &serde_json::Value) -> u64 {
    let workers: u64 = state["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["running_tasks"].as_u64().unwrap() + w["live_attempts"].as_u64().unwrap())
        .sum();
    state["driver"]["running_tasks"].as_u64().unwrap() + workers
}

/// Polls `state` until no job or task is left on the driver or any worker, failing if that takes
/// more than a second after `what`.
fn assert_idle_within_a_second(state: &dyn Fn() -> serde_json::Value, what: &str) {
    let cancelled = std::time::Instant::now();
    loop {
        let now = state();
        if tasks_running(&now) == 0 && now["driver"]["jobs"] == 0 {
            break;
        }
        assert!(
            cancelled.elapsed() < Duration::from_secs(1),
            "tasks still ran 1 s after {what}: {now}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_remote_cli_shows_the_servers_progress_and_ctrl_c_cancels_its_job_on_every_worker() {
    use std::io::{Read, Write};
    let server = Server::start(&["--workers", "2"], tpch_dir());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let observer = runtime
        .block_on(sluice_server::RemoteSession::connect(&server.url))
        .unwrap();
    let state = || runtime.block_on(observer.state()).unwrap();
    // `script` gives the CLI a terminal, so it draws its progress line; a Ctrl-C byte written to
    // the terminal reaches it as SIGINT.
    let command = format!(
        "{} sql --connect {} '{LONG_QUERY}'",
        env!("CARGO_BIN_EXE_sluice"),
        server.url
    );
    let mut child = Command::new("script")
        .args(["-qfec", &command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("script (util-linux) gives the CLI a terminal");
    let mut stdout = child.stdout.take().unwrap();
    let (send, chunks) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buffer) {
            if n == 0
                || send
                    .send(String::from_utf8_lossy(&buffer[..n]).into_owned())
                    .is_err()
            {
                break;
            }
        }
    });
    let mut seen = String::new();
    let started = std::time::Instant::now();
    while !(seen.contains("job ") && seen.contains(" · tasks ")) {
        assert!(
            started.elapsed().as_secs() < 60,
            "no progress line from the server: {seen:?}"
        );
        if let Ok(chunk) = chunks.recv_timeout(Duration::from_millis(100)) {
            seen.push_str(&chunk);
        }
    }
    let busy = state();
    assert_eq!(busy["running_statements"], 1, "{busy}");
    assert!(tasks_running(&busy) > 0, "{busy}");

    child.stdin.as_mut().unwrap().write_all(b"\x03").unwrap();
    assert_idle_within_a_second(&state, "Ctrl-C");
    let status = child.wait().unwrap();
    reader.join().unwrap();
    seen.extend(chunks.try_iter());
    assert_eq!(status.code(), Some(130), "{seen:?}");
    assert!(seen.contains("cancelled"), "{seen:?}");
    let idle = state();
    assert_eq!(idle["running_statements"], 0, "{idle}");

    // `tpch run` on the server's tables, each result compared with local mode's.
    let tpch = sluice()
        .args([
            "tpch",
            "run",
            "--connect",
            &server.url,
            "--compare-local",
            "-q",
            "1",
            "-q",
            "15",
        ])
        .arg("--data")
        .arg(tpch_dir())
        .output()
        .unwrap();
    let report = String::from_utf8(tpch.stdout).unwrap();
    assert!(tpch.status.success(), "{report}");
    assert!(
        report.starts_with(&format!("TPC-H SF 0.01 · mode server {} · ", server.url)),
        "{report}"
    );
    assert!(report.ends_with("2 passed, 0 failed\n"), "{report}");

    // The shell on the server.
    let command = format!(
        "{} sql --connect {}",
        env!("CARGO_BIN_EXE_sluice"),
        server.url
    );
    let mut shell = Command::new("script")
        .args(["-qfec", &command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Typed only once the prompt shows: input that arrives before the line editor switches the
    // terminal to raw mode may be flushed away with the switch.
    let mut out = shell.stdout.take().unwrap();
    let (send, chunks) = std::sync::mpsc::channel::<String>();
    let relay = std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(n) = out.read(&mut buffer) {
            if n == 0
                || send
                    .send(String::from_utf8_lossy(&buffer[..n]).into_owned())
                    .is_err()
            {
                break;
            }
        }
    });
    let mut text = String::new();
    let started = std::time::Instant::now();
    while !text.contains("sluice> ") {
        assert!(started.elapsed().as_secs() < 60, "no prompt: {text:?}");
        if let Ok(chunk) = chunks.recv_timeout(Duration::from_millis(100)) {
            text.push_str(&chunk);
        }
    }
    // Its stdin stays open until it exits (an end of file `script` sees early may cut the input).
    let mut input = shell.stdin.take().unwrap();
    input.write_all(b"select 41 + 1 as answer;\n").unwrap();
    input.flush().unwrap();
    while !text.contains("| 42     |") {
        assert!(started.elapsed().as_secs() < 120, "no answer: {text:?}");
        if let Ok(chunk) = chunks.recv_timeout(Duration::from_millis(100)) {
            text.push_str(&chunk);
        }
    }
    input.write_all(b"\\q\n").unwrap();
    input.flush().unwrap();
    let status = shell.wait().unwrap();
    drop(input);
    relay.join().unwrap();
    text.extend(chunks.try_iter());
    assert!(status.success(), "{text}");
    assert!(
        text.contains(&format!("connected to {}", server.url)),
        "{text}"
    );
    assert!(text.contains("| 42     |"), "{text}");
    server.stop();
}

#[test]
fn both_front_doors_serve_tls_and_refuse_clients_that_do_not_use_it() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = tls_files(dir.path());
    let server = Server::start_in(
        &["--mode", "local"],
        &[
            "--serve-tls-cert",
            cert.to_str().unwrap(),
            "--serve-tls-key",
            key.to_str().unwrap(),
        ],
        Some(tpch_dir()),
        None,
    );
    assert!(
        server.url.starts_with("grpc+tls://127.0.0.1:"),
        "{}",
        server.url
    );
    assert!(
        server
            .started
            .iter()
            .any(|line| line.starts_with("sluice server: Postgres on")
                && line.ends_with("(no login, TLS only)")),
        "{:?}",
        server.started
    );
    let sql = "select count(*) as n from nation";
    let over_tls = sluice()
        .arg("--server-ca")
        .arg(&ca)
        .args(["sql", "--connect", &server.url, sql])
        .output()
        .unwrap();
    assert!(
        over_tls.status.success(),
        "{}",
        String::from_utf8_lossy(&over_tls.stderr)
    );
    assert!(
        String::from_utf8(over_tls.stdout)
            .unwrap()
            .contains("| 25 |"),
        "the nation count over grpc+tls"
    );
    let without_ca = sluice()
        .args(["sql", "--connect", &server.url, sql])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(without_ca.stderr).unwrap(),
        format!(
            "error: '{}': grpc+tls:// needs the CA certificate that signed the server's \
             (--server-ca FILE)\n",
            server.url
        )
    );
    let plain_url = server.url.replace("grpc+tls://", "grpc://");
    let plain = sluice()
        .args(["sql", "--connect", &plain_url, sql])
        .output()
        .unwrap();
    assert!(!plain.status.success(), "plain gRPC reached a TLS door");

    // ADBC (Go's TLS) checks the same certificate.
    let script = "import sys, adbc_driver_flightsql as a, adbc_driver_flightsql.dbapi as f\n\
                  ca = open(sys.argv[2]).read()\n\
                  conn = f.connect(sys.argv[1], db_kwargs={a.DatabaseOptions.TLS_ROOT_CERTS.value: ca}, autocommit=True)\n\
                  cur = conn.cursor()\n\
                  cur.execute(sys.argv[3])\n\
                  print(cur.fetchall())\n";
    let adbc = Command::new(python())
        .args(["-W", "ignore", "-c", script, &server.url])
        .arg(&ca)
        .arg(sql)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&adbc.stdout),
        "[(25,)]\n",
        "{}",
        String::from_utf8_lossy(&adbc.stderr)
    );

    let (host, port) = server.pg.rsplit_once(':').unwrap();
    let psql = |sslmode: &str| {
        Command::new("psql")
            .arg(format!(
                "host={host} port={port} user=sluice dbname=sluice sslmode={sslmode} \
                 sslrootcert={}",
                ca.display()
            ))
            .args(["-X", "-A", "-t", "-c", sql])
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .expect("psql is needed for the client tests (.ci/run installs postgresql-client)")
    };
    let verified = psql("verify-full");
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stderr)
    );
    assert_eq!(String::from_utf8(verified.stdout).unwrap(), "25\n");
    let clear = psql("disable");
    assert!(!clear.status.success());
    let refused = String::from_utf8(clear.stderr).unwrap();
    assert!(
        refused.contains("this server takes Postgres connections over TLS only"),
        "{refused}"
    );
    server.stop();
}

#[test]
fn the_rest_api_lists_jobs_with_their_attempts_cancels_one_on_every_worker_and_metrics_agree() {
    let server = Server::start(&["--workers", "2"], tpch_dir());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let observer = runtime
        .block_on(sluice_server::RemoteSession::connect(&server.url))
        .unwrap();
    let state = || runtime.block_on(observer.state()).unwrap();
    let (host, port) = server.pg.rsplit_once(':').unwrap();
    let sql = "select n_name from nation where n_regionkey = 1";
    let psql = Command::new("psql")
        .args([
            "-h", host, "-p", port, "-U", "ann", "-d", "sluice", "-X", "-A", "-t", "-c", sql,
        ])
        .output()
        .expect("psql is needed for the client tests (.ci/run installs postgresql-client)");
    assert!(
        psql.status.success(),
        "{}",
        String::from_utf8_lossy(&psql.stderr)
    );
    assert_eq!(String::from_utf8(psql.stdout).unwrap().lines().count(), 5);
    let (status, jobs) = http("GET", &server.http, "/api/v1/jobs");
    assert_eq!(status, 200, "{jobs}");
    let last = jobs.as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["state"], "succeeded", "{jobs}");
    assert_eq!(last["rows"], 5, "{last}");
    assert_eq!(
        last["sql"], "SELECT n_name FROM nation WHERE n_regionkey = 1",
        "{last}"
    );
    assert_eq!(last["user"], "ann", "{last}");
    assert!(
        last["ended_ms"].as_u64() >= last["submitted_ms"].as_u64(),
        "{last}"
    );
    let id = last["id"].as_u64().unwrap();
    let (status, one) = http("GET", &server.http, &format!("/api/v1/jobs/{id}"));
    assert_eq!((status, &one["id"]), (200, &last["id"]), "{one}");
    // Every task attempt of it, all succeeded on the two workers, and per stage their sums.
    let attempts = one["attempts"].as_array().unwrap();
    assert_eq!(
        attempts.len() as u64,
        last["tasks"].as_u64().unwrap(),
        "{one}"
    );
    assert!(
        attempts.iter().all(|a| a["state"] == "succeeded"
            && a["attempt"] == 0
            && a["worker_id"].as_u64().is_some()
            && a["ended_ms"].as_u64() >= a["started_ms"].as_u64()),
        "{one}"
    );
    let stages = one["stage_details"].as_array().unwrap();
    assert_eq!(
        stages.len() as u64,
        last["stages"].as_u64().unwrap(),
        "{one}"
    );
    assert_eq!(stages.last().unwrap()["rows"], 5, "{one}");
    assert!(
        stages
            .iter()
            .all(|s| s["succeeded"] == s["tasks"] && s["attempts"] == s["tasks"]),
        "{one}"
    );

    // A long statement through Flight SQL, cancelled through the API.
    let long = sluice()
        .args(["sql", "--connect", &server.url, LONG_QUERY])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The CLI sends each statement as its parser prints it.
    let sent = "SELECT count(DISTINCT value % 1000003) FROM generate_series(1, 5000000000)";
    let started = std::time::Instant::now();
    let running = loop {
        let (_, jobs) = http("GET", &server.http, "/api/v1/jobs");
        let found = jobs
            .as_array()
            .unwrap()
            .iter()
            .find(|job| job["state"] == "running" && job["sql"] == sent)
            .cloned();
        if let Some(job) = found
            && tasks_running(&state()) > 0
        {
            break job;
        }
        assert!(
            started.elapsed().as_secs() < 30,
            "the long job never ran: {jobs}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        running["tag"]
            .as_str()
            .map(|t| t.starts_with("flight-sql statement ")),
        Some(true)
    );
    let id = running["id"].as_u64().unwrap();
    let (status, detail) = http("GET", &server.http, &format!("/api/v1/jobs/{id}"));
    assert_eq!(status, 200);
    assert_eq!(
        detail["progress"].as_array().map(Vec::len),
        running["stages"].as_u64().map(|n| n as usize),
        "{detail}"
    );
    let (status, body) = http("POST", &server.http, &format!("/api/v1/jobs/{id}/cancel"));
    assert_eq!(
        (status, body),
        (200, serde_json::json!({"cancelled": true}))
    );
    assert_idle_within_a_second(&state, "the cancel");
    let output = long.wait_with_output().unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(!output.status.success());
    assert!(
        stderr.ends_with(&format!("job {id} was cancelled (REST API)\n")),
        "{stderr}"
    );
    let (status, body) = http("POST", &server.http, &format!("/api/v1/jobs/{id}/cancel"));
    assert_eq!(status, 409, "{body}");
    let (_, record) = http("GET", &server.http, &format!("/api/v1/jobs/{id}"));
    assert_eq!(record["state"], "cancelled", "{record}");
    let (status, _) = http("GET", &server.http, "/api/v1/jobs/999999");
    assert_eq!(status, 404);
    let (status, mut workers) = http("GET", &server.http, "/api/v1/workers");
    assert_eq!(status, 200);
    // The heartbeat's age moves between two reads: each worker's is recent, the driver has none.
    let mut shown = state()["workers"].clone();
    for list in [&mut workers, &mut shown] {
        for worker in list.as_array_mut().unwrap() {
            let age = worker
                .as_object_mut()
                .unwrap()
                .remove("last_heartbeat_ms_ago")
                .unwrap();
            match worker["address"].as_str().unwrap() {
                "driver" => assert!(age.is_null(), "{age}"),
                _ => assert!(age.as_u64().unwrap() < 5_000, "{age}"),
            }
            if worker["address"] != "driver" {
                assert!(worker["slots"].as_u64().unwrap() > 0, "{worker}");
            }
        }
    }
    assert_eq!(workers, shown, "the API shows what sluice.state shows");
    assert_metrics_agree_with_the_jobs(&server.http);
    server.stop();
}

/// `/metrics` parses as Prometheus text (prometheus_client's parser) and its counters are what
/// `/api/v1/jobs` says the server's jobs did.
fn assert_metrics_agree_with_the_jobs(http_address: &str) {
    let (status, text) = common::http_text("GET", http_address, "/metrics");
    assert_eq!(status, 200, "{text}");
    let mut parse = Command::new(python())
        .arg(Path::new(PYTHON_DIR).join("parse_metrics.py"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut parse.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let parsed = parse.wait_with_output().unwrap();
    assert!(
        parsed.status.success(),
        "{}\n{text}",
        String::from_utf8_lossy(&parsed.stderr)
    );
    let samples: serde_json::Value = serde_json::from_slice(&parsed.stdout).unwrap();
    // A series a counter has not counted yet may be absent; one that counted must be there.
    let sample = |name: &str| samples[name].as_f64().map(|v| v as u64);
    let counted = |name: &str, expected: u64| {
        assert_eq!(
            sample(name),
            (expected > 0 || sample(name).is_some()).then_some(expected),
            "{name}: {samples}"
        );
    };
    for family in [
        "sluice_jobs_total counter",
        "sluice_tasks_total counter",
        "sluice_job_duration_seconds histogram",
        "sluice_worker_memory_used_bytes gauge",
        "sluice_shuffle_read_bytes_total counter",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family}\n")),
            "{family}: {text}"
        );
    }
    let (_, jobs) = http("GET", http_address, "/api/v1/jobs");
    let jobs = jobs.as_array().unwrap();
    let count = |state: &str| jobs.iter().filter(|j| j["state"] == state).count() as u64;
    assert!(
        count("succeeded") >= 1 && count("cancelled") == 1,
        "{jobs:?}"
    );
    for state in ["succeeded", "failed", "cancelled"] {
        counted(&format!("sluice_jobs_total{{state={state}}}"), count(state));
    }
    let rows: u64 = jobs
        .iter()
        .filter(|j| j["state"] == "succeeded")
        .map(|j| j["rows"].as_u64().unwrap())
        .sum();
    counted("sluice_rows_returned_total{}", rows);
    counted(
        "sluice_job_duration_seconds_count{state=succeeded}",
        count("succeeded"),
    );
    let attempts: Vec<serde_json::Value> = jobs
        .iter()
        .flat_map(|j| {
            let (_, detail) = http("GET", http_address, &format!("/api/v1/jobs/{}", j["id"]));
            detail["attempts"].as_array().unwrap().clone()
        })
        .collect();
    for state in ["succeeded", "failed", "cancelled", "lost"] {
        let ended = attempts.iter().filter(|a| a["state"] == state).count() as u64;
        counted(&format!("sluice_tasks_total{{state={state}}}"), ended);
    }
    assert_eq!(sample("sluice_workers{}"), Some(2), "{samples}");
    assert_eq!(sample("sluice_jobs_running{}"), Some(0), "{samples}");
    assert_eq!(sample("sluice_tasks_running{}"), Some(0), "{samples}");
    let memory_series = samples
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("sluice_worker_memory_used_bytes{worker="))
        .count();
    assert_eq!(
        memory_series, 3,
        "the two workers and the driver's executor: {samples}"
    );
}

#[test]
fn the_web_ui_shows_q5s_stages_and_tasks_and_its_cancel_button_stops_a_long_query() {
    let python = python();
    let chromium = std::env::var("SLUICE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "{chromium}: Debian's chromium is needed for the web UI test (.ci/run installs it)"
    );
    let dir = tempfile::tempdir().unwrap();
    let users = users_file_with(dir.path(), &[("ada", "pw-of-ada", "admin")]);
    let server = Server::start_in(
        &["--workers", "2"],
        &["--users", users.to_str().unwrap()],
        Some(tpch_dir()),
        None,
    );
    // The workspace's target/ui-screenshots (also when CARGO_TARGET_DIR points elsewhere): CI's
    // artifacts.
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/ui-screenshots");
    let _ = std::fs::remove_dir_all(&shots);
    let output = Command::new(&python)
        .arg(Path::new(PYTHON_DIR).join("ui_check.py"))
        .env("SLUICE_HTTP", &server.http)
        .env("SLUICE_FLIGHT_SQL", &server.url)
        .env("SLUICE_TPCH_QUERIES", query_files())
        .env("SLUICE_SCREENSHOTS", &shots)
        .env("SLUICE_CHROMIUM", &chromium)
        .env("SLUICE_UI_USER", "ada")
        .env("SLUICE_UI_PASSWORD", "pw-of-ada")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.trim_end(), "ui ok");
    for shot in ["jobs.png", "job.png"] {
        let size = std::fs::metadata(shots.join(shot)).unwrap().len();
        assert!(size > 10_000, "{shot}: {size} bytes");
    }
    server.stop();
}
