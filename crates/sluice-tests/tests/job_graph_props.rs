//! Property test: small random queries (filters, aggregates, joins of every type, unions, windows,
//! sorts with limits) over multi-partition tables give the same rows through the driver and an
//! in-process worker (`local-graph`) as through plain DataFusion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::datasource::MemTable;
use proptest::prelude::*;
use sluice_engine::config::ConfigLayer;
use sluice_engine::{ExecutionMode, SluiceConfig, SluiceSession};
use sluice_runtime::{JobRunner, LocalGraphRunner, LocalRunner};
use sluice_tpch::answers::format_rows;

/// Table `name` with `rows` rows spread over 3 partitions: k (keys 0..7, some NULL), v, s.
fn table(rows: usize, seed: i64) -> MemTable {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("v", DataType::Int64, false),
        Field::new("s", DataType::Utf8, false),
    ]));
    let partitions = (0..3)
        .map(|p| {
            let range = (p * rows / 3)..((p + 1) * rows / 3);
            let k: Int64Array = range
                .clone()
                .map(|i| {
                    let x = (i as i64 * 7 + seed) % 11;
                    (x < 8).then_some(x)
                })
                .collect();
            let v: Int64Array = range
                .clone()
                .map(|i| (i as i64 * 13 + seed) % 101)
                .collect();
            let s: StringArray = range
                .map(|i| Some(format!("s{}", (i as i64 + seed) % 5)))
                .collect();
            vec![
                RecordBatch::try_new(schema.clone(), vec![Arc::new(k), Arc::new(v), Arc::new(s)])
                    .unwrap(),
            ]
        })
        .collect();
    MemTable::try_new(schema, partitions).unwrap()
}

fn session(mode: ExecutionMode, seed: i64, t_rows: usize, u_rows: usize) -> SluiceSession {
    let mut config = SluiceConfig::default();
    let layer = ConfigLayer {
        mode: Some(mode),
        session: vec![
            ("datafusion.execution.target_partitions".into(), "4".into()),
            ("datafusion.execution.batch_size".into(), "7".into()),
            // Cut every job into stages: the point is to compare the distributed path.
            ("sluice.single_task_bytes".into(), "0".into()),
        ],
        ..Default::default()
    };
    config.apply(layer, "test").unwrap();
    let runner: Arc<dyn JobRunner> = match mode {
        ExecutionMode::Local => Arc::new(LocalRunner),
        _ => Arc::new(LocalGraphRunner::default()),
    };
    let session = SluiceSession::new(&config, runner).unwrap();
    let ctx = session.context();
    ctx.register_table("t", Arc::new(table(t_rows, seed)))
        .unwrap();
    ctx.register_table("u", Arc::new(table(u_rows, seed + 3)))
        .unwrap();
    session
}

fn query() -> impl Strategy<Value = String> {
    let join = prop_oneof![
        Just("join"),
        Just("left join"),
        Just("right join"),
        Just("full join"),
    ];
    let semi = prop_oneof![Just("in"), Just("not in")];
    let exists = prop_oneof![Just("exists"), Just("not exists")];
    prop_oneof![
        (0i64..100).prop_map(|x| format!("select k, v, s from t where v > {x}")),
        (0i64..100).prop_map(|x| format!(
            "select k, count(*), sum(v), min(s) from t where v < {x} group by k"
        )),
        join.prop_map(|j| format!(
            "select t.k, t.v, u.v, u.s from t {j} u on t.k = u.k and t.v < u.v + 50"
        )),
        semi.prop_map(|op| format!(
            "select k, v from t where k {op} (select k from u where v > 40)"
        )),
        exists.prop_map(|op| format!(
            "select k, v from t where {op} (select 1 from u where u.k = t.k and u.v > t.v)"
        )),
        (1usize..30).prop_map(|n| format!("select k, v, s from t order by v, s, k limit {n}")),
        Just("select k, v from t union all select k, v from u".to_string()),
        Just("select distinct s from t union select s from u".to_string()),
        Just("select k, v, row_number() over (partition by k order by v, s) from t".to_string()),
        (0i64..8).prop_map(|x| format!(
            "select t.s, count(*) from t join u on t.s = u.s where t.k > {x} group by t.s"
        )),
        Just("select count(*) from t, u where t.v < u.v".to_string()),
        Just("select k, (select max(v) from u) from t".to_string()),
    ]
}

async fn sorted_rows(session: &SluiceSession, sql: &str) -> Result<Vec<Vec<String>>, String> {
    let outputs = session.run_sql(sql).await.map_err(|e| e.to_string())?;
    let mut rows = format_rows(&outputs.last().unwrap().batches).map_err(|e| e.to_string())?;
    rows.sort();
    Ok(rows)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn job_graph_execution_equals_datafusion(
        sql in query(),
        seed in 0i64..50,
        t_rows in 0usize..60,
        u_rows in 0usize..60,
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (expected, actual) = runtime.block_on(async {
            let local = session(ExecutionMode::Local, seed, t_rows, u_rows);
            let graph = session(ExecutionMode::LocalGraph, seed, t_rows, u_rows);
            (sorted_rows(&local, &sql).await, sorted_rows(&graph, &sql).await)
        });
        prop_assert!(expected.is_ok(), "local mode failed: {expected:?}");
        prop_assert_eq!(expected, actual, "{}", sql);
    }
}
