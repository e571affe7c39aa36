//! `KeySummaryExec`: passes its input through unchanged and, once the input ended, leaves the
//! summary of some of its columns (`runtime_filter::KeySummary`, encoded) in a slot the task reads
//! when it reports success. A task of a runtime filter's source stage runs it under its writer.
//!
//! ```text
//!   stage plan ──batches──► KeySummaryExec ──same batches──► ShuffleWriterExec
//!                                │ at the input's end
//!                                ▼
//!                         SummarySlot: Some(bytes)  (None if the stream was dropped or failed)
//! ```
//!
//! Invariants: the slot holds a summary only if the input was read to its end, so it covers every
//! row the task wrote, and only if it fits a report (`MAX_SUMMARY_BYTES`); a task executes one
//! partition of its plan, so one stream fills the slot. Nothing is spawned; errors go into the
//! stream.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::{Stream, StreamExt};
use sluice_planner::plan::{RECOMPUTE, only_child};

use crate::runtime_filter::{KeySummaryBuilder, MAX_SUMMARY_BYTES};

/// Where a finished summary is left (encoded), shared by every copy of one node.
pub type SummarySlot = Arc<Mutex<Option<Vec<u8>>>>;

/// Summarises `columns` of its input; see the module docs.
#[derive(Debug)]
pub struct KeySummaryExec {
    input: Arc<dyn ExecutionPlan>,
    columns: Vec<usize>,
    slot: SummarySlot,
}

impl KeySummaryExec {
    /// A summary of `columns` of `input`'s rows.
    pub fn new(input: Arc<dyn ExecutionPlan>, columns: Vec<usize>) -> Self {
        Self {
            input,
            columns,
            slot: Arc::new(Mutex::new(None)),
        }
    }

    /// The slot its summary is left in.
    pub fn slot(&self) -> SummarySlot {
        Arc::clone(&self.slot)
    }
}

/// The summary left in `slot`, if any (empty: none).
pub fn take_summary(slot: &SummarySlot) -> Vec<u8> {
    slot.lock()
        .ok()
        .and_then(|mut summary| summary.take())
        .unwrap_or_default()
}

impl DisplayAs for KeySummaryExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let schema = self.input.schema();
        let names: Vec<String> = self
            .columns
            .iter()
            .map(|c| match schema.fields().get(*c) {
                Some(field) => format!("{}@{c}", field.name()),
                None => format!("@{c}"),
            })
            .collect();
        write!(f, "KeySummaryExec: columns=[{}]", names.join(", "))
    }
}

impl ExecutionPlan for KeySummaryExec {
    fn name(&self) -> &str {
        "KeySummaryExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self {
            input: only_child(self.name(), children)?,
            columns: self.columns.clone(),
            slot: Arc::clone(&self.slot),
        }))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(children, RECOMPUTE)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let builder = KeySummaryBuilder::try_new(&self.input.schema(), &self.columns)?;
        Ok(Box::pin(SummarisingStream {
            input: self.input.execute(partition, context)?,
            builder: Some(builder),
            slot: Arc::clone(&self.slot),
        }))
    }
}

struct SummarisingStream {
    input: SendableRecordBatchStream,
    /// Taken when the input ended (or failed).
    builder: Option<KeySummaryBuilder>,
    slot: SummarySlot,
}

impl Stream for SummarisingStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = match self.input.poll_next_unpin(cx) {
            Poll::Ready(next) => next,
            Poll::Pending => return Poll::Pending,
        };
        Poll::Ready(match next {
            Some(Ok(batch)) => match self.builder.as_mut().map(|b| b.update(&batch)) {
                Some(Err(e)) => {
                    self.builder = None;
                    Some(Err(e))
                }
                _ => Some(Ok(batch)),
            },
            Some(Err(e)) => {
                self.builder = None;
                Some(Err(e))
            }
            None => {
                let summary = self
                    .builder
                    .take()
                    .map(|b| b.finish().and_then(|s| s.encode_within(MAX_SUMMARY_BYTES)));
                match summary {
                    Some(Ok(bytes)) => match self.slot.lock() {
                        Ok(mut slot) => {
                            *slot = bytes;
                            None
                        }
                        Err(_) => Some(Err(DataFusionError::Internal(
                            "a key summary's slot was poisoned".to_string(),
                        ))),
                    },
                    Some(Err(e)) => Some(Err(e)),
                    None => None,
                }
            }
        })
    }
}

impl RecordBatchStream for SummarisingStream {
    fn schema(&self) -> SchemaRef {
        self.input.schema()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::ScalarValue;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_plan::collect;

    use crate::runtime_filter::KeySummary;

    fn input(values: Vec<i64>) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from(values))],
        )
        .unwrap();
        MemorySourceConfig::try_new_exec(&[vec![batch.clone(), batch]], schema, None).unwrap()
    }

    #[tokio::test]
    async fn a_read_to_its_end_leaves_the_summary_of_every_row_it_passed_on() {
        let exec = Arc::new(KeySummaryExec::new(input(vec![4, 2, 8]), vec![0]));
        let slot = exec.slot();
        let copy = Arc::clone(&exec)
            .replace_children(vec![input(vec![4, 2, 8])], sluice_planner::plan::RECOMPUTE)
            .unwrap();
        let batches = collect(copy, Arc::new(TaskContext::default()))
            .await
            .unwrap();
        assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 6);
        let summary = KeySummary::decode(&take_summary(&slot)).unwrap();
        assert_eq!(
            summary.bounds,
            vec![Some((
                ScalarValue::Int64(Some(2)),
                ScalarValue::Int64(Some(8))
            ))]
        );
        assert_eq!(summary.keys.map(|k| k.len()), Some(3));
        assert!(take_summary(&slot).is_empty(), "taken once");
    }

    #[tokio::test]
    async fn a_read_dropped_before_its_end_leaves_no_summary() {
        let exec = Arc::new(KeySummaryExec::new(input(vec![1]), vec![0]));
        let slot = exec.slot();
        let mut stream = exec.execute(0, Arc::new(TaskContext::default())).unwrap();
        assert_eq!(stream.next().await.unwrap().unwrap().num_rows(), 1);
        drop(stream);
        assert!(take_summary(&slot).is_empty());
    }
}
