//! Delta Lake tables end to end, against Python `deltalake` as the independent writer and reader
//! (`tests/python/delta_fixture.py`, in the pinned venv of the object-store tests): a table it
//! wrote (partitioned, three versions, one delete that rewrote files) reads in every mode exactly
//! as `deltalake` reads it, at version 1 and at the newest; Sluice's `INSERT INTO` adds exactly one
//! version that `deltalake` reads back. (A worker killed during an insert: `tests/cluster.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::Output;

use common::s3::delta_fixture;
use common::sluice;

/// The fixture's queries by name (the CSV answers it computes with `deltalake` use these names).
const QUERIES: [(&str, &str); 3] = [
    (
        "all",
        "select k, count(*) as n, sum(id) as s, sum(v) as w from t group by k order by k",
    ),
    (
        "k1",
        "select k, count(*) as n, sum(id) as s, sum(v) as w from t where k = 'k1' group by k \
         order by k",
    ),
    (
        "small_ids",
        "select k, count(*) as n, sum(id) as s, sum(v) as w from t where id < 300 group by k \
         order by k",
    ),
];

const MODES: [&[&str]; 4] = [
    &["--mode", "local"],
    &["--mode", "local-graph"],
    &["--mode", "local-cluster", "--workers", "2"],
    &["--mode", "cluster", "--workers", "2"],
];

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn run(mode: &[&str], extra: &[&str], sql: &str) -> Output {
    sluice()
        .args(mode)
        .args(["sql", "--format", "csv"])
        .args(extra)
        .arg(sql)
        .output()
        .unwrap()
}

fn create(table: &Path, version: Option<u32>) -> String {
    let options = version
        .map(|v| format!(" OPTIONS ('version' '{v}')"))
        .unwrap_or_default();
    format!(
        "CREATE EXTERNAL TABLE t STORED AS DELTA LOCATION '{}'{options};",
        table.display()
    )
}

#[test]
fn a_delta_table_reads_as_deltalake_reads_it_in_every_mode_at_version_1_and_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("events");
    let expected = delta_fixture(&["make", table.to_str().unwrap()], &[]);
    assert_eq!(expected["version"], 2);
    for mode in MODES {
        for (version, key) in [(Some(1), "v1"), (None, "latest")] {
            for (name, query) in QUERIES {
                let output = run(mode, &[], &format!("{} {query}", create(&table, version)));
                assert_eq!(
                    text(&output.stdout),
                    expected[key][name].as_str().unwrap(),
                    "{mode:?} {key} {name}: {}",
                    text(&output.stderr)
                );
            }
        }
    }
    // A directory with a Delta log is a Delta table however it is named: `--table`, `--data`'s
    // sub-directory, a quoted path. (Its directory also holds the files the delete removed: a
    // listing would count them.)
    let all = QUERIES[0].1;
    let latest = expected["latest"]["all"].as_str().unwrap();
    let by_table = run(
        MODES[2],
        &["--table", &format!("t={}", table.display())],
        all,
    );
    assert_eq!(text(&by_table.stdout), latest, "{}", text(&by_table.stderr));
    let by_data = run(
        MODES[0],
        &["--data", dir.path().to_str().unwrap()],
        &all.replace("from t", "from events"),
    );
    assert_eq!(text(&by_data.stdout), latest, "{}", text(&by_data.stderr));
    let by_path = run(
        MODES[0],
        &[],
        &all.replace("from t", &format!("from '{}/'", table.display())),
    );
    assert_eq!(text(&by_path.stdout), latest, "{}", text(&by_path.stderr));
}

#[test]
fn a_delta_scan_runs_on_workers_and_reads_only_the_files_its_filters_can_match() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("events");
    delta_fixture(&["make", table.to_str().unwrap()], &[]);
    let explain = |query: &str| {
        let output = run(
            MODES[2],
            &[],
            &format!("{} EXPLAIN DISTRIBUTED {query}", create(&table, None)),
        );
        assert!(output.status.success(), "{}", text(&output.stderr));
        text(&output.stdout)
    };
    let plan = explain(QUERIES[0].1);
    let scan = plan.find("DataSourceExec").expect("a scan");
    let stage = &plan[plan[..scan].rfind("Stage ").unwrap()..scan];
    assert!(stage.contains("placement=Worker"), "{plan}");
    // The newest version has 5 files, whatever else lies in the directories: the delete of
    // every tenth id rewrote the files holding such ids into one per partition (k0, k1's first
    // write, k2) and left the append's odd ids (k1, k3) alone.
    assert_eq!(plan.matches(".parquet").count(), 5, "{plan}");
    // Partition pruning: only k=k1's two files.
    let plan = explain(QUERIES[1].1);
    assert_eq!(plan.matches(".parquet").count(), 2, "{plan}");
    assert_eq!(plan.matches("/k=k1/").count(), 2, "{plan}");
    // Statistics: ids under 300 lie only in the rewritten files of the first write (k0, k1, k2);
    // the append's files (ids from 3000) are skipped.
    let plan = explain(QUERIES[2].1);
    assert_eq!(plan.matches(".parquet").count(), 3, "{plan}");
    assert!(!plan.contains("/k=k3/"), "{plan}");
}

/// `select k, n, s, w` answers (CSV with a header) as rows keyed by `k`.
fn groups(csv: &str) -> Vec<(String, [i64; 3])> {
    csv.lines()
        .skip(1)
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            let number = |i: usize| fields[i].parse::<i64>().unwrap();
            (fields[0].to_string(), [number(1), number(2), number(3)])
        })
        .collect()
}

#[test]
fn an_insert_into_a_delta_table_adds_one_version_that_deltalake_reads_back() {
    for mode in [MODES[0], MODES[3]] {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("events");
        let before = delta_fixture(&["make", table.to_str().unwrap()], &[]);
        let insert = format!(
            "{} INSERT INTO t SELECT id + 100000, k, v FROM t",
            create(&table, None)
        );
        let output = run(mode, &[], &insert);
        assert_eq!(
            text(&output.stdout),
            "count\n4050\n",
            "{mode:?}: {}",
            text(&output.stderr)
        );
        let after = delta_fixture(&["answers", table.to_str().unwrap()], &[]);
        assert_eq!(after["version"], 3, "{mode:?}: one new version");
        let expected: Vec<(String, [i64; 3])> = groups(before["latest"]["all"].as_str().unwrap())
            .into_iter()
            .map(|(k, [n, s, w])| (k, [2 * n, 2 * s + 100_000 * n, 2 * w]))
            .collect();
        assert_eq!(
            groups(after["latest"]["all"].as_str().unwrap()),
            expected,
            "{mode:?}"
        );
        assert!(
            !dir.path().join(".sluice-staging").exists(),
            "{mode:?}: the staging is removed"
        );
    }
}

#[test]
fn a_delta_table_error_names_the_table_and_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let not_delta = dir.path().join("plain");
    std::fs::create_dir_all(&not_delta).unwrap();
    let output = run(
        MODES[0],
        &[],
        &format!("{} select * from t", create(&not_delta, None)),
    );
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains(&format!("Delta table file://{}/", not_delta.display())),
        "{stderr}"
    );
    let table = dir.path().join("events");
    delta_fixture(&["make", table.to_str().unwrap()], &[]);
    let output = run(
        MODES[0],
        &[],
        &format!(
            "CREATE EXTERNAL TABLE t STORED AS DELTA LOCATION '{}' OPTIONS ('version' 'x');",
            table.display()
        ),
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("version 'x' is not a number"),
        "{}",
        text(&output.stderr)
    );
}
