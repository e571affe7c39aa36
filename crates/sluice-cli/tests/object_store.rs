//! Tables in an object store, against a real S3 API server with credentials checked
//! ([`common::s3`]: moto from a pinned venv). Each test starts its own server on a free loopback
//! port, holding TPC-H SF 0.01 uploaded with boto3.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::s3::{S3Server, free_port};
use common::{sf01_dir, signal, sluice, tpch_dir, worker_pids};

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
    // ... and says how many bytes the scan fetched from the store (the Parquet byte ranges).
    let fetched = all
        .split("scanned: 25 rows, ")
        .nth(1)
        .and_then(|rest| rest.split(" fetched").next())
        .unwrap_or_else(|| panic!("no bytes fetched: {all}"));
    let (number, unit) = fetched.split_once(' ').unwrap();
    assert!(number.parse::<f64>().unwrap() > 0.0, "{all}");
    assert!(["B", "KiB"].contains(&unit), "{all}");
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

/// The keys of `inspected` (an `S3Server::inspect`) under `prefix`.
/// The `groups` lines `s3_inspect.py` computed from the written files.
fn groups_of(inspected: &serde_json::Value) -> Vec<&str> {
    inspected["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap())
        .collect()
}

fn keys_under<'a>(inspected: &'a serde_json::Value, prefix: &str) -> Vec<&'a str> {
    inspected["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|key| key.as_str().unwrap())
        .filter(|key| key.starts_with(prefix))
        .collect()
}

#[test]
fn a_distributed_copy_to_s3_commits_every_row_once_and_a_failed_one_leaves_nothing() {
    let s3 = S3Server::start();
    let mut local = sluice();
    local.arg("sql").arg("--data").arg(tpch_dir()).args([
        "--format",
        "csv",
        "select l_returnflag, count(*), sum(l_orderkey), sum(l_linenumber) from lineitem \
         group by 1 order by 1",
    ]);
    let expected: Vec<String> = text(&ok(local).stdout)
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect();
    let total: u64 = expected
        .iter()
        .map(|line| line.split(',').nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    let mut copy = s3.sluice();
    copy.args([
        "--mode",
        "cluster",
        "--workers",
        "3",
        "sql",
        "--format",
        "csv",
        "CREATE EXTERNAL TABLE lineitem STORED AS PARQUET LOCATION 's3://lake/sf0.01/lineitem/'; \
         COPY (select * from lineitem) TO 's3://lake/out/' STORED AS PARQUET \
         PARTITIONED BY (l_returnflag)",
    ]);
    let stdout = text(&ok(copy).stdout);
    assert!(stdout.ends_with(&format!("count\n{total}\n")), "{stdout}");
    let inspected = s3.inspect(Some("out/"));
    let groups = groups_of(&inspected);
    assert_eq!(groups, expected);
    let written = keys_under(&inspected, "out/");
    let data: Vec<&str> = written
        .iter()
        .copied()
        .filter(|key| key.ends_with(".parquet"))
        .collect();
    assert_eq!(written.len(), data.len() + 1, "{written:?}");
    assert!(written.contains(&"out/_SUCCESS"), "{written:?}");
    assert_eq!(
        keys_under(&inspected, ".sluice-staging"),
        Vec::<&str>::new()
    );

    // A write that fails on a row: nothing under its target, nothing staged.
    let mut failing = s3.sluice();
    failing.args([
        "--mode",
        "cluster",
        "--workers",
        "3",
        "sql",
        "CREATE EXTERNAL TABLE lineitem STORED AS PARQUET LOCATION 's3://lake/sf0.01/lineitem/'; \
         COPY (select arrow_cast(l_comment, 'Int64') as n from lineitem) TO 's3://lake/bad/' \
         STORED AS CSV",
    ]);
    let output = failing.output().unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stdout));
    assert!(
        text(&output.stderr).contains("Int64"),
        "{}",
        text(&output.stderr)
    );
    let inspected = s3.inspect(None);
    assert_eq!(keys_under(&inspected, "bad"), Vec::<&str>::new());
    assert_eq!(
        keys_under(&inspected, ".sluice-staging"),
        Vec::<&str>::new()
    );
}

#[test]
fn a_delta_table_on_s3_reads_as_deltalake_reads_it_and_takes_one_insert_commit() {
    use common::s3::delta_fixture;
    let s3 = S3Server::start();
    // Python deltalake writes (and later reads back) the table with the same key; its S3 writer
    // commits by rename here, as it documents for a single writer.
    let mut storage = serde_json::Map::new();
    for (name, value) in s3.env_with(&s3.endpoint, &s3.secret) {
        storage.insert(name.to_string(), value.into());
    }
    storage.insert("AWS_S3_ALLOW_UNSAFE_RENAME".into(), "true".into());
    let env = [(
        "DELTA_STORAGE_OPTIONS",
        serde_json::Value::Object(storage).to_string(),
    )];
    let url = "s3://lake/delta/events";
    let expected = delta_fixture(&["make", url], &env);
    let query = "select k, count(*) as n, sum(id) as s, sum(v) as w from t group by k order by k";
    for (options, key) in [(" OPTIONS ('version' '1')", "v1"), ("", "latest")] {
        let mut read = s3.sluice();
        read.args([
            "--mode",
            "cluster",
            "--workers",
            "2",
            "sql",
            "--format",
            "csv",
        ])
        .arg(format!(
            "CREATE EXTERNAL TABLE t STORED AS DELTA LOCATION '{url}'{options}; {query}"
        ));
        assert_eq!(
            text(&ok(read).stdout),
            expected[key]["all"].as_str().unwrap(),
            "{key}"
        );
    }
    let mut insert = s3.sluice();
    insert
        .args([
            "--mode",
            "cluster",
            "--workers",
            "2",
            "sql",
            "--format",
            "csv",
        ])
        .args(["--table", &format!("t={url}")])
        .arg("INSERT INTO t SELECT id + 100000, k, v FROM t");
    assert_eq!(text(&ok(insert).stdout), "count\n4050\n");
    let after = delta_fixture(&["answers", url], &env);
    assert_eq!(after["version"], 3, "one new version");
    let doubled: Vec<String> = expected["latest"]["all"]
        .as_str()
        .unwrap()
        .lines()
        .skip(1)
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            let n = |i: usize| f[i].parse::<i64>().unwrap();
            format!(
                "{},{},{},{}",
                f[0],
                2 * n(1),
                2 * n(2) + 100_000 * n(1),
                2 * n(3)
            )
        })
        .collect();
    let read_back: Vec<&str> = after["latest"]["all"]
        .as_str()
        .unwrap()
        .lines()
        .skip(1)
        .collect();
    assert_eq!(read_back, doubled);
    let inspected = s3.inspect(None);
    let staged: Vec<&str> = keys_under(&inspected, "")
        .into_iter()
        .filter(|key| key.contains(".sluice-staging"))
        .collect();
    assert_eq!(staged, Vec::<&str>::new());
}

#[test]
fn a_copy_to_s3_survives_a_killed_worker_and_a_cancelled_one_leaves_nothing() {
    use std::process::Stdio;
    let s3 = S3Server::start();
    let data = sf01_dir();
    // Four times lineitem, written in row groups of 20,000 rows through 5 MiB upload parts: each
    // file is a multipart upload under way well before its write task ends, so the write can be
    // seen staging (and a worker killed, or the statement cancelled, in the middle of it).
    let times = |n: u32| {
        format!("select l.* from lineitem l cross join (select * from generate_series(1, {n}))")
    };
    let mut local = sluice();
    local
        .arg("sql")
        .arg("--data")
        .arg(data)
        .args(["--format", "csv"])
        .arg(format!(
            "select l_returnflag, count(*), sum(l_orderkey), sum(l_linenumber) from ({}) \
         group by 1 order by 1",
            times(4)
        ));
    let expected: Vec<String> = text(&ok(local).stdout)
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect();
    let copy = |n: u32, target: &str| {
        let mut command = s3.sluice();
        command
            .args(["--mode", "cluster", "--workers", "3", "sql", "--data"])
            .arg(data)
            .args(["--format", "csv"])
            .arg(format!(
                "SET datafusion.execution.objectstore_writer_buffer_size = 5242880; \
                 COPY ({}) TO 's3://lake/{target}/' STORED AS PARQUET \
                 PARTITIONED BY (l_returnflag) OPTIONS ('format.max_row_group_size' '20000')",
                times(n)
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command.spawn().unwrap()
    };
    let staged_keys = |inspected: &serde_json::Value| -> Vec<String> {
        keys_under(inspected, "")
            .into_iter()
            .filter(|key| key.contains(".sluice-staging"))
            .map(str::to_string)
            .collect()
    };

    // A worker killed while the write tasks stage files: the job still succeeds, exactly once.
    let client = copy(4, "killed");
    s3.wait_staged();
    let pids = worker_pids(client.id());
    assert_eq!(pids.len(), 3, "{pids:?}");
    signal(pids[0], "KILL");
    let output = client.wait_with_output().unwrap();
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(text(&output.stdout), "count\n2402288\n", "{stderr}");
    assert!(stderr.contains(" lost"), "the loss is reported: {stderr}");
    let inspected = s3.inspect(Some("killed/"));
    let groups = groups_of(&inspected);
    assert_eq!(groups, expected, "{stderr}");
    assert!(
        keys_under(&inspected, "killed/").contains(&"killed/_SUCCESS"),
        "{inspected}"
    );
    assert_eq!(staged_keys(&inspected), Vec::<String>::new());

    // Ctrl-C while a write of 30 times the table stages its files: nothing under the target,
    // nothing staged.
    let client = copy(30, "cancelled");
    s3.wait_staged();
    signal(client.id(), "INT");
    let output = client.wait_with_output().unwrap();
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert_eq!(text(&output.stdout), "", "{stderr}");
    let inspected = s3.inspect(None);
    assert_eq!(keys_under(&inspected, "cancelled"), Vec::<&str>::new());
    assert_eq!(staged_keys(&inspected), Vec::<String>::new());
}
