//! The one mapping from Sluice's errors to gRPC status codes, used by every front-door call.
//!
//! The message is the text local mode gives: the error's `Display` (the line `sluice sql` prints after
//! `error: `), except that a DataFusion error keeps its own line breaks ("type_coercion\ncaused by\n…"),
//! as a local session (and the SQL logic tests' expected errors) sees it. The code says what kind of
//! failure it was:
//!
//! | failure                                   | code                |
//! |-------------------------------------------|---------------------|
//! | SQL syntax, planning, bad setting/request | `InvalidArgument`   |
//! | unknown table                             | `NotFound`          |
//! | memory pool exhausted                     | `ResourceExhausted` |
//! | cancelled by the user                     | `Cancelled`         |
//! | anything else (I/O, corrupt data, bugs)   | `Internal`          |

use datafusion::error::DataFusionError;
use sluice_engine::SluiceError;
use tonic::{Code, Status};

/// The status a client gets for `error`.
pub fn status_of(error: &SluiceError) -> Status {
    let message = match error {
        SluiceError::DataFusion(error) => error.strip_backtrace(),
        other => other.to_string(),
    };
    Status::new(code_of(error), message)
}

/// The status for a DataFusion error raised while a result streams.
pub fn status_of_datafusion(error: DataFusionError) -> Status {
    status_of(&SluiceError::from(error))
}

fn code_of(error: &SluiceError) -> Code {
    match error {
        SluiceError::Cancelled => Code::Cancelled,
        SluiceError::Invalid(_) | SluiceError::Config { .. } => Code::InvalidArgument,
        SluiceError::Table { .. } | SluiceError::Io { .. } | SluiceError::Arrow(_) => {
            Code::Internal
        }
        SluiceError::DataFusion(error) => code_of_datafusion(error),
    }
}

fn code_of_datafusion(error: &DataFusionError) -> Code {
    match error.find_root() {
        DataFusionError::Plan(message) if is_unknown_table(message) => Code::NotFound,
        DataFusionError::SQL(..)
        | DataFusionError::Plan(_)
        | DataFusionError::SchemaError(..)
        | DataFusionError::NotImplemented(_)
        | DataFusionError::Configuration(_) => Code::InvalidArgument,
        DataFusionError::ResourcesExhausted(_) => Code::ResourceExhausted,
        _ => Code::Internal,
    }
}

/// DataFusion's "table 'datafusion.public.x' not found".
fn is_unknown_table(message: &str) -> bool {
    message.starts_with("table '") && message.ends_with("' not found")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::Arc;

    use sluice_engine::{SluiceConfig, SluiceSession};

    use super::*;

    async fn error_of(sql: &str) -> Status {
        let session = SluiceSession::new(
            &SluiceConfig::default(),
            Arc::new(sluice_runtime::LocalRunner),
        )
        .unwrap();
        let error = session.run_sql(sql).await.unwrap_err();
        status_of(&error)
    }

    #[tokio::test]
    async fn a_syntax_error_is_an_invalid_argument_with_the_local_text() {
        let status = error_of("selec 1").await;
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "SQL error: ParserError(\"Expected: an SQL statement, found: selec at Line: 1, Column: 1\")"
        );
    }

    #[tokio::test]
    async fn an_unknown_table_is_not_found() {
        let status = error_of("select * from nope").await;
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(
            status.message(),
            "Error during planning: table 'datafusion.public.nope' not found"
        );
    }

    #[tokio::test]
    async fn an_unknown_column_is_an_invalid_argument() {
        let status = error_of("select nope").await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    }

    #[tokio::test]
    async fn a_multi_line_datafusion_error_keeps_its_lines() {
        let status = error_of("select x from (select 1 as a)").await;
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status
                .message()
                .starts_with("Schema error: No field named x.\nValid fields are"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn exhausted_memory_and_cancellation_keep_their_codes() {
        let exhausted = status_of_datafusion(DataFusionError::ResourcesExhausted("pool".into()));
        assert_eq!(exhausted.code(), Code::ResourceExhausted);
        assert_eq!(exhausted.message(), "Resources exhausted: pool");
        assert_eq!(status_of(&SluiceError::Cancelled).code(), Code::Cancelled);
        assert_eq!(
            status_of(&SluiceError::Cancelled).message(),
            "query cancelled"
        );
    }
}
