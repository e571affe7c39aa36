//! DataFusion's SQL logic tests in `../shared/slt` (beside the repository) must pass in every mode.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

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

fn run_slt(mode: &str) {
    run_slt_with(mode, &[]);
}

fn run_slt_with(mode: &str, flags: &[&str]) {
    let output = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["slt", "--mode", mode])
        .args(flags)
        .args(shared_slt_files())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary = stdout.lines().last().unwrap_or_default();
    println!("{mode}: {summary}");
    assert!(
        output.status.success() && summary.contains(" 0 failed"),
        "sluice slt --mode {mode} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn shared_slt_files_pass_in_local_mode() {
    run_slt("local");
}

#[test]
fn shared_slt_files_pass_in_local_graph_mode() {
    run_slt("local-graph");
}

#[test]
fn shared_slt_files_pass_on_a_local_cluster_of_2_workers() {
    run_slt_with("local-cluster", &["--workers", "2"]);
}

#[test]
fn shared_slt_files_pass_on_a_local_cluster_of_4_workers() {
    run_slt_with("local-cluster", &["--workers", "4"]);
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
