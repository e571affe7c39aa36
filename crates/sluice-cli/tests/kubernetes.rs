//! `--cluster-manager kubernetes` against a fake API server (`fake_kube`): worker pods that run
//! real `sluice worker` processes at their own loopback addresses, created while task regions
//! wait, deleted when idle and when the driver stops, replaced when they fail, and a pod that
//! cannot pull its image failing the query that waits for it with its reason. Also: the
//! manifests in `deploy/kubernetes/` parse into Kubernetes' own types without losing a field.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod fake_kube;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Server, assert_pytest_passes, python_clients, sf01_dir as sf01, signal, sluice};
use fake_kube::FakeKube;

const SECRET: &str = "kubernetes-test-cluster-secret";

/// A fake API server with the cluster secret in Secret `sluice-cluster-secret`, and a `sluice
/// server --cluster-manager kubernetes` with `flags` using it.
fn kube_server(flags: &[&str], dir: &Path) -> (FakeKube, Server) {
    let fake = FakeKube::start(&[("sluice-cluster-secret", "secret", SECRET)], dir);
    let kubeconfig = fake.kubeconfig(dir, "sluice-test");
    let mut all = vec!["--cluster-manager", "kubernetes"];
    all.extend_from_slice(flags);
    let server = Server::start_with_env(
        &all,
        &[],
        Some(sf01()),
        None,
        &[
            ("KUBECONFIG", kubeconfig.to_str().unwrap()),
            ("SLUICE_SECRET", SECRET),
            ("SLUICE_LOG", "sluice::cluster=info"),
        ],
    );
    (fake, server)
}

fn wait_for(what: &str, seconds: u64, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {seconds} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// The TPC-H queries of SF 0.1 as `qNN.sql`.
fn query_files() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tpch-queries-sf0.1");
    common::tpch_into("queries", "0.1", &dir);
    dir
}

#[test]
fn worker_pods_follow_the_load_answer_tpch_like_local_mode_and_go_when_the_driver_stops() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, server) = kube_server(
        &[
            "--workers",
            "1",
            "--min-workers",
            "1",
            "--max-workers",
            "3",
            "--slots",
            "8",
            "--worker-idle-timeout",
            "2s",
        ],
        dir.path(),
    );
    assert_eq!(fake.pods().len(), 1, "{:?}", fake.pods());
    let local = Server::start(&["--mode", "local"], sf01());
    let queries = query_files();
    assert_pytest_passes(
        &python_clients(),
        "test_flight_sql.py",
        &["-k", "test_tpch_query_equals_local_mode"],
        &[
            ("SLUICE_FLIGHT_SQL", &server.url),
            ("SLUICE_FLIGHT_SQL_LOCAL", &local.url),
            // Read when the suite's shared helpers are imported.
            ("SLUICE_PG", &server.pg),
            ("SLUICE_PG_LOCAL", &local.pg),
            ("SLUICE_TPCH_QUERIES", queries.to_str().unwrap()),
        ],
        22,
    );
    // Regions of up to 19 tasks on 8-slot workers: the manager went up to its maximum of 3.
    assert_eq!(fake.peak(), 3, "created: {:?}", fake.created());
    // Idle for 2 s, two of them are let go (their pods deleted): the floor of 1 stays.
    wait_for("back to one worker pod", 30, || fake.pods().len() == 1);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(fake.pods().len(), 1, "{:?}", fake.pods());
    let pids = fake.all_pids();
    assert!(pids.len() >= 3, "{pids:?}");
    // SIGTERM to the driver: every pod it made is deleted, every worker process gone.
    let said = server.stop();
    assert_eq!(fake.pods().len(), 0, "{:?}\n{said:?}", fake.pods());
    assert!(pids.iter().all(|pid| !alive(*pid)), "{pids:?}");
}

#[test]
fn a_worker_pod_whose_process_dies_mid_query_fails_is_replaced_and_the_answers_stay_right() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, server) = kube_server(&["--workers", "2", "--slots", "16"], dir.path());
    let first = fake.created();
    assert_eq!(first.len(), 2);
    let run = sluice()
        .args(["tpch", "run", "--connect", &server.url])
        .args(["--data", sf01().to_str().unwrap(), "--compare-local"])
        .args(["--iterations", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Killed while a task runs there.
    let victim = &first[0];
    let ip = fake.pod(victim).unwrap()["status"]["podIP"]
        .as_str()
        .unwrap()
        .to_string();
    wait_for("a task running on the first pod", 60, || {
        let (_, body) = common::http("GET", &server.http, "/api/v1/workers");
        body.as_array().unwrap().iter().any(|w| {
            w["address"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{ip}:"))
                && w["running_tasks"].as_u64().unwrap() > 0
        })
    });
    signal(fake.pid_of(victim).unwrap(), "KILL");
    let output = run.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("22 passed, 0 failed"), "{stdout}");
    // The pod turned Failed, was deleted, and a third pod took its place.
    assert_eq!(fake.ended(), [(victim.clone(), "Failed".to_string())]);
    wait_for("the failed pod deleted", 10, || {
        !fake.pods().contains_key(victim)
    });
    let created = fake.created();
    assert!(created.len() >= 3, "{created:?}");
    wait_for("two running pods again", 30, || {
        fake.pods().values().filter(|p| *p == "Running").count() == 2
    });
    drop(server);
}

#[test]
fn a_pod_that_cannot_pull_its_image_fails_the_query_waiting_for_it_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, server) = kube_server(
        &[
            "--workers",
            "1",
            "--max-workers",
            "2",
            "--slots",
            "8",
            "--capacity-wait",
            "4s",
        ],
        dir.path(),
    );
    fake.pull_fails(true);
    let started = Instant::now();
    // q9's largest region needs more than the one worker's 8 slots.
    let output = sluice()
        .args(["tpch", "run", "--connect", &server.url])
        .args(["--data", sf01().to_str().unwrap(), "-q", "9"])
        .output()
        .unwrap();
    let took = started.elapsed();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{said}");
    assert!(
        said.contains("(capacity_wait); the cluster manager says: pod "),
        "{said}"
    );
    assert!(
        said.contains("cannot start: ErrImagePull: failed to pull image"),
        "{said}"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    let pending: Vec<String> = fake
        .pods()
        .into_iter()
        .filter(|(_, phase)| phase == "Pending")
        .map(|(name, _)| name)
        .collect();
    assert_eq!(pending.len(), 1, "{:?}", fake.pods());
    drop(server);
}

/// Every manifest in `deploy/kubernetes/`, parsed into the Kubernetes type its `kind` names and
/// written back, is the file itself (no field lost or misspelled); the Role grants verbs on pods
/// only, in one namespace.
#[test]
fn the_manifests_round_trip_through_the_kubernetes_types_and_the_role_touches_pods_only() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use serde_json::Value;

    fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(document: &Value) -> Value {
        let typed: T = serde_json::from_value(document.clone()).unwrap();
        serde_json::to_value(typed).unwrap()
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
    let mut kinds = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let documents: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
        for document in documents {
            let kind = document["kind"].as_str().unwrap().to_string();
            let back = match kind.as_str() {
                "Deployment" => round_trip::<Deployment>(&document),
                "Service" => round_trip::<Service>(&document),
                "ServiceAccount" => round_trip::<ServiceAccount>(&document),
                "Role" => round_trip::<Role>(&document),
                "RoleBinding" => round_trip::<RoleBinding>(&document),
                "ConfigMap" => round_trip::<ConfigMap>(&document),
                other => panic!("{}: no check for kind {other}", file.display()),
            };
            assert_eq!(back, document, "{} ({kind})", file.display());
            if kind == "Role" {
                let role: Role = serde_json::from_value(document.clone()).unwrap();
                assert!(role.metadata.namespace.is_some(), "a namespaced Role");
                for rule in role.rules.unwrap() {
                    assert_eq!(rule.api_groups, Some(vec![String::new()]));
                    assert_eq!(rule.resources, Some(vec!["pods".to_string()]));
                    assert_eq!(rule.resource_names, None);
                }
            }
            kinds.push(kind);
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "Deployment",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount"
        ]
    );
}
