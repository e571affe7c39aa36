//! DataFusion's SQL logic tests in `../shared/slt` (beside the repository) must pass in every mode.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

fn shared_slt_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/slt");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "the shared SQL logic tests are expected at {} (a checkout of ../shared beside the repository): {e}",
            dir.display()
        )
    });
    let mut files: Vec<PathBuf> = entries
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "slt"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .slt files in {}", dir.display());
    files
}

/// What `sluice slt` printed in one mode: one line per file (timings removed) and the totals.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SltRun {
    files: Vec<String>,
    passed: usize,
    failed: usize,
    skipped: usize,
}

fn run_slt(mode: &str, flags: &[&str]) -> SltRun {
    let output = common::sluice()
        .args(["slt", "--mode", mode])
        .args(flags)
        .args(shared_slt_files())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let summary = stdout.lines().last().unwrap_or_default().to_string();
    println!("{mode} {flags:?}: {summary}");
    let counts: Vec<usize> = summary
        .split(", ")
        .map(|part| {
            part.split(' ')
                .next()
                .unwrap_or("")
                .parse()
                .unwrap_or(usize::MAX)
        })
        .collect();
    let [passed, failed, skipped] = counts[..] else {
        panic!("no totals line from sluice slt --mode {mode}:\n{stdout}");
    };
    // "file.slt  3 passed, 0 failed, 1 skipped (0.12s)": the counts, without the time.
    let files = stdout
        .lines()
        .filter(|line| line.contains(".slt  "))
        .map(|line| {
            line.rsplit_once(" (")
                .map_or(line, |(head, _)| head)
                .to_string()
        })
        .collect();
    assert!(
        output.status.success() && failed == 0,
        "sluice slt --mode {mode} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    SltRun {
        files,
        passed,
        failed,
        skipped,
    }
}

/// Local mode's run, the reference (once per test binary).
fn local_run() -> &'static SltRun {
    static LOCAL: OnceLock<SltRun> = OnceLock::new();
    LOCAL.get_or_init(|| run_slt("local", &[]))
}

/// Fewer passed records than this means records stopped running, whatever else passes.
const MIN_PASSED: usize = 1224;

#[test]
fn shared_slt_files_pass_in_local_mode() {
    let local = local_run();
    assert!(local.passed >= MIN_PASSED, "{local:?}");
    assert_eq!(local.files.len(), shared_slt_files().len());
}

fn assert_same_as_local(mode: &str, flags: &[&str]) {
    let run = run_slt(mode, flags);
    assert!(run.passed >= MIN_PASSED, "{mode}: {run:?}");
    assert_eq!(
        &run,
        local_run(),
        "{mode} {flags:?} differs from local mode"
    );
}

#[test]
fn shared_slt_files_pass_the_same_records_in_local_graph_mode() {
    assert_same_as_local("local-graph", &[]);
}

#[test]
fn shared_slt_files_pass_the_same_records_on_a_local_cluster_of_2_workers() {
    assert_same_as_local("local-cluster", &["--workers", "2"]);
}

#[test]
fn shared_slt_files_pass_the_same_records_on_a_local_cluster_of_4_workers() {
    assert_same_as_local("local-cluster", &["--workers", "4"]);
}

#[test]
fn shared_slt_files_pass_the_same_records_on_3_worker_processes() {
    assert_same_as_local("cluster", &["--workers", "3"]);
}

#[test]
fn shared_slt_files_pass_the_same_records_on_worker_processes_with_blocking_exchanges() {
    assert_same_as_local("cluster", &["--workers", "2", "--exchange", "blocking"]);
}

#[test]
fn shared_slt_files_pass_the_same_records_through_a_server_of_2_worker_processes() {
    // The server's working directory is where the files' relative paths (scratch output) land.
    let dir = tempfile::tempdir().unwrap();
    let server = common::Server::start_in(&["--workers", "2"], &[], None, Some(dir.path()));
    let url = server.url.clone();
    assert_same_as_local("local", &["--connect", &url]);
    let stopping = server.stop();
    assert_eq!(
        stopping.last().map(String::as_str),
        Some("sluice server: stopped")
    );
}

/// Runs `sluice slt` on one file named `name` holding `text`; expects failure, returns stdout.
fn failing_slt(name: &str, text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(name);
    std::fs::write(&file, text).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("slt")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!output.status.success());
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn a_file_needing_datafusion_test_context_fails_clearly() {
    let stdout = failing_slt("joins.slt", "query I\nselect 1\n----\n1\n");
    assert!(
        stdout.contains("needs DataFusion's sqllogictest context"),
        "{stdout}"
    );
    assert!(
        stdout.ends_with("0 passed, 1 failed, 0 skipped\n"),
        "{stdout}"
    );
}

#[test]
fn a_failing_record_prints_location_sql_and_both_results() {
    let stdout = failing_slt("wrong.slt", "query I\nselect 40 + 2\n----\n41\n");
    assert!(stdout.contains("wrong.slt:1"), "{stdout}");
    assert!(stdout.contains("select 40 + 2"), "{stdout}");
    assert!(stdout.contains("41") && stdout.contains("42"), "{stdout}");
}
