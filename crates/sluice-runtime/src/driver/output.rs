//! The job output: the final stage's streams, read as soon as its tasks run and forwarded to the
//! caller.
//!
//! ```text
//!   actor ── Add(attempt, address, streams) ──► forwarder ── StreamFetcher ──► worker stores
//!         ── Finish(Ok(final attempts) | Err) ─►    │ first non-empty batch of an attempt:
//!                                                   │   ApproveOutput ─► actor (scheduler)
//!                                                   ▼
//!                                            caller's record-batch stream
//! ```
//!
//! Exactly-once policy: a batch reaches the caller only from a task attempt the scheduler approves
//! (its region's current attempt; asked on the attempt's first non-empty batch), and only the part
//! of it the caller does not have yet: when a region is retried after its final-stage tasks
//! delivered rows, each retried stream skips the rows already delivered and proves it may
//! (`resume`: an order-sensitive checksum of the skipped prefix), or the job fails saying the
//! result is not deterministic. Once an attempt of a task is read, older attempts of that task
//! deliver nothing more. The stream ends only after the scheduler reported success and every
//! stream of the final attempts ended (each having reproduced its delivered prefix); a read error
//! of a final attempt, or a batch of one that was refused, fails the job then (a replaced
//! attempt's read errors do not matter). The actor announces every final task's succeeded attempt
//! before it says the job ended, so the output never ends without reading one. For
//! `EXPLAIN ANALYZE`, one more batch follows: a row per earlier stage (`crate::analyze`). Dropping
//! the stream cancels the job.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::{RecordBatchReceiverStream, RecordBatchStreamAdapter};
use futures::stream::{BoxStream, SelectAll};
use futures::{StreamExt, TryStreamExt, stream};
use sluice_planner::{JobGraph, JobId, StreamId, TaskAttempt, TaskId};
use tokio::sync::{mpsc, oneshot};

use super::resume::DeliveredRows;
use super::{DriverEvent, Submission, driver_gone};
use crate::analyze::{StageReport, report_batch};
use crate::transport::StreamFetcher;

/// How a job ended, as the output needs to know it.
pub(crate) struct FinishedJob {
    /// The rows `EXPLAIN ANALYZE` adds for the earlier stages.
    pub reports: Vec<StageReport>,
    /// The succeeded attempt of every final-stage task.
    pub attempts: HashMap<TaskId, usize>,
}

/// What the actor tells a job's output.
pub(crate) enum OutputCommand {
    /// Read these streams of a final-stage task attempt, at `address`.
    Add {
        attempt: TaskAttempt,
        address: String,
        streams: Vec<StreamId>,
    },
    /// The job ended.
    Finish(Result<FinishedJob>),
}

/// Submits `graph` on first poll and returns its output stream.
pub(crate) fn job_output(
    events: mpsc::UnboundedSender<DriverEvent>,
    fetcher: Arc<dyn StreamFetcher>,
    graph: JobGraph,
    context: Arc<TaskContext>,
) -> SendableRecordBatchStream {
    let schema = graph.schema().clone();
    let output_schema = schema.clone();
    let start = async move {
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let (reply, accepted) = oneshot::channel();
        let submission = Submission {
            graph: Arc::new(graph),
            context,
            output: commands_tx,
            reply,
        };
        events
            .send(DriverEvent::Submit(Box::new(submission)))
            .map_err(|_| driver_gone())?;
        let job = accepted.await.map_err(|_| driver_gone())??;
        let guard = CancelOnDrop {
            events: events.clone(),
            job,
            armed: true,
        };
        let mut builder = RecordBatchReceiverStream::builder(schema.clone(), 2);
        let tx = builder.tx();
        let forwarder = Forwarder {
            job,
            events,
            fetcher,
            schema,
            tx,
            guard,
        };
        builder.spawn(async move {
            forwarder.run(commands).await;
            Ok(())
        });
        Ok::<_, DataFusionError>(builder.build())
    };
    Box::pin(RecordBatchStreamAdapter::new(
        output_schema,
        stream::once(start).try_flatten(),
    ))
}

/// Cancels the job unless its output was read to the end.
struct CancelOnDrop {
    events: mpsc::UnboundedSender<DriverEvent>,
    job: JobId,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.events.send(DriverEvent::Cancel(self.job));
        }
    }
}

struct Forwarder {
    job: JobId,
    events: mpsc::UnboundedSender<DriverEvent>,
    fetcher: Arc<dyn StreamFetcher>,
    schema: SchemaRef,
    tx: mpsc::Sender<Result<RecordBatch>>,
    guard: CancelOnDrop,
}

/// An item of one attempt's stream (by channel); `None` marks that stream's end.
type Tagged = (TaskAttempt, usize, Option<Result<RecordBatch>>);

/// What the forwarder knows about the attempts it reads.
#[derive(Default)]
struct Reads {
    open: HashMap<TaskAttempt, usize>,
    /// Channels of each attempt whose stream ended.
    ended: HashMap<TaskAttempt, Vec<usize>>,
    approved: HashSet<TaskAttempt>,
    rejected: HashSet<TaskAttempt>,
    errors: HashMap<TaskAttempt, DataFusionError>,
    /// The newest attempt of each task being read; older ones deliver nothing more.
    newest: HashMap<TaskId, usize>,
    delivered: DeliveredRows,
}

impl Reads {
    /// Whether every stream of the final attempts has ended.
    fn final_streams_ended(&self, finished: &FinishedJob) -> bool {
        finished.attempts.iter().all(|(task, attempt)| {
            let attempt = TaskAttempt {
                task: *task,
                attempt: *attempt,
            };
            self.open.get(&attempt).copied().unwrap_or(0) == 0
        })
    }

    /// The first read error of a final attempt, or the first final stream that did not
    /// reproduce what an earlier attempt delivered.
    fn final_error(&mut self, job: JobId, finished: &FinishedJob) -> Option<DataFusionError> {
        let mut tasks: Vec<_> = finished.attempts.iter().collect();
        tasks.sort();
        tasks.into_iter().find_map(|(task, attempt)| {
            let attempt = TaskAttempt {
                task: *task,
                attempt: *attempt,
            };
            if let Some(error) = self.errors.remove(&attempt) {
                return Some(error);
            }
            if self.rejected.contains(&attempt) {
                // Rows of the attempt that made the answer were held back: never a short answer.
                return Some(DataFusionError::Internal(format!(
                    "job {job}: rows of {} were refused while the job ran, yet it is a final \
                     attempt",
                    attempt.of_job(job)
                )));
            }
            let channels = self.ended.get(&attempt).cloned().unwrap_or_default();
            channels
                .into_iter()
                .find_map(|channel| self.delivered.finish(job, attempt, channel).err())
        })
    }
}

impl Forwarder {
    async fn run(self, mut commands: mpsc::UnboundedReceiver<OutputCommand>) {
        let mut streams: SelectAll<BoxStream<'static, Tagged>> = SelectAll::new();
        let mut reads = Reads::default();
        let mut finished: Option<FinishedJob> = None;
        loop {
            if let Some(done) = finished.as_ref()
                && reads.final_streams_ended(done)
            {
                let result = match reads.final_error(self.job, done) {
                    Some(error) => Err(error.context(format!(
                        "job {}: reading the output of its final stage",
                        self.job
                    ))),
                    None => Ok(()),
                };
                if result.is_ok()
                    && let Some(batch) = report_batch(&self.schema, &done.reports)
                    && self.tx.send(Ok(batch)).await.is_err()
                {
                    return;
                }
                self.end(result).await;
                return;
            }
            tokio::select! {
                command = commands.recv(), if finished.is_none() => match command {
                    Some(OutputCommand::Add { attempt, address, streams: ids }) => {
                        let newest = reads.newest.entry(attempt.task).or_insert(attempt.attempt);
                        *newest = (*newest).max(attempt.attempt);
                        for id in ids {
                            let channel = id.stream.channel;
                            let read = self.fetcher.fetch(&address, id, self.schema.clone());
                            *reads.open.entry(attempt).or_insert(0) += 1;
                            let tagged = read
                                .map(Some)
                                .chain(stream::once(async { None }))
                                .map(move |item| (attempt, channel, item));
                            streams.push(tagged.boxed());
                        }
                    }
                    Some(OutputCommand::Finish(Ok(done))) => finished = Some(done),
                    Some(OutputCommand::Finish(Err(error))) => {
                        self.end(Err(error)).await;
                        return;
                    }
                    None => {
                        self.end(Err(driver_gone())).await;
                        return;
                    }
                },
                Some((attempt, channel, item)) = streams.next(), if !streams.is_empty() => {
                    let batch = match item {
                        None => {
                            if let Some(open) = reads.open.get_mut(&attempt) {
                                *open = open.saturating_sub(1);
                            }
                            reads.ended.entry(attempt).or_default().push(channel);
                            continue;
                        }
                        Some(Err(error)) => {
                            // The job's own outcome explains a broken read better; keep it for
                            // the end, where it matters only if the attempt is a final one.
                            reads.errors.entry(attempt).or_insert(error);
                            continue;
                        }
                        Some(Ok(batch)) => batch,
                    };
                    let superseded = reads
                        .newest
                        .get(&attempt.task)
                        .is_some_and(|newest| *newest > attempt.attempt);
                    if batch.num_rows() == 0 || superseded || reads.rejected.contains(&attempt) {
                        continue;
                    }
                    if !reads.approved.contains(&attempt) {
                        if self.approve(attempt).await {
                            reads.approved.insert(attempt);
                        } else {
                            reads.rejected.insert(attempt);
                            continue;
                        }
                    }
                    let admitted = reads.delivered.admit(self.job, attempt, channel, batch);
                    for (resumed, channel, rows) in reads.delivered.take_resumed() {
                        let _ = self.events.send(DriverEvent::Notice(format!(
                            "{} resumed its output after the {rows} rows already delivered \
                             from channel {channel} (checked: the same rows)",
                            resumed.of_job(self.job)
                        )));
                    }
                    let batch = match admitted {
                        Ok(Some(batch)) => batch,
                        Ok(None) => continue,
                        Err(error) => {
                            self.end(Err(error)).await;
                            return;
                        }
                    };
                    if self.tx.send(Ok(batch)).await.is_err() {
                        return; // the caller went away: the guard cancels the job
                    }
                }
                // Every stream ended while the job still runs: the loop re-checks and waits again.
                else => {}
            }
        }
    }

    async fn approve(&self, attempt: TaskAttempt) -> bool {
        let (reply, answer) = oneshot::channel();
        let event = DriverEvent::ApproveOutput {
            job: self.job,
            attempt,
            reply,
        };
        self.events.send(event).is_ok() && answer.await.unwrap_or(false)
    }

    async fn end(mut self, result: Result<()>) {
        let ok = result.is_ok();
        if let Err(error) = result {
            let _ = self.tx.send(Err(error)).await;
        }
        if ok {
            self.guard.armed = false;
            let _ = self.events.send(DriverEvent::OutputDone(self.job));
        }
    }
}
