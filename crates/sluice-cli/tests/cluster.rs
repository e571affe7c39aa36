//! `--mode cluster` end to end: the client hosts the driver and starts `sluice worker` processes of
//! the same binary; these tests kill those processes (and the client) with real signals and check
//! that every answer equals local mode's and that no worker outlives its client.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, ChildStderr, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{signal, sluice, tls_files, worker_pids};

use common::sf01_dir as sf01;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether `pid` is a live process (a zombie waiting to be reaped counts as gone).
fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn wait_until_gone(pids: &[u32], within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| is_alive(*p)).collect();
        if alive.is_empty() || Instant::now() > deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running client whose stderr is collected line by line.
struct Client {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    joined: mpsc::Receiver<()>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Client {
    /// A failed assertion leaves no client behind (its workers follow it).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Client {
    /// Runs `sluice args`, with the cluster's log lines (workers joining and leaving) on stderr.
    fn start(args: &[&str]) -> Self {
        let mut child = sluice()
            .env("SLUICE_LOG", "sluice::cluster=info")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (tell, joined) = mpsc::channel();
        let pipe: ChildStderr = child.stderr.take().unwrap();
        let lines = Arc::clone(&stderr);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(|l| l.ok()) {
                if line.contains(" joined the driver at ") {
                    let _ = tell.send(());
                }
                lines.lock().unwrap().push(line);
            }
        });
        Self {
            child,
            stderr,
            joined,
            reader: Some(reader),
        }
    }

    /// Waits until `n` workers printed their registration line.
    fn wait_joined(&self, n: usize) {
        for _ in 0..n {
            self.joined
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("workers did not join: {:?}", self.stderr()));
        }
    }

    /// Waits (at most 30 s, then fails with `what`) for the process to exit; its exit status and
    /// everything it printed on stderr.
    fn wait_exit(&mut self, what: &str) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(50));
        };
        self.join_stderr();
        (status, self.stderr())
    }

    /// Waits until the client's stderr ended and every line of it was stored.
    fn join_stderr(&mut self) {
        if let Some(reader) = self.reader.take() {
            reader.join().unwrap();
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    fn finish(mut self) -> (Output, String) {
        let mut stdout = Vec::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_end(&mut stdout)
            .unwrap();
        let status = self.child.wait().unwrap();
        self.join_stderr();
        let stderr = self.stderr();
        (
            Output {
                status,
                stdout,
                stderr: Vec::new(),
            },
            stderr,
        )
    }
}

/// `sluice --mode cluster --workers 3 tpch run --data <SF 0.1> <extra>`, started.
fn tpch_on_three_workers(extra: &[&str]) -> Client {
    let data = sf01().to_str().unwrap();
    let mut args = vec![
        "--mode",
        "cluster",
        "--workers",
        "3",
        "tpch",
        "run",
        "--data",
        data,
    ];
    args.extend_from_slice(extra);
    Client::start(&args)
}

#[test]
fn tpch_on_three_worker_processes_matches_local_mode_and_leaves_no_worker_behind() {
    let client = tpch_on_three_workers(&["--compare-local"]);
    client.wait_joined(3);
    let client_pid = client.child.id();
    let pids = worker_pids(client_pid);
    assert_eq!(pids.len(), 3, "{pids:?}: {}", client.stderr());
    let (output, stderr) = client.finish();
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("22 passed, 0 failed"), "{stdout}");
    assert_eq!(stdout.matches("same as local").count(), 22, "{stdout}");
    // It exited only after its workers did (it waits for each).
    assert_eq!(wait_until_gone(&pids, Duration::ZERO), Vec::<u32>::new());
    // Nor their work directory.
    let prefix = format!("sluice-cluster-{client_pid}-");
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_stopped_cluster_mode_server_exits_only_after_its_worker_processes() {
    let server = common::Server::start(&["--mode", "cluster", "--workers", "2"], sf01());
    let pids = worker_pids(server.pid());
    assert_eq!(pids.len(), 2, "{pids:?}");
    let said = server.stop();
    assert!(said.iter().any(|l| l.contains("stopped")), "{said:?}");
    assert_eq!(wait_until_gone(&pids, Duration::ZERO), Vec::<u32>::new());
}

/// Polls the cluster's driver until it has `count` workers (at most 30 s); their snapshots.
async fn until_workers(
    cluster: &sluice_cluster::ProcessCluster,
    count: usize,
) -> Vec<sluice_runtime::WorkerSnapshot> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let workers = cluster.snapshot().await.unwrap().workers;
        if workers.len() == count {
            return workers;
        }
        assert!(
            Instant::now() < deadline,
            "{} workers, not {count}",
            workers.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn the_process_cluster_manager_starts_drains_and_stops_worker_processes() {
    use sluice_cluster::{ProcessCluster, ProcessClusterOptions};
    use sluice_runtime::cluster_manager::ClusterManager;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let executable = std::path::PathBuf::from(env!("CARGO_BIN_EXE_sluice"));
        let cluster = ProcessCluster::start(ProcessClusterOptions::new(executable, 1))
            .await
            .unwrap();
        let manager = cluster.manager();
        assert_eq!((manager.name(), manager.desired_workers()), ("process", 1));
        manager.start_workers(1).await.unwrap();
        let workers = until_workers(&cluster, 2).await;
        let pids = cluster.worker_pids();
        assert_eq!(pids.len(), 2, "{pids:?}");
        // The driver may register the worker before the manager has read the worker's own line
        // saying under which id it joined: wait for both.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !manager.manages(workers[1].id) {
            assert!(
                Instant::now() < deadline,
                "the manager never saw {}",
                workers[1].id
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The second drains and leaves; it is not replaced.
        manager.drain(workers[1].id).await.unwrap();
        let left = until_workers(&cluster, 1).await;
        assert_eq!(left[0].id, workers[0].id);
        // It drained and left, rather than stopping at once: a departure, not a loss (the log
        // says so; no notice for the user, no lost worker counted).
        let notices = cluster.driver().take_notices().await.unwrap();
        assert_eq!(notices, Vec::<String>::new());
        assert_eq!(cluster.snapshot().await.unwrap().counters.workers_lost, 0);
        assert_eq!(
            wait_until_gone(&pids[1..], Duration::from_secs(10)),
            Vec::<u32>::new()
        );
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(cluster.worker_pids(), pids[..1].to_vec(), "no replacement");
        let unknown = manager.drain(workers[1].id).await.unwrap_err().to_string();
        assert_eq!(
            unknown,
            format!(
                "Execution error: no worker process registered as {}",
                workers[1].id
            )
        );
        // Stop returns once every worker process exited.
        manager.stop().await.unwrap();
        assert_eq!(wait_until_gone(&pids, Duration::ZERO), Vec::<u32>::new());
        let refused = manager.start_workers(1).await.unwrap_err().to_string();
        assert_eq!(
            refused,
            "Execution error: the cluster is stopping: no worker process is started"
        );
    });
}

#[test]
fn workers_of_a_sigkilled_client_exit_on_their_own() {
    let client = tpch_on_three_workers(&["--iterations", "1000"]);
    client.wait_joined(3);
    let pids = worker_pids(client.child.id());
    assert_eq!(pids.len(), 3, "{pids:?}");
    signal(client.child.id(), "KILL");
    let (output, _) = client.finish();
    assert_eq!(output.status.code(), None, "killed by a signal");
    // Their stdin (the client's pipe) closed: each stops at once.
    assert_eq!(
        wait_until_gone(&pids, Duration::from_secs(5)),
        Vec::<u32>::new()
    );
}

/// Rows of a CSV output, sorted (the query has no ORDER BY).
fn sorted_lines(bytes: &[u8]) -> Vec<String> {
    let mut lines: Vec<String> = text(bytes).lines().map(str::to_string).collect();
    lines.sort();
    lines
}

#[test]
fn a_worker_killed_after_its_final_tasks_delivered_rows_leaves_every_row_exactly_once() {
    let data = sf01().to_str().unwrap();
    let query = "select l_orderkey, l_linenumber, l_comment from lineitem";
    let local = sluice()
        .args(["sql", "--data", data, "--format", "csv", query])
        .output()
        .unwrap();
    assert!(local.status.success(), "{}", text(&local.stderr));
    let expected = sorted_lines(&local.stdout);
    assert_eq!(expected.len(), 600_573, "header and 600 572 rows");

    let mut client = Client::start(&[
        "--mode",
        "cluster",
        "--workers",
        "2",
        "sql",
        "--data",
        data,
        "--format",
        "csv",
        query,
    ]);
    client.wait_joined(2);
    let pids = worker_pids(client.child.id());
    // Read part of the output, then stop reading: the job stalls on a full pipe with rows of
    // every final task delivered and more to come. Kill a worker then.
    let mut stdout = BufReader::new(client.child.stdout.take().unwrap());
    let mut head = Vec::new();
    for _ in 0..20_000 {
        stdout.read_until(b'\n', &mut head).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    signal(pids[0], "KILL");
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = client.child.wait().unwrap();
    client.join_stderr();
    let stderr = client.stderr();
    assert!(status.success(), "{stderr}");
    head.extend(rest);
    let actual = sorted_lines(&head);
    assert_eq!(actual.len(), expected.len(), "{stderr}");
    assert!(actual == expected, "rows differ from local mode: {stderr}");
    assert!(stderr.contains(" lost"), "the loss is reported: {stderr}");
    assert!(stderr.contains("retrying region"), "{stderr}");
}

/// Runs `scripts/chaos.py` with this test binary's `sluice`; returns its stdout.
fn chaos(signal: &str, exchange: &str, queries: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/chaos.py");
    let output = Command::new("python3")
        .arg(script)
        // Its jobs are cut into stages, so a lost worker takes shuffle outputs with it.
        .env(common::CUT_EVERY_JOB.0, common::CUT_EVERY_JOB.1)
        .args(["--sluice", env!("CARGO_BIN_EXE_sluice")])
        .args(["--data", sf01().to_str().unwrap()])
        .args([
            "--signal",
            signal,
            "--exchange",
            exchange,
            "--queries",
            queries,
        ])
        .args(["--seed", "13"])
        .output()
        .unwrap();
    let stdout = text(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        text(&output.stderr)
    );
    stdout
}

/// The `retried: W workers lost, R regions, T tasks` totals of a chaos run.
fn retried(stdout: &str) -> (usize, usize, usize) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("retried: "))
        .unwrap_or_else(|| panic!("no retried line: {stdout}"));
    let numbers: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    (numbers[0], numbers[1], numbers[2])
}

/// Runs the chaos script; every query must pass and at least `min_lost` of them must have lost
/// their worker (a signal can land after a query ended; a stopped worker the rest of the query
/// does not need is not waited for), with regions retried, or the run proved nothing.
fn assert_chaos(signal: &str, exchange: &str, queries: &str, count: usize, min_lost: usize) {
    let stdout = chaos(signal, exchange, queries);
    assert!(
        stdout.contains(&format!("{count} passed, 0 failed")),
        "{stdout}"
    );
    let (lost, regions, tasks) = retried(&stdout);
    assert!(lost >= min_lost, "{stdout}");
    assert!(regions > 0 && tasks >= regions, "{stdout}");
}

#[test]
fn every_tpch_query_survives_a_sigkilled_worker_with_pipelined_exchanges() {
    assert_chaos("KILL", "pipelined", "all", 22, 11);
}

#[test]
fn every_tpch_query_survives_a_sigkilled_worker_with_blocking_exchanges() {
    assert_chaos("KILL", "blocking", "all", 22, 11);
}

#[test]
fn tpch_queries_survive_a_sigstopped_worker_in_both_exchange_modes() {
    // A stopped worker is found by its missing heartbeats (3 s), so fewer queries than above.
    assert_chaos("STOP", "pipelined", "1,3,9,13,18,21", 6, 1);
    assert_chaos("STOP", "blocking", "1,3,9,13,18,21", 6, 1);
}

/// The per-query numbers `tpch run --json` wrote.
fn json_queries(path: &Path) -> Vec<serde_json::Value> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json["queries"].as_array().unwrap().clone()
}

#[test]
fn a_memory_limited_cluster_spills_its_sort_merge_joins_and_matches_local_mode() {
    // Each worker's one pool is MEMORY_LIMIT. With `--joins sort-merge` the partitioned joins are
    // sort-merge joins whose sorts spill to the workers' work directories; every answer must
    // still be local mode's (which runs unlimited, with hash joins).
    const MEMORY_LIMIT: &str = "32M";
    let dir = tempfile::tempdir().unwrap();
    let data = sf01().to_str().unwrap();
    // `tpch run` on 2 worker processes under the limit, its `--json` written to `json`.
    let run = |joins: &str, json: &Path, extra: &[&str]| {
        let mut args = vec!["--mode", "cluster", "--workers", "2"];
        args.extend(["--memory-limit", MEMORY_LIMIT, "--joins", joins]);
        args.extend([
            "tpch",
            "run",
            "--data",
            data,
            "--json",
            json.to_str().unwrap(),
        ]);
        args.extend_from_slice(extra);
        Client::start(&args).finish()
    };
    let json = dir.path().join("m.json");
    let (output, stderr) = run("sort-merge", &json, &["--compare-local"]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("22 passed, 0 failed"), "{stdout}");
    assert_eq!(stdout.matches("same as local").count(), 22, "{stdout}");
    let queries = json_queries(&json);
    assert_eq!(queries.len(), 22);
    let spilled: Vec<(u64, u64)> = queries
        .iter()
        .map(|q| {
            (
                q["query"].as_u64().unwrap(),
                q["spilled_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    // q18 sorts lineitem's join side by order key: more than a worker's pool.
    let q18 = spilled.iter().find(|(q, _)| *q == 18).unwrap().1;
    assert!(q18 > 1 << 20, "q18 spilled {q18} B: {spilled:?}");
    // The budget was met by spilling, not by failing and retrying regions (the sorts' merge
    // reservations are scaled to the limit).
    for query in &queries {
        assert_eq!(query["regions_retried"], 0, "{query}");
    }

    // With hash joins under the same budget, q18 spills nothing: its spills were the sorts of its
    // sort-merge joins. The default (auto) plans hash joins, which fit here: no query needs the
    // sort-merge fallback, none spills and each answers as local mode does.
    for joins in ["hash", "auto"] {
        let json = dir.path().join(format!("{joins}.json"));
        let (output, stderr) = run(joins, &json, &["-q", "18", "-q", "21", "--compare-local"]);
        let stdout = text(&output.stdout);
        assert!(
            output.status.success(),
            "--joins {joins}: {stdout}\n{stderr}"
        );
        assert!(
            stdout.contains("2 passed, 0 failed"),
            "--joins {joins}: {stdout}"
        );
        assert!(
            !stderr.contains("sort-merge joins"),
            "--joins {joins}: {stderr}"
        );
        let queries = json_queries(&json);
        assert_eq!(queries[0]["query"], 18);
        for query in &queries {
            assert_eq!(query["spilled_bytes"], 0, "--joins {joins}: {query}");
        }
    }
    let explain = "EXPLAIN select count(*) from lineitem join orders on l_orderkey = o_orderkey";
    for (joins, expected) in [
        ("sort-merge", "SortMergeJoinExec: join_type=Inner"),
        ("auto", "HashJoinExec: mode=Partitioned"),
        ("hash", "HashJoinExec: mode=Partitioned"),
    ] {
        let output = sluice()
            .args(["--memory-limit", MEMORY_LIMIT, "--joins", joins])
            .args(["sql", "--data", data, explain])
            .output()
            .unwrap();
        let plan = text(&output.stdout);
        assert!(plan.contains(expected), "--joins {joins}: {plan}");
    }
}

#[test]
fn spawned_workers_log_in_the_format_the_clients_flag_asked_for() {
    let output = sluice()
        .env("SLUICE_LOG", "sluice::worker=debug")
        .env_remove("SLUICE_LOG_FORMAT")
        .args([
            "--mode",
            "cluster",
            "--workers",
            "1",
            "--log-format",
            "json",
        ])
        .args(["sql", "--data", sf01().to_str().unwrap(), "--format", "csv"])
        .arg("select count(*) from nation")
        .output()
        .unwrap();
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(text(&output.stdout), "count(*)\n25\n");
    // The worker's lines, relayed under its prefix: the one line it prints once registered, then
    // only JSON events.
    let relayed: Vec<&str> = stderr
        .lines()
        .filter_map(|line| line.strip_prefix("[worker process 1] "))
        .filter(|line| !line.contains("joined the driver"))
        .collect();
    let events: Vec<serde_json::Value> = relayed
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    let attempts = events
        .iter()
        .filter(|e| e["span"]["name"] == "task attempt")
        .count();
    assert!(attempts > 0, "{stderr}");
}

/// A free loopback port (bound and released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_worker_started_elsewhere_joins_with_the_secret_and_is_refused_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, "correct-horse-battery-staple\n").unwrap();
    let wrong_file = dir.path().join("wrong");
    std::fs::write(&wrong_file, "wrong-horse\n").unwrap();
    let secret = secret_file.to_str().unwrap();
    let address = format!("127.0.0.1:{}", free_port());
    let query = "select count(*) as n from (values (1), (2), (3)) as t(x)";
    // The client starts one worker and waits for a second one, started below.
    let client = Client::start(&[
        "--mode",
        "cluster",
        "--workers",
        "1",
        "--min-workers",
        "2",
        "--driver-listen",
        &address,
        "--secret-file",
        secret,
        "sql",
        "--format",
        "csv",
        query,
    ]);
    client.wait_joined(1);
    let spawned = worker_pids(client.child.id());
    assert_eq!(spawned.len(), 1);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", spawned[0])).unwrap();
    assert!(
        !text(&cmdline).contains("correct-horse"),
        "the secret is not on the command line"
    );

    let without = sluice()
        .args(["worker", "--driver", &address])
        .output()
        .unwrap();
    assert_eq!(without.status.code(), Some(1));
    assert_eq!(
        text(&without.stderr).trim(),
        "error: sluice worker needs the cluster's secret: --secret-file FILE or SLUICE_SECRET \
         (the same as the driver's)"
    );
    let wrong = sluice()
        .args(["worker", "--driver", &address, "--secret-file"])
        .arg(&wrong_file)
        .output()
        .unwrap();
    assert_eq!(wrong.status.code(), Some(1));
    assert!(
        text(&wrong.stderr).contains("could not register with the driver")
            && text(&wrong.stderr).contains("lacks the cluster's secret"),
        "{}",
        text(&wrong.stderr)
    );

    let mut external = Client::start(&["worker", "--driver", &address, "--secret-file", secret]);
    let (output, stderr) = client.finish();
    assert!(output.status.success(), "{stderr}");
    assert_eq!(text(&output.stdout), "n\n3\n");
    // The external worker outlives the client by at most its driver timeout (10 s) and says why.
    let (status, said) =
        external.wait_exit("the external worker did not exit after its driver ended");
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(said.contains(") joined the driver at "), "{said}");
    assert!(
        said.contains("sluice worker exits: the driver at"),
        "{said}"
    );
}

#[test]
fn tpch_runs_on_a_tls_cluster_and_a_worker_without_a_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = tls_files(dir.path());
    let tls = [
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--tls-ca",
        ca.to_str().unwrap(),
    ];
    let data = sf01().to_str().unwrap();
    let mut args = vec!["--mode", "cluster", "--workers", "2"];
    args.extend_from_slice(&tls);
    args.extend_from_slice(&["tpch", "run", "--data", data, "--compare-local"]);
    let output = sluice().args(&args).output().unwrap();
    let stdout = text(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        text(&output.stderr)
    );
    assert!(stdout.contains("22 passed, 0 failed"), "{stdout}");

    // A plain-TCP worker (right secret, no certificate) cannot register with a TLS driver.
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, "tls-test-secret").unwrap();
    let secret = secret_file.to_str().unwrap();
    let address = format!("127.0.0.1:{}", free_port());
    let mut args = vec![
        "--mode",
        "cluster",
        "--workers",
        "0",
        "--min-workers",
        "1",
        "--driver-listen",
        &address,
        "--secret-file",
        secret,
    ];
    args.extend_from_slice(&tls);
    args.extend_from_slice(&["sql", "select 1"]);
    let _client = Client::start(&args);
    std::thread::sleep(Duration::from_millis(500));
    let plain = sluice()
        .args(["worker", "--driver", &address, "--secret-file", secret])
        .args(["--driver-timeout-ms", "2000"])
        .output()
        .unwrap();
    assert_eq!(plain.status.code(), Some(1), "{}", text(&plain.stderr));
    let said = text(&plain.stderr);
    assert!(
        !said.contains("joined the driver"),
        "a worker without TLS joined: {said}"
    );
}

#[test]
fn sigterm_drains_a_worker_which_then_leaves_while_the_cluster_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, "drain-test-secret").unwrap();
    let secret = secret_file.to_str().unwrap();
    let address = format!("127.0.0.1:{}", free_port());
    let data = sf01().to_str().unwrap();
    let client = Client::start(&[
        "--mode",
        "cluster",
        "--workers",
        "1",
        "--min-workers",
        "2",
        "--driver-listen",
        &address,
        "--secret-file",
        secret,
        "tpch",
        "run",
        "--data",
        data,
        "-q",
        "1",
        "-q",
        "3",
        "--iterations",
        "100",
    ]);
    client.wait_joined(1);
    let mut external = Client::start(&["worker", "--driver", &address, "--secret-file", secret]);
    // Once it joined, let it take part in a few queries, then ask it to drain (the 100
    // iterations outlast this by several seconds, also on a loaded machine).
    external.wait_joined(1);
    std::thread::sleep(Duration::from_secs(1));
    signal(external.child.id(), "TERM");
    let (status, said) = external.wait_exit("the drained worker did not leave");
    assert_eq!(status.code(), Some(0), "a drained worker exits 0: {said}");
    assert!(said.contains(") joined the driver at "), "{said}");
    let (output, stderr) = client.finish();
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains(") is draining"), "{stderr}");
    assert!(stderr.contains("it drained and left"), "{stderr}");
    assert!(!stdout.contains("ERROR"), "{stdout}");
}

/// Every file under `dir`, relative to it, sorted.
fn files_under(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[test]
fn a_worker_killed_while_a_copy_writes_leaves_every_row_committed_exactly_once() {
    let data = sf01().to_str().unwrap();
    let check = "select l_returnflag, count(*) as n, sum(l_orderkey) as k, \
                 sum(l_linenumber) as l from {} group by 1 order by 1";
    let local = sluice()
        .args(["sql", "--data", data, "--format", "csv"])
        .arg(check.replace("{}", "lineitem"))
        .output()
        .unwrap();
    assert!(local.status.success(), "{}", text(&local.stderr));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let copy = format!(
        "COPY (select * from lineitem) TO '{}/' STORED AS PARQUET PARTITIONED BY (l_returnflag)",
        out.display()
    );
    let client = Client::start(&[
        "--mode",
        "cluster",
        "--workers",
        "3",
        "sql",
        "--data",
        data,
        "--format",
        "csv",
        &copy,
    ]);
    client.wait_joined(3);
    let pids = worker_pids(client.child.id());
    // Kill a worker as soon as the write tasks have staged their first files.
    let staging = dir.path().join(".sluice-staging");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !staging.exists() || files_under(&staging).is_empty() {
        assert!(Instant::now() < deadline, "nothing was staged");
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(pids[0], "KILL");
    let (output, stderr) = client.finish();
    assert!(output.status.success(), "{stderr}");
    assert_eq!(text(&output.stdout), "count\n600572\n", "{stderr}");
    assert!(stderr.contains(" lost"), "the loss is reported: {stderr}");
    assert!(!staging.exists(), "{:?}", files_under(dir.path()));
    let files = files_under(&out);
    let manifest = std::fs::read_to_string(out.join("_SUCCESS")).unwrap();
    let mut listed: Vec<&str> = manifest.lines().collect();
    listed.sort();
    let data_files: Vec<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| *f != "_SUCCESS")
        .collect();
    assert_eq!(listed, data_files);
    let read_back = sluice()
        .args(["sql", "--format", "csv"])
        .arg(format!(
            "CREATE EXTERNAL TABLE written STORED AS PARQUET LOCATION '{}/'; {}",
            out.display(),
            check.replace("{}", "written")
        ))
        .output()
        .unwrap();
    assert_eq!(
        text(&read_back.stdout),
        text(&local.stdout),
        "{}",
        text(&read_back.stderr)
    );
}

/// `k,n,s,w` CSV answers (with a header) as rows.
fn delta_groups(csv: &str) -> Vec<Vec<String>> {
    csv.lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_string).collect())
        .collect()
}

#[test]
fn a_worker_killed_while_an_insert_writes_a_delta_table_adds_every_row_in_one_version() {
    use common::s3::delta_fixture;
    let data = sf01().to_str().unwrap();
    let lineitem = sluice()
        .args(["sql", "--data", data, "--format", "csv"])
        .arg(
            "select l_returnflag as k, count(*) as n, sum(l_orderkey) as s, \
             sum(l_linenumber) as w from lineitem group by 1 order by 1",
        )
        .output()
        .unwrap();
    assert!(lineitem.status.success(), "{}", text(&lineitem.stderr));
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("events");
    let before = delta_fixture(&["make", table.to_str().unwrap()], &[]);
    let insert = format!(
        "CREATE EXTERNAL TABLE t STORED AS DELTA LOCATION '{}'; \
         INSERT INTO t SELECT l_orderkey, l_returnflag, l_linenumber FROM lineitem",
        table.display()
    );
    let client = Client::start(&[
        "--mode",
        "cluster",
        "--workers",
        "3",
        "sql",
        "--data",
        data,
        "--format",
        "csv",
        &insert,
    ]);
    client.wait_joined(3);
    let pids = worker_pids(client.child.id());
    // Kill a worker as soon as the write tasks have staged their first files.
    let staging = dir.path().join(".sluice-staging");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !staging.exists() || files_under(&staging).is_empty() {
        assert!(Instant::now() < deadline, "nothing was staged");
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(pids[0], "KILL");
    let (output, stderr) = client.finish();
    assert!(output.status.success(), "{stderr}");
    assert_eq!(text(&output.stdout), "count\n600572\n", "{stderr}");
    assert!(stderr.contains(" lost"), "the loss is reported: {stderr}");
    assert!(!staging.exists(), "{:?}", files_under(dir.path()));
    let after = delta_fixture(&["answers", table.to_str().unwrap()], &[]);
    assert_eq!(after["version"], 3, "exactly one new version");
    let mut expected = delta_groups(&text(&lineitem.stdout));
    expected.extend(delta_groups(before["latest"]["all"].as_str().unwrap()));
    expected.sort();
    assert_eq!(
        delta_groups(after["latest"]["all"].as_str().unwrap()),
        expected
    );
}

/// Counts `parent`'s worker processes every 50 ms until `stop` is set: each count with when it was
/// seen, in order.
fn count_workers_until(
    parent: u32,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<(Instant, usize)> {
    let mut counts = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        counts.push((Instant::now(), worker_pids(parent).len()));
        std::thread::sleep(Duration::from_millis(50));
    }
    counts
}

#[test]
fn a_cluster_starts_workers_while_regions_wait_and_lets_idle_ones_go_after_the_timeout() {
    let server = common::Server::start(
        &[
            "--mode",
            "cluster",
            "--workers",
            "1",
            "--min-workers",
            "1",
            "--max-workers",
            "4",
            "--slots",
            "8",
            "--worker-idle-timeout",
            "2s",
        ],
        sf01(),
    );
    let pid = server.pid();
    assert_eq!(worker_pids(pid).len(), 1, "one worker at the start");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let counter = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || count_workers_until(pid, &stop))
    };
    // All 22 queries, each compared with local mode (the server's regions have up to 19 tasks
    // here: they cannot run on one 8-slot worker).
    let run = sluice()
        .args(["tpch", "run", "--connect", &server.url])
        .args(["--data", sf01().to_str().unwrap(), "--compare-local"])
        .output()
        .unwrap();
    let ran = Instant::now();
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", text(&run.stderr));
    assert!(stdout.contains("22 passed, 0 failed"), "{stdout}");
    // Idle for the timeout (2 s), the extra workers are let go: back to the floor of 1.
    let deadline = ran + Duration::from_secs(20);
    while worker_pids(pid).len() > 1 {
        assert!(Instant::now() < deadline, "{:?}", worker_pids(pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::Release);
    let counts = counter.join().unwrap();
    let peak = counts.iter().map(|(_, n)| *n).max().unwrap();
    assert!(
        (2..=4).contains(&peak),
        "more workers while regions waited, at most 4: {peak}"
    );
    // No worker was let go before it could have been idle for the timeout (2 s): the first
    // decrease comes at least 2 s after the increase before it.
    let first_drop = (1..counts.len())
        .find(|&i| counts[i].1 < counts[i - 1].1)
        .unwrap();
    let last_rise = (1..first_drop)
        .rev()
        .find(|&i| counts[i].1 > counts[i - 1].1)
        .unwrap();
    let idle_for = counts[first_drop].0 - counts[last_rise].0;
    assert!(idle_for >= Duration::from_secs(2), "{idle_for:?}");
    // The count fell back to 1 and stayed there (at least 2 s of samples).
    let last_above = counts.iter().rev().find(|(_, n)| *n > 1).unwrap().0;
    let after: Vec<usize> = counts
        .iter()
        .filter(|(at, _)| *at > last_above)
        .map(|(_, n)| *n)
        .collect();
    assert!(
        after.len() >= 40 && after.iter().all(|n| *n == 1),
        "{after:?}"
    );
    let _ = server.stop();
    assert_eq!(worker_pids(pid), Vec::<u32>::new());
}

/// The interactive shell, driven in a pseudo-terminal (`python/shell_pty.py` types the lines and
/// prints the screen the terminal ends with), in cluster mode: its results and nothing else — no
/// worker join lines (they are log lines), no progress line left above a result.
#[test]
fn the_shell_in_cluster_mode_shows_results_without_worker_lines_or_a_stale_progress_line() {
    let dir = tempfile::tempdir().unwrap();
    let lines = dir.path().join("lines");
    std::fs::write(
        &lines,
        "select count(*) as n from nation;\nselect r_name from region order by r_name;\n\\q\n",
    )
    .unwrap();
    let output = common::without_sluice_env(&mut Command::new("python3"))
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/shell_pty.py"
        ))
        .arg(&lines)
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .args(["--mode", "cluster", "--workers", "2", "sql", "--data"])
        .arg(sf01())
        // The shell's history file goes there.
        .env("HOME", dir.path())
        .env("SHELL_PTY_RAW", dir.path().join("raw"))
        // Every job outlasts the progress line's 250 ms tick: each task's reports wait 300 ms.
        // The log filter is the default (`warn`) but for the fault's own warning each time.
        .env("SLUICE_FAILPOINTS", "report_before_send=delay(300)")
        .env("SLUICE_FAILPOINTS_WORKERS", "1,2")
        .env("SLUICE_LOG", "warn,sluice::faults=error")
        .output()
        .unwrap();
    let screen = text(&output.stdout);
    assert!(
        output.status.success(),
        "{screen}\n{}",
        text(&output.stderr)
    );
    // Timings vary: "1 row in 0.073s" → "1 row in <t>s".
    let screen: String = screen
        .lines()
        .map(|line| match line.split_once(" in ") {
            Some((count, time)) if line.contains(" row") && time.ends_with('s') => {
                format!("{count} in <t>s\n")
            }
            _ => format!("{line}\n"),
        })
        .collect();
    let expected = format!(
        "Sluice {} · cluster mode · 8 tables. End statements with ';', \\? for help, \\q to quit.\n\
         sluice> select count(*) as n from nation;\n\
         +----+\n\
         | n  |\n\
         +----+\n\
         | 25 |\n\
         +----+\n\
         1 row in <t>s\n\
         sluice> select r_name from region order by r_name;\n\
         +-------------+\n\
         | r_name      |\n\
         +-------------+\n\
         | AFRICA      |\n\
         | AMERICA     |\n\
         | ASIA        |\n\
         | EUROPE      |\n\
         | MIDDLE EAST |\n\
         +-------------+\n\
         5 rows in <t>s\n\
         sluice> \\q\n",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(screen, expected);
    // A progress line was drawn (and then cleared): the screen above is not free of it by chance.
    let raw = std::fs::read_to_string(dir.path().join("raw")).unwrap();
    assert!(raw.contains("] job 2 · tasks "), "{raw:?}");
}
