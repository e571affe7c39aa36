//! Distributed file writes commit exactly once: every write task stages its files, and the driver
//! moves only the files of the attempts the job accepted into the target, writes `_SUCCESS` and
//! removes the staging (`sluice_runtime::write`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::sync::Arc;

use sluice_cluster::{ClusterOptions, LocalClusterRunner};
use sluice_engine::session::collect_stream;
use sluice_engine::{ExecutionMode, SluiceError, SluiceSession};
use sluice_runtime::faults::{FaultPoint, FaultPoints};
use sluice_runtime::{JobRunner, WorkerOptions};
use sluice_tpch::answers::format_rows;

use common::{session, tpch_session};

async fn rows(session: &SluiceSession, sql: &str) -> Result<Vec<Vec<String>>, SluiceError> {
    let mut rows = Vec::new();
    for statement in session.parse_sql(sql).unwrap() {
        let stream = session.execute_statement(statement).await?;
        rows = format_rows(&collect_stream(stream).await?.batches).unwrap();
    }
    Ok(rows)
}

/// Rows, and a sum that changes if any row is lost or doubled, per return flag.
const CHECK: &str = "select l_returnflag, count(*), sum(l_orderkey), sum(l_linenumber) from {} \
                     group by 1 order by 1";

async fn cluster_session(faults: &Arc<FaultPoints>) -> (SluiceSession, LocalClusterRunner) {
    let runner = LocalClusterRunner::with_options(ClusterOptions {
        workers: 2,
        worker: WorkerOptions {
            faults: Some(Arc::clone(faults)),
            ..WorkerOptions::default()
        },
        ..ClusterOptions::default()
    });
    let session = tpch_session(
        ExecutionMode::LocalCluster,
        &[],
        Arc::new(runner.clone()) as Arc<dyn JobRunner>,
    )
    .await;
    (session, runner)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_attempt_failed_after_staging_its_files_commits_each_row_once() {
    let local = session(ExecutionMode::Local, &[]).await;
    let expected = rows(&local, &CHECK.replace("{}", "lineitem"))
        .await
        .unwrap();
    let total: u64 = expected.iter().map(|r| r[1].parse::<u64>().unwrap()).sum();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A write task's only output is its staged row, sent after all its files are written: the
    // fault fails one attempt whose files are staged, and its region runs again.
    let faults = Arc::new(
        "producer_mid_stream=1*error"
            .parse::<FaultPoints>()
            .unwrap(),
    );
    let (cluster, runner) = cluster_session(&faults).await;
    let written = rows(
        &cluster,
        &format!(
            "COPY (select * from lineitem) TO '{}/' STORED AS PARQUET \
             PARTITIONED BY (l_returnflag)",
            out.display()
        ),
    )
    .await
    .unwrap();
    assert_eq!(written, [[total.to_string()]]);
    assert_eq!(faults.fired(FaultPoint::ProducerMidStream), 1);
    assert_eq!(runner.counters().await.regions_retried, 1);

    let files = files_under(&out);
    let data: Vec<&String> = files.iter().filter(|f| f.ends_with(".parquet")).collect();
    assert_eq!(files.len(), data.len() + 1, "{files:?}");
    let manifest = std::fs::read_to_string(out.join("_SUCCESS")).unwrap();
    let mut listed: Vec<&str> = manifest.lines().collect();
    listed.sort();
    assert_eq!(listed, data, "{manifest}");
    assert!(
        data.iter().all(|f| f.starts_with("l_returnflag=")),
        "{data:?}"
    );
    assert!(
        !dir.path().join(".sluice-staging").exists(),
        "{:?}",
        files_under(dir.path())
    );

    let read_back = format!(
        "CREATE EXTERNAL TABLE written STORED AS PARQUET LOCATION '{}/'; {}",
        out.display(),
        CHECK.replace("{}", "written")
    );
    assert_eq!(rows(&local, &read_back).await.unwrap(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_fails_on_a_bad_row_leaves_nothing_under_its_target_or_staging() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(FaultPoints::default());
    let (cluster, _runner) = cluster_session(&faults).await;
    let error = rows(
        &cluster,
        &format!(
            "COPY (select arrow_cast(l_comment, 'Int64') as n from lineitem) TO '{}/bad/' \
             STORED AS CSV",
            dir.path().display()
        ),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("Int64"), "{error}");
    assert_eq!(files_under(dir.path()), Vec::<String>::new());
    assert!(!dir.path().join(".sluice-staging").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_partition_value_is_refused_by_a_distributed_write_instead_of_written_as_zero() {
    let faults = Arc::new(FaultPoints::default());
    let (cluster, _runner) = cluster_session(&faults).await;
    let graph = session(ExecutionMode::LocalGraph, &[]).await;
    for (mode, session) in [("local-graph", &graph), ("local-cluster", &cluster)] {
        let dir = tempfile::tempdir().unwrap();
        let target = format!("{}/out/", dir.path().display());
        let error = rows(
            session,
            &format!(
                "COPY (select l_orderkey, case when l_linenumber = 1 then null \
                 else l_linenumber end as k from lineitem) TO '{target}' STORED AS PARQUET \
                 PARTITIONED BY (k)"
            ),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            error.contains(&format!(
                "the write to file://{target} has a NULL in its partition column k, which \
                 cannot name a partition directory"
            )),
            "{mode}: {error}"
        );
        assert_eq!(files_under(dir.path()), Vec::<String>::new(), "{mode}");
        // Without the NULLs the same write goes through.
        let written = rows(
            session,
            &format!(
                "COPY (select l_orderkey, l_linenumber as k from lineitem where l_linenumber < 3) \
                 TO '{target}' STORED AS PARQUET PARTITIONED BY (k)"
            ),
        )
        .await
        .unwrap();
        let expected = rows(
            session,
            "select count(*) from lineitem where l_linenumber < 3",
        )
        .await
        .unwrap();
        assert_eq!(written, expected, "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_into_an_external_table_writes_through_the_workers_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("nations");
    std::fs::create_dir(&table).unwrap();
    let faults = Arc::new(FaultPoints::default());
    let (cluster, _runner) = cluster_session(&faults).await;
    let sql = format!(
        "CREATE EXTERNAL TABLE nations (k bigint, name varchar) STORED AS CSV LOCATION '{}/' \
         OPTIONS ('format.has_header' 'true'); \
         INSERT INTO nations select n_nationkey, n_name from nation where n_nationkey < 10",
        table.display()
    );
    assert_eq!(rows(&cluster, &sql).await.unwrap(), [["10"]]);
    let again =
        "INSERT INTO nations select n_nationkey, n_name from nation where n_nationkey >= 20";
    assert_eq!(rows(&cluster, again).await.unwrap(), [["5"]]);
    let back = rows(&cluster, "select count(*), sum(k) from nations")
        .await
        .unwrap();
    assert_eq!(back, [["15", (45 + 110).to_string().as_str()]]);
    let plan = rows(
        &cluster,
        "EXPLAIN DISTRIBUTED INSERT INTO nations select 1, 'x'",
    )
    .await
    .unwrap();
    let plan = plan.concat().join("\n");
    // The write tasks run on workers; the commit on the driver.
    let stage_of = |node: &str| {
        let at = plan
            .find(node)
            .unwrap_or_else(|| panic!("no {node}: {plan}"));
        plan[..at]
            .rfind("Stage ")
            .map(|s| &plan[s..at])
            .unwrap()
            .to_string()
    };
    assert!(
        stage_of("FileWriteExec: format=csv").contains("placement=Worker"),
        "{plan}"
    );
    assert!(
        stage_of("FileCommitExec").contains("placement=Driver"),
        "{plan}"
    );
}

/// A write is never run as a single task, however little it reads: its commit runs on the driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_insert_is_cut_into_write_tasks_and_a_commit_even_below_the_single_task_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("nations");
    std::fs::create_dir(&table).unwrap();
    let cluster = session(
        ExecutionMode::LocalCluster,
        &[("sluice.single_task_bytes", "1073741824")],
    )
    .await;
    let create = format!(
        "CREATE EXTERNAL TABLE nations (k bigint, name varchar) STORED AS CSV LOCATION '{}/' \
         OPTIONS ('format.has_header' 'true')",
        table.display()
    );
    rows(&cluster, &create).await.unwrap();
    let explained = rows(
        &cluster,
        "EXPLAIN DISTRIBUTED INSERT INTO nations select n_nationkey, n_name from nation",
    )
    .await
    .unwrap()
    .concat()
    .join("\n");
    assert!(!explained.contains("Single task"), "{explained}");
    assert!(explained.contains("placement=Driver"), "{explained}");
    let query = explained.contains("FileCommitExec") && explained.contains("FileWriteExec");
    assert!(query, "{explained}");
    // A read of the same data below the limit is one task.
    let read = rows(&cluster, "EXPLAIN DISTRIBUTED select n_name from nation")
        .await
        .unwrap()
        .concat()
        .join("\n");
    assert!(read.starts_with("Single task: the scans read "), "{read}");
    let sql = "INSERT INTO nations select n_nationkey, n_name from nation";
    assert_eq!(rows(&cluster, sql).await.unwrap(), [["25"]]);
    let back = rows(&cluster, "select count(*), sum(k) from nations")
        .await
        .unwrap();
    assert_eq!(back, [["25", "300"]]);
}

/// What Sluice and Spark leave beside data files, a `_SUCCESS` manifest and checksum files, is
/// not data: a quoted directory and an external table over it read only the files of the data's
/// extension, with the directory's hive partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_with_a_manifest_and_checksum_files_reads_only_its_data_files() {
    let dir = tempfile::tempdir().unwrap();
    for (part, name, body) in [
        ("1", "x.csv", "k,v\n1,10\n2,20\n"),
        ("2", "y.csv", "k,v\n3,30\n"),
    ] {
        let partition = dir.path().join(format!("a={part}"));
        std::fs::create_dir(&partition).unwrap();
        std::fs::write(partition.join(name), body).unwrap();
    }
    std::fs::write(dir.path().join("_SUCCESS"), "a=1/x.csv\na=2/y.csv\n").unwrap();
    std::fs::write(dir.path().join(".x.csv.crc"), "not,data,at,all\n").unwrap();
    let local = session(ExecutionMode::Local, &[]).await;
    let location = format!("{}/", dir.path().display());
    let quoted = format!("select a, count(*), sum(v) from '{location}' group by a order by a");
    let expected = [["1", "2", "30"], ["2", "1", "30"]];
    assert_eq!(rows(&local, &quoted).await.unwrap(), expected);
    let inferred = format!(
        "CREATE EXTERNAL TABLE inferred STORED AS CSV LOCATION '{location}' \
         OPTIONS ('format.has_header' 'true'); \
         select a, count(*), sum(v) from inferred group by a order by a"
    );
    assert_eq!(rows(&local, &inferred).await.unwrap(), expected);
    let declared = format!(
        "CREATE EXTERNAL TABLE declared (k bigint, v bigint, a int) STORED AS CSV \
         PARTITIONED BY (a) LOCATION '{location}' OPTIONS ('format.has_header' 'true'); \
         select a, count(*), sum(v) from declared group by a order by a"
    );
    assert_eq!(rows(&local, &declared).await.unwrap(), expected);
}
