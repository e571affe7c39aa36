//! Golden files for user-visible text: each `tests/golden/NAME.sql` runs through `sluice sql -f` (and
//! `sluice config` runs as the case `config`) in every mode, and what it prints — stdout, then
//! stderr — must equal `tests/golden/NAME.out` (the same in every mode) or, where a mode rightly
//! differs, `tests/golden/NAME.MODE.out`. Timings, durations and the data directory are redacted,
//! and `EXPLAIN ANALYZE` metric values too (they vary run to run); everything else is compared
//! byte for byte, so a change of wording is a reviewed diff. The `explain_analyze*` cases run the
//! distributed modes with blocking exchanges, whose rows per stage do not depend on timing.
//!
//! `SLUICE_BLESS=1 cargo test -p sluice-cli --test golden` rewrites the files from the current
//! output (per-mode files only where the modes differ).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::{sluice, tpch_dir};

const MODES: &[&str] = &["local", "local-graph", "local-cluster"];

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Replaces every match of a simple pattern: `digits` runs (with an optional fraction and unit
/// suffix) after `prefix`.
fn redact_numbers_after(text: &str, prefix: &str, replacement: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let (head, tail) = rest.split_at(at + prefix.len());
        out.push_str(head);
        let number_len = tail
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(tail.len());
        if number_len == 0 {
            rest = tail;
            continue;
        }
        let unit_len = tail[number_len..]
            .find(|c: char| !(c.is_ascii_alphabetic() || c == 'µ'))
            .unwrap_or(tail.len() - number_len);
        out.push_str(replacement);
        rest = &tail[number_len + unit_len..];
    }
    out.push_str(rest);
    out
}

/// Replaces what follows `prefix` up to its matching `]` (brackets nest) with `replacement`.
fn redact_brackets_after(text: &str, prefix: &str, replacement: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let (head, tail) = rest.split_at(at + prefix.len());
        out.push_str(head);
        let mut depth = 1usize;
        let end = tail
            .char_indices()
            .find(|(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map_or(tail.len(), |(i, _)| i);
        out.push_str(replacement);
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Replaces every number followed by one of `units` (" ms", " KiB", …) with `<n>`, keeping the unit.
fn redact_quantities(text: &str, units: &[&str]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
        let (head, tail) = rest.split_at(start);
        out.push_str(head);
        let len = tail
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(tail.len());
        let after = &tail[len..];
        let is_quantity = units.iter().any(|unit| {
            after.starts_with(unit)
                && !after[unit.len()..].starts_with(|c: char| c.is_ascii_alphanumeric())
        });
        // A number inside a word (`part-0`, `r_name@0`) is not a quantity.
        let in_word = head.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '@');
        out.push_str(if is_quantity && !in_word {
            "<n>"
        } else {
            &tail[..len]
        });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// Replaces what lies between `start` and the next `end` with `replacement`.
fn redact_between(text: &str, start: &str, end: &str, replacement: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(start) {
        let (head, tail) = rest.split_at(at + start.len());
        out.push_str(head);
        let Some(stop) = tail.find(end) else {
            rest = tail;
            break;
        };
        out.push_str(replacement);
        rest = &tail[stop..];
    }
    out.push_str(rest);
    out
}

/// What may differ between two runs of the same case.
fn redact_in(text: &str, case: &str, data: &Path) -> String {
    let data = data.display().to_string();
    let mut text = text.replace(&data, "[DATA]");
    text = text.replace(data.trim_start_matches('/'), "[DATA]");
    // "4 rows in 0.012s"
    text = redact_numbers_after(&text, " in ", "<time>");
    if case.starts_with("explain_analyze") {
        // Which task of a stage is the slowest (the one shown) varies, and with it every metric;
        // rows and batches per task do not.
        text = redact_brackets_after(&text, "metrics=[", "…");
        // Local mode's join dynamic filters hold the bounds the build side had when the probe
        // scan asked, which depends on timing.
        text = redact_brackets_after(&text, "DynamicFilter [", "…]");
        text = redact_between(&text, "pruning_predicate=", ", required_guarantees", "…");
        text = redact_numbers_after(&text, "=", "<n>");
        text = redact_numbers_after(&text, "partition ", "<n>");
        // The time skew is left out when a stage's median task took 0 ms, which varies too.
        text = redact_numbers_after(&text, "time skew ", "<n>").replace("time skew <n>; ", "");
        // Times, and bytes: their split between local and remote reads depends on placement.
        text = redact_quantities(&text, &[" ms", " B", " KiB", " MiB", " GiB"]);
    }
    text
}

/// The output of `case` in `mode`: stdout, then stderr.
fn run_case(case: &str, mode: &str) -> String {
    run_case_in(case, mode, tpch_dir())
}

/// [`run_case`] over the data in `data`.
fn run_case_in(case: &str, mode: &str, data: &Path) -> String {
    let mut command = sluice();
    command.args(["--mode", mode]);
    if case.starts_with("explain_analyze") && mode != "local" {
        // Rows, not only wording, are compared: with pipelined exchanges a runtime filter reaches
        // its target's running tasks at a time that varies from run to run, and so do the rows it
        // drops; with blocking exchanges the target waits for it, so its rows are always the same.
        command.args(["--exchange", "blocking"]);
    }
    if case == "config" {
        // The configuration a user gets: no setting of the tests' environment.
        command.env_remove(common::CUT_EVERY_JOB.0).arg("config");
    } else {
        let file = golden_dir().join(format!("{case}.sql"));
        command.args(["sql", "--format", "csv", "--data"]);
        command.arg(data).arg("-f").arg(file);
    }
    let output = command.output().unwrap();
    let text = format!(
        "{}--- stderr (exit {})\n{}",
        String::from_utf8_lossy(&output.stdout),
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr)
    );
    redact_in(&text, case, data)
}

fn cases() -> Vec<String> {
    let mut cases: Vec<String> = std::fs::read_dir(golden_dir())
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            (path.extension()? == "sql").then(|| path.file_stem()?.to_str().map(String::from))?
        })
        .collect();
    cases.push("config".to_string());
    cases.sort();
    cases
}

#[test]
fn user_visible_text_matches_the_golden_files_in_every_mode() {
    let bless = std::env::var_os("SLUICE_BLESS").is_some();
    let mut failures = Vec::new();
    for case in cases() {
        let outputs: Vec<(&str, String)> = MODES.iter().map(|m| (*m, run_case(&case, m))).collect();
        let shared = golden_dir().join(format!("{case}.out"));
        if bless {
            for mode in MODES {
                let _ = std::fs::remove_file(golden_dir().join(format!("{case}.{mode}.out")));
            }
            let _ = std::fs::remove_file(&shared);
            if outputs.iter().all(|(_, o)| *o == outputs[0].1) {
                std::fs::write(&shared, &outputs[0].1).unwrap();
            } else {
                for (mode, output) in &outputs {
                    std::fs::write(golden_dir().join(format!("{case}.{mode}.out")), output)
                        .unwrap();
                }
            }
            continue;
        }
        for (mode, output) in &outputs {
            let per_mode = golden_dir().join(format!("{case}.{mode}.out"));
            let path = if per_mode.exists() {
                per_mode
            } else {
                shared.clone()
            };
            let expected = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (bless with SLUICE_BLESS=1)", path.display()));
            if *output != expected {
                failures.push(format!(
                    "{case} in {mode} differs from {}:\n--- expected\n{expected}\n--- actual\n{output}",
                    path.display()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// EXPLAIN ANALYZE of TPC-H q18 at SF 1 on a 4-worker local cluster against
/// `tests/golden/sf1/explain_analyze_q18.local-cluster.out`: the per-stage rows, batches, skew of
/// rows and totals at a scale where they mean something. Needs SF 1 data, so it runs on demand:
/// `sluice tpch gen --scale 1 --out DIR`, then
/// `SLUICE_TPCH_SF1=DIR cargo test --workspace --test golden -- --ignored` (`SLUICE_BLESS=1` too
/// to rewrite the file).
#[test]
#[ignore = "needs TPC-H SF 1 data in SLUICE_TPCH_SF1"]
fn explain_analyze_of_q18_at_sf1_matches_its_golden_file() {
    let data = std::env::var_os("SLUICE_TPCH_SF1")
        .map(PathBuf::from)
        .expect("SLUICE_TPCH_SF1 names a directory of TPC-H SF 1 data (sluice tpch gen --scale 1)");
    let output = run_case_in("explain_analyze_q18", "local-cluster", &data);
    let golden = golden_dir().join("sf1/explain_analyze_q18.local-cluster.out");
    if std::env::var_os("SLUICE_BLESS").is_some() {
        std::fs::create_dir_all(golden.parent().unwrap()).unwrap();
        std::fs::write(&golden, &output).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&golden).unwrap();
    assert_eq!(output, expected);
}

#[test]
fn a_user_error_reads_the_same_in_every_mode() {
    let outputs: Vec<String> = MODES
        .iter()
        .map(|mode| run_case("error_divide_by_zero", mode))
        .collect();
    assert_eq!(
        outputs[0],
        "--- stderr (exit 1)\nerror: reading table 'nation' ([DATA]/nation) caused by Arrow error: \
         Divide by zero error\n"
    );
    assert!(outputs.iter().all(|o| *o == outputs[0]), "{outputs:#?}");
}

#[test]
fn redaction_keeps_everything_but_numbers_after_the_markers() {
    assert_eq!(
        redact_numbers_after("4 rows in 0.012s, done in x", " in ", "<t>"),
        "4 rows in <t>, done in x"
    );
    assert_eq!(
        redact_numbers_after("elapsed=1.5ms, rows=12 a=b", "=", "<n>"),
        "elapsed=<n>, rows=<n> a=b"
    );
    assert_eq!(
        redact_brackets_after("X, metrics=[a=1, b=[2, 3]], y=[4]", "metrics=[", "…"),
        "X, metrics=[…], y=[4]"
    );
    assert_eq!(
        redact_between("a, p=x < 3, r=[] b", "p=", ", r=", "…"),
        "a, p=…, r=[] b"
    );
    assert_eq!(
        redact_quantities(
            "5 rows in 2 batches (1.5 KiB); 3 ms, 12 B; part-0 9 Bytes",
            &[" ms", " B", " KiB"]
        ),
        "5 rows in 2 batches (<n> KiB); <n> ms, <n> B; part-0 9 Bytes"
    );
}
