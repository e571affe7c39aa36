//! The one classification of Sluice's errors for every front door: [`Failure::of`] says what kind of
//! failure an error is, and each protocol turns that into its own code, gRPC status codes here
//! ([`status_of`]) and SQLSTATEs on the Postgres wire ([`Failure::sqlstate`]).
//!
//! The message is the text local mode gives: the error's `Display` (the line `sluice sql` prints after
//! `error: `), except that a DataFusion error keeps its own line breaks ("type_coercion\ncaused by\n…"),
//! as a local session (and the SQL logic tests' expected errors) sees it.
//!
//! | failure                                   | gRPC code           | SQLSTATE |
//! |-------------------------------------------|---------------------|----------|
//! | SQL syntax                                | `InvalidArgument`   | `42601`  |
//! | unknown table                             | `NotFound`          | `42P01`  |
//! | unknown column                            | `InvalidArgument`   | `42703`  |
//! | other planning error                      | `InvalidArgument`   | `42000`  |
//! | feature not supported                     | `InvalidArgument`   | `0A000`  |
//! | bad setting or request                    | `InvalidArgument`   | `22023`  |
//! | not allowed for the user's role           | `PermissionDenied`  | `42501`  |
//! | division by zero                          | `InvalidArgument`   | `22012`  |
//! | memory pool exhausted                     | `ResourceExhausted` | `53200`  |
//! | cancelled by the user                     | `Cancelled`         | `57014`  |
//! | anything else (I/O, corrupt data, bugs)   | `Internal`          | `XX000`  |

use datafusion::arrow::error::ArrowError;
use datafusion::error::DataFusionError;
use sluice_engine::SluiceError;
use tonic::{Code, Status};

/// What kind of failure an error is, as a client should see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The SQL text does not parse.
    Syntax,
    /// A table the statement names does not exist.
    UnknownTable,
    /// A column the statement names does not exist.
    UnknownColumn,
    /// Any other planning error (types, functions, ambiguous names).
    Planning,
    /// Valid SQL that the engine does not support.
    NotSupported,
    /// A bad setting or request.
    InvalidArgument,
    /// The user's role does not allow it.
    PermissionDenied,
    /// A division by zero while the query ran.
    DivisionByZero,
    /// The memory pool is exhausted.
    ResourcesExhausted,
    /// The user cancelled the statement.
    Cancelled,
    /// Anything else: I/O, corrupt data, a lost cluster, a bug.
    Internal,
}

impl Failure {
    /// The kind of `error`.
    pub fn of(error: &SluiceError) -> Self {
        match error {
            SluiceError::Cancelled => Self::Cancelled,
            SluiceError::Invalid(_) | SluiceError::Config { .. } => Self::InvalidArgument,
            SluiceError::PermissionDenied(_) => Self::PermissionDenied,
            SluiceError::Table { .. } | SluiceError::Io { .. } | SluiceError::Arrow(_) => {
                Self::Internal
            }
            SluiceError::DataFusion(error) => Self::of_datafusion(error),
        }
    }

    /// The kind of a DataFusion error.
    pub fn of_datafusion(error: &DataFusionError) -> Self {
        let root = error.find_root();
        if let DataFusionError::External(inner) = root
            && let Some(error) = inner.downcast_ref::<SluiceError>()
        {
            return Self::of(error);
        }
        match root {
            DataFusionError::SQL(..) => Self::Syntax,
            DataFusionError::Plan(message) if is_unknown_table(message) => Self::UnknownTable,
            DataFusionError::SchemaError(error, _)
                if matches!(
                    **error,
                    datafusion::common::SchemaError::FieldNotFound { .. }
                ) =>
            {
                Self::UnknownColumn
            }
            DataFusionError::Plan(_) | DataFusionError::SchemaError(..) => Self::Planning,
            DataFusionError::NotImplemented(_) => Self::NotSupported,
            DataFusionError::Configuration(_) => Self::InvalidArgument,
            DataFusionError::ArrowError(error, _)
                if matches!(**error, ArrowError::DivideByZero) =>
            {
                Self::DivisionByZero
            }
            DataFusionError::ResourcesExhausted(_) => Self::ResourcesExhausted,
            _ => Self::Internal,
        }
    }

    /// The gRPC status code of this kind.
    pub fn code(self) -> Code {
        match self {
            Self::UnknownTable => Code::NotFound,
            Self::Syntax
            | Self::UnknownColumn
            | Self::Planning
            | Self::NotSupported
            | Self::InvalidArgument
            | Self::DivisionByZero => Code::InvalidArgument,
            Self::ResourcesExhausted => Code::ResourceExhausted,
            Self::PermissionDenied => Code::PermissionDenied,
            Self::Cancelled => Code::Cancelled,
            Self::Internal => Code::Internal,
        }
    }

    /// The Postgres SQLSTATE of this kind.
    pub fn sqlstate(self) -> &'static str {
        match self {
            Self::Syntax => "42601",
            Self::UnknownTable => "42P01",
            Self::UnknownColumn => "42703",
            Self::Planning => "42000",
            Self::NotSupported => "0A000",
            Self::InvalidArgument => "22023",
            Self::PermissionDenied => "42501",
            Self::DivisionByZero => "22012",
            Self::ResourcesExhausted => "53200",
            Self::Cancelled => "57014",
            Self::Internal => "XX000",
        }
    }
}

/// The text a client gets for `error`: what local mode prints, DataFusion's line breaks kept.
pub fn message_of(error: &SluiceError) -> String {
    match error {
        SluiceError::DataFusion(error) => datafusion_message(error),
        other => other.to_string(),
    }
}

/// The text a client gets for a DataFusion error: its own, line breaks kept, except that a
/// refusal raised inside DataFusion (the table of a quoted path) reads as it was raised.
pub fn datafusion_message(error: &DataFusionError) -> String {
    match error.find_root() {
        DataFusionError::External(inner)
            if matches!(
                inner.downcast_ref::<SluiceError>(),
                Some(SluiceError::PermissionDenied(_))
            ) =>
        {
            inner.to_string()
        }
        _ => error.strip_backtrace(),
    }
}

/// The status a client gets for `error`.
pub fn status_of(error: &SluiceError) -> Status {
    Status::new(Failure::of(error).code(), message_of(error))
}

/// The status for a DataFusion error raised while a result streams.
pub fn status_of_datafusion(error: DataFusionError) -> Status {
    status_of(&SluiceError::from(error))
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

    #[tokio::test]
    async fn each_kind_has_its_sqlstate() {
        let session = SluiceSession::new(
            &SluiceConfig::default(),
            Arc::new(sluice_runtime::LocalRunner),
        )
        .unwrap();
        let kind = async |sql: &str| Failure::of(&session.run_sql(sql).await.unwrap_err());
        assert_eq!(kind("selec 1").await.sqlstate(), "42601");
        assert_eq!(kind("select * from nope").await.sqlstate(), "42P01");
        assert_eq!(kind("select nope").await.sqlstate(), "42703");
        assert_eq!(kind("select 1 + 'a'").await.sqlstate(), "42000");
        assert_eq!(kind("select 1 / 0").await.sqlstate(), "22012");
        assert_eq!(kind("set datafusion.nope = 1").await.sqlstate(), "22023");
        let exhausted = DataFusionError::ResourcesExhausted("pool".into());
        assert_eq!(Failure::of(&exhausted.into()).sqlstate(), "53200");
        assert_eq!(Failure::of(&SluiceError::Cancelled).sqlstate(), "57014");
        let io = DataFusionError::Execution("disk on fire".into());
        assert_eq!(Failure::of(&io.into()).sqlstate(), "XX000");
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
