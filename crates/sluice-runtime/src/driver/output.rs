//! The job output: the final stage's streams, read as soon as its tasks run and forwarded to the
//! caller.
//!
//! ```text
//!   actor ── Add(attempt, address, streams) ──► forwarder ── StreamFetcher ──► worker stores
//!         ── Finish(Ok(reports) | Err) ───────►    │ first non-empty batch of an attempt:
//!                                                  │   ApproveOutput ─► actor (scheduler)
//!         ◄── OutputRead / OutputUnreadable ───────┤ every stream of an attempt ended / broke
//!                                                  ▼
//!                                           caller's record-batch stream
//! ```
//!
//! Exactly-once policy: a batch reaches the caller only from a task attempt the scheduler approves
//! (its region's current attempt; asked on the attempt's first non-empty batch), and only the part
//! of it the caller does not have yet: when a region is retried after its final-stage tasks
//! delivered rows, each retried stream skips the rows already delivered and proves it may
//! (`resume`: an order-sensitive checksum of the skipped prefix), or the job fails saying the
//! result is not deterministic. Once an attempt of a task is read, older attempts deliver nothing
//! more; once one was read to its end, later ones are not read at all (the caller has that task's
//! whole output), and count as read. The forwarder tells the actor when every stream of an attempt ended (each having
//! reproduced its delivered prefix), and when one broke: the scheduler ends the job only once it
//! read every final task's current attempt, and runs a region again whose final output could not
//! be read (its worker died after the task succeeded), so the stream ends only after the
//! scheduler said the job succeeded, with every row. For `EXPLAIN ANALYZE`, one more batch
//! follows: a row per earlier stage (`crate::analyze`). Dropping the stream cancels the job.

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

/// What the actor tells a job's output.
pub(crate) enum OutputCommand {
    /// Read these streams of a final-stage task attempt, at `address`.
    Add {
        attempt: TaskAttempt,
        address: String,
        streams: Vec<StreamId>,
    },
    /// The job ended (when it succeeded: with the rows `EXPLAIN ANALYZE` adds for the earlier
    /// stages).
    Finish(Result<Vec<StageReport>>),
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
    /// Streams of each attempt still open.
    open: HashMap<TaskAttempt, usize>,
    /// Channels of each attempt whose stream ended.
    ended: HashMap<TaskAttempt, Vec<usize>>,
    approved: HashSet<TaskAttempt>,
    rejected: HashSet<TaskAttempt>,
    /// Attempts one of whose streams broke (told to the actor once).
    broken: HashSet<TaskAttempt>,
    /// Tasks an attempt of which was read to its end: the caller has their whole output, so a
    /// later attempt (its region ran again) is not read but counts as read at once.
    complete: HashSet<TaskId>,
    /// The newest attempt of each task being read; older ones deliver nothing more.
    newest: HashMap<TaskId, usize>,
    delivered: DeliveredRows,
}

impl Reads {
    fn superseded(&self, attempt: TaskAttempt) -> bool {
        self.newest
            .get(&attempt.task)
            .is_some_and(|newest| *newest > attempt.attempt)
    }
}

impl Forwarder {
    async fn run(self, mut commands: mpsc::UnboundedReceiver<OutputCommand>) {
        let mut streams: SelectAll<BoxStream<'static, Tagged>> = SelectAll::new();
        let mut reads = Reads::default();
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(OutputCommand::Add { attempt, address, streams: ids }) => {
                        let newest = reads.newest.entry(attempt.task).or_insert(attempt.attempt);
                        *newest = (*newest).max(attempt.attempt);
                        if reads.complete.contains(&attempt.task) {
                            let _ = self.events.send(DriverEvent::OutputRead {
                                job: self.job,
                                attempt,
                            });
                            continue;
                        }
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
                    Some(OutputCommand::Finish(Ok(reports))) => {
                        if let Some(batch) = report_batch(&self.schema, &reports)
                            && self.tx.send(Ok(batch)).await.is_err()
                        {
                            return;
                        }
                        self.end(Ok(())).await;
                        return;
                    }
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
                            let open = reads.open.entry(attempt).or_insert(0);
                            *open = open.saturating_sub(1);
                            let all_ended = *open == 0;
                            reads.ended.entry(attempt).or_default().push(channel);
                            if all_ended && let Err(error) = self.attempt_ended(&mut reads, attempt) {
                                self.end(Err(error)).await;
                                return;
                            }
                            continue;
                        }
                        Some(Err(error)) => {
                            // A replaced attempt's broken read does not matter; the current one's
                            // makes its region run again (its own failure, if any, explains it).
                            if !reads.superseded(attempt) && reads.broken.insert(attempt) {
                                let _ = self.events.send(DriverEvent::OutputUnreadable {
                                    job: self.job,
                                    attempt,
                                    error,
                                });
                            }
                            continue;
                        }
                        Some(Ok(batch)) => batch,
                    };
                    if batch.num_rows() == 0
                        || reads.superseded(attempt)
                        || reads.rejected.contains(&attempt)
                    {
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
            }
        }
    }

    /// Every stream of `attempt` ended. Unless it broke, was replaced or refused, each must have
    /// reproduced what the caller has from it (else the job fails: the result is not
    /// deterministic); then the actor learns it was read.
    fn attempt_ended(&self, reads: &mut Reads, attempt: TaskAttempt) -> Result<()> {
        if reads.broken.contains(&attempt)
            || reads.superseded(attempt)
            || reads.rejected.contains(&attempt)
        {
            return Ok(());
        }
        let channels = reads.ended.remove(&attempt).unwrap_or_default();
        for channel in channels {
            reads
                .delivered
                .finish(self.job, attempt, channel)
                .map_err(|error| {
                    error.context(format!(
                        "job {}: reading the output of its final stage",
                        self.job
                    ))
                })?;
        }
        reads.complete.insert(attempt.task);
        let _ = self.events.send(DriverEvent::OutputRead {
            job: self.job,
            attempt,
        });
        Ok(())
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

    /// Ends the caller's stream with `result`; a job that succeeded is not cancelled.
    async fn end(mut self, result: Result<()>) {
        match result {
            Ok(()) => self.guard.armed = false,
            Err(error) => {
                let _ = self.tx.send(Err(error)).await;
            }
        }
    }
}
