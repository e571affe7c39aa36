//! The fault matrix: every named fault point (`sluice_runtime::faults`) × {error, panic, exit} ×
//! {pipelined, blocking}, fired once in one worker process of `--mode cluster --workers 3` while
//! TPC-H q18 runs at SF 0.1 (the spill cells with sort-merge joins under `--memory-limit 48M`, so that their sorts spill).
//! Each cell proves its point fired (the worker's log line), ends within 120 s, and returns exactly
//! local mode's rows (`--compare-local`): never partial rows, never a hang. In the pipelined spill
//! cells, three target partitions put a task of each of q18's sorting stages on every worker, so
//! worker 1 spills too (with two, its sorts may all land elsewhere).
//!
//! The workers read `SLUICE_FAILPOINTS`, which needs the `failpoints` feature; this crate's
//! dev-dependencies turn it on for the test build.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::sluice;

use common::sf01_dir as sf01;

/// How long a cell may take before it counts as a hang.
const CELL_LIMIT: Duration = Duration::from_secs(120);

/// Runs q18 on three worker processes with `point=1*action` armed in worker 1.
fn cell(point: &str, action: &str, exchange: &str) {
    let data = sf01().to_str().unwrap();
    let mut args = vec![
        "--mode",
        "cluster",
        "--workers",
        "3",
        "--exchange",
        exchange,
    ];
    if point == "spill_write" {
        // q18's sort-merge joins spill about 10 MB under this budget (measured 2026-12-04; none at
        // 64M), with room for a retried region whose tasks land on two workers while the third
        // is replaced (at 32M such a retry ran out of memory now and then).
        args.extend(["--memory-limit", "48M", "--joins", "sort-merge"]);
        if exchange == "pipelined" {
            args.extend(["--set", "datafusion.execution.target_partitions=3"]);
        }
    }
    args.extend(["tpch", "run", "--data", data, "-q", "18", "--compare-local"]);
    let spec = format!("{point}=1*{action}");
    let mut child = sluice()
        .args(&args)
        .env("SLUICE_FAILPOINTS", &spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        stdout.read_to_string(&mut text).unwrap();
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        stderr.read_to_string(&mut text).unwrap();
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > CELL_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{spec} ({exchange}) did not end within {} s:\n{}",
                CELL_LIMIT.as_secs(),
                err.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    assert!(status.success(), "{spec} ({exchange}): {stdout}\n{stderr}");
    let q18 = stdout
        .lines()
        .find(|line| line.starts_with("q18 "))
        .unwrap_or("");
    assert!(
        q18.ends_with("same as local"),
        "{spec} ({exchange}): {stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed, 0 failed"),
        "{spec} ({exchange}): {stdout}"
    );
    assert!(
        stderr.contains(&format!("fault point {point} fired ({action}) in worker 1")),
        "{spec} ({exchange}) never fired: {stderr}"
    );
}

macro_rules! cells {
    ($($name:ident: $point:literal, $action:literal, $exchange:literal;)*) => {
        $(
            #[test]
            fn $name() {
                cell($point, $action, $exchange);
            }
        )*
    };
}

cells! {
    producer_mid_stream_error_pipelined: "producer_mid_stream", "error", "pipelined";
    producer_mid_stream_error_blocking: "producer_mid_stream", "error", "blocking";
    producer_mid_stream_panic_pipelined: "producer_mid_stream", "panic", "pipelined";
    producer_mid_stream_panic_blocking: "producer_mid_stream", "panic", "blocking";
    producer_mid_stream_exit_pipelined: "producer_mid_stream", "exit", "pipelined";
    producer_mid_stream_exit_blocking: "producer_mid_stream", "exit", "blocking";
    report_before_send_error_pipelined: "report_before_send", "error", "pipelined";
    report_before_send_error_blocking: "report_before_send", "error", "blocking";
    report_before_send_panic_pipelined: "report_before_send", "panic", "pipelined";
    report_before_send_panic_blocking: "report_before_send", "panic", "blocking";
    report_before_send_exit_pipelined: "report_before_send", "exit", "pipelined";
    report_before_send_exit_blocking: "report_before_send", "exit", "blocking";
    report_after_send_error_pipelined: "report_after_send", "error", "pipelined";
    report_after_send_error_blocking: "report_after_send", "error", "blocking";
    report_after_send_panic_pipelined: "report_after_send", "panic", "pipelined";
    report_after_send_panic_blocking: "report_after_send", "panic", "blocking";
    report_after_send_exit_pipelined: "report_after_send", "exit", "pipelined";
    report_after_send_exit_blocking: "report_after_send", "exit", "blocking";
    flight_fetch_error_pipelined: "flight_fetch", "error", "pipelined";
    flight_fetch_error_blocking: "flight_fetch", "error", "blocking";
    flight_fetch_panic_pipelined: "flight_fetch", "panic", "pipelined";
    flight_fetch_panic_blocking: "flight_fetch", "panic", "blocking";
    flight_fetch_exit_pipelined: "flight_fetch", "exit", "pipelined";
    flight_fetch_exit_blocking: "flight_fetch", "exit", "blocking";
    spill_write_error_pipelined: "spill_write", "error", "pipelined";
    spill_write_error_blocking: "spill_write", "error", "blocking";
    spill_write_panic_pipelined: "spill_write", "panic", "pipelined";
    spill_write_panic_blocking: "spill_write", "panic", "blocking";
    spill_write_exit_pipelined: "spill_write", "exit", "pipelined";
    spill_write_exit_blocking: "spill_write", "exit", "blocking";
    heartbeat_error_pipelined: "heartbeat", "error", "pipelined";
    heartbeat_error_blocking: "heartbeat", "error", "blocking";
    heartbeat_panic_pipelined: "heartbeat", "panic", "pipelined";
    heartbeat_panic_blocking: "heartbeat", "panic", "blocking";
    heartbeat_exit_pipelined: "heartbeat", "exit", "pipelined";
    heartbeat_exit_blocking: "heartbeat", "exit", "blocking";
}

/// A task that exits its worker on every attempt fails its job at the attempt limit, naming the
/// task and what each attempt met, while every dead worker process is replaced. Each death seen
/// as a process exit is charged; one a peer's failed read reports first counts as a cut-off
/// worker, not charged, so the job ends after four or five attempts.
#[test]
fn a_task_that_kills_every_worker_it_lands_on_fails_its_job_at_the_attempt_limit() {
    let data = sf01().to_str().unwrap();
    let output = sluice()
        .args([
            "--mode",
            "cluster",
            "--workers",
            "2",
            "--capacity-wait",
            "30s",
        ])
        .args(["sql", "--data", data])
        .arg("select n_regionkey, count(*) from nation group by n_regionkey")
        // Every worker id a replacement can get: each one dies at its first output.
        .env("SLUICE_FAILPOINTS", "producer_mid_stream=exit")
        .env("SLUICE_FAILPOINTS_WORKERS", "1,2,3,4,5,6,7,8,9,10,11,12")
        // Workers' join lines are log lines (info) of the cluster.
        .env("SLUICE_LOG", "sluice::cluster=info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(" after 4 attempts (attempt 0: stage ")
            || stderr.contains(" after 5 attempts (attempt 0: stage "),
        "the job names its task and each attempt: {stderr}"
    );
    assert!(!stderr.contains(" after 6 attempts"), "{stderr}");
    for attempt in 0..4 {
        assert!(
            stderr.contains(&format!("attempt {attempt}: stage ")),
            "attempt {attempt} is listed: {stderr}"
        );
    }
    assert!(
        stderr.contains("was lost: its process (pid "),
        "the attempts met dead worker processes: {stderr}"
    );
    // The dead workers were replaced: processes 3 and up are replacements (started together,
    // either may join first, and the job may end before the other joins).
    let replacements_joined = stderr
        .lines()
        .filter_map(|line| {
            line.split_once("worker process ")?
                .1
                .split_once(": sluice worker ")
        })
        .filter_map(|(process, _)| process.parse::<u32>().ok())
        .filter(|process| *process >= 3)
        .count();
    assert!(replacements_joined >= 1, "replacements joined: {stderr}");
}
