//! Local mode: the plan runs in this process through DataFusion's own `execute_stream`, which merges
//! the plan's output partitions into one stream. This is the reference every other mode must match.
//! The plan executes on the task runtime, so a CPU-bound query never holds the thread that answers
//! Ctrl-C.

use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::common::runtime::JoinSet;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{ExecutionPlan, execute_stream};
use futures::{StreamExt, stream};
use tokio::sync::mpsc;

use super::{JobRunner, lazy_stream};
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
        Ok(spawn_stream(schema, move || execute_stream(plan, task_ctx)))
    }
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
