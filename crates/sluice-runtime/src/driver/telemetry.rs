//! The driver's Prometheus series, recorded through the `metrics` facade: every name is here, and
//! the driver calls these functions where the things they count happen. A process that installs no
//! recorder (tests, the CLI) pays a no-op; `sluice server` installs the Prometheus one and serves it
//! on `/metrics`.
//!
//! | series | kind | labels | counts |
//! | --- | --- | --- | --- |
//! | `sluice_jobs_total` | counter | `state` | jobs that ended, by how |
//! | `sluice_job_duration_seconds` | histogram | `state` | submission to end of each ended job |
//! | `sluice_rows_returned_total` | counter | | rows the succeeded jobs' final stages wrote |
//! | `sluice_tasks_total` | counter | `state` | task attempts that ended, by how |
//! | `sluice_regions_retried_total` | counter | | task regions run again (failure or lineage) |
//! | `sluice_tasks_retried_total` | counter | | task attempts started again |
//! | `sluice_workers_lost_total` | counter | | workers declared lost |
//! | `sluice_shuffle_bytes_total` | counter | | bytes succeeded attempts wrote to output channels |
//! | `sluice_spill_bytes_total` | counter | | bytes succeeded attempts spilled to disk |
//!
//! The retry, lost-worker and byte counters are the driver's own `DriverCounters`, and the gauges
//! of the present (running jobs and tasks, workers, memory per worker) come from the cluster state:
//! whoever serves the scrape sets both from the state read then ([`describe`] names them too).
//!
//! Invariant: each job and each task attempt is counted once, when it leaves `running`; the
//! counters read from `DriverCounters` are never counted twice, because nothing else counts them.

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, histogram};

use super::attempts::TaskRecord;
use super::history::JobRecord;

/// Ended jobs by state.
pub const JOBS_TOTAL: &str = "sluice_jobs_total";
/// Ended jobs' latency.
pub const JOB_DURATION_SECONDS: &str = "sluice_job_duration_seconds";
/// Rows returned by succeeded jobs.
pub const ROWS_RETURNED_TOTAL: &str = "sluice_rows_returned_total";
/// Ended task attempts by state.
pub const TASKS_TOTAL: &str = "sluice_tasks_total";
/// Regions run again.
pub const REGIONS_RETRIED_TOTAL: &str = "sluice_regions_retried_total";
/// Task attempts started again.
pub const TASKS_RETRIED_TOTAL: &str = "sluice_tasks_retried_total";
/// Workers lost.
pub const WORKERS_LOST_TOTAL: &str = "sluice_workers_lost_total";
/// Shuffled bytes.
pub const SHUFFLE_BYTES_TOTAL: &str = "sluice_shuffle_bytes_total";
/// Spilled bytes.
pub const SPILL_BYTES_TOTAL: &str = "sluice_spill_bytes_total";
/// Bytes tasks read from earlier stages, by `via`: `local` (their own worker's store) or `flight`
/// (another worker, over Arrow Flight).
pub const SHUFFLE_READ_BYTES_TOTAL: &str = "sluice_shuffle_read_bytes_total";
/// Running jobs (a gauge set at scrape time).
pub const JOBS_RUNNING: &str = "sluice_jobs_running";
/// Running task attempts (a gauge set at scrape time).
pub const TASKS_RUNNING: &str = "sluice_tasks_running";
/// Registered workers (a gauge set at scrape time).
pub const WORKERS: &str = "sluice_workers";
/// Bytes each worker's memory pool handed out (a gauge set at scrape time, label `worker`).
pub const WORKER_MEMORY_USED_BYTES: &str = "sluice_worker_memory_used_bytes";

/// Bucket bounds of [`JOB_DURATION_SECONDS`], from interactive to batch.
pub const JOB_DURATION_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Gives every series its help text and unit (call once, after installing a recorder).
pub fn describe() {
    describe_counter!(JOBS_TOTAL, "Jobs that ended, by state");
    describe_histogram!(
        JOB_DURATION_SECONDS,
        Unit::Seconds,
        "Time from a job's submission to its end"
    );
    describe_counter!(
        ROWS_RETURNED_TOTAL,
        "Rows the final stages of succeeded jobs wrote"
    );
    describe_counter!(TASKS_TOTAL, "Task attempts that ended, by state");
    describe_counter!(
        REGIONS_RETRIED_TOTAL,
        "Task regions run again after a failure or a lost output"
    );
    describe_counter!(TASKS_RETRIED_TOTAL, "Task attempts started again");
    describe_counter!(WORKERS_LOST_TOTAL, "Workers declared lost");
    describe_counter!(
        SHUFFLE_BYTES_TOTAL,
        Unit::Bytes,
        "Bytes succeeded task attempts wrote to their output channels"
    );
    describe_counter!(
        SPILL_BYTES_TOTAL,
        Unit::Bytes,
        "Bytes succeeded task attempts spilled to disk"
    );
    describe_counter!(
        SHUFFLE_READ_BYTES_TOTAL,
        Unit::Bytes,
        "Bytes succeeded task attempts read from earlier stages, by via (local store or Flight)"
    );
    describe_gauge!(JOBS_RUNNING, "Jobs running now");
    describe_gauge!(TASKS_RUNNING, "Task attempts holding a slot now");
    describe_gauge!(WORKERS, "Workers registered now");
    describe_gauge!(
        WORKER_MEMORY_USED_BYTES,
        Unit::Bytes,
        "Bytes a worker's memory pool has handed out"
    );
}

/// `job` left `running`.
pub(crate) fn job_ended(job: &JobRecord) {
    let state = job.state.name();
    counter!(JOBS_TOTAL, "state" => state).increment(1);
    histogram!(JOB_DURATION_SECONDS, "state" => state).record(job.elapsed_ms() as f64 / 1000.0);
    if job.state == super::JobState::Succeeded {
        counter!(ROWS_RETURNED_TOTAL).increment(job.rows);
    }
}

/// `task` left `running`.
pub(crate) fn task_ended(task: &TaskRecord) {
    counter!(TASKS_TOTAL, "state" => task.state.name()).increment(1);
}
