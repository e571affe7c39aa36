//! A real S3 API server for the tests: `moto_server` from a venv made from the pinned
//! `tests/python/requirements-s3.txt`, with credentials checked. `tests/python/s3_setup.py` makes an
//! IAM user, its key and an S3 policy in the server's first three (unauthenticated) calls, then
//! uploads a local directory with boto3 under that key. Sluice gets the key only through the
//! standard `AWS_*` variables of each process, the way a user gives it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::sluice;

const PYTHON_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python");

/// The venv's `bin` with moto and boto3, made once per test binary.
pub fn python_bin() -> PathBuf {
    static VENV: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    VENV.get_or_init(|| {
        super::pinned_venv(
            "python-s3",
            &Path::new(PYTHON_DIR).join("requirements-s3.txt"),
        )
    })
    .clone()
}

/// A port nothing listens on (bound, then let go).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running moto S3 server holding bucket `lake` with one uploaded directory; dropping it kills
/// the server.
pub struct S3Server {
    child: Child,
    pub endpoint: String,
    pub key_id: String,
    pub secret: String,
}

impl S3Server {
    /// A server on a free loopback port with TPC-H SF 0.01 under `s3://lake/sf0.01/`.
    pub fn start() -> Self {
        Self::start_in(&[], "127.0.0.1", free_port(), super::tpch_dir(), "sf0.01")
    }

    /// A server started (and set up) through the command prefix `wrap` (such as `ip netns exec
    /// NS`), listening on `host:port`, with `local` uploaded under `s3://lake/PREFIX/`.
    pub fn start_in(wrap: &[&str], host: &str, port: u16, local: &Path, prefix: &str) -> Self {
        let bin = python_bin();
        let endpoint = format!("http://{host}:{port}");
        let wrapped = |program: PathBuf| {
            let mut command = match wrap.split_first() {
                Some((first, rest)) => {
                    let mut command = Command::new(first);
                    command.args(rest).arg(program);
                    command
                }
                None => Command::new(program),
            };
            command.env_remove("RUST_BACKTRACE");
            command
        };
        let child = wrapped(bin.join("moto_server"))
            .args(["-H", host, "-p", &port.to_string()])
            .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server from the test venv");
        let mut server = Self {
            child,
            endpoint,
            key_id: String::new(),
            secret: String::new(),
        };
        // The setup's first call waits for the server (boto3 retries a refused connection only
        // briefly, so poll first).
        let started = Instant::now();
        loop {
            let probe = wrapped(bin.join("python"))
                .args([
                    "-c",
                    &format!("import socket; socket.create_connection(('{host}', {port}), 1)"),
                ])
                .output()
                .unwrap();
            if probe.status.success() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "moto_server did not listen on {} within 60 s",
                server.endpoint
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let setup = wrapped(bin.join("python"))
            .arg(Path::new(PYTHON_DIR).join("s3_setup.py"))
            .args([&server.endpoint, "lake", prefix])
            .arg(local)
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

    /// The standard variables that point a process at this server with `secret`.
    pub fn env_with(&self, endpoint: &str, secret: &str) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", self.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", secret.to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ENDPOINT_URL", endpoint.to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
        ]
    }

    /// `sluice` with this server's endpoint and `secret` in the standard variables (and no other
    /// `AWS_*` variable of the caller's).
    pub fn sluice_with(&self, endpoint: &str, secret: &str) -> Command {
        let mut command = sluice();
        for (name, _) in std::env::vars() {
            if name.starts_with("AWS_") {
                command.env_remove(name);
            }
        }
        command.envs(self.env_with(endpoint, secret));
        command
    }

    /// Every key of bucket `lake` and, with `parquet`, the hive-partitioned lineitem dataset under
    /// that prefix per return flag, as boto3 and pyarrow see them (`tests/python/s3_inspect.py`).
    #[allow(dead_code)] // not every test binary reads the bucket back
    pub fn inspect(&self, parquet: Option<&str>) -> serde_json::Value {
        let output = Command::new(python_bin().join("python"))
            .arg(Path::new(PYTHON_DIR).join("s3_inspect.py"))
            .args([&self.endpoint, &self.key_id, &self.secret, "lake"])
            .args(parquet)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "s3_inspect.py: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).unwrap()
    }

    /// Waits until a write staged an object, or started a multipart upload of one, under a
    /// `.sluice-staging/` prefix of bucket `lake` (`tests/python/s3_wait_staged.py`, listing every
    /// 20 ms for at most 60 s).
    #[allow(dead_code)] // not every test binary writes
    pub fn wait_staged(&self) {
        let output = Command::new(python_bin().join("python"))
            .arg(Path::new(PYTHON_DIR).join("s3_wait_staged.py"))
            .args([&self.endpoint, &self.key_id, &self.secret, "lake"])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "s3_wait_staged.py: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// `sluice` pointed at this server with its key.
    pub fn sluice(&self) -> Command {
        self.sluice_with(&self.endpoint, &self.secret)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tests/python/delta_fixture.py ARGS` with Python `deltalake` (with `env` added) and
/// returns the JSON it printed.
pub fn delta_fixture(args: &[&str], env: &[(&str, String)]) -> serde_json::Value {
    let output = Command::new(python_bin().join("python"))
        .arg(Path::new(PYTHON_DIR).join("delta_fixture.py"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "delta_fixture.py {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}
