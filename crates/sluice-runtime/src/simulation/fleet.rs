//! The simulation's fake fleet: a [`SimWorker`] per worker answers the driver's calls at once and
//! tells the simulator what it was asked ([`FleetEvent`]); a [`SimFetcher`] serves every final
//! task's stream as one row. No process, socket or task plan is involved: the driver's scheduler,
//! placement, definitions and job output are the real ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::array::{Int64Array, RecordBatch};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream;
use sluice_planner::{AttemptKey, JobId, StreamId};
use tokio::sync::mpsc;

use crate::definition::TaskDefinition;
use crate::transport::{RunTaskError, StreamFetcher, WorkerClient};

/// The index of a fake worker in the simulator's fleet (not its driver-given `WorkerId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct FleetIndex(pub(crate) usize);

/// What a fake worker was asked.
#[derive(Debug)]
pub(crate) enum FleetEvent {
    /// Run an attempt (accepted at once).
    Run(FleetIndex, AttemptKey),
    /// Stop an attempt.
    Stop(FleetIndex, AttemptKey),
}

/// One fake worker: accepts every `RunTask` and forwards what it was asked to the simulator.
#[derive(Debug)]
pub(crate) struct SimWorker {
    index: FleetIndex,
    accepted: AtomicU64,
    events: mpsc::UnboundedSender<FleetEvent>,
}

impl SimWorker {
    pub(crate) fn new(index: FleetIndex, events: mpsc::UnboundedSender<FleetEvent>) -> Self {
        Self {
            index,
            accepted: AtomicU64::new(0),
            events,
        }
    }
}

impl WorkerClient for SimWorker {
    fn run_task(
        &self,
        definition: TaskDefinition,
    ) -> BoxFuture<'static, Result<u64, RunTaskError>> {
        let accepted = self.accepted.fetch_add(1, Ordering::Relaxed) + 1;
        // A simulator that stopped listening has ended; the driver's answer no longer matters.
        let _ = self
            .events
            .send(FleetEvent::Run(self.index, definition.attempt));
        futures::future::ready(Ok(accepted)).boxed()
    }

    fn stop_task(&self, attempt: AttemptKey) -> BoxFuture<'static, Result<()>> {
        let _ = self.events.send(FleetEvent::Stop(self.index, attempt));
        futures::future::ready(Ok(())).boxed()
    }

    fn release_output(&self, _attempt: AttemptKey) -> BoxFuture<'static, Result<()>> {
        futures::future::ready(Ok(())).boxed()
    }

    fn clean_up_job(&self, _job: JobId) -> BoxFuture<'static, Result<()>> {
        futures::future::ready(Ok(())).boxed()
    }

    fn apply_runtime_filter(
        &self,
        _update: crate::definition::RuntimeFilterUpdate,
    ) -> BoxFuture<'static, Result<()>> {
        futures::future::ready(Ok(())).boxed()
    }
}

/// Serves every stream as one row holding its partition: a job's output is one row per final task.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SimFetcher;

impl StreamFetcher for SimFetcher {
    fn fetch(&self, _address: &str, id: StreamId, schema: SchemaRef) -> SendableRecordBatchStream {
        let value = i64::try_from(id.stream.partition).unwrap_or(i64::MAX);
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from(vec![value]))],
        )
        .map_err(Into::into);
        Box::pin(RecordBatchStreamAdapter::new(schema, stream::iter([batch])))
    }
}
