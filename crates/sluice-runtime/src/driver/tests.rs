//! Deterministic tests of the driver actor: fake workers record what the driver asks of them, the
//! test plays their reports, a fake data plane serves scripted final-stage streams, and tokio's
//! clock is paused (a heartbeat timeout happens when the test lets time pass, never by accident).
//!
//! ```text
//!   test ── Driver::execute(graph) ──► actor ── RunTask / StopTask / ReleaseOutput / CleanUpJob ──► FakeWorker (log)
//!     │                                  ▲                                                          │
//!     └── Driver::report(TaskStatusReport) ┘        job output ◄── FakeFetcher (scripted streams) ◄─┘
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use datafusion::arrow::array::{Int64Array, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::DataFusionError;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{ExecutionPlan, PlanProperties};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, stream};
use sluice_planner::{
    AttemptKey, InputMode, JobGraph, JobId, OutputDistribution, OutputMode, Stage, StageId,
    StageInput, StageInputExec, StreamId, TaskPlacement, WorkerId,
};

use super::*;
use crate::analyze::TaskMetrics;
use crate::definition::{TaskDefinition, TaskState};
use crate::error::{ErrorKind, RemoteError};
use crate::transport::{RunTaskError, StreamFetcher, WorkerClient};

/// What a fake worker was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Run(AttemptKey),
    Stop(AttemptKey),
    Release(AttemptKey),
    CleanUp(JobId),
    Filter(crate::definition::RuntimeFilterUpdate),
}

/// How a fake worker answers `RunTask`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Accept,
    /// Accepted, the answer coming back after `Duration`.
    AcceptAfter(Duration),
    Refuse,
    /// No answer comes back (after `Duration`): the request may or may not have arrived.
    LoseReply(Duration),
}

#[derive(Debug, Default)]
struct FakeState {
    calls: Vec<Call>,
    answers: HashMap<(usize, usize, usize), Answer>,
    /// The runtime filters each attempt's definition carried.
    live_filters: HashMap<AttemptKey, Vec<crate::definition::LiveRuntimeFilter>>,
}

#[derive(Debug, Clone, Default)]
struct FakeWorker(Arc<Mutex<FakeState>>);

impl FakeWorker {
    fn calls(&self) -> Vec<Call> {
        self.0.lock().unwrap().calls.clone()
    }

    fn runs(&self) -> Vec<AttemptKey> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Run(key) => Some(key),
                _ => None,
            })
            .collect()
    }

    fn live_filters(&self, attempt: AttemptKey) -> Vec<crate::definition::LiveRuntimeFilter> {
        self.0.lock().unwrap().live_filters[&attempt].clone()
    }

    fn filter_updates(&self) -> Vec<crate::definition::RuntimeFilterUpdate> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Filter(update) => Some(update),
                _ => None,
            })
            .collect()
    }

    fn answer(&self, stage: usize, partition: usize, attempt: usize, answer: Answer) {
        self.0
            .lock()
            .unwrap()
            .answers
            .insert((stage, partition, attempt), answer);
    }

    fn clear(&self) {
        self.0.lock().unwrap().calls.clear();
    }

    fn log(&self, call: Call) {
        self.0.lock().unwrap().calls.push(call);
    }
}

impl WorkerClient for FakeWorker {
    fn run_task(
        &self,
        definition: TaskDefinition,
    ) -> BoxFuture<'static, Result<u64, RunTaskError>> {
        let key = definition.attempt;
        self.log(Call::Run(key));
        self.0
            .lock()
            .unwrap()
            .live_filters
            .insert(key, definition.runtime_filters.clone());
        // Accepted in the order asked: the n-th RunTask is the n-th accepted.
        let accepted = self.runs().len() as u64;
        let answer = self
            .0
            .lock()
            .unwrap()
            .answers
            .get(&(key.stage.0, key.partition, key.attempt))
            .copied()
            .unwrap_or(Answer::Accept);
        async move {
            match answer {
                Answer::Accept => Ok(accepted),
                Answer::AcceptAfter(after) => {
                    tokio::time::sleep(after).await;
                    Ok(accepted)
                }
                Answer::Refuse => Err(RunTaskError {
                    refused: true,
                    error: RemoteError::new(ErrorKind::ResourcesExhausted, "no room"),
                }),
                Answer::LoseReply(after) => {
                    tokio::time::sleep(after).await;
                    Err(crate::transport::unreachable("deadline exceeded"))
                }
            }
        }
        .boxed()
    }

    fn stop_task(&self, attempt: AttemptKey) -> BoxFuture<'static, datafusion::common::Result<()>> {
        self.log(Call::Stop(attempt));
        async { Ok(()) }.boxed()
    }

    fn release_output(
        &self,
        attempt: AttemptKey,
    ) -> BoxFuture<'static, datafusion::common::Result<()>> {
        self.log(Call::Release(attempt));
        async { Ok(()) }.boxed()
    }

    fn clean_up_job(&self, job: JobId) -> BoxFuture<'static, datafusion::common::Result<()>> {
        self.log(Call::CleanUp(job));
        async { Ok(()) }.boxed()
    }

    fn apply_runtime_filter(
        &self,
        update: crate::definition::RuntimeFilterUpdate,
    ) -> BoxFuture<'static, datafusion::common::Result<()>> {
        self.log(Call::Filter(update));
        async { Ok(()) }.boxed()
    }
}

/// One item of a scripted stream.
#[derive(Debug, Clone)]
enum Item {
    Rows(Vec<i64>),
    Error(&'static str),
    /// Nothing more ever comes (a read from a worker that died mid-stream, until it is given up).
    Hang,
}

/// Serves the final stage's streams from scripts, by (partition, attempt); unscripted streams end
/// at once.
#[derive(Debug, Clone, Default)]
struct FakeFetcher(Arc<Mutex<Scripts>>);

/// Scripted streams by (partition, attempt).
type Scripts = HashMap<(usize, usize), Vec<Item>>;

impl FakeFetcher {
    fn script(&self, partition: usize, attempt: usize, items: Vec<Item>) {
        self.0.lock().unwrap().insert((partition, attempt), items);
    }
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]))
}

fn batch(values: &[i64]) -> RecordBatch {
    RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from(values.to_vec()))]).unwrap()
}

impl StreamFetcher for FakeFetcher {
    fn fetch(&self, _address: &str, id: StreamId, schema: SchemaRef) -> SendableRecordBatchStream {
        let items = self
            .0
            .lock()
            .unwrap()
            .get(&(id.stream.partition, id.stream.attempt))
            .cloned()
            .unwrap_or_default();
        let batches = stream::iter(items).flat_map(|item| match item {
            Item::Rows(values) => stream::once(async move { Ok(batch(&values)) }).boxed(),
            Item::Error(message) => {
                stream::once(async move { Err(crate::error::transport_error(message)) }).boxed()
            }
            Item::Hang => stream::pending().boxed(),
        });
        Box::pin(RecordBatchStreamAdapter::new(schema, batches))
    }
}

/// Stage 0 (2 partitions, 2 round-robin channels) → stage 1 (2 partitions reading it by Shuffle,
/// final), with stage 0's output `mode`: one region of 4 tasks when pipelined.
fn graph(mode: OutputMode) -> JobGraph {
    let source: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema()).with_partitions(2));
    let read = PlanProperties::new(
        EquivalenceProperties::new(schema()),
        Partitioning::UnknownPartitioning(2),
        EmissionType::Incremental,
        Boundedness::Bounded,
    );
    let consumer: Arc<dyn ExecutionPlan> = Arc::new(StageInputExec::new(0usize, Arc::new(read)));
    let stages = vec![
        Stage {
            inputs: vec![],
            plan: source,
            mode,
            distribution: OutputDistribution::RoundRobin { channels: 2 },
            placement: TaskPlacement::Worker,
            wire_form: None,
        },
        Stage {
            inputs: vec![StageInput {
                stage: StageId(0),
                mode: InputMode::Shuffle,
            }],
            plan: consumer,
            mode: OutputMode::Pipelined,
            distribution: OutputDistribution::RoundRobin { channels: 1 },
            placement: TaskPlacement::Worker,
            wire_form: None,
        },
    ];
    JobGraph::from_stages(stages, schema()).unwrap()
}

fn key(job: u64, stage: usize, partition: usize, attempt: usize) -> AttemptKey {
    AttemptKey {
        job: JobId(job),
        stage: StageId(stage),
        partition,
        attempt,
    }
}

/// Every task of `graph(Pipelined)` at `attempt`.
fn region(job: u64, attempt: usize) -> Vec<AttemptKey> {
    vec![
        key(job, 0, 0, attempt),
        key(job, 0, 1, attempt),
        key(job, 1, 0, attempt),
        key(job, 1, 1, attempt),
    ]
}

struct Harness {
    driver: Driver,
    fetcher: FakeFetcher,
    executor: FakeWorker,
}

impl Harness {
    fn new(options: DriverOptions) -> Self {
        let fetcher = FakeFetcher::default();
        let executor = FakeWorker::default();
        let driver = Driver::start(
            options,
            ExecutorEndpoint {
                address: "fake:driver".into(),
                client: Arc::new(executor.clone()),
            },
            Arc::new(fetcher.clone()),
        );
        Self {
            driver,
            fetcher,
            executor,
        }
    }

    async fn worker(&self, slots: usize, liveness: Liveness) -> (WorkerId, FakeWorker) {
        self.worker_at("fake:worker", slots, liveness).await
    }

    async fn worker_at(
        &self,
        address: &str,
        slots: usize,
        liveness: Liveness,
    ) -> (WorkerId, FakeWorker) {
        let worker = FakeWorker::default();
        let id = self
            .driver
            .register_worker(WorkerRegistration {
                address: address.into(),
                slots,
                client: Arc::new(worker.clone()),
                liveness,
            })
            .await
            .unwrap();
        (id, worker)
    }

    /// Starts `graph` and collects its output in the background.
    fn run(&self, graph: JobGraph) -> tokio::task::JoinHandle<Result<Vec<i64>, DataFusionError>> {
        let mut output = self.driver.execute(graph, Arc::new(TaskContext::default()));
        tokio::spawn(async move {
            let mut values = Vec::new();
            while let Some(batch) = output.next().await {
                let batch = batch?;
                let column = batch
                    .column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap();
                values.extend(column.values().iter().copied());
            }
            // Final-stage streams interleave as they arrive.
            values.sort_unstable();
            Ok(values)
        })
    }

    fn report(&self, worker: WorkerId, attempt: AttemptKey, sequence: u64, state: TaskState) {
        self.driver
            .handle()
            .report(TaskStatusReport {
                worker,
                attempt,
                sequence,
                state,
            })
            .unwrap();
    }

    fn succeed(&self, worker: WorkerId, attempt: AttemptKey, rows: u64) {
        self.report(worker, attempt, 1, TaskState::Running);
        self.report(
            worker,
            attempt,
            2,
            TaskState::Succeeded(TaskMetrics {
                rows,
                elapsed_ms: 1,
                ..TaskMetrics::default()
            }),
        );
    }

    async fn snapshot(&self) -> DriverSnapshot {
        settle().await;
        self.driver.snapshot().await.unwrap()
    }
}

/// Lets the actor, its RPC futures and the output forwarder run until they wait for something.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

fn transport(message: &str) -> TaskState {
    TaskState::Failed(RemoteError::new(ErrorKind::Transport, message))
}

fn in_process() -> DriverOptions {
    DriverOptions::default()
}

#[tokio::test(start_paused = true)]
async fn a_region_retried_after_a_failure_in_its_middle_returns_only_the_new_attempts_rows() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    // Attempt 0's final tasks hand over an empty batch and then a broken read: neither is output,
    // so neither may stop the region from being retried.
    h.fetcher.script(
        0,
        0,
        vec![Item::Rows(vec![]), Item::Error("connection reset")],
    );
    h.fetcher.script(0, 1, vec![Item::Rows(vec![1, 2])]);
    h.fetcher.script(1, 1, vec![Item::Rows(vec![3])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    assert_eq!(worker.runs(), region(1, 0));
    assert_eq!(h.snapshot().await.busy_slots(), [4]);

    h.succeed(w, key(1, 0, 0, 0), 10);
    h.report(w, key(1, 1, 0, 0), 1, TaskState::Running);
    settle().await;
    worker.clear();
    h.report(w, key(1, 0, 1, 0), 1, TaskState::Running);
    h.report(w, key(1, 0, 1, 0), 2, transport("disk gone"));
    settle().await;
    let calls = worker.calls();
    // The rest of the region stops, every output of attempt 0 goes, attempt 1 starts whole.
    for stopped in [key(1, 1, 0, 0), key(1, 1, 1, 0)] {
        assert!(calls.contains(&Call::Stop(stopped)), "{calls:?}");
    }
    for released in region(1, 0) {
        assert!(calls.contains(&Call::Release(released)), "{calls:?}");
    }
    assert_eq!(worker.runs(), region(1, 1));
    // The failed attempt freed its slot, the stopped ones hold theirs until they report.
    assert_eq!(h.snapshot().await.busy_slots(), [6]);

    // Stale reports of attempt 0 free their slots and change nothing else: their rows are not
    // counted, and the job does not move on.
    h.report(w, key(1, 1, 0, 0), 2, TaskState::Canceled);
    h.report(
        w,
        key(1, 1, 1, 0),
        2,
        TaskState::Succeeded(TaskMetrics {
            rows: 999,
            elapsed_ms: 1,
            ..TaskMetrics::default()
        }),
    );
    assert_eq!(h.snapshot().await.busy_slots(), [4]);
    let progress = h.driver.progress().await.unwrap();
    assert_eq!(progress[0].stages[1].done, 0, "{progress:?}");
    assert_eq!(progress[0].stages[1].rows, 0, "{progress:?}");
    assert_eq!(progress[0].retries, 1);

    for attempt in region(1, 1) {
        h.succeed(w, attempt, 1);
    }
    // A duplicate of a final report frees nothing twice.
    h.succeed(w, key(1, 1, 1, 1), 1);
    assert_eq!(output.await.unwrap().unwrap(), [1, 2, 3]);
    let snapshot = h.snapshot().await;
    assert_eq!(snapshot.busy_slots(), [0]);
    assert_eq!(
        (
            snapshot.jobs,
            snapshot.scheduler_jobs,
            snapshot.running_tasks
        ),
        (0, 0, 0)
    );
    assert!(worker.calls().contains(&Call::CleanUp(JobId(1))));
}

#[tokio::test(start_paused = true)]
async fn final_tasks_whose_running_reports_came_late_still_deliver_their_rows() {
    let h = Harness::new(in_process());
    let (w, _worker) = h.worker(8, Liveness::InProcess).await;
    h.fetcher.script(0, 0, vec![Item::Rows(vec![1, 2])]);
    h.fetcher.script(1, 0, vec![Item::Rows(vec![3])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    for attempt in [key(1, 0, 0, 0), key(1, 0, 1, 0)] {
        h.succeed(w, attempt, 1);
    }
    // Each final task's success is taken before its `Running` report, which is then stale: the
    // output was never announced by `Running`, and the job's success must read it anyway.
    for attempt in [key(1, 1, 0, 0), key(1, 1, 1, 0)] {
        h.report(
            w,
            attempt,
            2,
            TaskState::Succeeded(TaskMetrics {
                rows: 1,
                elapsed_ms: 1,
                ..TaskMetrics::default()
            }),
        );
        h.report(w, attempt, 1, TaskState::Running);
    }
    assert_eq!(output.await.unwrap().unwrap(), [1, 2, 3]);
}

#[tokio::test(start_paused = true)]
async fn run_task_refusals_retry_and_lost_replies_of_running_tasks_change_nothing() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    // Attempt 0 of (0, 0) is refused; in attempt 1, (0, 1)'s reply is lost but the task runs.
    worker.answer(0, 0, 0, Answer::Refuse);
    worker.answer(0, 1, 1, Answer::LoseReply(Duration::from_secs(5)));
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let runs = worker.runs();
    assert_eq!(runs[..4], region(1, 0)[..], "{runs:?}");
    assert_eq!(runs[4..], region(1, 1)[..], "{runs:?}");
    // A refused task holds no slot; the others of attempt 0 hold theirs until they report.
    assert_eq!(h.snapshot().await.busy_slots(), [7]);
    for stale in &region(1, 0)[1..] {
        h.report(w, *stale, 2, TaskState::Canceled);
    }
    assert_eq!(h.snapshot().await.busy_slots(), [4]);

    h.report(w, key(1, 0, 1, 1), 1, TaskState::Running);
    tokio::time::sleep(Duration::from_secs(6)).await;
    settle().await;
    // The lost reply arrived as a failure, but the task had reported: no retry, no stop.
    assert_eq!(worker.runs().len(), 8);
    assert!(!worker.calls().contains(&Call::Stop(key(1, 0, 1, 1))));
    assert_eq!(h.snapshot().await.busy_slots(), [4]);
    for attempt in region(1, 1) {
        h.succeed(w, attempt, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), Vec::<i64>::new());
    assert_eq!(h.snapshot().await.busy_slots(), [0]);
}

#[tokio::test(start_paused = true)]
async fn a_run_task_without_an_answer_loses_its_worker_and_the_region_runs_on_the_others() {
    let h = Harness::new(in_process());
    let (w1, one) = h.worker(8, Liveness::InProcess).await;
    let (w2, two) = h.worker(8, Liveness::InProcess).await;
    // Placement alternates: (0,0) and (1,0) on worker 1, (0,1) and (1,1) on worker 2.
    one.answer(1, 0, 0, Answer::LoseReply(Duration::from_secs(1)));
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    assert_eq!(one.runs(), [key(1, 0, 0, 0), key(1, 1, 0, 0)]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let snapshot = h.snapshot().await;
    assert_eq!(
        (snapshot.workers.len(), snapshot.counters.workers_lost),
        (1, 1),
        "{snapshot:?}"
    );
    // The silent attempt is told to stop anyway (the request may have arrived).
    assert!(one.calls().contains(&Call::Stop(key(1, 1, 0, 0))));
    // The region runs again on worker 2, every task of it; its old attempts there stop.
    assert_eq!(two.runs()[2..], region(1, 1)[..]);
    for stale in [key(1, 0, 1, 0), key(1, 1, 1, 0)] {
        assert!(two.calls().contains(&Call::Stop(stale)));
        h.report(w2, stale, 2, TaskState::Canceled);
    }
    // A late report from the lost worker changes nothing.
    h.report(w1, key(1, 0, 0, 0), 2, TaskState::Canceled);
    assert_eq!(h.snapshot().await.busy_slots(), [4]);
    for attempt in region(1, 1) {
        h.succeed(w2, attempt, 1);
    }
    assert!(output.await.unwrap().is_ok());
    assert_eq!(h.snapshot().await.busy_slots(), [0]);
}

#[tokio::test(start_paused = true)]
async fn a_user_error_fails_the_job_at_once_with_its_own_text() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let divide = RemoteError::of(&DataFusionError::ArrowError(
        Box::new(datafusion::arrow::error::ArrowError::DivideByZero),
        None,
    ));
    h.report(w, key(1, 1, 1, 0), 2, TaskState::Failed(divide));
    let error = output.await.unwrap().unwrap_err();
    assert_eq!(error.to_string(), "Arrow error: Divide by zero error");
    assert_eq!(worker.runs(), region(1, 0), "no retry");
    let calls = worker.calls();
    for other in [key(1, 0, 0, 0), key(1, 0, 1, 0), key(1, 1, 0, 0)] {
        assert!(calls.contains(&Call::Stop(other)), "{calls:?}");
    }
    assert!(calls.contains(&Call::CleanUp(JobId(1))), "{calls:?}");
}

#[tokio::test(start_paused = true)]
async fn a_region_retried_after_it_delivered_rows_resumes_its_output_without_duplicates() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    // Attempt 0 of the final task for partition 0 delivers 7 and 8, then the region fails (its
    // stream never ends).
    h.fetcher.script(
        0,
        0,
        vec![Item::Rows(vec![7]), Item::Rows(vec![8]), Item::Hang],
    );
    // Attempt 1 reproduces them (in other batches) and goes on.
    h.fetcher.script(0, 1, vec![Item::Rows(vec![7, 8, 9])]);
    h.fetcher.script(1, 1, vec![Item::Rows(vec![20])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    h.report(w, key(1, 1, 0, 0), 1, TaskState::Running);
    settle().await;
    h.report(w, key(1, 0, 1, 0), 2, transport("disk gone"));
    settle().await;
    assert_eq!(worker.runs(), [region(1, 0), region(1, 1)].concat());
    for attempt in region(1, 1) {
        h.succeed(w, attempt, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), [7, 8, 9, 20]);
    let notices = h.driver.take_notices().await.unwrap();
    assert_eq!(
        notices,
        [
            "job 1: retrying region 0 (attempt 2; 1 of 4 failures allowed so far): stage 0 \
          partition 1 failed on worker 1 (fake:worker): External error: disk gone",
            "job 1 stage 1 partition 0 attempt 1 resumed its output after the 2 rows already \
             delivered from channel 0 (checked: the same rows)"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_final_task_read_to_its_end_is_not_read_again_when_its_region_runs_again() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    // Final task 0's first attempt is read to its end; its region then fails elsewhere. Its
    // second attempt returns the rows in another order: read, it would fail the job as not
    // deterministic, but the caller has the task's whole output already.
    h.fetcher.script(0, 0, vec![Item::Rows(vec![7, 8])]);
    h.fetcher.script(0, 1, vec![Item::Rows(vec![8, 7])]);
    h.fetcher.script(1, 1, vec![Item::Rows(vec![20])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    h.report(w, key(1, 1, 0, 0), 1, TaskState::Running);
    settle().await;
    h.report(w, key(1, 0, 1, 0), 2, transport("disk gone"));
    settle().await;
    assert_eq!(worker.runs(), [region(1, 0), region(1, 1)].concat());
    for attempt in region(1, 1) {
        h.succeed(w, attempt, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), [7, 8, 20]);
}

#[tokio::test(start_paused = true)]
async fn a_retry_that_does_not_reproduce_the_delivered_rows_fails_the_job_saying_why() {
    let h = Harness::new(in_process());
    let (w, _worker) = h.worker(8, Liveness::InProcess).await;
    h.fetcher
        .script(0, 0, vec![Item::Rows(vec![7, 8]), Item::Hang]);
    h.fetcher.script(0, 1, vec![Item::Rows(vec![8, 7, 9])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    h.report(w, key(1, 1, 0, 0), 1, TaskState::Running);
    settle().await;
    h.report(w, key(1, 0, 0, 0), 2, transport("disk gone"));
    settle().await;
    h.report(w, key(1, 1, 0, 1), 1, TaskState::Running);
    let error = output.await.unwrap().unwrap_err().to_string();
    assert_eq!(
        error,
        "Execution error: job 1: stage 1 partition 0 was retried after 2 of its rows had reached \
         the caller, and the retry produced different rows in that prefix: the query's result is \
         not deterministic (a LIMIT without ORDER BY, ties in the ORDER BY, a volatile \
         function), so the job fails rather than return missing or duplicate rows (attempt 1)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_worker_holding_blocking_outputs_makes_them_again_before_their_readers_rerun() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker(4, Liveness::Heartbeats).await;
    let (w2, two) = h.worker(4, Liveness::Heartbeats).await;
    h.fetcher.script(0, 1, vec![Item::Rows(vec![1])]);
    h.fetcher.script(1, 1, vec![Item::Rows(vec![2])]);
    let output = h.run(graph(OutputMode::Blocking));
    settle().await;
    // Stage 0's two tasks are regions of their own; find where each went.
    let at = |worker: &FakeWorker, key: AttemptKey| worker.runs().contains(&key);
    let producers = [key(1, 0, 0, 0), key(1, 0, 1, 0)];
    let victim = producers
        .iter()
        .find(|k| at(&two, **k))
        .copied()
        .expect("placement spreads stage 0 over both workers");
    for producer in producers {
        h.succeed(if at(&one, producer) { w1 } else { w2 }, producer, 1);
    }
    settle().await;
    let readers: Vec<AttemptKey> = [one.runs(), two.runs()]
        .concat()
        .into_iter()
        .filter(|k| k.stage == StageId(1))
        .collect();
    assert_eq!(readers.len(), 2, "both stage-1 tasks run");
    // Worker 2 falls silent while stage 1 reads; worker 1 keeps beating.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.driver.handle().heartbeat(w1).unwrap();
    }
    settle().await;
    // Its stage-0 output is made again on worker 1 (attempt 1); stage 1 waits for it.
    let rerun = AttemptKey {
        attempt: 1,
        ..victim
    };
    assert!(one.runs().contains(&rerun), "{:?}", one.runs());
    assert!(
        one.runs()
            .iter()
            .all(|k| !(k.stage == StageId(1) && k.attempt == 1)),
        "stage 1 must wait for the re-run: {:?}",
        one.runs()
    );
    for reader in readers.iter().filter(|k| at(&one, **k)) {
        assert!(
            one.calls().contains(&Call::Stop(*reader)),
            "{:?}",
            one.calls()
        );
        h.report(w1, *reader, 2, TaskState::Canceled);
    }
    h.succeed(w1, rerun, 1);
    settle().await;
    let rerun_readers = [key(1, 1, 0, 1), key(1, 1, 1, 1)];
    for reader in rerun_readers {
        assert!(one.runs().contains(&reader), "{:?}", one.runs());
        h.succeed(w1, reader, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), [1, 2]);
    let notices = h.driver.take_notices().await.unwrap();
    assert!(
        notices
            .iter()
            .any(|n| n.starts_with("worker 2 (fake:worker) lost during job 1 stage 1")),
        "{notices:?}"
    );
    let lineage = format!(
        "job 1: outputs of region {} were lost with their worker; running it again before \
         region 2, region 3",
        victim.partition
    );
    assert!(notices.contains(&lineage), "{notices:?}");
}

#[tokio::test(start_paused = true)]
async fn a_final_output_that_cannot_be_read_runs_its_task_again_and_the_output_resumes() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    // Final task 0's first attempt delivers 1, then its stream breaks after it succeeded.
    h.fetcher.script(
        0,
        0,
        vec![Item::Rows(vec![1]), Item::Error("tcp connect error")],
    );
    h.fetcher.script(0, 1, vec![Item::Rows(vec![1, 5])]);
    h.fetcher.script(1, 0, vec![Item::Rows(vec![2])]);
    let output = h.run(graph(OutputMode::Blocking));
    settle().await;
    for producer in [key(1, 0, 0, 0), key(1, 0, 1, 0)] {
        h.succeed(w, producer, 1);
    }
    settle().await;
    for reader in [key(1, 1, 0, 0), key(1, 1, 1, 0)] {
        h.succeed(w, reader, 1);
    }
    settle().await;
    // Every task succeeded, yet the job runs final task 0 again instead of ending short.
    assert!(!output.is_finished());
    assert_eq!(
        worker.runs().last(),
        Some(&key(1, 1, 0, 1)),
        "{:?}",
        worker.runs()
    );
    h.succeed(w, key(1, 1, 0, 1), 1);
    assert_eq!(output.await.unwrap().unwrap(), [1, 2, 5]);
    let notices = h.driver.take_notices().await.unwrap();
    assert_eq!(
        notices,
        [
            "job 1: retrying region 2 (attempt 2; 1 of 4 failures allowed so far): stage 1 \
             partition 0 failed on worker 1 (fake:worker): External error: the job output could \
             not read its output: tcp connect error",
            "job 1 stage 1 partition 0 attempt 1 resumed its output after the 1 rows already \
             delivered from channel 0 (checked: the same rows)"
        ]
    );
    assert_eq!(h.snapshot().await.scheduler_jobs, 0);
}

#[tokio::test(start_paused = true)]
async fn a_worker_lost_after_its_final_task_succeeded_runs_it_again_before_the_output_ends() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker_at("fake:one", 4, Liveness::Heartbeats).await;
    let (w2, two) = h.worker_at("fake:two", 4, Liveness::Heartbeats).await;
    // Final task 0's first attempt is being read (1 delivered) when its worker falls silent.
    h.fetcher
        .script(0, 0, vec![Item::Rows(vec![1]), Item::Hang]);
    h.fetcher.script(0, 1, vec![Item::Rows(vec![1, 5])]);
    h.fetcher.script(1, 0, vec![Item::Rows(vec![2])]);
    let output = h.run(graph(OutputMode::Blocking));
    settle().await;
    let on = |key: AttemptKey| if one.runs().contains(&key) { w1 } else { w2 };
    for producer in [key(1, 0, 0, 0), key(1, 0, 1, 0)] {
        h.succeed(on(producer), producer, 1);
    }
    settle().await;
    for reader in [key(1, 1, 0, 0), key(1, 1, 1, 0)] {
        h.succeed(on(reader), reader, 1);
    }
    settle().await;
    assert!(
        !output.is_finished(),
        "final task 0's output is still being read"
    );
    let (victim, survivor, survivor_id) = if on(key(1, 1, 0, 0)) == w1 {
        (w1, two.clone(), w2)
    } else {
        (w2, one.clone(), w1)
    };
    // The victim falls silent; the survivor keeps beating and runs what is made again (the
    // final task, after any stage-0 output it reads that went with the victim).
    let mut reported = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.driver.handle().heartbeat(survivor_id).unwrap();
        settle().await;
        for run in survivor.runs() {
            if run.attempt > 0 && !reported.contains(&run) {
                h.succeed(survivor_id, run, 1);
                reported.push(run);
            }
        }
    }
    assert!(reported.contains(&key(1, 1, 0, 1)), "{reported:?}");
    assert_eq!(output.await.unwrap().unwrap(), [1, 2, 5]);
    let notices = h.driver.take_notices().await.unwrap();
    assert!(
        notices
            .iter()
            .any(|n| n.starts_with(&format!("worker {} (fake:", victim.0))),
        "{notices:?}"
    );
    assert!(
        notices.iter().any(|n| n.starts_with("job 1: outputs of ")
            && n.contains("region 2")
            && n.ends_with("were lost with their worker; running them again")
            || n == "job 1: outputs of region 2 were lost with their worker; running it again"),
        "{notices:?}"
    );
    assert!(
        notices.contains(
            &"job 1 stage 1 partition 0 attempt 1 resumed its output after the 1 rows already \
              delivered from channel 0 (checked: the same rows)"
                .to_string()
        ),
        "{notices:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn cancelling_a_job_while_its_region_waits_for_slots_starts_nothing() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(4, Liveness::InProcess).await;
    let first = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let second = h.run(graph(OutputMode::Pipelined));
    let snapshot = h.snapshot().await;
    assert_eq!(
        (snapshot.waiting_regions, snapshot.busy_slots()),
        (1, vec![4])
    );
    // The caller of job 2 goes away while it waits.
    second.abort();
    let _ = second.await;
    assert_eq!(h.snapshot().await.waiting_regions, 0);
    for attempt in region(1, 0) {
        h.succeed(w, attempt, 1);
    }
    assert!(first.await.unwrap().is_ok());
    settle().await;
    assert!(
        worker.runs().iter().all(|k| k.job == JobId(1)),
        "{:?}",
        worker.runs()
    );
    let snapshot = h.snapshot().await;
    assert_eq!((snapshot.jobs, snapshot.busy_slots()), (0, vec![0]));
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_stops_sending_heartbeats_is_lost_and_its_region_runs_elsewhere() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        capacity_wait: Duration::from_secs(1),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker(2, Liveness::Heartbeats).await;
    let (w2, two) = h.worker(2, Liveness::Heartbeats).await;
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    assert_eq!(one.runs().len() + two.runs().len(), 4);
    // Worker 1 keeps beating; worker 2 falls silent.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.driver.handle().heartbeat(w1).unwrap();
    }
    let snapshot = h.snapshot().await;
    assert_eq!(
        (snapshot.workers.len(), snapshot.counters.workers_lost),
        (1, 1),
        "{snapshot:?}"
    );
    // The region runs again, on worker 1 only: 4 tasks wait for its 2 slots... and no worker
    // joins within the capacity wait.
    let error = output.await.unwrap().unwrap_err().to_string();
    assert!(
        error.starts_with(
            "External error: job 1: a task region needs 4 task slots at once but the cluster \
             has 2 (1 workers) after waiting 1."
        ),
        "{error}"
    );
    assert!(
        error.ends_with(
            " s for workers to join (capacity_wait); add workers or task slots, or lower \
             datafusion.execution.target_partitions"
        ),
        "{error}"
    );
    let _ = (w2, h.executor.calls());
}

/// A heartbeat of `worker` listing `known` attempts, `accepted` RunTasks; whether it still counts.
async fn beat(h: &Harness, worker: WorkerId, known: Vec<AttemptKey>, accepted: u64) -> bool {
    let registered = h
        .driver
        .handle()
        .heartbeat_reporting(worker, Some(WorkerBeat { known, accepted }))
        .await
        .unwrap();
    settle().await;
    registered
}

#[tokio::test(start_paused = true)]
async fn an_accepted_attempt_missing_from_a_heartbeat_fails_and_its_region_runs_again() {
    let h = Harness::new(DriverOptions::default());
    let (w, worker) = h.worker(8, Liveness::Heartbeats).await;
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let first = worker.runs();
    assert_eq!(first, region(1, 0));
    // The worker lists three of the four attempts it accepted: the fourth's final report was
    // lost (or the attempt never ran there).
    let missing = first[3];
    assert!(beat(&h, w, first[..3].to_vec(), 4).await);
    let calls = worker.calls();
    for stopped in &first[..3] {
        assert!(calls.contains(&Call::Stop(*stopped)), "{calls:?}");
    }
    assert!(!calls.contains(&Call::Stop(missing)), "{calls:?}");
    assert_eq!(&worker.runs()[4..], region(1, 1).as_slice());
    let jobs = h.driver.handle().jobs().await.unwrap();
    let lost = jobs[0]
        .attempts
        .iter()
        .find(|record| record.attempt == missing.task_attempt())
        .unwrap();
    assert_eq!(lost.state, TaskRecordState::Lost);
    assert_eq!(
        lost.error.as_deref(),
        Some(
            "worker 1 (fake:worker) does not know job 1 stage 1 partition 1 attempt 0: it never \
             ran it, or its final report was lost"
        )
    );
    for attempt in region(1, 1) {
        h.succeed(w, attempt, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), Vec::<i64>::new());
    assert_eq!(h.snapshot().await.counters.regions_retried, 1);
}

#[tokio::test(start_paused = true)]
async fn a_heartbeat_read_before_an_attempt_was_accepted_does_not_fail_it() {
    let h = Harness::new(DriverOptions::default());
    let (w, worker) = h.worker(8, Liveness::Heartbeats).await;
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let first = worker.runs();
    // The heartbeat was read when only three RunTasks had arrived: the fourth is not judged.
    assert!(beat(&h, w, first[..3].to_vec(), 3).await);
    assert_eq!(worker.runs().len(), 4, "nothing retried");
    assert!(!worker.calls().iter().any(|c| matches!(c, Call::Stop(_))));
    for attempt in first {
        h.succeed(w, attempt, 1);
    }
    // Once its final report arrived, an attempt the worker still lists (its report's
    // acknowledgement is on its way back) is an orphan to stop, which changes nothing.
    assert!(beat(&h, w, vec![region(1, 0)[0]], 4).await);
    assert!(worker.calls().contains(&Call::Stop(region(1, 0)[0])));
    assert_eq!(output.await.unwrap().unwrap(), Vec::<i64>::new());
    assert_eq!(h.snapshot().await.counters.regions_retried, 0);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_a_worker_runs_that_the_driver_ended_is_stopped_there() {
    let h = Harness::new(DriverOptions::default());
    let (w, worker) = h.worker(8, Liveness::Heartbeats).await;
    // A job the driver never gave this worker (or one it ended long ago).
    let stray = key(7, 0, 0, 2);
    assert!(beat(&h, w, vec![stray], 0).await);
    assert_eq!(worker.calls(), vec![Call::Stop(stray)]);
    // An unknown worker is told it is not registered, and nothing is asked of anyone.
    assert!(!beat(&h, WorkerId(99), vec![stray], 0).await);
    assert_eq!(worker.calls(), vec![Call::Stop(stray)]);
}

#[tokio::test(start_paused = true)]
async fn a_region_short_of_slots_waits_for_a_worker_to_join_then_runs() {
    let h = Harness::new(DriverOptions {
        capacity_wait: Duration::from_secs(30),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker(2, Liveness::InProcess).await;
    h.fetcher.script(0, 0, vec![Item::Rows(vec![7])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    // 4 tasks, 2 slots in the whole cluster: the region waits instead of failing.
    assert!(one.runs().is_empty(), "{:?}", one.runs());
    assert_eq!(h.snapshot().await.waiting_regions, 1);
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(!output.is_finished());
    let (w2, two) = h.worker(2, Liveness::InProcess).await;
    settle().await;
    assert_eq!(one.runs().len(), 2, "{:?}", one.runs());
    assert_eq!(two.runs().len(), 2, "{:?}", two.runs());
    for attempt in one.runs() {
        h.succeed(w1, attempt, 1);
    }
    for attempt in two.runs() {
        h.succeed(w2, attempt, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), vec![7]);
    assert_eq!(h.snapshot().await.waiting_regions, 0);
}

#[tokio::test(start_paused = true)]
async fn a_region_short_of_slots_fails_after_the_capacity_wait_saying_what_it_needed() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        capacity_wait: Duration::from_secs(5),
        ..DriverOptions::default()
    });
    let (_w1, one) = h.worker(2, Liveness::InProcess).await;
    let started = tokio::time::Instant::now();
    let error = h
        .run(graph(OutputMode::Pipelined))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert_eq!(
        error,
        "External error: job 1: a task region needs 4 task slots at once but the cluster has 2 \
         (1 workers) after waiting 5.0 s for workers to join (capacity_wait); add workers or task \
         slots, or lower datafusion.execution.target_partitions"
    );
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert!(one.runs().is_empty());
    let snapshot = h.snapshot().await;
    assert_eq!((snapshot.jobs, snapshot.waiting_regions), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_lost_workers_tasks_are_retried_on_the_others() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker(4, Liveness::Heartbeats).await;
    let (_w2, two) = h.worker(4, Liveness::Heartbeats).await;
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    assert!(!two.runs().is_empty(), "placement spreads the region");
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.driver.handle().heartbeat(w1).unwrap();
    }
    settle().await;
    // The region's attempt 0 stops on worker 1; once those attempts report, attempt 1 fits there.
    let stopped: Vec<AttemptKey> = one
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::Stop(key) => Some(key),
            _ => None,
        })
        .collect();
    assert_eq!(stopped.len(), 2, "{:?}", one.calls());
    for key in stopped {
        h.report(w1, key, 2, TaskState::Canceled);
    }
    settle().await;
    assert_eq!(one.runs()[one.runs().len() - 4..], region(1, 1)[..]);
    for attempt in region(1, 1) {
        h.succeed(w1, attempt, 1);
    }
    assert!(output.await.unwrap().is_ok());
    let snapshot = h.snapshot().await;
    assert_eq!(
        (snapshot.counters.workers_lost, snapshot.busy_slots()),
        (1, vec![0])
    );
}

#[tokio::test(start_paused = true)]
async fn a_worker_declared_lost_that_comes_back_registers_again_and_gets_slots() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        capacity_wait: Duration::from_secs(30),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker_at("fake:worker1", 2, Liveness::Heartbeats).await;
    let (w2, two) = h.worker_at("fake:worker2", 2, Liveness::Heartbeats).await;
    h.fetcher.script(0, 1, vec![Item::Rows(vec![5])]);
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    assert_eq!((one.runs().len(), two.runs().len()), (2, 2));
    // Worker 2 falls silent (a cut link) and is declared lost; worker 1 keeps beating.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.driver.handle().heartbeat(w1).unwrap();
    }
    settle().await;
    for key in one.runs() {
        h.report(w1, key, 2, TaskState::Canceled);
    }
    let snapshot = h.snapshot().await;
    assert_eq!(
        (snapshot.counters.workers_lost, snapshot.waiting_regions),
        (1, 1),
        "{snapshot:?}"
    );
    // Back, its next heartbeat is refused (it is told to register again) ...
    assert!(!beat(&h, w2, Vec::new(), 2).await);
    // ... it registers under a new id and the waiting region runs on both workers.
    let (w3, three) = h.worker_at("fake:worker2", 2, Liveness::Heartbeats).await;
    assert_ne!(w3, w2);
    settle().await;
    let second: Vec<AttemptKey> = one.runs()[2..].to_vec();
    assert_eq!((second.len(), three.runs().len()), (2, 2));
    for attempt in second {
        h.succeed(w1, attempt, 1);
    }
    for attempt in three.runs() {
        h.succeed(w3, attempt, 1);
    }
    assert_eq!(output.await.unwrap().unwrap(), vec![5]);
    let snapshot = h.snapshot().await;
    assert_eq!(snapshot.workers.len(), 2, "{snapshot:?}");
    assert_eq!(snapshot.busy_slots(), vec![0, 0]);
}

#[tokio::test(start_paused = true)]
async fn jobs_are_recorded_with_their_end_and_a_cancel_on_request_ends_the_output_saying_why() {
    use crate::driver::JobState;
    let h = Harness::new(in_process());
    let (w, _worker) = h.worker(4, Liveness::InProcess).await;
    let first = h.run(graph(OutputMode::Pipelined));
    settle().await;
    for attempt in region(1, 0) {
        h.succeed(w, attempt, 3);
    }
    assert!(first.await.unwrap().is_ok());
    let second = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let handle = h.driver.handle();
    assert_eq!(
        handle.jobs().await.unwrap()[1].state,
        JobState::Running,
        "job 2 runs"
    );
    assert!(handle.cancel_job(JobId(2), "REST API").await.unwrap());
    let error = second.await.unwrap().unwrap_err();
    assert_eq!(ErrorKind::of(&error), ErrorKind::Cancelled, "{error}");
    assert!(
        error
            .to_string()
            .ends_with("job 2 was cancelled (REST API)"),
        "{error}"
    );
    assert!(
        !handle.cancel_job(JobId(2), "again").await.unwrap(),
        "an ended job is not cancelled twice"
    );
    assert!(!handle.cancel_job(JobId(9), "nobody").await.unwrap());
    let records = handle.jobs().await.unwrap();
    let summary: Vec<(u64, JobState, u64, usize, usize)> = records
        .iter()
        .map(|r| (r.job, r.state, r.rows, r.stages(), r.tasks()))
        .collect();
    // Job 1's final stage: 2 tasks of 3 rows each.
    assert_eq!(
        summary,
        vec![
            (1, JobState::Succeeded, 6, 2, 4),
            (2, JobState::Cancelled, 0, 2, 4)
        ]
    );
    assert_eq!(
        records[1].error.as_deref(),
        Some("job 2 was cancelled (REST API)")
    );
    assert!(records.iter().all(|r| r.ended_ms >= Some(r.submitted_ms)));
    // The worker stops job 2's tasks and says so; their slots come back.
    for attempt in region(2, 0) {
        let stopped = TaskState::Failed(RemoteError::new(ErrorKind::Cancelled, "stopped"));
        h.report(w, attempt, 1, stopped);
    }
    let snapshot = h.snapshot().await;
    assert_eq!((snapshot.jobs, snapshot.busy_slots()), (0, vec![0]));
    // Every attempt is recorded where it ran and how it ended: job 1's with what they reported,
    // job 2's cancelled with it (the job left the driver before their stop reports came).
    let records = handle.jobs().await.unwrap();
    type Seen<'a> = (
        String,
        usize,
        Option<WorkerId>,
        &'a str,
        u64,
        Option<&'a str>,
    );
    let attempts = |job: usize| -> Vec<Seen> {
        records[job]
            .attempts
            .iter()
            .map(|a| {
                (
                    a.attempt.task.to_string(),
                    a.attempt.attempt,
                    a.worker,
                    a.state.name(),
                    a.metrics.rows,
                    a.error.as_deref(),
                )
            })
            .collect()
    };
    let mut first = attempts(0);
    first.sort();
    assert_eq!(
        first,
        vec![
            (
                "stage 0 partition 0".to_string(),
                0,
                Some(w),
                "succeeded",
                3,
                None
            ),
            (
                "stage 0 partition 1".to_string(),
                0,
                Some(w),
                "succeeded",
                3,
                None
            ),
            (
                "stage 1 partition 0".to_string(),
                0,
                Some(w),
                "succeeded",
                3,
                None
            ),
            (
                "stage 1 partition 1".to_string(),
                0,
                Some(w),
                "succeeded",
                3,
                None
            ),
        ]
    );
    let second = attempts(1);
    assert_eq!(second.len(), 4, "{second:?}");
    assert!(
        second
            .iter()
            .all(|a| (a.2, a.3, a.4, a.5) == (Some(w), "cancelled", 0, None)),
        "{second:?}"
    );
    assert!(
        records
            .iter()
            .flat_map(|r| r.attempts.iter())
            .all(|a| a.ended_ms >= Some(a.started_ms))
    );
}

/// A transport failure of a read from the worker at `peer` that never reached it.
fn unreachable_read(peer: &str) -> TaskState {
    let mut error = RemoteError::new(
        ErrorKind::Transport,
        format!("reading stream job 1 stage 0 partition 0 from {peer}: tcp connect error"),
    );
    error.peer = Some(peer.to_string());
    TaskState::Failed(error)
}

#[tokio::test(start_paused = true)]
async fn a_failed_read_from_a_worker_that_still_heartbeats_keeps_it_and_retries_the_reader() {
    let h = Harness::new(DriverOptions {
        heartbeat_timeout: Duration::from_secs(2),
        ..DriverOptions::default()
    });
    let (w1, one) = h.worker_at("fake:one", 8, Liveness::Heartbeats).await;
    let (w2, _two) = h.worker_at("fake:two", 8, Liveness::Heartbeats).await;
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    let reader = one.runs()[0];
    // Both beat; a read on worker 1 from worker 2 fails at the connection: a partition.
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.driver.handle().heartbeat(w1).unwrap();
    h.driver.handle().heartbeat(w2).unwrap();
    h.report(w1, reader, 2, unreachable_read("fake:two"));
    let snapshot = h.snapshot().await;
    assert_eq!(
        (
            snapshot.workers.len(),
            snapshot.counters.workers_lost,
            snapshot.counters.regions_retried
        ),
        (2, 0, 1),
        "{snapshot:?}"
    );
    let notices = h.driver.take_notices().await.unwrap();
    assert!(
        notices.iter().any(|n| n.starts_with(&format!(
            "{reader} on worker 1 (fake:one) could not read from worker 2 (fake:two), which \
             still sends heartbeats: it is kept, the attempt is retried (reading stream"
        ))),
        "{notices:?}"
    );
    // Worker 2 then falls silent: it is given up for its silence (the heartbeat timeout), not
    // for the reader's failure.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.driver.handle().heartbeat(w1).unwrap();
    }
    let snapshot = h.snapshot().await;
    assert_eq!(
        (snapshot.workers.len(), snapshot.counters.workers_lost),
        (1, 1),
        "{snapshot:?}"
    );
    let notices = h.driver.take_notices().await.unwrap();
    assert!(
        notices
            .iter()
            .any(|n| n.starts_with("worker 2 (fake:two) lost") && n.contains(": no heartbeat for")),
        "{notices:?}"
    );
    drop(output);
}

/// A stop sent while an attempt's `RunTask` is still in flight can miss it (the worker lists the
/// attempt only once it decoded the plan): once the `RunTask` is answered, the driver stops the
/// attempt again, so it does not run on unseen (a write task would leave its staged files behind).
#[tokio::test(start_paused = true)]
async fn an_attempt_stopped_while_its_run_task_was_in_flight_is_stopped_again_once_accepted() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(8, Liveness::InProcess).await;
    worker.answer(1, 1, 0, Answer::AcceptAfter(Duration::from_secs(1)));
    let output = h.run(graph(OutputMode::Pipelined));
    settle().await;
    assert_eq!(worker.runs(), region(1, 0));
    let stops = |attempt: AttemptKey| {
        worker
            .calls()
            .iter()
            .filter(|c| **c == Call::Stop(attempt))
            .count()
    };
    // A task of the region fails: the others are stopped, the in-flight one too.
    h.report(w, key(1, 0, 0, 0), 1, TaskState::Running);
    h.report(w, key(1, 0, 0, 0), 2, transport("disk gone"));
    settle().await;
    assert_eq!((stops(key(1, 1, 1, 0)), stops(key(1, 1, 0, 0))), (1, 1));
    // Its answer comes: it is stopped again; the others, answered before, are not.
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!((stops(key(1, 1, 1, 0)), stops(key(1, 1, 0, 0))), (2, 1));
    output.abort();
}

/// `select big.b from small join big on small.a = big.a` over in-memory tables, both sides
/// hash-shuffled, with pipelined exchanges: one runtime filter, from `small`'s producer stage to
/// `big`'s, delivered while it runs.
async fn pipelined_join_graph() -> JobGraph {
    use datafusion::datasource::MemTable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    let mut config = SessionConfig::new().with_target_partitions(2);
    for (key, value) in sluice_planner::DISTRIBUTED_SETTINGS.iter().chain(&[
        (
            "datafusion.optimizer.hash_join_single_partition_threshold",
            "0",
        ),
        (
            "datafusion.optimizer.hash_join_single_partition_threshold_rows",
            "0",
        ),
    ]) {
        config.options_mut().set(key, value).unwrap();
    }
    let ctx = SessionContext::new_with_config(config);
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int64, true),
        Field::new("b", DataType::Int64, false),
    ]));
    for name in ["big", "small"] {
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(Int64Array::from(vec![3, 4])),
            ],
        )
        .unwrap();
        let table = MemTable::try_new(Arc::clone(&schema), vec![vec![batch]; 2]).unwrap();
        ctx.register_table(name, Arc::new(table)).unwrap();
    }
    let plan = ctx
        .sql("select big.b from small join big on small.a = big.a")
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    JobGraph::try_new_with(plan, &sluice_planner::JobGraphOptions::default()).unwrap()
}

/// The encoded summary of a build side whose keys are `keys`.
fn summary_of(keys: &[i64]) -> Vec<u8> {
    let value = |k: i64| datafusion::common::ScalarValue::Int64(Some(k));
    let (min, max) = (keys.iter().min().unwrap(), keys.iter().max().unwrap());
    crate::runtime_filter::KeySummary {
        bounds: vec![Some((value(*min), value(*max)))],
        keys: Some(keys.iter().map(|k| vec![value(*k)]).collect()),
        bloom: None,
    }
    .encode()
    .unwrap()
}

/// With pipelined exchanges a runtime filter's target runs alongside its source. Once every task
/// of the source succeeded, the merged summary goes to the worker running the target's tasks (one
/// update per worker); when the region runs again the filter is withdrawn, and a re-run of the
/// source that sees other keys is no reason to fail.
#[tokio::test(start_paused = true)]
async fn a_pipelined_filter_reaches_its_targets_running_tasks_once_its_source_finished() {
    use crate::definition::RuntimeFilterUpdate;
    use crate::runtime_filter::KeySummary;

    let h = Harness::new(in_process());
    let (w, worker) = h.worker(64, Liveness::InProcess).await;
    let graph = pipelined_join_graph().await;
    let [filter] = graph.runtime_filters() else {
        panic!("one filter: {:?}", graph.runtime_filters());
    };
    assert_eq!(
        filter.delivery,
        sluice_planner::FilterDelivery::WhileRunning
    );
    let (source, target) = (filter.source, filter.target);
    let output = h.run(graph.clone());
    settle().await;
    // The whole job is one region: the target's tasks start with the source's, and without a
    // summary (their filter keeps every row for now).
    let runs = worker.runs();
    let of_stage = |stage: StageId, attempt: usize| -> Vec<AttemptKey> {
        runs.iter()
            .filter(|k| k.stage == stage && k.attempt == attempt)
            .copied()
            .collect()
    };
    let (sources, targets) = (of_stage(source, 0), of_stage(target, 0));
    assert_eq!((sources.len(), targets.len()), (2, 2), "{runs:?}");
    let expected_filter = |summary: Option<bytes::Bytes>| {
        vec![crate::definition::LiveRuntimeFilter {
            filter: 0,
            path: filter.target_path.clone(),
            columns: filter.target_columns.clone(),
            summary,
            wait: true,
        }]
    };
    for key in &targets {
        assert_eq!(worker.live_filters(*key), expected_filter(None));
    }
    for key in &sources {
        assert_eq!(worker.live_filters(*key), []);
    }

    // One source task succeeds: nothing is sent yet.
    let succeed_with = |key: AttemptKey, keys: &[i64]| {
        h.report(w, key, 1, TaskState::Running);
        h.report(
            w,
            key,
            2,
            TaskState::Succeeded(TaskMetrics {
                rows: keys.len() as u64,
                elapsed_ms: 1,
                key_summary: summary_of(keys),
                ..TaskMetrics::default()
            }),
        );
    };
    succeed_with(sources[0], &[1, 5]);
    settle().await;
    assert_eq!(worker.filter_updates(), []);

    // The other one does: the merged summary goes out once, to the one worker running both
    // target tasks.
    succeed_with(sources[1], &[3]);
    settle().await;
    let updates = worker.filter_updates();
    let [update] = updates.as_slice() else {
        panic!("one update: {updates:?}");
    };
    let merged = KeySummary::decode(&update.summary).unwrap();
    let value = |k: i64| datafusion::common::ScalarValue::Int64(Some(k));
    assert_eq!(
        (update.job, update.stage, update.filter, merged.keys),
        (
            JobId(1),
            target,
            0,
            Some(vec![vec![value(1)], vec![value(3)], vec![value(5)]])
        )
    );
    let sent: RuntimeFilterUpdate = update.clone();

    // A target task fails: the region runs again, and the filter is withdrawn: the target's new
    // attempts read every row (upstream filters may reach the source's new run at other times, so
    // it may see other keys than the first).
    h.report(w, targets[0], 1, TaskState::Running);
    h.report(w, targets[0], 2, transport("disk gone"));
    settle().await;
    let runs = worker.runs();
    let retried: Vec<AttemptKey> = runs
        .iter()
        .filter(|k| k.stage == target && k.attempt == 1)
        .copied()
        .collect();
    assert_eq!(retried.len(), 2, "{runs:?}");
    for key in retried {
        assert_eq!(worker.live_filters(key), []);
    }
    // The source runs again and sees other keys: no new update, and the job goes on.
    let reruns = [key(1, source.0, 0, 1), key(1, source.0, 1, 1)];
    assert!(reruns.iter().all(|k| runs.contains(k)), "{runs:?}");
    succeed_with(reruns[0], &[1, 5, 7]);
    succeed_with(reruns[1], &[3, 9]);
    settle().await;
    assert_eq!(worker.filter_updates(), [sent]);
    // Had the job failed, its output would have ended with the error.
    assert_eq!(h.snapshot().await.scheduler_jobs, 1);
    assert!(!output.is_finished());
}

#[tokio::test(start_paused = true)]
async fn a_pipelined_filter_that_cannot_be_built_releases_the_target_tasks_waiting_for_it() {
    let h = Harness::new(in_process());
    let (w, worker) = h.worker(64, Liveness::InProcess).await;
    let graph = pipelined_join_graph().await;
    let source = graph.runtime_filters()[0].source;
    let _output = h.run(graph.clone());
    settle().await;
    let sources: Vec<AttemptKey> = worker
        .runs()
        .into_iter()
        .filter(|k| k.stage == source)
        .collect();
    assert_eq!(sources.len(), 2, "{:?}", worker.runs());
    // One source task reports keys, the other none (its build side was too large): no filter,
    // and the target's waiting tasks are told so at once instead of waiting out their wait.
    for (key, summary) in [(sources[0], summary_of(&[1, 5])), (sources[1], Vec::new())] {
        h.report(w, key, 1, TaskState::Running);
        h.report(
            w,
            key,
            2,
            TaskState::Succeeded(TaskMetrics {
                rows: 2,
                elapsed_ms: 1,
                key_summary: summary,
                ..TaskMetrics::default()
            }),
        );
    }
    settle().await;
    assert_eq!(
        worker.filter_updates(),
        [crate::definition::RuntimeFilterUpdate {
            job: JobId(1),
            stage: graph.runtime_filters()[0].target,
            filter: 0,
            summary: bytes::Bytes::new(),
        }]
    );
}
