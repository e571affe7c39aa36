//! Distributed file writes that commit exactly once: `COPY (query) TO url` and `INSERT INTO` an
//! external table, run by a driver. DataFusion writes through one `DataSinkExec` over a single
//! merged partition; a distributed run instead lets every task write its own files in parallel
//! into a staging prefix, and the driver commits exactly the accepted attempts' files.
//!
//! ```text
//!   DataSinkExec (Parquet|CSV|JSON sink)       FileCommitExec                 driver: commit, count
//!     CoalescePartitionsExec          ──►        CoalescePartitionsExec       (Merge)
//!       X (n partitions)                           FileWriteExec              n tasks on workers:
//!                                                    X                        each stages its files
//! ```
//!
//! [`stage_file_writes`] makes that rewrite (a single-file target keeps its merged input: one task
//! writes it); [`StagedWriteGuard`] ends the statement: whatever way its output stream ends
//! without a commit (an error, a cancel, a drop), the statement's staging is removed.
//!
//! Invariants: nothing is written under the target before the commit, so a failed or cancelled
//! write leaves nothing new there; the commit moves only files named by rows the job output
//! accepted; objects already under the target stay (new files have generated names, as with
//! DataFusion's own COPY). In-memory tables and other sinks keep DataFusion's `DataSinkExec` on
//! the driver.

pub mod commit;
pub mod file_write;
pub mod layout;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::sink::DataSinkExec;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream};
use datafusion::logical_expr::dml::InsertOp;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use futures::Stream;
use futures::future::BoxFuture;

pub use commit::{CommitLog, FileCommitExec};
pub use file_write::{FileWriteExec, SinkFormat};
pub use layout::{Staging, WriteTarget};

/// `plan` with a file write at its root made distributed (see the module docs), and the write's
/// staging; `plan` itself (and `None`) when its root writes no file this way.
pub fn stage_file_writes(
    plan: Arc<dyn ExecutionPlan>,
) -> Result<(Arc<dyn ExecutionPlan>, Option<Staging>)> {
    if let Some(commit) = plan.downcast_ref::<FileCommitExec>() {
        // Planned staged already (an INSERT into a Delta table).
        let staging = commit.staging().clone();
        return Ok((plan, Some(staging)));
    }
    let Some(sink) = plan.downcast_ref::<DataSinkExec>() else {
        return Ok((plan, None));
    };
    let Some(format) = SinkFormat::of(sink.sink()) else {
        return Ok((plan, None));
    };
    if format.config().insert_op != InsertOp::Append || format.config().table_paths.len() != 1 {
        return Ok((plan, None));
    }
    let commit = staged_write(Arc::clone(sink.input()), format, CommitLog::Manifest)?;
    let staging = commit
        .downcast_ref::<FileCommitExec>()
        .map(|commit| commit.staging().clone());
    Ok((commit, staging))
}

/// `input` written with `format`'s sink by a task per partition into a new staging prefix, and
/// committed with `log` by the driver: `FileCommitExec` over the `FileWriteExec`s.
pub fn staged_write(
    input: Arc<dyn ExecutionPlan>,
    format: SinkFormat,
    log: CommitLog,
) -> Result<Arc<dyn ExecutionPlan>> {
    let target = WriteTarget::of(format.config())?;
    let per_task = if target.single_file {
        input
    } else {
        unmerged(input)
    };
    let staging = Staging::beside(&target)?;
    let write: Arc<dyn ExecutionPlan> =
        Arc::new(FileWriteExec::try_new(per_task, format, staging.clone())?);
    let staged = if write.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(write))
    } else {
        write
    };
    Ok(Arc::new(
        FileCommitExec::new(staged, target, staging).with_log(log),
    ))
}

/// `plan` without the merge DataFusion put above it for its single-partition sink: each partition
/// then writes its own files (a merge that sorted keeps each partition's order within its files).
fn unmerged(plan: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    if let Some(merge) = plan.downcast_ref::<CoalescePartitionsExec>()
        && merge.fetch().is_none()
    {
        return Arc::clone(merge.input());
    }
    if let Some(merge) = plan.downcast_ref::<SortPreservingMergeExec>()
        && merge.fetch().is_none()
    {
        return Arc::clone(merge.input());
    }
    plan
}

/// Work of ended statements still running on its own: commits that began before their statement
/// was cancelled, and staging removals of cancelled statements (see `Drop` below).
static DETACHED: std::sync::LazyLock<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>> =
    std::sync::LazyLock::new(|| std::sync::Mutex::new(Vec::new()));

/// Keeps `task` (a statement's commit or staging removal) for [`finish_detached_work`].
fn keep_until_exit(task: tokio::task::JoinHandle<()>) {
    if let Ok(mut detached) = DETACHED.lock() {
        detached.retain(|task| !task.is_finished());
        detached.push(task);
    }
}

/// Waits, at most `within`, for the commits and staging removals of ended statements that are
/// still under way: a process that is about to exit (a CLI cancelled with Ctrl-C) calls it so
/// that a cancelled write leaves neither staging nor half a commit behind.
pub async fn finish_detached_work(within: std::time::Duration) {
    let detached: Vec<tokio::task::JoinHandle<()>> = match DETACHED.lock() {
        Ok(mut detached) => detached.drain(..).collect(),
        Err(_) => return,
    };
    let _ = tokio::time::timeout(within, futures::future::join_all(detached)).await;
}

/// How long after a failed write's first staging removal the second one runs.
const STRAGGLER_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The output stream of a statement that writes through staging: when it ends in an error, or
/// without the write committed, the statement's staging is removed before the end is passed on;
/// when it is dropped first (a cancel), the removal is started on the way out.
pub struct StagedWriteGuard {
    inner: SendableRecordBatchStream,
    staging: Staging,
    runtime: Arc<RuntimeEnv>,
    /// A removal under way, and the end it holds back (an error, or the stream's end).
    removing: Option<(BoxFuture<'static, ()>, Option<DataFusionError>)>,
    done: bool,
}

impl StagedWriteGuard {
    /// Guards `inner`, the output of the statement staging under `staging`.
    pub fn new(
        inner: SendableRecordBatchStream,
        staging: Staging,
        runtime: Arc<RuntimeEnv>,
    ) -> Self {
        commit::started(&staging);
        Self {
            inner,
            staging,
            runtime,
            removing: None,
            done: false,
        }
    }

    /// The removal of the statement's staging, unless its commit started (the commit then
    /// removes it, whatever its outcome).
    fn removal(&self) -> Option<BoxFuture<'static, ()>> {
        if commit::committed_rows(&self.staging).is_some() || commit::commit_started(&self.staging)
        {
            return None;
        }
        let store = self.runtime.object_store(&self.staging.store).ok()?;
        let staging = self.staging.clone();
        Some(Box::pin(async move {
            commit::remove_staging(store.as_ref(), &staging).await;
            // Write tasks stopped with the job may still finish a file they had under way (a
            // local disk's writes run on blocking threads an abort cannot stop): a second pass
            // removes what they left; the next write to the target removes anything later.
            tokio::time::sleep(STRAGGLER_WAIT).await;
            commit::remove_staging(store.as_ref(), &staging).await;
        }))
    }
}

impl Stream for StagedWriteGuard {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some((removal, _)) = &mut self.removing {
                ready!(removal.as_mut().poll(cx));
                let error = self.removing.take().and_then(|(_, error)| error);
                self.done = true;
                commit::finished(&self.staging);
                return Poll::Ready(error.map(Err));
            }
            let end = match ready!(Pin::new(&mut self.inner).poll_next(cx)) {
                Some(Ok(batch)) => return Poll::Ready(Some(Ok(batch))),
                Some(Err(error)) => Some(error),
                None => None,
            };
            match self.removal() {
                Some(removal) => self.removing = Some((removal, end)),
                None => {
                    self.done = true;
                    commit::finished(&self.staging);
                    return Poll::Ready(end.map(Err));
                }
            }
        }
    }
}

impl RecordBatchStream for StagedWriteGuard {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }
}

impl Drop for StagedWriteGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Dropped before its end (a cancel): the job and its write tasks are being stopped. The
        // removal is the statement's, not an operator's work, so it runs on without the stream.
        let removal = match self.removing.take() {
            Some((removal, _)) => Some(removal),
            None => self.removal(),
        };
        commit::finished(&self.staging);
        if let (Some(removal), Ok(handle)) = (removal, tokio::runtime::Handle::try_current()) {
            keep_until_exit(handle.spawn(removal));
        }
    }
}
