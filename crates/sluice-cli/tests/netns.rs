//! A cluster across network namespaces (`scripts/netns-cluster.sh`): a driver and 3 external
//! workers, each in a namespace of its own with its own address and a private `/tmp`, every link
//! limited to 200 Mbit/s, TPC-H q1–q22 at SF 0.1 with `--compare-local` while the network fails:
//! one worker cut off for 6 s (under its driver timeout of 10 s: it is declared lost, comes back
//! and joins again), for 15 s (over it: it exits), and two workers cut from each other for 8 s
//! while both reach the driver (neither is lost; the run says which read failed and what was
//! retried).
//!
//! A fourth runs the 22 queries over TPC-H SF 0.1 in an S3 API server (moto, in the driver's
//! namespace on the bridge) whose only copy of the data it is: every worker reads the objects with
//! the key from its own environment, and every answer equals, to the character, local mode's over
//! the files the objects were uploaded from, computed before those were deleted.
//!
//! These tests need root (network namespaces, veth, tc, mount): CI runs as root. Without it they
//! fail, saying so. They run one at a time (one lock), each with namespaces of its own prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::sf01_dir;

/// One scenario at a time: each starts 4 processes with their own heartbeats on 2 cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The longest a run may take (a clean one takes about 15 s here).
const RUN_LIMIT: Duration = Duration::from_secs(240);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/netns-cluster.sh")
}

fn require_root() {
    let uid = Command::new("id").arg("-u").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&uid.stdout).trim(),
        "0",
        "the network-namespace tests need root (ip netns, tc, mount); CI runs them as root"
    );
}

/// The namespaces of one scenario; dropping it removes them and stops what runs in them.
struct Netns {
    prefix: String,
    state: PathBuf,
}

impl Netns {
    fn up(prefix: &str, workers: usize) -> Netns {
        let netns = Netns::links_only(prefix, workers);
        netns.start_workers(workers, &[]);
        netns
    }

    /// The namespaces and links, no worker yet.
    fn links_only(prefix: &str, workers: usize) -> Netns {
        require_root();
        // Generated before the workers start: they wait for their driver at most 10 s.
        sf01_dir();
        let state = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("netns-{prefix}"));
        let netns = Netns {
            prefix: prefix.to_string(),
            state,
        };
        netns.ok(&["up", &workers.to_string(), "--rate", "200mbit"]);
        netns
    }

    /// Starts the workers with `env` added to their environment.
    fn start_workers(&self, workers: usize, env: &[(&str, String)]) {
        let output = self
            .command(&["workers", &workers.to_string()])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "netns-cluster.sh workers: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(script());
        command
            .args(args)
            .env("NETNS_PREFIX", &self.prefix)
            .env("STATE", &self.state)
            .env("SLUICE_BIN", env!("CARGO_BIN_EXE_sluice"))
            .env_remove("RUST_BACKTRACE");
        for (name, _) in std::env::vars() {
            if name.starts_with("SLUICE_") && name != "SLUICE_BIN" {
                command.env_remove(name);
            }
        }
        // Jobs cut into stages, so workers read from each other across the namespaces.
        command.env(common::CUT_EVERY_JOB.0, common::CUT_EVERY_JOB.1);
        command
    }

    fn ok(&self, args: &[&str]) -> Output {
        let output = self.command(args).output().unwrap();
        assert!(
            output.status.success(),
            "netns-cluster.sh {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }

    fn log(&self, worker: usize) -> String {
        std::fs::read_to_string(self.state.join(format!("worker-{worker}.log"))).unwrap_or_default()
    }

    /// Waits until every worker printed its join line.
    fn wait_joined(&self, workers: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while (1..=workers).any(|i| !self.log(i).contains(") joined the driver at ")) {
            assert!(
                Instant::now() < deadline,
                "workers did not join within 60 s: {:?}",
                (1..=workers).map(|i| self.log(i)).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts `sluice tpch run` over SF 0.1 (q1–q22, `iterations` times, compared with local
    /// mode) as the driver.
    fn start_run(&self, iterations: usize) -> Run {
        self.start_run_over(
            sf01_dir().to_str().unwrap(),
            iterations,
            &["--compare-local"],
            &[],
        )
    }

    /// Starts `sluice tpch run --data DATA` (`iterations` times, checked by `check`: for example
    /// `--compare-local`) as the driver, with `env` added to its environment.
    fn start_run_over(
        &self,
        data: &str,
        iterations: usize,
        check: &[&str],
        env: &[(&str, String)],
    ) -> Run {
        let iterations = iterations.to_string();
        let mut args = vec![
            "driver",
            "tpch",
            "run",
            "--data",
            data,
            "--iterations",
            &iterations,
        ];
        args.extend_from_slice(check);
        let mut child = self
            .command(&args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = collect(child.stdout.take().unwrap(), false);
        let stderr = collect(child.stderr.take().unwrap(), true);
        Run {
            child,
            started: Instant::now(),
            stdout,
            stderr,
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.command(&["down"]).output();
    }
}

/// Reads a pipe to its end on a thread of its own (echoing stderr, for the test's log).
fn collect(pipe: impl std::io::Read + Send + 'static, echo: bool) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(pipe).lines().map_while(|l| l.ok()) {
            if echo {
                eprintln!("[driver] {line}");
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    })
}

struct Run {
    child: Child,
    started: Instant,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
}

impl Run {
    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits for the run's end (at most [`RUN_LIMIT`]): its exit success, stdout and stderr.
    fn finish(mut self) -> (bool, String, String) {
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if self.started.elapsed() > RUN_LIMIT {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the run did not end within {} s", RUN_LIMIT.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let stdout = self.stdout.join().unwrap();
        let stderr = self.stderr.join().unwrap();
        (status.success(), stdout, stderr)
    }
}

/// Asserts the run answered all 22 queries with local mode's rows.
fn assert_all_answered(success: bool, stdout: &str, stderr: &str) {
    assert!(
        success && stdout.contains("22 passed, 0 failed"),
        "the run failed:\n{stdout}\n{stderr}"
    );
    assert_eq!(
        stdout.matches("same as local").count(),
        22,
        "every query equals local mode:\n{stdout}"
    );
}

/// Cuts worker 1 off for `cut` once all joined and the run is 2 s in, then heals it; returns the
/// finished run.
fn run_with_worker_cut(netns: &Netns, cut: Duration) -> (bool, String, String) {
    // A clean run of 22 queries takes 2-4 s per iteration here: enough iterations that the run
    // outlasts the 2 s wait and the cut even at the faster pace.
    let iterations = cut.as_secs() as usize / 2 + 4;
    let mut run = netns.start_run(iterations);
    netns.wait_joined(3);
    std::thread::sleep(Duration::from_secs(2));
    netns.ok(&["cut", "1"]);
    std::thread::sleep(cut);
    assert!(
        run.running(),
        "the run ended before the cut was healed: make it longer"
    );
    netns.ok(&["heal", "1"]);
    run.finish()
}

#[test]
fn netns_cluster_answers_every_query_with_a_worker_cut_off_for_6s() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let netns = Netns::up("sln6", 3);
    let (success, stdout, stderr) = run_with_worker_cut(&netns, Duration::from_secs(6));
    assert_all_answered(success, &stdout, &stderr);
    // The driver gave it up after its heartbeat timeout (3 s); the worker, still within its own
    // driver timeout (10 s), came back, was told so, and joined again.
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("(10.231.0.11:") && l.contains(") lost")),
        "the cut worker was declared lost:\n{stderr}"
    );
    let log = netns.log(1);
    assert!(
        log.contains("declared this worker lost")
            && log.matches(") joined the driver at ").count() >= 2,
        "the cut worker joined again after the cut:\n{log}"
    );
}

#[test]
fn netns_cluster_answers_every_query_when_a_worker_cut_off_for_15s_exits() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let netns = Netns::up("sln15", 3);
    let (success, stdout, stderr) = run_with_worker_cut(&netns, Duration::from_secs(15));
    assert_all_answered(success, &stdout, &stderr);
    let log = netns.log(1);
    assert!(
        log.contains("sluice worker exits: the driver at 10.231.0.1:50050 did not answer for"),
        "the worker cut off past its driver timeout exited:\n{log}"
    );
}

#[test]
fn netns_cluster_keeps_two_workers_cut_from_each_other_for_8s() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let netns = Netns::up("slnp", 3);
    let mut run = netns.start_run(4);
    netns.wait_joined(3);
    std::thread::sleep(Duration::from_secs(2));
    netns.ok(&["cut-pair", "1", "2"]);
    std::thread::sleep(Duration::from_secs(8));
    assert!(
        run.running(),
        "the run ended before the cut was healed: make it longer"
    );
    netns.ok(&["heal-pair", "1", "2"]);
    let (success, stdout, stderr) = run.finish();
    assert_all_answered(success, &stdout, &stderr);
    // The run says which read failed and what was retried: a read made again within the fetch
    // retry window, or a task retried with the unreachable worker kept.
    let retried_read = stderr.contains("succeeded when made again");
    let kept = stderr.contains("which still sends heartbeats") && stderr.contains("is kept");
    assert!(
        retried_read || kept,
        "the run names the failed read and its retry:\n{stderr}"
    );
    // Both still heartbeat to the driver: neither is lost, both keep their slots.
    for address in ["(10.231.0.11:", "(10.231.0.12:"] {
        assert!(
            !stderr
                .lines()
                .any(|l| l.contains(address) && l.contains(") lost")),
            "the worker at {address} was not declared lost:\n{stderr}"
        );
    }
    for worker in [1, 2] {
        let log = netns.log(worker);
        assert!(
            !log.contains("declared this worker lost")
                && log.matches(") joined the driver at ").count() == 1,
            "worker {worker} stayed registered under its first id:\n{log}"
        );
    }
}

#[test]
fn netns_cluster_answers_every_query_over_data_in_an_s3_server_on_the_bridge() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let netns = Netns::links_only("sls3", 3);
    // The objects are the only copy: the local one they were uploaded from is deleted first.
    let copy = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let local = copy.path().join("sf0.1");
    copy_dir(sf01_dir(), &local);
    let drv = format!("{}-drv", netns.prefix);
    let s3 = common::s3::S3Server::start_in(
        &["ip", "netns", "exec", &drv],
        "10.231.0.1",
        9000,
        &local,
        "sf0.1",
    );
    // Local mode's answers over the local files, computed before they are deleted.
    let local_answers = copy.path().join("answers-local");
    let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["--mode", "local", "tpch", "run", "--data"])
        .arg(&local)
        .arg("--save-answers")
        .arg(&local_answers)
        .env_remove("SLUICE_MODE")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "local mode over the local files: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::remove_dir_all(&local).unwrap();
    let env = s3.env_with(&s3.endpoint, &s3.secret);
    // Each worker logs its finished attempts, with the bytes their scans fetched.
    let mut worker_env = env.clone();
    worker_env.push(("SLUICE_LOG", "sluice::worker=debug".to_string()));
    netns.start_workers(3, &worker_env);
    let cluster_answers = copy.path().join("answers-cluster");
    let report = copy.path().join("report.json");
    let check = [
        "--answers",
        local_answers.to_str().unwrap(),
        "--save-answers",
        cluster_answers.to_str().unwrap(),
        "--json",
        report.to_str().unwrap(),
    ];
    let (success, stdout, stderr) = netns
        .start_run_over("s3://lake/sf0.1", 1, &check, &env)
        .finish();
    assert!(
        success && stdout.contains("22 passed, 0 failed"),
        "the run failed:\n{stdout}\n{stderr}"
    );
    assert_eq!(stdout.matches("verified").count(), 22, "{stdout}");
    assert!(stdout.contains("TPC-H SF 0.1"), "{stdout}");
    // `--answers` allows the TPC-H tolerances; the answers must be equal to the character, rows
    // in the same order, as `--compare-local` requires.
    for query in 1..=22 {
        let name = format!("q{query:02}.tbl");
        let want = std::fs::read_to_string(local_answers.join(&name)).unwrap();
        let got = std::fs::read_to_string(cluster_answers.join(&name)).unwrap();
        assert!(
            want.lines().count() > 1,
            "{name} of local mode has no rows: {want}"
        );
        assert_eq!(
            got, want,
            "{name}: the cluster over S3 and local mode over the files"
        );
    }
    // Every worker joined and ran tasks of the run, and the workers fetched every byte the run's
    // scans fetched: no scan ran on the driver.
    let mut fetched_by_workers = 0;
    for worker in 1..=3 {
        let log = netns.log(worker);
        assert!(
            log.contains(") joined the driver at "),
            "worker {worker}: {log}"
        );
        assert!(
            log.contains("task attempt succeeded"),
            "worker {worker}: {log}"
        );
        fetched_by_workers += log
            .lines()
            .filter(|line| line.contains("task attempt succeeded"))
            .filter_map(|line| line.split("scanned_bytes=").nth(1))
            .map(|rest| rest.split(' ').next().unwrap().parse::<u64>().unwrap())
            .sum::<u64>();
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let fetched: u64 = report["queries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|query| query["scanned_bytes"].as_u64().unwrap())
        .sum();
    assert!(fetched > 0, "{report}");
    assert_eq!(
        fetched_by_workers, fetched,
        "bytes the workers' scans fetched"
    );
    assert!(
        !stderr.contains(&s3.secret),
        "the secret in the driver's output"
    );
}

/// Copies the directory tree `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}
