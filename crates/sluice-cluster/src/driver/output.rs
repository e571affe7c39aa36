//! The job output: the final stage's streams, read over Flight as soon as its tasks run and forwarded
//! to the caller.
//!
//! ```text
//!   actor ── Add(attempt, streams) ──► forwarder ── Flight DoGet ──► worker stores
//!         ── Finish(Ok | Err) ──────►     │ first batch of an attempt: ApproveOutput ─► actor
//!                                          ▼
//!                                    caller's record-batch stream
//! ```
//!
//! Exactly-once policy: a batch reaches the caller only from a task attempt the scheduler approves
//! (its region's current attempt); approval also marks the region delivered, so it is never retried —
//! a failure after that fails the job instead of duplicating rows. Batches of an attempt the scheduler
//! replaced are dropped unread. The stream ends only after the scheduler reported success and every
//! approved stream ended; a read error surfaces then (or the job's own error if it failed). For
//! `EXPLAIN ANALYZE`, one more batch follows the final stage's: a row per earlier stage
//! (`sluice_runtime::analyze`). Dropping the stream cancels the job.

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::{RecordBatchReceiverStream, RecordBatchStreamAdapter};
use futures::stream::{BoxStream, SelectAll};
use futures::{StreamExt, TryStreamExt, stream};
use sluice_planner::JobGraph;
use sluice_runtime::JobId;
use sluice_runtime::analyze::{StageReport, report_batch};
use sluice_runtime::scheduler::TaskAttempt;
use tokio::sync::{mpsc, oneshot};

use super::{DriverEvent, Submission, driver_gone};
use crate::flight::FlightClients;
use crate::wire::StreamId;

/// What the actor tells a job's output.
pub(crate) enum OutputCommand {
    /// Read these streams of a final-stage task attempt, at `address`.
    Add {
        attempt: TaskAttempt,
        address: String,
        streams: Vec<StreamId>,
    },
    /// The job ended; on success, with the rows `EXPLAIN ANALYZE` adds for the earlier stages.
    Finish(std::result::Result<Vec<StageReport>, String>),
}

/// Submits `graph` on first poll and returns its output stream.
pub(crate) fn job_output(
    events: mpsc::UnboundedSender<DriverEvent>,
    flight: FlightClients,
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
            flight,
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
    flight: FlightClients,
    schema: datafusion::arrow::datatypes::SchemaRef,
    tx: mpsc::Sender<Result<RecordBatch>>,
    guard: CancelOnDrop,
}

type Tagged = (TaskAttempt, Result<RecordBatch>);

impl Forwarder {
    async fn run(self, mut commands: mpsc::UnboundedReceiver<OutputCommand>) {
        let mut streams: SelectAll<BoxStream<'static, Tagged>> = SelectAll::new();
        let mut approved: HashSet<TaskAttempt> = HashSet::new();
        let mut rejected: HashSet<TaskAttempt> = HashSet::new();
        let mut finished: Option<Vec<StageReport>> = None;
        let mut read_error: Option<DataFusionError> = None;
        loop {
            if let Some(reports) = finished.as_ref()
                && streams.is_empty()
            {
                let result = match read_error.take() {
                    Some(error) => Err(error),
                    None => Ok(()),
                };
                if result.is_ok()
                    && let Some(batch) = report_batch(&self.schema, reports)
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
                        for id in ids {
                            let read = self.flight.read(&address, id, self.schema.clone());
                            streams.push(read.map(move |item| (attempt, item)).boxed());
                        }
                    }
                    Some(OutputCommand::Finish(Ok(reports))) => finished = Some(reports),
                    Some(OutputCommand::Finish(Err(message))) => {
                        self.end(Err(DataFusionError::Execution(message))).await;
                        return;
                    }
                    None => {
                        self.end(Err(driver_gone())).await;
                        return;
                    }
                },
                Some((attempt, item)) = streams.next(), if !streams.is_empty() => {
                    if rejected.contains(&attempt) {
                        continue;
                    }
                    if !approved.contains(&attempt) {
                        if self.approve(attempt).await {
                            approved.insert(attempt);
                        } else {
                            rejected.insert(attempt);
                            continue;
                        }
                    }
                    match item {
                        Ok(batch) => {
                            if self.tx.send(Ok(batch)).await.is_err() {
                                return; // the caller went away: the guard cancels the job
                            }
                        }
                        // The job's own outcome explains a broken read better; keep it for the end.
                        Err(error) => {
                            read_error.get_or_insert(error);
                        }
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
