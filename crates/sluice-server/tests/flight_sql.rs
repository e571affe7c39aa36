//! The Flight SQL endpoint through arrow-flight's own client: sessions, statements, metadata,
//! prepared statements and mapped errors, over a real socket (in-process modes; the cluster and the
//! Python clients are tested by the CLI's `clients` test).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::util::pretty::pretty_format_batches;
use arrow_flight::FlightInfo;
use arrow_flight::error::FlightError;
use arrow_flight::sql::CommandGetTables;
use arrow_flight::sql::client::FlightSqlServiceClient;
use datafusion::common::runtime::SpawnedTask;
use futures::TryStreamExt;
use sluice_engine::access::Roots;
use sluice_engine::catalog::table_at;
use sluice_engine::{SluiceConfig, SluiceSession};
use sluice_server::limits::ServerLimits;
use sluice_server::users::{Users, Verifier};
use sluice_server::{FlightSqlEndpoint, FlightSqlOptions, SessionFactory, Sessions};
use tonic::transport::Channel;

struct Server {
    endpoint: FlightSqlEndpoint,
    _dir: tempfile::TempDir,
}

async fn server() -> Server {
    server_with(None).await
}

async fn server_with(users: Option<Users>) -> Server {
    server_limited(users, None).await
}

async fn server_limited(users: Option<Users>, max_concurrent_jobs: Option<usize>) -> Server {
    server_on(
        Arc::new(sluice_runtime::LocalRunner),
        users,
        max_concurrent_jobs,
        ServerLimits::default(),
    )
    .await
}

async fn server_on(
    runner: Arc<dyn sluice_runtime::JobRunner>,
    users: Option<Users>,
    max_concurrent_jobs: Option<usize>,
    limits: ServerLimits,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    std::fs::write(&path, "a,b\n1,x\n2,y\n3,z\n").unwrap();
    let mut base = SluiceSession::new(&SluiceConfig::default(), runner).unwrap();
    base.register_table(table_at("t", &path).unwrap())
        .await
        .unwrap();
    // Non-admins read under the directory and write under its `out`.
    let out = dir.path().join("out");
    let roots = Roots::parse(
        &[dir.path().display().to_string()],
        &[out.display().to_string()],
    )
    .unwrap();
    let sessions = Arc::new(
        Sessions::with_users(SessionFactory::new(base), users)
            .await
            .unwrap()
            .with_max_concurrent_jobs(max_concurrent_jobs)
            .with_roots(roots)
            .with_limits(limits),
    );
    let options = FlightSqlOptions {
        listen: "127.0.0.1:0".into(),
        tls: None,
    };
    let endpoint = FlightSqlEndpoint::start(sessions, &options).await.unwrap();
    Server {
        endpoint,
        _dir: dir,
    }
}

async fn client(server: &Server) -> FlightSqlServiceClient<Channel> {
    let channel = Channel::from_shared(format!("http://{}", server.endpoint.address()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    FlightSqlServiceClient::new(channel)
}

async fn fetch(client: &mut FlightSqlServiceClient<Channel>, info: FlightInfo) -> Vec<RecordBatch> {
    let mut batches = Vec::new();
    for endpoint in info.endpoint {
        let ticket = endpoint.ticket.unwrap();
        let stream = client.do_get(ticket).await.unwrap();
        batches.extend(stream.try_collect::<Vec<_>>().await.unwrap());
    }
    batches
}

async fn query(client: &mut FlightSqlServiceClient<Channel>, sql: &str) -> String {
    let info = client.execute(sql.to_string(), None).await.unwrap();
    pretty_format_batches(&fetch(client, info).await)
        .unwrap()
        .to_string()
}

fn status_of(error: FlightError) -> tonic::Status {
    match error {
        FlightError::Tonic(status) => *status,
        other => panic!("not a status: {other}"),
    }
}

#[tokio::test]
async fn a_statement_returns_the_local_rows_and_schema() {
    let server = server().await;
    let mut client = client(&server).await;
    client.handshake("ann", "").await.unwrap();
    let info = client
        .execute(
            "select a, upper(b) as b from t order by a desc".into(),
            None,
        )
        .await
        .unwrap();
    let announced = info.clone().try_decode_schema().unwrap();
    let local = server
        .endpoint
        .sessions()
        .base()
        .run_sql("select a, upper(b) as b from t order by a desc")
        .await
        .unwrap()
        .remove(0);
    assert_eq!(&announced, local.schema.as_ref());
    let batches = fetch(&mut client, info).await;
    assert_eq!(
        pretty_format_batches(&batches).unwrap().to_string(),
        pretty_format_batches(&local.batches).unwrap().to_string()
    );
    assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 3);
    assert_eq!(server.endpoint.pending_statements(), 0);
}

#[tokio::test]
async fn errors_carry_their_code_and_the_local_text() {
    let server = server().await;
    let mut client = client(&server).await;
    let syntax = status_of(client.execute("selec 1".into(), None).await.unwrap_err());
    assert_eq!(syntax.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        syntax.message(),
        "SQL error: ParserError(\"Expected: an SQL statement, found: selec at Line: 1, Column: 1\")"
    );
    let unknown = status_of(
        client
            .execute("select * from nope".into(), None)
            .await
            .unwrap_err(),
    );
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    assert_eq!(
        unknown.message(),
        "Error during planning: table 'datafusion.public.nope' not found"
    );
    let two = status_of(
        client
            .execute("select 1; select 2".into(), None)
            .await
            .unwrap_err(),
    );
    assert_eq!(two.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        two.message(),
        "one statement per Flight SQL request, got 2: send them one by one"
    );
}

#[tokio::test]
async fn sessions_keep_their_own_views() {
    let server = server().await;
    let mut ann = client(&server).await;
    ann.handshake("ann", "").await.unwrap();
    let mut bob = client(&server).await;
    bob.handshake("bob", "").await.unwrap();
    let created = ann
        .execute_update(
            "create view big as select a from t where a > 1".into(),
            None,
        )
        .await
        .unwrap();
    assert_eq!(created, 0);
    assert_eq!(
        query(&mut ann, "select count(*) as n from big").await,
        "+---+\n| n |\n+---+\n| 2 |\n+---+"
    );
    let missing = status_of(
        bob.execute("select * from big".into(), None)
            .await
            .unwrap_err(),
    );
    assert_eq!(missing.code(), tonic::Code::NotFound, "{missing}");
    assert_eq!(server.endpoint.sessions().len(), 2);
    let mut forged = client(&server).await;
    forged.set_token("s1.00000000000000000000000000000000".into());
    let refused = status_of(forged.execute("select 1".into(), None).await.unwrap_err());
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
}

#[tokio::test]
async fn tables_are_listed_with_their_schemas() {
    let server = server().await;
    let mut client = client(&server).await;
    let info = client
        .get_tables(CommandGetTables {
            catalog: None,
            db_schema_filter_pattern: None,
            table_name_filter_pattern: Some("t".into()),
            table_types: vec![],
            include_schema: true,
        })
        .await
        .unwrap();
    let batches = fetch(&mut client, info).await;
    let text = pretty_format_batches(&batches).unwrap().to_string();
    assert_eq!(
        batches.iter().map(RecordBatch::num_rows).sum::<usize>(),
        1,
        "{text}"
    );
    assert!(
        text.contains("| datafusion   | public         | t          | TABLE      |"),
        "{text}"
    );
    let batch = &batches[0];
    let schema_bytes = batch
        .column_by_name("table_schema")
        .unwrap()
        .as_any()
        .downcast_ref::<arrow::array::BinaryArray>()
        .unwrap()
        .value(0)
        .to_vec();
    let schema = arrow::ipc::convert::try_schema_from_ipc_buffer(&schema_bytes).unwrap();
    let names: Vec<_> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(schema.field(0).data_type(), &DataType::Int64);
}

#[tokio::test]
async fn a_prepared_statement_runs_with_its_bound_parameters() {
    let server = server().await;
    let mut client = client(&server).await;
    let mut prepared = client
        .prepare("select b from t where a = $1".into(), None)
        .await
        .unwrap();
    assert_eq!(
        prepared.parameter_schema().unwrap().field(0).data_type(),
        &DataType::Int64
    );
    for (value, expected) in [(2, "y"), (3, "z")] {
        let parameters = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("$1", DataType::Int64, true)])),
            vec![Arc::new(Int64Array::from(vec![value]))],
        )
        .unwrap();
        prepared.set_parameters(parameters).unwrap();
        let info = prepared.execute().await.unwrap();
        let text = pretty_format_batches(&fetch(&mut client, info).await)
            .unwrap()
            .to_string();
        assert_eq!(text, format!("+---+\n| b |\n+---+\n| {expected} |\n+---+"));
    }
    prepared.close().await.unwrap();
}

#[tokio::test]
async fn with_accounts_only_a_right_password_opens_a_session() {
    let verifier = Verifier::new("s3cret", b"some salt", 64).to_text();
    let users = Users::parse(&format!("ann:{verifier}")).unwrap();
    let server = server_with(Some(users)).await;
    let mut client = client(&server).await;
    let anonymous = status_of(client.execute("select 1".into(), None).await.unwrap_err());
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);
    for (user, password) in [("ann", "wrong"), ("bob", "s3cret"), ("ann", "")] {
        // arrow-flight's client reports a failed handshake as text holding the status.
        let refused = client
            .handshake(user, password)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("code: 'The request does not have valid authentication credentials'")
                && refused.contains(&format!(
                    "message: \"wrong user name or password for '{user}'\""
                )),
            "{refused}"
        );
    }
    assert_eq!(server.endpoint.sessions().len(), 0);
    client.handshake("ann", "s3cret").await.unwrap();
    assert_eq!(
        query(&mut client, "select count(*) as n from t").await,
        "+---+\n| n |\n+---+\n| 3 |\n+---+"
    );
}

#[tokio::test]
async fn a_role_refusal_is_permission_denied_naming_what_was_refused() {
    let verifier = Verifier::new("pw", b"some salt", 64).to_text();
    let users = Users::parse(&format!("ann:{verifier}\nwes:{verifier} writer")).unwrap();
    let server = server_with(Some(users)).await;
    let dir = server._dir.path().canonicalize().unwrap();
    let mut reader = client(&server).await;
    reader.handshake("ann", "pw").await.unwrap();
    let refused = status_of(
        reader
            .execute("select * from '/etc/passwd'".into(), None)
            .await
            .unwrap_err(),
    );
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(
        refused.message(),
        format!(
            "permission denied for user 'ann' (reader): cannot read '/etc/passwd' (/etc/passwd): \
             it is not under a read root ({})",
            dir.display()
        )
    );
    assert_eq!(
        query(&mut reader, "select count(*) as n from t").await,
        "+---+\n| n |\n+---+\n| 3 |\n+---+"
    );
    let mut writer = client(&server).await;
    writer.handshake("wes", "pw").await.unwrap();
    let copy = format!("copy (select 1 as a) to '{}/out/x.csv'", dir.display());
    let refused = status_of(reader.execute(copy.clone(), None).await.unwrap_err());
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(
        refused.message(),
        "permission denied for user 'ann' (reader): COPY needs the writer role"
    );
    assert_eq!(
        query(&mut writer, &copy).await,
        "+-------+\n| count |\n+-------+\n| 1     |\n+-------+"
    );
    assert!(dir.join("out/x.csv").exists());
}

/// The median of `runs` runs of a small query, in seconds.
async fn median_latency(client: &mut FlightSqlServiceClient<Channel>, runs: usize) -> f64 {
    let mut seconds = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = std::time::Instant::now();
        query(client, "select count(*) as n from t").await;
        seconds.push(start.elapsed().as_secs_f64());
    }
    seconds.sort_by(f64::total_cmp);
    seconds[runs / 2]
}

/// 200 wrong passwords at once from one address: 5 (or the few more the hashing permits let in
/// while the fifth is hashed) are checked (PBKDF2 with Postgres's 4,096 rounds, on the blocking
/// pool) and refused as wrong, the others are refused before any hashing; a logged-in client's queries meanwhile keep their pace (median latency within 2x of
/// the idle server's), and even the right password is refused while the lockout lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_failed_logins_is_refused_after_five_and_does_not_stall_queries() {
    let verifier = Verifier::generate("s3cret").unwrap().to_text();
    let users = Users::parse(&format!("ann:{verifier}\nbob:{verifier}")).unwrap();
    let server = server_with(Some(users)).await;
    let mut bob = client(&server).await;
    bob.handshake("bob", "s3cret").await.unwrap();
    let idle = median_latency(&mut bob, 21).await;
    let channel = Channel::from_shared(format!("http://{}", server.endpoint.address()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let burst = futures::future::join_all((0..200).map(|_| {
        let mut client = FlightSqlServiceClient::new(channel.clone());
        async move {
            client
                .handshake("ann", "wrong")
                .await
                .unwrap_err()
                .to_string()
        }
    }));
    let (refusals, busy) = tokio::join!(burst, median_latency(&mut bob, 21));
    let wrong = refusals
        .iter()
        .filter(|r| r.contains("wrong user name or password for 'ann'"))
        .count();
    let limited = refusals
        .iter()
        .filter(|r| r.contains("too many failed logins for user 'ann': try again in "))
        .count();
    // The hashing permits let at most that many more past the check while the fifth is hashed.
    let most = 5 + sluice_server::sessions::HASHING_PERMITS - 1;
    assert!(
        (5..=most).contains(&wrong) && wrong + limited == 200,
        "{wrong} wrong, {limited} limited: {refusals:#?}"
    );
    assert!(
        busy <= 2.0 * idle,
        "median query latency {busy:.4} s during the burst, {idle:.4} s idle"
    );
    let locked = FlightSqlServiceClient::new(channel)
        .handshake("ann", "s3cret")
        .await
        .unwrap_err()
        .to_string();
    assert!(locked.contains("too many failed logins"), "{locked}");
}

#[tokio::test]
async fn only_loopback_addresses_serve_without_tls() {
    let base = SluiceSession::new(
        &SluiceConfig::default(),
        Arc::new(sluice_runtime::LocalRunner),
    )
    .unwrap();
    let sessions = Arc::new(Sessions::new(SessionFactory::new(base)).await.unwrap());
    let options = FlightSqlOptions {
        listen: "0.0.0.0:0".into(),
        tls: None,
    };
    let error = FlightSqlEndpoint::start(sessions, &options)
        .await
        .unwrap_err();
    let text = error.to_string();
    assert!(
        text.starts_with(
            "the Flight SQL endpoint would send passwords and session tokens in clear text on 0.0.0.0:"
        ) && text.ends_with(
            ": listen on a loopback address, or serve TLS (--serve-tls-cert FILE --serve-tls-key \
             FILE) with user accounts (--users FILE)"
        ),
        "{text}"
    );
}

/// `CancelFlightInfo` for `info`, and the status it answers.
async fn cancel_flight_info(
    client: &mut FlightSqlServiceClient<Channel>,
    info: &FlightInfo,
) -> i32 {
    use arrow_flight::{Action, CancelFlightInfoRequest, CancelFlightInfoResult};
    use prost::Message;
    let request = CancelFlightInfoRequest {
        info: Some(info.clone()),
    };
    let action = Action::new("CancelFlightInfo", request.encode_to_vec());
    let mut results = client.do_action(action).await.unwrap();
    let result = results.message().await.unwrap().unwrap();
    CancelFlightInfoResult::decode(result.body).unwrap().status
}

/// Minutes of work that returns nothing until it is done.
const LONG: &str = "select count(distinct value % 1000003) from generate_series(1, 5000000000)";

/// Fetches `info`'s rows in a task of its own.
fn fetch_in_background(
    client: &FlightSqlServiceClient<Channel>,
    info: &FlightInfo,
) -> SpawnedTask<Result<Vec<RecordBatch>, FlightError>> {
    let ticket = info.endpoint[0].ticket.clone().unwrap();
    let mut fetcher = client.clone();
    SpawnedTask::spawn(async move {
        let stream = fetcher.do_get(ticket).await?;
        stream.try_collect::<Vec<_>>().await
    })
}

/// Waits (up to 30 s) until `condition` holds.
async fn wait_for(what: &str, condition: impl Fn() -> bool) {
    let started = std::time::Instant::now();
    while !condition() {
        assert!(started.elapsed().as_secs() < 30, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn cancel_flight_info_ends_a_running_statement_and_drops_a_waiting_one() {
    use arrow_flight::CancelStatus;
    let server = server().await;
    let mut client = client(&server).await;
    let info = client.execute(LONG.to_string(), None).await.unwrap();
    let fetching = fetch_in_background(&client, &info);
    wait_for("the statement never ran", || {
        server.endpoint.running_statements() == 1
    })
    .await;
    assert_eq!(
        cancel_flight_info(&mut client, &info).await,
        CancelStatus::Cancelled as i32
    );
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), fetching.join())
        .await
        .expect("the cancelled DoGet ended")
        .unwrap()
        .unwrap_err();
    let status = status_of(ended);
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status}");
    assert!(
        status
            .message()
            .ends_with("was cancelled (CancelFlightInfo)"),
        "{status}"
    );
    assert_eq!(server.endpoint.running_statements(), 0);

    // A statement cancelled before its DoGet never runs.
    let waiting = client.execute("select 1".to_string(), None).await.unwrap();
    assert_eq!(
        cancel_flight_info(&mut client, &waiting).await,
        CancelStatus::Cancelled as i32
    );
    let ticket = waiting.endpoint[0].ticket.clone().unwrap();
    let refused = status_of(client.do_get(ticket).await.unwrap_err());
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused}");
    assert_eq!(server.endpoint.pending_statements(), 0);
}

#[tokio::test]
async fn beyond_max_concurrent_jobs_queries_updates_and_postgres_wait_until_a_running_one_ends() {
    let server = server_limited(None, Some(1)).await;
    let postgres = sluice_server::PgEndpoint::start(
        server.endpoint.sessions().clone(),
        &sluice_server::PgOptions {
            listen: "127.0.0.1:0".into(),
            tls: None,
        },
    )
    .await
    .unwrap();
    let mut client = client(&server).await;
    let long = client.execute(LONG.to_string(), None).await.unwrap();
    let long_fetch = fetch_in_background(&client, &long);
    wait_for("the long statement never ran", || {
        server.endpoint.running_statements() == 1
    })
    .await;
    assert_eq!(server.endpoint.queued_statements(), 0);
    let short = client
        .execute("select 7 as n".to_string(), None)
        .await
        .unwrap();
    let mut short_fetch = fetch_in_background(&client, &short);
    wait_for("the short statement never queued", || {
        server.endpoint.queued_statements() == 1
    })
    .await;
    // A statement update (DoPut) waits in the same queue.
    let mut update = {
        let mut client = client.clone();
        SpawnedTask::spawn(async move { client.execute_update("select 8".into(), None).await })
    };
    wait_for("the statement update never queued", || {
        server.endpoint.queued_statements() == 2
    })
    .await;
    // And so does a Postgres statement.
    let mut postgres_query = {
        let address = postgres.address();
        SpawnedTask::spawn(async move { pg_simple_query(address, "select 9 as n").await })
    };
    wait_for("the Postgres statement never queued", || {
        server.endpoint.queued_statements() == 3
    })
    .await;
    let early = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        short_fetch.join_unwind_mut(),
    )
    .await;
    assert!(early.is_err(), "it ran beyond the limit");
    let early = tokio::time::timeout(
        std::time::Duration::from_millis(100),
        update.join_unwind_mut(),
    )
    .await;
    assert!(early.is_err(), "the update ran beyond the limit");
    let early = tokio::time::timeout(
        std::time::Duration::from_millis(100),
        postgres_query.join_unwind_mut(),
    )
    .await;
    assert!(
        early.is_err(),
        "the Postgres statement ran beyond the limit"
    );
    assert_eq!(server.endpoint.queued_statements(), 3);
    cancel_flight_info(&mut client, &long).await;
    let rows = tokio::time::timeout(std::time::Duration::from_secs(10), short_fetch.join())
        .await
        .expect("the queued statement ran once the slot was free")
        .unwrap()
        .unwrap();
    assert_eq!(
        pretty_format_batches(&rows).unwrap().to_string(),
        "+---+\n| n |\n+---+\n| 7 |\n+---+"
    );
    let counted = tokio::time::timeout(std::time::Duration::from_secs(10), update.join())
        .await
        .expect("the queued update ran once the slot was free")
        .unwrap()
        .unwrap();
    assert_eq!(counted, 1, "the update counts its result's one row");
    let rows = tokio::time::timeout(std::time::Duration::from_secs(10), postgres_query.join())
        .await
        .expect("the queued Postgres statement ran once the slot was free")
        .unwrap();
    assert_eq!(rows, vec!["9".to_string()]);
    let ended = long_fetch.join().await.unwrap().unwrap_err();
    assert_eq!(status_of(ended).code(), tonic::Code::Cancelled);
    assert_eq!(server.endpoint.queued_statements(), 0);
}

#[tokio::test]
async fn a_thousand_idle_prepared_statements_over_ten_sessions_are_closed_after_their_expiry() {
    let verifier = Verifier::new("pw", b"some salt", 64).to_text();
    let users = Users::parse(&format!("ann:{verifier}")).unwrap();
    let limits = ServerLimits {
        prepared_per_session: 100,
        prepared_idle: std::time::Duration::from_secs(1),
        ..ServerLimits::default()
    };
    let server = server_on(
        Arc::new(sluice_runtime::LocalRunner),
        Some(users),
        None,
        limits,
    )
    .await;
    let mut clients = Vec::new();
    for _ in 0..10 {
        let mut client = client(&server).await;
        client.handshake("ann", "pw").await.unwrap();
        for _ in 0..100 {
            client
                .prepare("select * from t where a > $1".into(), None)
                .await
                .unwrap();
        }
        // The session holds its 100 (made well within the expiry): one more is refused. (All
        // 1,000 are not counted at one instant: on a loaded machine making them can take longer
        // than the expiry, and the first ones are rightly gone by then.)
        let refused = client
            .prepare("select 1".into(), None)
            .await
            .map(|_| ())
            .unwrap_err();
        let refused = status_of(refused);
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            refused.message(),
            "this session holds 100 prepared statements, the most one may \
             (max_prepared_statements): close one (one unused for 1 s is closed)"
        );
        clients.push(client);
    }
    assert!(server.endpoint.prepared_statements() > 0);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(server.endpoint.prepared_statements(), 0);
}

#[tokio::test]
async fn bound_parameters_beyond_their_limit_are_refused_and_sessions_per_user_are_bounded() {
    let verifier = Verifier::new("pw", b"some salt", 64).to_text();
    let users = Users::parse(&format!("ann:{verifier}")).unwrap();
    let limits = ServerLimits {
        parameter_bytes: 4096,
        sessions_per_user: 2,
        ..ServerLimits::default()
    };
    let server = server_on(
        Arc::new(sluice_runtime::LocalRunner),
        Some(users),
        None,
        limits,
    )
    .await;
    let mut client = client(&server).await;
    client.handshake("ann", "pw").await.unwrap();
    let mut prepared = client.prepare("select $1 as v".into(), None).await.unwrap();
    let big = RecordBatch::try_from_iter(vec![(
        "$1",
        Arc::new(arrow::array::StringArray::from(vec!["x".repeat(10_000)]))
            as arrow::array::ArrayRef,
    )])
    .unwrap();
    prepared.set_parameters(big).unwrap();
    let refused = status_of(prepared.execute().await.unwrap_err());
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        refused.message(),
        "the bound parameters are larger than max_parameter_bytes (4 KiB)"
    );
    let small = RecordBatch::try_from_iter(vec![(
        "$1",
        Arc::new(arrow::array::StringArray::from(vec!["small"])) as arrow::array::ArrayRef,
    )])
    .unwrap();
    prepared.set_parameters(small).unwrap();
    let info = prepared.execute().await.unwrap();
    let rows = pretty_format_batches(&fetch(&mut client, info).await)
        .unwrap()
        .to_string();
    assert!(rows.contains("| small |"), "{rows}");
    // Two sessions per user here: the third handshake is refused until one expires.
    let mut second = self::client(&server).await;
    second.handshake("ann", "pw").await.unwrap();
    let mut third = self::client(&server).await;
    let third = third.handshake("ann", "pw").await.unwrap_err().to_string();
    assert!(
        third
            .contains("user 'ann' holds 2 sessions, the most one user may (max_sessions_per_user)"),
        "{third}"
    );
}

/// `sql` through the Postgres wire's simple query protocol on a server without accounts (the
/// protocol by hand: startup, then one `Query`): the first column of each row, as text.
async fn pg_simple_query(address: std::net::SocketAddr, sql: &str) -> Vec<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let parameters = b"user\0sluice\0database\0sluice\0\0";
    let mut startup = ((8 + parameters.len()) as i32).to_be_bytes().to_vec();
    startup.extend_from_slice(&196_608i32.to_be_bytes());
    startup.extend_from_slice(parameters);
    socket.write_all(&startup).await.unwrap();
    async fn until_ready(socket: &mut tokio::net::TcpStream) -> Vec<String> {
        let mut rows = Vec::new();
        loop {
            let kind = socket.read_u8().await.unwrap();
            let length = socket.read_i32().await.unwrap() as usize;
            let mut body = vec![0; length - 4];
            socket.read_exact(&mut body).await.unwrap();
            match kind {
                b'Z' => return rows,
                b'E' => panic!(
                    "the server answered an error: {}",
                    String::from_utf8_lossy(&body)
                ),
                b'D' => {
                    let width = i32::from_be_bytes(body[2..6].try_into().unwrap()) as usize;
                    rows.push(String::from_utf8(body[6..6 + width].to_vec()).unwrap());
                }
                _ => {}
            }
        }
    }
    until_ready(&mut socket).await;
    let mut query = vec![b'Q'];
    query.extend_from_slice(&((4 + sql.len() + 1) as i32).to_be_bytes());
    query.extend_from_slice(sql.as_bytes());
    query.push(0);
    socket.write_all(&query).await.unwrap();
    until_ready(&mut socket).await
}

/// One `PollFlightInfo` with `descriptor`: the info's JSON progress report, the next descriptor
/// (none once complete) and the progress fraction.
async fn poll(
    client: &FlightSqlServiceClient<Channel>,
    descriptor: arrow_flight::FlightDescriptor,
) -> (
    serde_json::Value,
    Option<arrow_flight::FlightDescriptor>,
    Option<f64>,
    FlightInfo,
) {
    let polled = try_poll(client, descriptor).await.unwrap();
    let info = polled.info.unwrap();
    let json = if info.app_metadata.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&info.app_metadata).unwrap()
    };
    (json, polled.flight_descriptor, polled.progress, info)
}

/// One `PollFlightInfo` in `client`'s session (its token, if it shook hands).
async fn try_poll(
    client: &FlightSqlServiceClient<Channel>,
    descriptor: arrow_flight::FlightDescriptor,
) -> Result<arrow_flight::PollInfo, tonic::Status> {
    let mut request = tonic::Request::new(descriptor);
    if let Some(token) = client.token() {
        let header = format!("Bearer {token}").parse().unwrap();
        request.metadata_mut().insert("authorization", header);
    }
    let mut raw = client.inner().clone();
    Ok(raw.poll_flight_info(request).await?.into_inner())
}

fn statement_descriptor(sql: &str) -> arrow_flight::FlightDescriptor {
    use arrow_flight::sql::{CommandStatementQuery, ProstMessageExt};
    use prost::Message;
    let command = CommandStatementQuery {
        query: sql.to_string(),
        transaction_id: None,
    };
    arrow_flight::FlightDescriptor::new_cmd(command.as_any().encode_to_vec())
}

#[tokio::test]
async fn poll_flight_info_reports_planned_queued_running_tasks_and_finished() {
    let runner = Arc::new(sluice_runtime::LocalGraphRunner::default());
    let server = server_on(runner, None, Some(1), ServerLimits::default()).await;
    let mut client = client(&server).await;

    let (json, long_poll, progress, long) = poll(&client, statement_descriptor(LONG)).await;
    assert_eq!(json, serde_json::json!({"state": "planned"}));
    assert_eq!(progress, Some(0.0));
    let long_poll = long_poll.expect("a planned statement is not complete");
    let long_fetch = fetch_in_background(&client, &long);
    let started = std::time::Instant::now();
    let report = loop {
        let (json, next, _, _) = poll(&client, long_poll.clone()).await;
        assert!(
            next.is_some(),
            "a running statement is not complete: {json}"
        );
        if json["tasks_total"].as_u64().unwrap_or(0) > 0 {
            break json;
        }
        assert!(started.elapsed().as_secs() < 30, "no task progress: {json}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(report["state"], "running", "{report}");
    let line = report["line"].as_str().unwrap();
    let (done, total) = (
        report["tasks_done"].as_u64().unwrap(),
        report["tasks_total"].as_u64().unwrap(),
    );
    assert!(done < total, "{report}");
    assert!(
        line.contains(&format!(" · tasks {done}/{total} (")),
        "{line}"
    );
    assert!(
        line.starts_with(&format!("job {} · tasks ", report["job"])),
        "{line}"
    );

    let (_, short_poll, _, short) = poll(&client, statement_descriptor("select 7 as n")).await;
    let short_poll = short_poll.unwrap();
    let short_fetch = fetch_in_background(&client, &short);
    wait_for("the short statement never queued", || {
        server.endpoint.queued_statements() == 1
    })
    .await;
    let (json, _, progress, _) = poll(&client, short_poll.clone()).await;
    assert_eq!(
        json,
        serde_json::json!({"state": "queued", "queue_position": 1})
    );
    assert_eq!(progress, Some(0.0));

    cancel_flight_info(&mut client, &long).await;
    let rows = short_fetch.join().await.unwrap().unwrap();
    assert_eq!(
        pretty_format_batches(&rows).unwrap().to_string(),
        "+---+\n| n |\n+---+\n| 7 |\n+---+"
    );
    long_fetch.join().await.unwrap().unwrap_err();
    for finished in [short_poll, long_poll] {
        // The server unlists a statement once its call is dropped, just after the client's end.
        let mut report = poll(&client, finished.clone()).await;
        let started = std::time::Instant::now();
        while report.0["state"] == "running" && started.elapsed().as_secs() < 10 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            report = poll(&client, finished.clone()).await;
        }
        let (json, next, progress, _) = report;
        assert_eq!(json, serde_json::json!({"state": "finished"}));
        assert!(next.is_none(), "a finished statement is complete");
        assert_eq!(progress, Some(1.0));
    }

    // Metadata is complete at once.
    use arrow_flight::sql::{CommandGetCatalogs, ProstMessageExt};
    use prost::Message;
    let catalogs =
        arrow_flight::FlightDescriptor::new_cmd(CommandGetCatalogs {}.as_any().encode_to_vec());
    let (_, next, progress, info) = poll(&client, catalogs).await;
    assert!(next.is_none());
    assert_eq!(progress, Some(1.0));
    assert_eq!(info.endpoint.len(), 1);
}

/// A self-signed certificate for 127.0.0.1 as PEM files in `dir`: (cert, key).
fn self_signed(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    let paths = (dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&paths.0, cert.pem()).unwrap();
    std::fs::write(&paths.1, key.serialize_pem()).unwrap();
    paths
}

#[tokio::test]
async fn any_address_serves_only_with_tls_and_user_accounts() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = self_signed(dir.path());
    let tls = sluice_server::tls::FrontDoorTls::from_files(&cert, &key).unwrap();
    let options = FlightSqlOptions {
        listen: "0.0.0.0:0".into(),
        tls: Some(tls),
    };
    let base = || {
        SluiceSession::new(
            &SluiceConfig::default(),
            Arc::new(sluice_runtime::LocalRunner),
        )
        .unwrap()
    };
    let open = Arc::new(Sessions::new(SessionFactory::new(base())).await.unwrap());
    let error = FlightSqlEndpoint::start(open, &options).await.unwrap_err();
    let text = error.to_string();
    assert!(
        text.ends_with(
            "would let anyone who reaches it run SQL as the server: give it user accounts \
             (--users FILE)"
        ),
        "{text}"
    );
    let verifier = Verifier::new("s3cret", b"some salt", 64).to_text();
    let users = Users::parse(&format!("ann:{verifier}")).unwrap();
    let guarded = Arc::new(
        Sessions::with_users(SessionFactory::new(base()), Some(users))
            .await
            .unwrap(),
    );
    let endpoint = FlightSqlEndpoint::start(guarded, &options).await.unwrap();
    assert!(
        endpoint.address().ip().is_unspecified(),
        "{}",
        endpoint.address()
    );

    let broken =
        std::fs::write(dir.path().join("empty.pem"), "").map(|()| dir.path().join("empty.pem"));
    let error = sluice_server::tls::FrontDoorTls::from_files(&broken.unwrap(), &key).unwrap_err();
    assert!(
        error
            .to_string()
            .ends_with("empty.pem: not a PEM certificate chain: no certificate in it"),
        "{error}"
    );
}

#[tokio::test]
async fn a_statement_is_polled_only_by_its_own_session_and_a_forged_descriptor_is_refused() {
    let server = server().await;
    let mut ann = client(&server).await;
    ann.handshake("ann", "").await.unwrap();
    let mut bob = client(&server).await;
    bob.handshake("bob", "").await.unwrap();
    let polled = try_poll(&ann, statement_descriptor("select 1"))
        .await
        .unwrap();
    let descriptor = polled.flight_descriptor.unwrap();
    let stranger = try_poll(&bob, descriptor.clone()).await.unwrap_err();
    assert_eq!(stranger.code(), tonic::Code::PermissionDenied, "{stranger}");
    assert!(
        stranger.message().ends_with("belongs to another session"),
        "{stranger}"
    );
    let forged = arrow_flight::FlightDescriptor::new_cmd(b"sluice-poll:not a flight info".to_vec());
    let refused = try_poll(&ann, forged).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    assert!(
        refused.message().starts_with("not a poll descriptor"),
        "{refused}"
    );
    // Its owner still sees it planned.
    let mine = try_poll(&ann, descriptor).await.unwrap();
    assert_eq!(
        mine.info.unwrap().app_metadata.as_ref(),
        b"{\"state\":\"planned\"}"
    );
}
