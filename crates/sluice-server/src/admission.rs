//! How many statements of the server's clients run at once (`--max-concurrent-jobs`): beyond the
//! limit a statement waits in one FIFO queue, shared by both front doors, until a running one ends.
//!
//! ```text
//!  DoGet / Postgres Execute ─► Admission::run ─► queue (FIFO, position visible in sluice.state)
//!                                              └► permit ─► session.run ─► rows … stream dropped ─► permit back
//! ```
//!
//! Invariants: a statement holds its permit exactly as long as its result stream lives (ended,
//! failed, cancelled or dropped), so a client that walks away frees its slot; a statement that is
//! dropped while it waits leaves the queue and never runs; the queue is first come, first served
//! (tokio's semaphore is fair).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{StreamExt, TryStreamExt, stream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A session's error as the DataFusion error a result stream carries (DataFusion's own unwrapped).
pub fn into_datafusion(error: sluice_engine::SluiceError) -> DataFusionError {
    match error {
        sluice_engine::SluiceError::DataFusion(error) => error,
        other => DataFusionError::External(Box::new(other)),
    }
}

/// A statement's place in the queue: handed out before it waits, so that its front end can ask
/// for its position while it does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionTicket(u64);

/// The server's limit on running statements and the queue beyond it.
#[derive(Debug)]
pub struct Admission {
    limit: Option<usize>,
    permits: Arc<Semaphore>,
    queue: Mutex<VecDeque<AdmissionTicket>>,
    next: AtomicU64,
}

impl Default for Admission {
    fn default() -> Self {
        Self::new(None)
    }
}

/// Takes a ticket out of the queue when its statement is admitted or dropped while waiting.
struct Waiting<'a> {
    admission: &'a Admission,
    ticket: AdmissionTicket,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut queue = self.admission.lock();
        queue.retain(|ticket| *ticket != self.ticket);
    }
}

impl Admission {
    /// At most `limit` statements at once (`None`: no limit).
    pub fn new(limit: Option<usize>) -> Self {
        let permits = limit.unwrap_or(Semaphore::MAX_PERMITS).max(1);
        Self {
            limit,
            permits: Arc::new(Semaphore::new(permits)),
            queue: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<AdmissionTicket>> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The limit, if any.
    pub fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// Statements waiting now.
    pub fn queued(&self) -> usize {
        self.lock().len()
    }

    /// A new place in the queue (taken when [`Self::run_as`] waits).
    pub fn ticket(&self) -> AdmissionTicket {
        AdmissionTicket(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Where `ticket` waits: 1 = next to run; `None` once admitted (or before it queued).
    pub fn position(&self, ticket: AdmissionTicket) -> Option<usize> {
        self.lock()
            .iter()
            .position(|waiting| *waiting == ticket)
            .map(|index| index + 1)
    }

    /// Waits for a slot, in arrival order.
    pub async fn enter(&self) -> Result<OwnedSemaphorePermit> {
        self.enter_as(self.ticket()).await
    }

    async fn enter_as(&self, ticket: AdmissionTicket) -> Result<OwnedSemaphorePermit> {
        self.lock().push_back(ticket);
        let _waiting = Waiting {
            admission: self,
            ticket,
        };
        self.permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| DataFusionError::Execution("the server is stopping".to_string()))
    }

    /// The stream `start` makes, started once a slot is free; the slot is held until the stream is
    /// dropped. `schema` is the statement's (known before it runs).
    pub fn run(
        self: &Arc<Self>,
        schema: SchemaRef,
        start: impl FnOnce() -> Result<SendableRecordBatchStream> + Send + 'static,
    ) -> SendableRecordBatchStream {
        self.run_as(self.ticket(), schema, start)
    }

    /// [`Self::run`] waiting under `ticket` (from [`Self::ticket`]).
    pub fn run_as(
        self: &Arc<Self>,
        ticket: AdmissionTicket,
        schema: SchemaRef,
        start: impl FnOnce() -> Result<SendableRecordBatchStream> + Send + 'static,
    ) -> SendableRecordBatchStream {
        let admission = Arc::clone(self);
        let started = async move {
            let permit = admission.enter_as(ticket).await?;
            let rows = start()?;
            Ok::<_, DataFusionError>(rows.map(move |batch| {
                let _slot = &permit;
                batch
            }))
        };
        Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream::once(started).try_flatten(),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::time::Duration;

    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::runtime::SpawnedTask;
    use datafusion::physical_plan::memory::MemoryStream;

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]))
    }

    /// A statement that returns `n` once it runs.
    fn statement(n: i64) -> impl FnOnce() -> Result<SendableRecordBatchStream> + Send + 'static {
        move || {
            let batch = RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from(vec![n]))])?;
            Ok(Box::pin(MemoryStream::try_new(vec![batch], schema(), None)?) as _)
        }
    }

    async fn first(stream: &mut SendableRecordBatchStream) -> i64 {
        let batch = stream.next().await.unwrap().unwrap();
        batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .value(0)
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_the_limit_statements_wait_in_arrival_order_until_a_stream_is_dropped() {
        let admission = Arc::new(Admission::new(Some(1)));
        let mut running = admission.run(schema(), statement(1));
        assert_eq!(first(&mut running).await, 1);
        let (second_ticket, third_ticket) = (admission.ticket(), admission.ticket());
        let mut second = admission.run_as(second_ticket, schema(), statement(2));
        let mut third = admission.run_as(third_ticket, schema(), statement(3));
        // Neither may start while the first stream lives.
        let waited = tokio::time::timeout(Duration::from_secs(60), second.next()).await;
        assert!(waited.is_err(), "the second ran beyond the limit");
        let mut third_task = SpawnedTask::spawn(async move { first(&mut third).await });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(admission.queued(), 2);
        assert_eq!(admission.position(second_ticket), Some(1));
        assert_eq!(admission.position(third_ticket), Some(2));
        drop(running);
        assert_eq!(first(&mut second).await, 2);
        let early =
            tokio::time::timeout(Duration::from_millis(1), third_task.join_unwind_mut()).await;
        assert!(
            early.is_err(),
            "the third ran while the second held the slot"
        );
        assert_eq!(admission.queued(), 1);
        assert_eq!(admission.position(second_ticket), None, "admitted");
        assert_eq!(admission.position(third_ticket), Some(1));
        drop(second);
        assert_eq!(third_task.join_unwind().await.unwrap(), 3);
        assert_eq!(admission.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_dropped_while_it_waits_leaves_the_queue_and_never_runs() {
        let admission = Arc::new(Admission::new(Some(1)));
        let mut running = admission.run(schema(), statement(1));
        assert_eq!(first(&mut running).await, 1);
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        let mut waiting = admission.run(schema(), move || {
            flag.store(true, Ordering::SeqCst);
            statement(2)()
        });
        let waited = tokio::time::timeout(Duration::from_secs(1), waiting.next()).await;
        assert!(waited.is_err());
        assert_eq!(admission.queued(), 1);
        drop(waiting);
        assert_eq!(admission.queued(), 0);
        drop(running);
        let mut next = admission.run(schema(), statement(3));
        assert_eq!(first(&mut next).await, 3);
        assert!(
            !ran.load(Ordering::SeqCst),
            "a dropped statement never runs"
        );
    }
}
