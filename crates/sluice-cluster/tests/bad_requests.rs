//! Malformed control and data requests get an error reply, and the worker keeps serving jobs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use arrow_flight::Ticket;
use arrow_flight::flight_service_client::FlightServiceClient;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::TryStreamExt;
use prost::Message;
use sluice_cluster::proto;
use sluice_cluster::proto::worker_service_client::WorkerServiceClient;
use sluice_cluster::{ClusterOptions, LocalCluster, WorkerOptions};
use sluice_planner::JobGraph;
use tonic::Code;

async fn cluster() -> LocalCluster {
    LocalCluster::start(ClusterOptions {
        workers: 1,
        worker: WorkerOptions {
            read_timeout: Duration::from_millis(300),
            ..WorkerOptions::default()
        },
        ..ClusterOptions::default()
    })
    .await
    .unwrap()
}

async fn run_query(cluster: &LocalCluster) -> String {
    let mut config = SessionConfig::new().with_target_partitions(3);
    for (key, value) in sluice_planner::DISTRIBUTED_SETTINGS {
        config.options_mut().set(key, value).unwrap();
    }
    let ctx = SessionContext::new_with_config(config);
    let sql = "select column1 % 3 as k, count(*) as n \
               from (values (1), (2), (3), (4), (5), (6), (7)) group by 1 order by 1";
    let plan = ctx
        .sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let graph = JobGraph::try_new(plan).unwrap();
    let batches: Vec<_> = cluster
        .execute(graph, ctx.task_ctx())
        .try_collect()
        .await
        .unwrap();
    pretty_format_batches(&batches).unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_run_task_bytes_get_an_error_and_the_worker_keeps_serving() {
    let cluster = cluster().await;
    let address = cluster.worker_address(0).unwrap().to_string();
    let mut client = WorkerServiceClient::connect(format!("http://{address}"))
        .await
        .unwrap();
    let status = client
        .run_task(proto::RunTaskRequest {
            task: vec![0xff, 0x01, 0x02, 0x03],
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("malformed task definition"),
        "{status:?}"
    );

    // A well-formed definition whose plan bytes are garbage fails the task, not the worker.
    let definition = proto::TaskDefinition {
        job: 99,
        plan: vec![1, 2, 3],
        ..Default::default()
    };
    let reply = client
        .run_task(proto::RunTaskRequest {
            task: definition.encode_to_vec(),
        })
        .await;
    assert!(reply.is_ok(), "{reply:?}");

    let expected = "+---+---+\n| k | n |\n+---+---+\n| 0 | 2 |\n| 1 | 3 |\n| 2 | 2 |\n+---+---+";
    assert_eq!(run_query(&cluster).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_malformed_tickets_get_an_error_and_the_worker_keeps_serving() {
    let cluster = cluster().await;
    let address = cluster.worker_address(0).unwrap().to_string();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut flight = FlightServiceClient::new(channel);
    let status = flight
        .do_get(Ticket {
            ticket: vec![0xff; 7].into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let unknown = proto::TaskStreamKey {
        job: 12345,
        stage: 1,
        partition: 2,
        attempt: 0,
        channel: 0,
        replica: 0,
    };
    let status = flight
        .do_get(Ticket {
            ticket: unknown.encode_to_vec().into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(
        status.message().contains("job 12345 stage 1 partition 2"),
        "{status:?}"
    );

    let expected = "+---+---+\n| k | n |\n+---+---+\n| 0 | 2 |\n| 1 | 3 |\n| 2 | 2 |\n+---+---+";
    assert_eq!(run_query(&cluster).await, expected);
}
