//! Prometheus `/metrics` of `sluice server`: the process's `metrics` recorder (installed once, on
//! the first REST endpoint) rendered in the text exposition format. The driver counts jobs and tasks
//! as they end (`sluice_runtime::telemetry` names every series); its own `DriverCounters` (retries,
//! lost workers, shuffled and spilled bytes) and the gauges of the present (running jobs and tasks,
//! workers, memory per worker) are set here from the cluster state read at each scrape.
//!
//! Invariants: one recorder per process (a second endpoint shares it; a process where another
//! recorder was installed answers `/metrics` with 503 saying so); a worker gauge that no scrape
//! set for [`GAUGE_IDLE`] is dropped, so a lost worker leaves the exposition.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use sluice_runtime::{JobRunner, telemetry};

/// How often histogram samples are folded into their buckets between scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// How long a gauge no scrape set stays in the exposition.
pub const GAUGE_IDLE: Duration = Duration::from_secs(60);

/// The process's Prometheus recorder, installed on first use; `Err` says why there is none.
fn handle() -> Result<&'static PrometheusHandle, &'static str> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .idle_timeout(MetricKindMask::GAUGE, Some(GAUGE_IDLE))
                .set_buckets_for_metric(
                    Matcher::Full(telemetry::JOB_DURATION_SECONDS.to_string()),
                    telemetry::JOB_DURATION_BUCKETS,
                )
                .and_then(|builder| builder.install_recorder())
                .map_err(|e| format!("the Prometheus recorder could not be installed: {e}"))?;
            telemetry::describe();
            // Histogram samples are folded into their buckets at a scrape or an upkeep; without
            // scrapes they would pile up, so a thread of the process folds them every few seconds.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("sluice-metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(UPKEEP_EVERY);
                        upkeep.run_upkeep();
                    }
                })
                .map_err(|e| format!("the metrics upkeep thread could not start: {e}"))?;
            Ok(handle)
        })
        .as_ref()
        .map_err(String::as_str)
}

/// Installs the recorder now, so that the driver's counters count from the server's start.
pub fn install() -> Result<(), String> {
    handle().map(|_| ()).map_err(str::to_string)
}

/// The exposition after setting the driver's counters and the gauges from `runner`'s cluster, or
/// why there is none.
pub async fn render(runner: &dyn JobRunner) -> Result<String, String> {
    let handle = handle().map_err(str::to_string)?;
    let state = runner.cluster_state().await.map_err(|e| e.to_string())?;
    let driver = state.as_ref().map(|s| s.driver.clone()).unwrap_or_default();
    let counters = driver.counters;
    counter!(telemetry::REGIONS_RETRIED_TOTAL).absolute(counters.regions_retried as u64);
    counter!(telemetry::TASKS_RETRIED_TOTAL).absolute(counters.tasks_retried as u64);
    counter!(telemetry::WORKERS_LOST_TOTAL).absolute(counters.workers_lost as u64);
    counter!(telemetry::SHUFFLE_BYTES_TOTAL).absolute(counters.shuffled_bytes);
    counter!(telemetry::SPILL_BYTES_TOTAL).absolute(counters.spilled_bytes);
    counter!(telemetry::SHUFFLE_READ_BYTES_TOTAL, "via" => "local")
        .absolute(counters.read_local_bytes);
    counter!(telemetry::SHUFFLE_READ_BYTES_TOTAL, "via" => "flight")
        .absolute(counters.read_remote_bytes);
    gauge!(telemetry::JOBS_RUNNING).set(driver.scheduler_jobs as f64);
    gauge!(telemetry::TASKS_RUNNING).set(driver.running_tasks as f64);
    gauge!(telemetry::WORKERS).set(driver.workers.len() as f64);
    for worker in state.iter().flat_map(|s| &s.workers) {
        gauge!(telemetry::WORKER_MEMORY_USED_BYTES, "worker" => worker.address.clone())
            .set(worker.memory_used as f64);
    }
    Ok(handle.render())
}
