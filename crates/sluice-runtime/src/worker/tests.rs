//! The worker's running set under races between `run_task`, an attempt's own end and its report.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use datafusion::arrow::array::{Int64Array, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::prelude::SessionContext;
use futures::FutureExt;
use futures::future::BoxFuture;
use sluice_planner::{AttemptKey, JobId, OutputDistribution, OutputMode, StageId, WorkerId};
use tokio::sync::Notify;

use super::{Worker, WorkerOptions};
use crate::definition::{StagePlan, TaskDefinition, TaskState, TaskStatusReport};
use crate::transport::{InProcessNetwork, StatusReporter};

/// Holds every final report until released, telling `started` when one begins; records the
/// reports whose delivery completed.
struct HeldFinalReports {
    started: Arc<AtomicUsize>,
    release: Arc<Notify>,
    delivered: Arc<Mutex<Vec<(AttemptKey, u64, bool)>>>,
}

impl StatusReporter for HeldFinalReports {
    fn report(&self, report: TaskStatusReport) -> BoxFuture<'static, ()> {
        let release = Arc::clone(&self.release);
        let delivered = Arc::clone(&self.delivered);
        let final_report = report.state.is_final();
        if final_report {
            self.started.fetch_add(1, Ordering::SeqCst);
        }
        async move {
            if final_report {
                release.notified().await;
            }
            let succeeded = matches!(report.state, TaskState::Succeeded(_));
            delivered
                .lock()
                .unwrap()
                .push((report.attempt, report.sequence, succeeded));
        }
        .boxed()
    }
}

fn one_batch_task(key: AttemptKey) -> TaskDefinition {
    let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(Int64Array::from(vec![1, 2, 3]))],
    )
    .unwrap();
    let plan = MemorySourceConfig::try_new_exec(&[vec![batch]], schema, None).unwrap();
    TaskDefinition {
        attempt: key,
        plan: StagePlan::InMemory {
            plan,
            context: SessionContext::new().task_ctx(),
        },
        inputs: vec![],
        output: OutputDistribution::RoundRobin { channels: 1 },
        replicas: 1,
        output_mode: OutputMode::Blocking,
        config: Arc::new(HashMap::new()),
        memory_limit: None,
        report_plan_metrics: false,
        summarise_columns: Vec::new(),
        runtime_filters: Vec::new(),
        announce_running: true,
    }
}

/// Runs `one_batch_task` of attempt 0 of task 0/0 of job 1 on `worker` (as the first task it
/// accepted) and returns its key.
async fn run_one_batch_task(worker: &Worker) -> AttemptKey {
    start(worker, one_batch_task(FIRST_ATTEMPT)).await;
    FIRST_ATTEMPT
}

/// Attempt 0 of task 0/0 of job 1.
const FIRST_ATTEMPT: AttemptKey = AttemptKey {
    job: JobId(1),
    stage: StageId(0),
    partition: 0,
    attempt: 0,
};

/// Starts `definition` on `worker` as the first task it accepted (`run_task` is called off the
/// runtime, as the control plane calls it).
async fn start(worker: &Worker, definition: TaskDefinition) {
    let spawned = tokio::task::spawn_blocking({
        let worker = worker.clone();
        move || worker.run_task(definition)
    });
    assert_eq!(spawned.await.unwrap().unwrap(), 1);
}

/// A worker whose unannounced attempts report `Running` once they outlive `grace`.
fn worker_with_grace(grace: Duration) -> Worker {
    let options = WorkerOptions {
        running_report_grace: grace,
        ..WorkerOptions::default()
    };
    Worker::new("w", "w:0", options, Arc::new(InProcessNetwork::default())).unwrap()
}

/// `run_task`'s caller is held after the spawn until the attempt's final report is under way
/// (or 2 s passed, when the running set keeps the attempt from finishing meanwhile). The report
/// must then complete, exactly once: the late half of `run_task` must not take the ended attempt
/// for a stopped one and abort it mid-report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_ends_before_run_task_returns_delivers_its_final_report() {
    let started = Arc::new(AtomicUsize::new(0));
    let held_until_started = Arc::clone(&started);
    let options = WorkerOptions {
        after_spawn: Some(Arc::new(move |_: &AttemptKey| {
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while held_until_started.load(Ordering::SeqCst) == 0
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        })),
        ..WorkerOptions::default()
    };
    let network = InProcessNetwork::default();
    let worker = Worker::new("w", "w:0", options, Arc::new(network)).unwrap();
    let release = Arc::new(Notify::new());
    let delivered = Arc::new(Mutex::new(Vec::new()));
    worker
        .set_reporter(
            WorkerId(1),
            Arc::new(HeldFinalReports {
                started: Arc::clone(&started),
                release: Arc::clone(&release),
                delivered: Arc::clone(&delivered),
            }),
        )
        .unwrap();
    let key = run_one_batch_task(&worker).await;
    // The final report has begun (at the latest once `run_task` let the attempt finish).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while started.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(started.load(Ordering::SeqCst), 1);
    release.notify_one();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while delivered.lock().unwrap().len() < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        *delivered.lock().unwrap(),
        vec![(key, 1, false), (key, 2, true)]
    );
    assert_eq!(worker.counts().0, 0);
}

/// A report as recorded: the worker id it carries, its attempt and sequence, whether it says
/// succeeded.
type ReportSeen = (WorkerId, AttemptKey, u64, bool);

/// Records every report it is given, with the worker id it carries.
struct Recorded(Arc<Mutex<Vec<ReportSeen>>>);

impl StatusReporter for Recorded {
    fn report(&self, report: TaskStatusReport) -> BoxFuture<'static, ()> {
        let succeeded = matches!(report.state, TaskState::Succeeded(_));
        self.0
            .lock()
            .unwrap()
            .push((report.worker, report.attempt, report.sequence, succeeded));
        async {}.boxed()
    }
}

/// A `RunTask` can reach a worker before the reply to its registration does. The attempt's
/// `Running` report then waits for the reporter instead of being dropped (a final task whose
/// `Running` the driver never saw left its output unread), and both reports carry the id the
/// driver gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_of_a_task_started_before_the_worker_registered_wait_and_arrive_in_order() {
    let network = InProcessNetwork::default();
    let worker = Worker::new("w", "w:0", WorkerOptions::default(), Arc::new(network)).unwrap();
    let key = run_one_batch_task(&worker).await;
    // The attempt runs (its output exists) while the worker has no reporter yet.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while worker.store().counts().outputs == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(worker.store().counts().outputs, 1);
    let recorded = Arc::new(Mutex::new(Vec::new()));
    worker
        .set_reporter(WorkerId(7), Arc::new(Recorded(Arc::clone(&recorded))))
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while recorded.lock().unwrap().len() < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        *recorded.lock().unwrap(),
        vec![(WorkerId(7), key, 1, false), (WorkerId(7), key, 2, true)]
    );
}

/// One batch, produced after `delay` (a task that waits that long, as for its input).
#[derive(Debug)]
struct SlowBatch {
    delay: Duration,
    batch: RecordBatch,
}

impl datafusion::physical_plan::streaming::PartitionStream for SlowBatch {
    fn schema(&self) -> &datafusion::arrow::datatypes::SchemaRef {
        self.batch.schema_ref()
    }

    fn execute(
        &self,
        _: Arc<datafusion::execution::TaskContext>,
    ) -> datafusion::execution::SendableRecordBatchStream {
        let (delay, batch) = (self.delay, self.batch.clone());
        let batch = futures::stream::once(async move {
            tokio::time::sleep(delay).await;
            Ok(batch)
        });
        Box::pin(
            datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                self.batch.schema(),
                batch,
            ),
        )
    }
}

/// `one_batch_task` whose batch comes after `delay`, of an attempt the driver does not wait on
/// (not of the final stage).
fn slow_task(key: AttemptKey, delay: Duration) -> TaskDefinition {
    let mut definition = one_batch_task(key);
    let StagePlan::InMemory { plan, context } = definition.plan else {
        unreachable!("one_batch_task runs an in-memory plan");
    };
    let batch = RecordBatch::try_new(
        plan.schema(),
        vec![Arc::new(Int64Array::from(vec![1, 2, 3]))],
    )
    .unwrap();
    let slow = datafusion::physical_plan::streaming::StreamingTableExec::try_new(
        plan.schema(),
        vec![Arc::new(SlowBatch { delay, batch })],
        None,
        Vec::new(),
        false,
        None,
    )
    .unwrap();
    definition.plan = StagePlan::InMemory {
        plan: Arc::new(slow),
        context,
    };
    definition.announce_running = false;
    definition
}

/// The reports `worker` sends for `definition` (run as its first task), once its final one
/// arrived and `quiet` passed in which no other came.
async fn reports_of(
    worker: &Worker,
    definition: TaskDefinition,
    quiet: Duration,
) -> Vec<ReportSeen> {
    let recorded = Arc::new(Mutex::new(Vec::new()));
    worker
        .set_reporter(WorkerId(7), Arc::new(Recorded(Arc::clone(&recorded))))
        .unwrap();
    start(worker, definition).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !recorded.lock().unwrap().iter().any(|r| r.2 == 2)
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(quiet).await;
    recorded.lock().unwrap().clone()
}

/// A task whose `Running` the driver does not act on and that ends within the grace sends its
/// final report alone: one round trip to the driver instead of two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_task_the_driver_does_not_wait_on_sends_only_its_final_report() {
    // A grace no debug build under load outlives with one batch of three rows.
    let worker = worker_with_grace(Duration::from_secs(2));
    let key = FIRST_ATTEMPT;
    let mut definition = one_batch_task(key);
    definition.announce_running = false;
    assert_eq!(
        reports_of(&worker, definition, Duration::from_millis(200)).await,
        vec![(WorkerId(7), key, 2, true)]
    );
}

/// The same task running past the grace reports `Running` first (the driver then knows it
/// started, should the reply to its `RunTask` be lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_outlives_the_grace_reports_running_before_its_end() {
    let worker = worker_with_grace(Duration::from_millis(10));
    let key = FIRST_ATTEMPT;
    let definition = slow_task(key, Duration::from_millis(300));
    assert_eq!(
        reports_of(&worker, definition, Duration::from_millis(50)).await,
        vec![(WorkerId(7), key, 1, false), (WorkerId(7), key, 2, true)]
    );
}

/// A final-stage task (`announce_running`) reports `Running` at once, however short it is and
/// however long the grace: the job output starts reading it then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announced_task_reports_running_at_once_however_short() {
    let worker = worker_with_grace(Duration::from_secs(60));
    let key = FIRST_ATTEMPT;
    let definition = one_batch_task(key);
    assert!(definition.announce_running);
    assert_eq!(
        reports_of(&worker, definition, Duration::from_millis(50)).await,
        vec![(WorkerId(7), key, 1, false), (WorkerId(7), key, 2, true)]
    );
}
