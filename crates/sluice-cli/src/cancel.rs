//! Ctrl-C handling: a running query is a future raced against SIGINT; on Ctrl-C the future (and with it
//! the job's stream and every task under it) is dropped, which is how DataFusion cancels work.

use std::future::Future;

use sluice_engine::{Result, SluiceError};

/// Runs `work` until it finishes or Ctrl-C arrives, in which case it is dropped and
/// [`SluiceError::Cancelled`] returned.
pub async fn until_ctrl_c<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::select! {
        result = work => result,
        _ = tokio::signal::ctrl_c() => Err(SluiceError::Cancelled),
    }
}
