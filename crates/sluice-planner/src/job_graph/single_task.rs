//! Small jobs as one task: a plan whose scans read little runs whole, uncut, in a single task, as
//! local mode runs it, instead of as stages of tasks joined by exchanges.
//!
//! ```text
//!   SortPreservingMergeExec                         stage 0 (the only one, 1 task on a worker):
//!     SortExec                                        SortPreservingMergeExec
//!       AggregateExec(final)                            SortExec
//!         RepartitionExec Hash(k, 2)        ──►           AggregateExec(final)
//!           AggregateExec(partial)                          RepartitionExec Hash(k, 2)   (in-process)
//!             DataSourceExec (2 MB of files)                  AggregateExec(partial)
//!                                                               DataSourceExec
//! ```
//!
//! Each task of a cut plan costs a `RunTask`, a plan decode, a status report and, for each
//! exchange, streams through the stream store or Arrow Flight; a small job spends more on those
//! than on its data. The single task runs every partition of the plan in one process, its exchanges
//! in memory, and streams its one output partition to the job output as any final stage does
//! (so retries, output resume and cancellation are unchanged).
//!
//! Invariants: a plan runs as one task only when [`JobGraphOptions::single_task_bytes`] is set and
//! the bytes its leaves read are known and at most that: every leaf is a file scan (the byte ranges
//! of its files, as stored: compressed Parquet may decode to several times more), an in-memory
//! source (its batches' memory), an empty relation or a placeholder row; the plan is bounded; every
//! node may run on a worker (no driver-only node, nothing unsupported); and the whole plan reaches
//! a worker exactly (the wire check). Any other job is cut as usual. The plan is run as planned (with
//! the settings distributed planning forces, `DISTRIBUTED_SETTINGS`), without the
//! distributed-correctness rewrites (they exist because a cut plan's partitions run in separate
//! instances; here one instance runs them all), coalesced to one partition when it has several, as
//! local mode's `execute_stream` does. The task holds one slot of its worker and runs every
//! partition of the plan there, within the task's memory limit if the session set one.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig};
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::placeholder_row::PlaceholderRowExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::distribution::{DistributionRules, NodeDistribution};

/// Why a job runs as one task: what its scans read and the limit they were held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SingleTask {
    /// The bytes the plan's leaves read.
    pub read_bytes: u64,
    /// `sluice.single_task_bytes`, the most a job run as one task may read.
    pub limit_bytes: u64,
}

/// What `plan` reads if it may run as one task under `limit_bytes`; `None` when it must be cut.
pub(super) fn single_task_of(
    plan: &Arc<dyn ExecutionPlan>,
    rules: &DistributionRules,
    limit_bytes: u64,
) -> Option<SingleTask> {
    if plan.boundedness().is_unbounded() {
        return None; // an endless source reads no bytes a limit could bound
    }
    let mut read_bytes = 0u64;
    let mut eligible = true;
    let walked = plan.apply(|node| {
        let runs_on_workers = matches!(
            rules.distribution_of(node.as_ref()),
            NodeDistribution::InStage(_) | NodeDistribution::Boundary(_)
        );
        let leaf_bytes = if node.children().is_empty() {
            leaf_read_bytes(node.as_ref())
        } else {
            Some(0)
        };
        match (runs_on_workers, leaf_bytes) {
            (true, Some(bytes)) => {
                read_bytes = read_bytes.saturating_add(bytes);
                if read_bytes > limit_bytes {
                    eligible = false;
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            }
            _ => {
                eligible = false;
                Ok(TreeNodeRecursion::Stop)
            }
        }
    });
    (walked.is_ok() && eligible).then_some(SingleTask {
        read_bytes,
        limit_bytes,
    })
}

/// The bytes a leaf reads, when known: its files' byte ranges, its in-memory batches, or nothing.
fn leaf_read_bytes(leaf: &dyn ExecutionPlan) -> Option<u64> {
    if leaf.downcast_ref::<EmptyExec>().is_some()
        || leaf.downcast_ref::<PlaceholderRowExec>().is_some()
    {
        return Some(0);
    }
    let source = leaf.downcast_ref::<DataSourceExec>()?.data_source();
    if let Some(files) = source.downcast_ref::<FileScanConfig>() {
        return Some(
            files
                .file_groups
                .iter()
                .flat_map(FileGroup::iter)
                .map(|file| match &file.range {
                    Some(range) => u64::try_from(range.end - range.start).unwrap_or(0),
                    None => file.object_meta.size,
                })
                .fold(0u64, u64::saturating_add),
        );
    }
    let memory = source.downcast_ref::<MemorySourceConfig>()?;
    Some(
        memory
            .partitions()
            .iter()
            .flatten()
            .map(|batch| batch.get_array_memory_size() as u64)
            .fold(0u64, u64::saturating_add),
    )
}
