//! Malformed control and data requests get an error reply naming what was wrong and change
//! nothing; the worker and the driver keep serving jobs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use arrow_flight::Ticket;
use arrow_flight::flight_service_client::FlightServiceClient;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::TryStreamExt;
use prost::Message;
use sluice_cluster::proto;
use sluice_cluster::proto::driver_service_client::DriverServiceClient;
use sluice_cluster::proto::worker_service_client::WorkerServiceClient;
use sluice_cluster::{ClusterOptions, LocalCluster};
use sluice_planner::JobGraph;
use sluice_runtime::WorkerOptions;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

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

/// What an interceptor of a test client sends as its `authorization` header.
type Header = Option<MetadataValue<Ascii>>;

/// A channel to `address` whose calls carry `header`.
async fn channel(
    address: &str,
    header: Header,
) -> InterceptedService<Channel, impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone> {
    let channel = Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    InterceptedService::new(channel, move |mut request: Request<()>| {
        if let Some(value) = &header {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    })
}

/// The header the cluster's own calls carry.
fn the_secret(cluster: &LocalCluster) -> Header {
    Some(
        format!("Bearer {}", cluster.secret().expose())
            .parse()
            .unwrap(),
    )
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
    let mut client = WorkerServiceClient::new(channel(&address, the_secret(&cluster)).await);
    let status = client
        .run_task(proto::RunTaskRequest {
            task: vec![0xff, 0x01, 0x02, 0x03],
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with(
            "worker 1: Error during planning: malformed cluster message: task definition (4 bytes)"
        ),
        "{status:?}"
    );

    // A well-formed definition whose plan bytes are garbage is refused before any task exists.
    let definition = proto::TaskDefinition {
        job: 99,
        plan: vec![1, 2, 3],
        ..Default::default()
    };
    let status = client
        .run_task(proto::RunTaskRequest {
            task: definition.encode_to_vec(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("decoding the plan of job 99 stage 0 partition 0 attempt 0"),
        "{status:?}"
    );
    let snapshot = cluster.snapshot().await.unwrap();
    assert_eq!(snapshot.worker_tasks, [0, 0], "{snapshot:?}");

    let expected = "+---+---+\n| k | n |\n+---+---+\n| 0 | 2 |\n| 1 | 3 |\n| 2 | 2 |\n+---+---+";
    assert_eq!(run_query(&cluster).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_malformed_tickets_get_an_error_and_the_worker_keeps_serving() {
    let cluster = cluster().await;
    let address = cluster.worker_address(0).unwrap().to_string();
    let mut flight = FlightServiceClient::new(channel(&address, the_secret(&cluster)).await);
    let status = flight
        .do_get(Ticket {
            ticket: vec![0xff; 7].into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("stream ticket (7 bytes)"),
        "{status:?}"
    );

    // A stream whose task never starts here: a transport failure after the read timeout, with the
    // error (and its kind) in the status details.
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
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains(
            "worker 1: stream job 12345 stage 1 partition 2 attempt 0 channel 0 replica 0 \
             did not appear within 0.3 s"
        ),
        "{status:?}"
    );
    let details = proto::TaskError::decode(status.details()).unwrap();
    assert_eq!(
        (details.kind.as_str(), details.root.as_str()),
        ("transport", "sluice.transport")
    );

    let expected = "+---+---+\n| k | n |\n+---+---+\n| 0 | 2 |\n| 1 | 3 |\n| 2 | 2 |\n+---+---+";
    assert_eq!(run_query(&cluster).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_at_an_unusable_address_or_a_garbled_report_is_refused_by_the_driver() {
    let cluster = cluster().await;
    let mut driver =
        DriverServiceClient::new(channel(cluster.driver_address(), the_secret(&cluster)).await);
    let status = driver
        .register_worker(proto::RegisterWorkerRequest {
            address: "not an address".to_string(),
            slots: 4,
            build: sluice_cluster::build(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("cannot register a worker at 'not an address'"),
        "{status:?}"
    );
    // A worker of another version, or one that does not say, is refused.
    for (build, runs) in [
        (
            "sluice 0.0.1 (DataFusion 54.0.0)",
            "sluice 0.0.1 (DataFusion 54.0.0)",
        ),
        ("", "a build that does not say which"),
    ] {
        let status = driver
            .register_worker(proto::RegisterWorkerRequest {
                address: "127.0.0.1:1".to_string(),
                slots: 4,
                build: build.to_string(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(
            status.message(),
            format!(
                "the worker at 127.0.0.1:1 runs {runs}, the driver {}: a cluster runs one version \
                 (plans and settings travel in its encoding)",
                sluice_cluster::build()
            )
        );
    }
    let status = driver
        .report_task_status(proto::TaskStatusReport {
            worker_id: 1,
            state: 42,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("unknown state 42"), "{status:?}");
    // A well-formed report or a heartbeat from another driver instance (epoch 7, not this one's)
    // changes nothing: the report is refused, the heartbeat told to register again.
    let status = driver
        .report_task_status(proto::TaskStatusReport {
            worker_id: 1,
            job: 1,
            sequence: 1,
            state: proto::TaskState::Running as i32,
            driver_epoch: 7,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(
        status.message(),
        "a report for another driver instance (epoch 7); this worker must register again"
    );
    let beat = driver
        .heartbeat(proto::HeartbeatRequest {
            worker_id: 1,
            driver_epoch: 7,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!beat.get_ref().registered);
    let snapshot = cluster.snapshot().await.unwrap();
    assert_eq!(snapshot.driver.workers.len(), 1, "{snapshot:?}");

    let expected = "+---+---+\n| k | n |\n+---+---+\n| 0 | 2 |\n| 1 | 3 |\n| 2 | 2 |\n+---+---+";
    assert_eq!(run_query(&cluster).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_the_secret_or_with_a_wrong_one_are_unauthenticated_and_do_nothing() {
    let cluster = cluster().await;
    let worker = cluster.worker_address(0).unwrap().to_string();
    let wrong = Some("Bearer not-the-secret".parse().unwrap());
    for header in [None, wrong] {
        let what = format!("{header:?}");
        // RunTask: refused before its bytes are even decoded (these would be InvalidArgument).
        let mut client = WorkerServiceClient::new(channel(&worker, header.clone()).await);
        let status = client
            .run_task(proto::RunTaskRequest {
                task: vec![0xff, 0x01],
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
        assert_eq!(
            status.message(),
            "this call lacks the cluster's secret (or carries a wrong one)"
        );
        // DoGet: refused (an unknown stream would be Unavailable after the read timeout).
        let mut flight = FlightServiceClient::new(channel(&worker, header.clone()).await);
        let unknown = proto::TaskStreamKey {
            job: 7,
            ..Default::default()
        };
        let status = flight
            .do_get(Ticket {
                ticket: unknown.encode_to_vec().into(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
        // The driver: a registration without the secret adds no worker.
        let mut driver =
            DriverServiceClient::new(channel(cluster.driver_address(), header.clone()).await);
        let status = driver
            .register_worker(proto::RegisterWorkerRequest {
                address: "127.0.0.1:1".to_string(),
                slots: 4,
                build: sluice_cluster::build(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
    }
    let snapshot = cluster.snapshot().await.unwrap();
    assert_eq!(
        (snapshot.driver.workers.len(), snapshot.worker_tasks.clone()),
        (1, vec![0, 0]),
        "{snapshot:?}"
    );
    let expected = "+---+---+\n| k | n |\n+---+---+\n| 0 | 2 |\n| 1 | 3 |\n| 2 | 2 |\n+---+---+";
    assert_eq!(run_query(&cluster).await, expected);
}
