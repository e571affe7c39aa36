//! How a stream's writer ended, and what its readers get when it did not finish.
//!
//! A stream ends cleanly only when its writer says so (`finish`) after its last batch. A writer
//! that fails hands its readers the error it wants them to see (`fail`); a writer that goes away
//! without either (dropped by a stopped task, unwound by a panic) leaves the stream
//! [`IncompleteStream`]. Readers get the error as soon as the writer ended that way, even with
//! batches still queued (a consumer of partial input must not compute on), once, and then the
//! end of the stream.
//!
//! ```text
//!   writer: send … send ─► finish ──► readers: the batches, then the end
//!                        ─► fail(e) ─► readers: e (at once)
//!                        ─► (drop)  ─► readers: IncompleteStream (at once)
//! ```

use std::fmt;
use std::sync::Arc;

use datafusion_common::DataFusionError;

/// A stream whose writer went away without ending it: its task was stopped, or panicked, or
/// dropped its writer. Its readers must not take what they read as the whole stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncompleteStream {
    /// The stream, as its buffers are named (e.g. "worker 1 job 3 stage 1 partition 0 attempt 0").
    pub stream: String,
}

impl fmt::Display for IncompleteStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is incomplete: its writer went away before the end of its output (its task \
             failed, was stopped or panicked)",
            self.stream
        )
    }
}

impl std::error::Error for IncompleteStream {}

/// The writer's side of a stream's end, as readers see it.
#[derive(Debug, Clone, Default)]
pub(crate) enum WriterEnd {
    /// Writing, or (once every writer is gone) finished cleanly.
    #[default]
    Clean,
    /// A writer failed; readers get this error.
    Failed(Arc<DataFusionError>),
    /// A writer went away without finishing.
    Abandoned,
}

impl WriterEnd {
    /// Records that a writer failed with `error` (the first failure wins).
    pub(crate) fn fail(&mut self, error: DataFusionError) {
        if matches!(self, WriterEnd::Clean) {
            *self = WriterEnd::Failed(Arc::new(error));
        }
    }

    /// Records that a writer went away without finishing (a failure recorded first wins).
    pub(crate) fn abandon(&mut self) {
        if matches!(self, WriterEnd::Clean) {
            *self = WriterEnd::Abandoned;
        }
    }

    /// What a reader of the stream `name` gets instead of more batches, if the writer did not
    /// end it cleanly.
    pub(crate) fn reader_error(&self, name: &str) -> Option<DataFusionError> {
        match self {
            WriterEnd::Clean => None,
            WriterEnd::Failed(error) => Some(DataFusionError::Shared(Arc::clone(error))),
            WriterEnd::Abandoned => Some(DataFusionError::External(Box::new(IncompleteStream {
                stream: name.to_string(),
            }))),
        }
    }
}
