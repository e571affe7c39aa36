//! Sluice's error type.
//!
//! Every failure a user can cause (bad SQL, a missing file, an unknown setting) ends up here as one
//! variant whose `Display` is a single line naming what failed and where: the CLI prints exactly that
//! line. DataFusion's own errors are wrapped, never re-worded, so their detail survives.

use std::path::PathBuf;

use datafusion::error::DataFusionError;

/// Result alias used across the engine.
pub type Result<T, E = SluiceError> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine, each naming its subject.
#[derive(Debug, thiserror::Error)]
pub enum SluiceError {
    /// A configuration key or value is wrong; `source_name` says where it came from.
    #[error("config {source_name}: {message}")]
    Config {
        /// Where the bad setting came from: a file path, an environment variable or a flag.
        source_name: String,
        /// What is wrong with it.
        message: String,
    },
    /// A file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
    /// A table could not be registered.
    #[error("table '{name}' ({location}): {message}")]
    Table {
        /// The table's name.
        name: String,
        /// Where its data lives: a local path or a URL.
        location: String,
        /// What went wrong.
        message: String,
    },
    /// A request that does not make sense (bad argument, unknown query number, …).
    #[error("{0}")]
    Invalid(String),
    /// The session's user may not do what the statement asks ([`crate::access`]); the message
    /// names the user, the role and what was refused.
    #[error("{0}")]
    PermissionDenied(String),
    /// The query was cancelled by the user.
    #[error("query cancelled")]
    Cancelled,
    /// An error raised by DataFusion while planning or running a query.
    #[error("{}", one_line(.0))]
    DataFusion(#[from] DataFusionError),
    /// An error raised by Arrow or Parquet outside a query.
    #[error("{0}")]
    Arrow(#[from] arrow::error::ArrowError),
}

impl SluiceError {
    /// An [`SluiceError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// An [`SluiceError::Invalid`] with the given message.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
}

/// DataFusion wraps errors in contexts ("Error during planning: …"); keep them, but on one line.
pub(crate) fn one_line(error: &dyn std::fmt::Display) -> String {
    let text = error.to_string();
    text.split('\n')
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datafusion_errors_print_on_one_line() {
        let error = SluiceError::from(DataFusionError::Plan("first\n  second".into()));
        assert_eq!(error.to_string(), "Error during planning: first second");
    }

    #[test]
    fn io_errors_name_the_path() {
        let error = SluiceError::io(
            "/no/such",
            std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
        );
        assert_eq!(error.to_string(), "/no/such: not found");
    }
}
