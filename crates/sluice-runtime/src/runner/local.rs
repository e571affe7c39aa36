//! Local mode: the plan runs in this process through DataFusion's own `execute_stream`, which merges
//! the plan's output partitions into one stream. This is the reference every other mode must match.
//! The plan executes on the task runtime, so a CPU-bound query never holds the thread that answers
//! Ctrl-C.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::common::runtime::JoinSet;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{ExecutionPlan, execute_stream};
use futures::future::BoxFuture;
use futures::{StreamExt, stream};
use tokio::sync::mpsc;

use super::{JobRunner, lazy_stream};
use crate::analyze::executed_task;
use crate::driver::DriverCounters;
use crate::task_runtime::task_runtime;

/// Runs plans in-process with plain DataFusion.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalRunner;

impl JobRunner for LocalRunner {
    fn mode_name(&self) -> &'static str {
        "local"
    }

    fn runs_job_graphs(&self) -> bool {
        false
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let schema = plan.schema();
        Ok(spawn_stream(schema, move || {
            let stream = execute_stream(Arc::clone(&plan), task_ctx)?;
            Ok(count_scanned_bytes(stream, plan))
        }))
    }

    fn counters(&self) -> BoxFuture<'static, DriverCounters> {
        let scanned_bytes = SCANNED_BYTES.load(Ordering::Relaxed);
        Box::pin(async move {
            DriverCounters {
                scanned_bytes,
                ..DriverCounters::default()
            }
        })
    }
}

/// Bytes fetched by the scans of every plan local mode ran to its end in this process.
static SCANNED_BYTES: AtomicU64 = AtomicU64::new(0);

/// `stream`, adding the bytes `plan`'s scans fetched to [`SCANNED_BYTES`] when it ends.
fn count_scanned_bytes(
    stream: SendableRecordBatchStream,
    plan: Arc<dyn ExecutionPlan>,
) -> SendableRecordBatchStream {
    let schema = stream.schema();
    let counted = stream.map(Some).chain(stream::once(async move {
        SCANNED_BYTES.fetch_add(executed_task(&plan, false).scanned_bytes, Ordering::Relaxed);
        None
    }));
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        counted.filter_map(std::future::ready),
    ))
}

/// A lazy stream whose batches `start` produces on the task runtime: on the first poll a task there
/// calls `start` and forwards its stream; dropping the returned stream aborts that task.
pub fn spawn_stream<F>(schema: SchemaRef, start: F) -> SendableRecordBatchStream
where
    F: FnOnce() -> Result<SendableRecordBatchStream> + Send + 'static,
{
    let batches_schema = schema.clone();
    lazy_stream(schema, async move {
        let handle = task_runtime()?;
        let (tx, rx) = mpsc::channel(2);
        let mut tasks = JoinSet::new();
        tasks.spawn_on(
            async move {
                let mut stream = match start() {
                    Ok(stream) => stream,
                    Err(error) => {
                        let _ = tx.send(Err(error)).await;
                        return;
                    }
                };
                while let Some(batch) = stream.next().await {
                    if tx.send(batch).await.is_err() {
                        return;
                    }
                }
            },
            &handle,
        );
        // The task set lives as long as the stream reading from it.
        let batches = stream::unfold((rx, tasks), |(mut rx, tasks)| async move {
            rx.recv().await.map(|batch| (batch, (rx, tasks)))
        });
        let batches: SendableRecordBatchStream =
            Box::pin(RecordBatchStreamAdapter::new(batches_schema, batches));
        Ok(batches)
    })
}
