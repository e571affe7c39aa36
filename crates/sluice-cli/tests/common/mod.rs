//! Helpers of the CLI's end-to-end tests: the built binary without the caller's `SLUICE_*`
//! environment, and TPC-H data generated once per test binary.
#![allow(dead_code)]

pub mod s3;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{OnceLock, mpsc};
use std::time::Duration;

/// The `sluice` binary with no `SLUICE_*` variable of this process and no backtraces; its jobs are
/// cut into stages however little they read ([`CUT_EVERY_JOB`]).
pub fn sluice() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    command.env_remove("RUST_BACKTRACE");
    without_sluice_env(&mut command);
    command.env(CUT_EVERY_JOB.0, CUT_EVERY_JOB.1);
    command
}

/// The environment setting under which the tests' small jobs still run as stages of tasks (not as
/// one task, `sluice.single_task_bytes`), so they exercise the distributed path. A test of
/// single-task jobs removes it or overrides it with `--set`.
pub const CUT_EVERY_JOB: (&str, &str) = ("SLUICE_SET", "sluice.single_task_bytes=0");

/// `command` without the `SLUICE_*` variables of this process.
pub fn without_sluice_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars() {
        if name.starts_with("SLUICE_") {
            command.env_remove(name);
        }
    }
    command
}

/// The Python suites and helpers of the CLI's tests.
pub const PYTHON_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python");

/// The python of the venv with the pinned clients (`python/requirements.txt`), created (or
/// refreshed when the requirements change) once per test binary. Tests of one binary run in
/// parallel threads: the first makes it while the others wait (two `python3 -m venv` into one
/// directory at once break each other's `ensurepip`).
pub fn python_clients() -> PathBuf {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        pinned_venv(
            "python-clients",
            &Path::new(PYTHON_DIR).join("requirements.txt"),
        )
        .join("python")
    })
    .clone()
}

/// Runs the pytest suite `file` (with `args`, and `env` set) and checks that exactly its summary
/// starts with `passed` passed.
pub fn assert_pytest_passes(
    python: &Path,
    file: &str,
    args: &[&str],
    env: &[(&str, &str)],
    passed: usize,
) {
    let output = Command::new(python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(Path::new(PYTHON_DIR).join(file))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "pytest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(summary.starts_with(&format!("{passed} passed")), "{stdout}");
}

/// Runs `sluice tpch <command> --scale <scale> --out <dir>` (`gen` or `queries`) and checks it
/// succeeded.
pub fn tpch_into(command: &str, scale: &str, dir: &Path) {
    let output = sluice()
        .args(["tpch", command, "--scale", scale, "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "sluice tpch {command}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The `bin` directory of a venv in Cargo's tmp dir named `name`, with the pinned packages of
/// `requirements` installed; made again only when the pins change. Callers make it once per test
/// binary (two `python3 -m venv` into one directory at once break each other's `ensurepip`).
pub fn pinned_venv(name: &str, requirements: &Path) -> PathBuf {
    let pins = std::fs::read_to_string(requirements).unwrap();
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let marker = venv.join("sluice-requirements.txt");
    let bin = venv.join("bin");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(pins.as_str()) {
        return bin;
    }
    let _ = std::fs::remove_dir_all(&venv);
    let created = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .expect("python3 is needed for the Python-driven tests (.ci/run installs it)");
    assert!(
        created.status.success(),
        "python3 -m venv failed (Debian: apt-get install python3-venv): {}",
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
        .arg(requirements)
        .output()
        .unwrap();
    assert!(
        installed.status.success(),
        "pip could not install {}: {}",
        requirements.display(),
        String::from_utf8_lossy(&installed.stderr)
    );
    std::fs::write(&marker, pins).unwrap();
    bin
}

/// TPC-H SF 0.01, generated once per test binary into Cargo's tmp dir.
pub fn tpch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tpch-sf0.01-{}", env!("CARGO_CRATE_NAME")));
        tpch_into("gen", "0.01", &dir);
        dir
    })
}

/// TPC-H SF 0.1, generated once per test binary into Cargo's tmp dir.
pub fn sf01_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tpch-sf0.1-{}", env!("CARGO_CRATE_NAME")));
        tpch_into("gen", "0.1", &dir);
        dir
    })
}

/// A running `sluice server`; dropping it sends SIGTERM and waits for it to stop.
pub struct Server {
    child: Child,
    pub url: String,
    /// `host:port` of its Postgres endpoint.
    pub pg: String,
    /// `host:port` of its REST API.
    pub http: String,
    /// What it printed up to its Flight SQL line (included).
    pub started: Vec<String>,
    lines: mpsc::Receiver<String>,
    /// The thread forwarding its stderr (ends when the server's stderr closes).
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(flags: &[&str], data: &Path) -> Server {
        Self::start_in(flags, &[], Some(data), None)
    }

    /// A server with `flags` before `server` and `server_flags` after it, the tables of `data`, and
    /// `dir` as its working directory (relative paths in SQL resolve there).
    pub fn start_in(
        flags: &[&str],
        server_flags: &[&str],
        data: Option<&Path>,
        dir: Option<&Path>,
    ) -> Server {
        Self::start_with_env(flags, server_flags, data, dir, &[])
    }

    /// [`Server::start_in`] with `env` set for the server.
    // The child is waited for by `stop` or `Drop`.
    #[allow(clippy::zombie_processes)]
    pub fn start_with_env(
        flags: &[&str],
        server_flags: &[&str],
        data: Option<&Path>,
        dir: Option<&Path>,
        env: &[(&str, &str)],
    ) -> Server {
        let mut command = sluice();
        command
            .envs(env.iter().copied())
            .args(flags)
            .args(["server", "--flight-sql-listen", "127.0.0.1:0"])
            .args(["--pg-listen", "127.0.0.1:0"])
            .args(["--http-listen", "127.0.0.1:0"])
            .args(server_flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(data) = data {
            command.arg("--data").arg(data);
        }
        if let Some(dir) = dir {
            command.current_dir(dir);
        }
        let mut child = command.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (send, lines) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
        let mut seen = Vec::new();
        loop {
            let line = lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no Flight SQL line from the server; it said {seen:?}"));
            seen.push(line.clone());
            if let Some(rest) = line.strip_prefix("sluice server: Flight SQL on ") {
                let url = rest.split_whitespace().next().unwrap().to_string();
                let pg = seen
                    .iter()
                    .find_map(|l| l.strip_prefix("sluice server: Postgres on postgres://"))
                    .and_then(|rest| rest.split_whitespace().next())
                    .unwrap_or_else(|| panic!("no Postgres line from the server: {seen:?}"))
                    .to_string();
                let http = seen
                    .iter()
                    .find_map(|l| {
                        l.strip_prefix("sluice server: REST API on http://")
                            .or_else(|| l.strip_prefix("sluice server: REST API on https://"))
                    })
                    .and_then(|rest| rest.split('/').next())
                    .unwrap_or_else(|| panic!("no REST line from the server: {seen:?}"))
                    .to_string();
                return Server {
                    child,
                    url,
                    pg,
                    http,
                    started: seen,
                    lines,
                    reader: Some(reader),
                };
            }
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then the lines it printed while stopping.
    pub fn stop(mut self) -> Vec<String> {
        let pid = self.child.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(killed.success());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the server exited with {status}");
        if let Some(reader) = self.reader.take() {
            // Every line it printed, up to the last one.
            let _ = reader.join();
        }
        self.lines.try_iter().collect()
    }
}

impl Drop for Server {
    /// A test that fails leaves no server (or its workers) behind.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and one certificate for `localhost` / `127.0.0.1` signed by it, as PEM files in `dir`:
/// (cert, key, ca).
pub fn tls_files(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    // Distinct names: OpenSSL (psql) takes a certificate whose issuer is its own subject for a
    // self-signed one, and rcgen gives every certificate the same default name.
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "Sluice test CA");
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let paths = (
        dir.join("node.pem"),
        dir.join("node.key"),
        dir.join("ca.pem"),
    );
    std::fs::write(&paths.0, cert.pem()).unwrap();
    std::fs::write(&paths.1, key.serialize_pem()).unwrap();
    std::fs::write(&paths.2, ca_cert.pem()).unwrap();
    paths
}

/// One HTTP/1.1 request to `address` (`host:port`): the status code and the JSON body.
pub fn http(method: &str, address: &str, path: &str) -> (u16, serde_json::Value) {
    let (status, body) = http_text(method, address, path);
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    (status, json)
}

/// `method path` on the HTTP endpoint at `address`: the status and the body as text.
pub fn http_text(method: &str, address: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

/// The `sluice worker` processes whose parent is `parent`.
pub fn worker_pids(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(stat), Ok(cmdline)) = (
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
            std::fs::read(format!("/proc/{pid}/cmdline")),
        ) else {
            continue;
        };
        let Some((_, after_name)) = stat.rsplit_once(')') else {
            continue;
        };
        let ppid = after_name.split_whitespace().nth(1);
        let is_worker = cmdline.split(|b| *b == 0).any(|arg| arg == b"worker");
        if ppid == Some(parent.to_string().as_str()) && is_worker {
            pids.push(pid);
        }
    }
    pids.sort();
    pids
}

/// Sends signal `name` (`KILL`, `INT`, ...) to `pid`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}
