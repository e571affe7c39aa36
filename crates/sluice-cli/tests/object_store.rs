//! Tables in an object store, against a real S3 API server: `moto_server` (from a venv this test
//! makes from the pinned `tests/python/requirements-s3.txt`) with credentials checked. Each test
//! starts its own server on a free loopback port; `tests/python/s3_setup.py` makes an IAM user, its
//! key and an S3 policy in the server's first three (unauthenticated) calls, then uploads TPC-H SF
//! 0.01 with boto3 under that key. Sluice gets the key only through the standard `AWS_*`
//! variables of each process, the way a user gives it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{sluice, tpch_dir};

const PYTHON_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python");

/// The venv with moto and boto3, made once per test binary (or again when the pins change).
fn python_bin() -> PathBuf {
    static VENV: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    VENV.get_or_init(|| {
        let requirements_path = Path::new(PYTHON_DIR).join("requirements-s3.txt");
        let requirements = std::fs::read_to_string(&requirements_path).unwrap();
        let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("python-s3");
        let marker = venv.join("sluice-requirements.txt");
        let bin = venv.join("bin");
        if std::fs::read_to_string(&marker).ok().as_deref() == Some(requirements.as_str()) {
            return bin;
        }
        let _ = std::fs::remove_dir_all(&venv);
        let created = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .output()
            .expect("python3 is needed for the object-store tests (.ci/run installs it)");
        assert!(
            created.status.success(),
            "python3 -m venv failed: {}",
            String::from_utf8_lossy(&created.stderr)
        );
        let installed = Command::new(bin.join("python"))
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&requirements_path)
            .output()
            .unwrap();
        assert!(
            installed.status.success(),
            "pip could not install moto and boto3: {}",
            String::from_utf8_lossy(&installed.stderr)
        );
        std::fs::write(&marker, requirements).unwrap();
        bin
    })
    .clone()
}

/// A port nothing listens on (bound, then let go).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running moto S3 server holding bucket `lake` with TPC-H SF 0.01 under `sf0.01/`; dropping it
/// kills the server.
struct S3Server {
    child: Child,
    endpoint: String,
    key_id: String,
    secret: String,
}

impl S3Server {
    fn start() -> Self {
        let bin = python_bin();
        let port = free_port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let child = Command::new(bin.join("moto_server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server from the test venv");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "moto_server did not listen on {endpoint} within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut server = Self {
            child,
            endpoint,
            key_id: String::new(),
            secret: String::new(),
        };
        let setup = Command::new(bin.join("python"))
            .arg(Path::new(PYTHON_DIR).join("s3_setup.py"))
            .args([&server.endpoint, "lake", "sf0.01"])
            .arg(tpch_dir())
            .output()
            .unwrap();
        assert!(
            setup.status.success(),
            "s3_setup.py: {}",
            String::from_utf8_lossy(&setup.stderr)
        );
        let key: serde_json::Value = serde_json::from_slice(&setup.stdout).unwrap();
        server.key_id = key["id"].as_str().unwrap().to_string();
        server.secret = key["secret"].as_str().unwrap().to_string();
        server
    }

    /// `sluice` with this server's endpoint and `secret` in the standard variables.
    fn sluice_with(&self, endpoint: &str, secret: &str) -> Command {
        let mut command = sluice();
        for (name, _) in std::env::vars() {
            if name.starts_with("AWS_") {
                command.env_remove(name);
            }
        }
        command
            .env("AWS_ACCESS_KEY_ID", &self.key_id)
            .env("AWS_SECRET_ACCESS_KEY", secret)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ENDPOINT_URL", endpoint)
            .env("AWS_ALLOW_HTTP", "true");
        command
    }

    fn sluice(&self) -> Command {
        self.sluice_with(&self.endpoint, &self.secret)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `command` and checks it succeeded.
fn ok(mut command: Command) -> Output {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{command:?}:\n{}\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
    output
}

#[test]
fn tpch_read_from_s3_answers_as_the_local_files_do_in_every_mode() {
    let s3 = S3Server::start();
    let queries = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tpch-queries-sf0.01-s3");
    common::tpch_into("queries", "0.01", &queries);
    for query in ["q01.sql", "q03.sql", "q18.sql"] {
        let file = queries.join(query);
        let mut local = sluice();
        local
            .arg("sql")
            .arg("--data")
            .arg(tpch_dir())
            .arg("-f")
            .arg(&file);
        let expected = text(&ok(local).stdout);
        assert!(expected.lines().count() > 3, "{query}: {expected}");
        for mode in ["local", "local-cluster", "cluster"] {
            let mut remote = s3.sluice();
            remote
                .args(["--mode", mode, "sql", "--data", "s3://lake/sf0.01/", "-f"])
                .arg(&file);
            assert_eq!(text(&ok(remote).stdout), expected, "{query} in {mode} mode");
        }
    }
    // Every query on two worker processes, each of which reads the store with its own
    // environment, against local mode over the same objects.
    let mut run = s3.sluice();
    run.args([
        "--mode",
        "cluster",
        "--workers",
        "2",
        "tpch",
        "run",
        "--data",
        "s3://lake/sf0.01",
        "--compare-local",
    ]);
    let stdout = text(&ok(run).stdout);
    assert!(stdout.contains("22 passed, 0 failed"), "{stdout}");
    assert!(stdout.contains("TPC-H SF 0.01"), "{stdout}");
}

#[test]
fn a_quoted_url_or_path_is_a_table() {
    let s3 = S3Server::start();
    let local_file = tpch_dir().join("nation").join("part-0.parquet");
    let sql = format!(
        "select (select count(*) from 's3://lake/sf0.01/nation/') as remote, \
                (select count(*) from '{}') as local",
        local_file.display()
    );
    let mut command = s3.sluice();
    command.args(["sql", "--format", "csv", &sql]);
    let output = ok(command);
    assert_eq!(text(&output.stdout), "remote,local\n25,25\n");
}

/// Runs `command`, which must fail within 10 s printing one `error:` line that names `url`.
fn assert_fails_naming(mut command: Command, url: &str, secrets: &[&str]) -> String {
    let started = Instant::now();
    let output = command.output().unwrap();
    let elapsed = started.elapsed();
    let err = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{command:?}: {err}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}: {err}");
    let lines: Vec<_> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(url), "{url} not in: {err}");
    for secret in secrets {
        assert!(!err.contains(secret), "a secret in: {err}");
    }
    err
}

#[test]
fn refused_keys_unknown_buckets_and_closed_ports_are_one_line_naming_the_url() {
    let s3 = S3Server::start();
    let wrong = "wrong-secret-value-1234";
    let url = "s3://lake/sf0.01/nation/";
    let mut refused = s3.sluice_with(&s3.endpoint, wrong);
    refused.args(["sql", "--table", &format!("t={url}"), "select 1"]);
    let err = assert_fails_naming(refused, url, &[wrong, &s3.secret]);
    assert!(
        err.contains("403") || err.contains("Forbidden") || err.contains("signature"),
        "{err}"
    );

    let missing = "s3://no-such-bucket/data/";
    let mut unknown = s3.sluice();
    unknown.args(["sql", "--table", &format!("t={missing}"), "select 1"]);
    let err = assert_fails_naming(unknown, missing, &[&s3.secret]);
    assert!(err.contains("404") || err.contains("NoSuchBucket"), "{err}");

    let closed = format!("http://127.0.0.1:{}", free_port());
    let mut unreachable = s3.sluice_with(&closed, &s3.secret);
    unreachable.args(["sql", "--data", "s3://lake/sf0.01/", "select 1"]);
    assert_fails_naming(unreachable, "s3://lake/sf0.01/", &[&s3.secret]);
}

#[test]
fn the_secret_appears_in_no_output_log_or_explain() {
    let s3 = S3Server::start();
    let mut command = s3.sluice();
    command.env("SLUICE_LOG", "debug").args([
        "--mode",
        "cluster",
        "--workers",
        "2",
        "sql",
        "--data",
        "s3://lake/sf0.01/",
        "explain analyze select sum(n_nationkey) from nation; \
             explain select * from lineitem; select count(*) from 's3://lake/sf0.01/region/'",
    ]);
    let output = ok(command);
    let all = format!("{}{}", text(&output.stdout), text(&output.stderr));
    // The plans name the objects they read; the scan ran on the workers and read every row.
    assert!(all.contains("sf0.01/lineitem/part-0.parquet"), "{all}");
    assert!(all.contains("scanned: 25 rows"), "{all}");
    assert!(all.contains("| 5 "), "{all}");
    assert!(!all.contains(&s3.secret), "the secret in the output");
    let mut config = s3.sluice();
    config.arg("config");
    let output = ok(config);
    assert!(!text(&output.stdout).contains(&s3.secret));
    assert!(!text(&output.stdout).contains(&s3.key_id));
}

#[test]
fn tpch_gen_create_external_table_and_copy_write_to_the_store() {
    let s3 = S3Server::start();
    let mut generate = s3.sluice();
    generate.args(["tpch", "gen", "--scale", "0.01", "--out", "s3://lake/gen"]);
    let output = ok(generate);
    assert!(
        text(&output.stderr).contains(" files to s3://lake/gen"),
        "{}",
        text(&output.stderr)
    );
    let mut run = s3.sluice();
    run.args([
        "--mode",
        "local-cluster",
        "tpch",
        "run",
        "--data",
        "s3://lake/gen",
        "-q",
        "1",
        "-q",
        "6",
        "--compare-local",
    ]);
    let stdout = text(&ok(run).stdout);
    assert!(stdout.contains("TPC-H SF 0.01"), "{stdout}");
    assert!(stdout.contains("2 passed, 0 failed"), "{stdout}");
    for mode in ["local", "cluster"] {
        let sql = format!(
            "CREATE EXTERNAL TABLE r STORED AS PARQUET LOCATION 's3://lake/gen/region/'; \
             COPY (select r_regionkey, r_name from r where r_regionkey < 3) \
               TO 's3://lake/out-{mode}/' STORED AS CSV; \
             select count(*) as n, sum(r_regionkey) as s from 's3://lake/out-{mode}/'"
        );
        let mut command = s3.sluice();
        command.args(["--mode", mode, "sql", "--format", "csv", &sql]);
        let stdout = text(&ok(command).stdout);
        assert!(stdout.ends_with("n,s\n3,3\n"), "{mode}: {stdout}");
    }
}
