//! Errors that cross hops: a task's error travels from its worker to the driver and on to the job
//! output, and a stream read's error from the producer's worker to its reader. They keep their kind
//! and their wording on the way, so a user error raised on a worker reads exactly as local mode reads
//! it, and the scheduler knows which failures are worth retrying.
//!
//! ```text
//!   DataFusionError ──RemoteError::of──► {kind, contexts, root, message} ──(wire)──► RemoteError
//!        ▲                                                                               │
//!        └──────────────────────── RemoteError::to_error (same variant, same text) ◄─────┘
//! ```
//!
//! Invariants: for every DataFusion variant whose payload is text (and for Arrow, Parquet, IO and SQL
//! parser errors) `to_error(of(e)).to_string() == e.to_string()` and the root keeps its variant, so
//! code that inspects `find_root()` (the session's read-error annotation) behaves the same after a hop;
//! any other variant keeps its text behind an `Execution` prefix. Sluice's own failures (a stream that
//! cannot be read, a stopped task) are [`SluiceFailure`]s with an explicit kind.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::error::ArrowError;
use datafusion::common::DataFusionError;
use datafusion::parquet::errors::ParquetError;
use datafusion::sql::sqlparser::parser::ParserError;
use sluice_shuffle::IncompleteStream;

/// What kind of failure an error is; decides retries and, on the wire, status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Caused by the query or its data (bad SQL, a division by zero, a corrupt file): deterministic,
    /// never retried, shown exactly as local mode shows it.
    User,
    /// Out of memory (or another budget); another attempt may find room.
    ResourcesExhausted,
    /// The work was cancelled on request.
    Cancelled,
    /// A worker, connection or stream failed; another attempt may succeed.
    Transport,
    /// A bug or an unexpected state.
    Internal,
}

impl ErrorKind {
    /// The kind of `error` (by its root cause).
    pub fn of(error: &DataFusionError) -> Self {
        RemoteError::of(error).kind
    }

    /// Whether another attempt of the failed task may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::ResourcesExhausted | ErrorKind::Transport | ErrorKind::Internal
        )
    }

    /// The kind's name on the wire and in messages.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::User => "user",
            ErrorKind::ResourcesExhausted => "resources_exhausted",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Transport => "transport",
            ErrorKind::Internal => "internal",
        }
    }

    /// The kind named `name` (unknown names are internal errors).
    pub fn from_name(name: &str) -> Self {
        match name {
            "user" => ErrorKind::User,
            "resources_exhausted" => ErrorKind::ResourcesExhausted,
            "cancelled" => ErrorKind::Cancelled,
            "transport" => ErrorKind::Transport,
            _ => ErrorKind::Internal,
        }
    }
}

/// A failure of Sluice's own machinery, with its kind: a stream that cannot be read, a worker that
/// cannot be reached, a stopped task. Carried as `DataFusionError::External`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SluiceFailure {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What failed, naming it.
    pub message: String,
    /// The data-plane address of a worker that could not be reached (the connection failed, not
    /// the worker's answer): evidence for the driver that the worker is gone.
    pub peer: Option<String>,
}

impl fmt::Display for SluiceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SluiceFailure {}

/// A transport failure (a connection, a worker, a stream) as a `DataFusionError`.
pub fn transport_error(message: impl Into<String>) -> DataFusionError {
    sluice_error(ErrorKind::Transport, message)
}

/// A failure of `kind` as a `DataFusionError`.
pub fn sluice_error(kind: ErrorKind, message: impl Into<String>) -> DataFusionError {
    DataFusionError::External(Box::new(SluiceFailure {
        kind,
        message: message.into(),
        peer: None,
    }))
}

/// A failed connection to the worker at `peer` (see [`SluiceFailure::peer`]).
pub fn unreachable_error(peer: impl Into<String>, message: impl Into<String>) -> DataFusionError {
    DataFusionError::External(Box::new(SluiceFailure {
        kind: ErrorKind::Transport,
        message: message.into(),
        peer: Some(peer.into()),
    }))
}

/// A text that displays as itself, for external errors rebuilt from the wire.
#[derive(Debug)]
struct RemoteText(String);

impl fmt::Display for RemoteText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RemoteText {}

/// A `DataFusionError` in a form that crosses process boundaries; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    /// The failure's kind.
    pub kind: ErrorKind,
    /// The `Context` descriptions wrapped around the root, outermost first.
    pub contexts: Vec<String>,
    /// Which error the root is, e.g. `arrow.divide_by_zero`, `execution`, `sluice.transport`.
    pub root: String,
    /// The root's own text, without DataFusion's prefix.
    pub message: String,
    /// A worker that could not be reached, when that is what failed (see [`SluiceFailure::peer`]).
    pub peer: Option<String>,
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_error())
    }
}

/// The innermost error, with the context descriptions on the way to it.
fn unwrap_contexts(error: &DataFusionError) -> (Vec<String>, &DataFusionError) {
    let mut contexts = Vec::new();
    let mut current = error;
    loop {
        current = match current {
            DataFusionError::Context(description, inner) => {
                contexts.push(description.clone());
                inner
            }
            DataFusionError::Shared(inner) => inner.as_ref(),
            DataFusionError::Diagnostic(_, inner) => inner,
            DataFusionError::Collection(errors) if !errors.is_empty() => &errors[0],
            DataFusionError::External(inner) => match inner.downcast_ref::<DataFusionError>() {
                Some(inner) => inner,
                None => return (contexts, current),
            },
            _ => return (contexts, current),
        };
    }
}

fn arrow_root(error: &ArrowError) -> (&'static str, String, ErrorKind) {
    use ErrorKind::{ResourcesExhausted, Transport, User};
    let (root, message, kind) = match error {
        ArrowError::NotYetImplemented(m) => ("arrow.not_yet_implemented", m.clone(), User),
        ArrowError::CastError(m) => ("arrow.cast", m.clone(), User),
        ArrowError::MemoryError(m) => ("arrow.memory", m.clone(), ResourcesExhausted),
        ArrowError::ParseError(m) => ("arrow.parse", m.clone(), User),
        ArrowError::SchemaError(m) => ("arrow.schema", m.clone(), User),
        ArrowError::ComputeError(m) => ("arrow.compute", m.clone(), User),
        ArrowError::DivideByZero => ("arrow.divide_by_zero", String::new(), User),
        ArrowError::ArithmeticOverflow(m) => ("arrow.arithmetic_overflow", m.clone(), User),
        ArrowError::CsvError(m) => ("arrow.csv", m.clone(), User),
        ArrowError::JsonError(m) => ("arrow.json", m.clone(), User),
        ArrowError::AvroError(m) => ("arrow.avro", m.clone(), User),
        ArrowError::IoError(m, _) => ("arrow.io", m.clone(), Transport),
        ArrowError::IpcError(m) => ("arrow.ipc", m.clone(), Transport),
        ArrowError::InvalidArgumentError(m) => ("arrow.invalid_argument", m.clone(), User),
        ArrowError::ParquetError(m) => ("arrow.parquet", m.clone(), User),
        ArrowError::CDataInterface(m) => ("arrow.c_data", m.clone(), User),
        ArrowError::DictionaryKeyOverflowError => {
            ("arrow.dictionary_overflow", String::new(), User)
        }
        ArrowError::RunEndIndexOverflowError => ("arrow.run_end_overflow", String::new(), User),
        ArrowError::OffsetOverflowError(offset) => {
            ("arrow.offset_overflow", offset.to_string(), User)
        }
        ArrowError::ExternalError(inner) => ("arrow.external", inner.to_string(), User),
    };
    (root, message, kind)
}

fn arrow_from(root: &str, message: &str) -> Option<ArrowError> {
    let m = message.to_string();
    Some(match root {
        "arrow.not_yet_implemented" => ArrowError::NotYetImplemented(m),
        "arrow.cast" => ArrowError::CastError(m),
        "arrow.memory" => ArrowError::MemoryError(m),
        "arrow.parse" => ArrowError::ParseError(m),
        "arrow.schema" => ArrowError::SchemaError(m),
        "arrow.compute" => ArrowError::ComputeError(m),
        "arrow.divide_by_zero" => ArrowError::DivideByZero,
        "arrow.arithmetic_overflow" => ArrowError::ArithmeticOverflow(m),
        "arrow.csv" => ArrowError::CsvError(m),
        "arrow.json" => ArrowError::JsonError(m),
        "arrow.avro" => ArrowError::AvroError(m),
        "arrow.io" => ArrowError::IoError(m.clone(), std::io::Error::other(m)),
        "arrow.ipc" => ArrowError::IpcError(m),
        "arrow.invalid_argument" => ArrowError::InvalidArgumentError(m),
        "arrow.parquet" => ArrowError::ParquetError(m),
        "arrow.c_data" => ArrowError::CDataInterface(m),
        "arrow.dictionary_overflow" => ArrowError::DictionaryKeyOverflowError,
        "arrow.run_end_overflow" => ArrowError::RunEndIndexOverflowError,
        "arrow.offset_overflow" => ArrowError::OffsetOverflowError(message.parse().ok()?),
        "arrow.external" => ArrowError::ExternalError(Box::new(RemoteText(m))),
        _ => return None,
    })
}

fn parquet_root(error: &ParquetError) -> (&'static str, String) {
    match error {
        ParquetError::General(m) => ("parquet.general", m.clone()),
        ParquetError::NYI(m) => ("parquet.nyi", m.clone()),
        ParquetError::EOF(m) => ("parquet.eof", m.clone()),
        ParquetError::ArrowError(m) => ("parquet.arrow", m.clone()),
        ParquetError::External(inner) => ("parquet.external", inner.to_string()),
        other => ("parquet.other", other.to_string()),
    }
}

fn parquet_from(root: &str, message: &str) -> Option<ParquetError> {
    let m = message.to_string();
    Some(match root {
        "parquet.general" => ParquetError::General(m),
        "parquet.nyi" => ParquetError::NYI(m),
        "parquet.eof" => ParquetError::EOF(m),
        "parquet.arrow" => ParquetError::ArrowError(m),
        "parquet.external" | "parquet.other" => ParquetError::External(Box::new(RemoteText(m))),
        _ => return None,
    })
}

fn io_kind_name(kind: std::io::ErrorKind) -> &'static str {
    use std::io::ErrorKind as K;
    match kind {
        K::NotFound => "not_found",
        K::PermissionDenied => "permission_denied",
        K::ConnectionRefused => "connection_refused",
        K::ConnectionReset => "connection_reset",
        K::BrokenPipe => "broken_pipe",
        K::AlreadyExists => "already_exists",
        K::InvalidData => "invalid_data",
        K::InvalidInput => "invalid_input",
        K::TimedOut => "timed_out",
        K::UnexpectedEof => "unexpected_eof",
        K::OutOfMemory => "out_of_memory",
        _ => "other",
    }
}

fn io_kind_from(name: &str) -> std::io::ErrorKind {
    use std::io::ErrorKind as K;
    match name {
        "not_found" => K::NotFound,
        "permission_denied" => K::PermissionDenied,
        "connection_refused" => K::ConnectionRefused,
        "connection_reset" => K::ConnectionReset,
        "broken_pipe" => K::BrokenPipe,
        "already_exists" => K::AlreadyExists,
        "invalid_data" => K::InvalidData,
        "invalid_input" => K::InvalidInput,
        "timed_out" => K::TimedOut,
        "unexpected_eof" => K::UnexpectedEof,
        "out_of_memory" => K::OutOfMemory,
        _ => K::Other,
    }
}

impl RemoteError {
    /// A failure of Sluice's own machinery.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            contexts: Vec::new(),
            root: format!("sluice.{}", kind.name()),
            message: message.into(),
            peer: None,
        }
    }

    /// `error` in wire form.
    pub fn of(error: &DataFusionError) -> Self {
        use ErrorKind::{Internal, ResourcesExhausted, Transport, User};
        let (contexts, root) = unwrap_contexts(error);
        let peer = match root {
            DataFusionError::External(inner) => inner
                .downcast_ref::<SluiceFailure>()
                .and_then(|failure| failure.peer.clone()),
            _ => None,
        };
        let (tag, message, kind): (String, String, ErrorKind) = match root {
            DataFusionError::Plan(m) => ("plan".into(), m.clone(), User),
            DataFusionError::Execution(m) => ("execution".into(), m.clone(), User),
            DataFusionError::NotImplemented(m) => ("not_implemented".into(), m.clone(), User),
            DataFusionError::Configuration(m) => ("configuration".into(), m.clone(), User),
            DataFusionError::ResourcesExhausted(m) => {
                ("resources_exhausted".into(), m.clone(), ResourcesExhausted)
            }
            DataFusionError::Internal(m) => ("internal".into(), m.clone(), Internal),
            DataFusionError::ArrowError(arrow, _) => {
                let (tag, message, kind) = arrow_root(arrow);
                (tag.into(), message, kind)
            }
            DataFusionError::ParquetError(parquet) => {
                let (tag, message) = parquet_root(parquet);
                (tag.into(), message, User)
            }
            DataFusionError::IoError(io) => (
                format!("io.{}", io_kind_name(io.kind())),
                io.to_string(),
                Transport,
            ),
            DataFusionError::SQL(parser, _) => match parser.as_ref() {
                ParserError::ParserError(m) => ("sql.parser".into(), m.clone(), User),
                ParserError::TokenizerError(m) => ("sql.tokenizer".into(), m.clone(), User),
                ParserError::RecursionLimitExceeded => {
                    ("sql.recursion".into(), String::new(), User)
                }
            },
            DataFusionError::External(inner) => {
                if let Some(failure) = inner.downcast_ref::<SluiceFailure>() {
                    (
                        format!("sluice.{}", failure.kind.name()),
                        failure.message.clone(),
                        failure.kind,
                    )
                } else if let Some(incomplete) = inner.downcast_ref::<IncompleteStream>() {
                    // A stream whose writer went away: another attempt may read it whole.
                    ("sluice.transport".into(), incomplete.to_string(), Transport)
                } else {
                    ("external".into(), inner.to_string(), User)
                }
            }
            DataFusionError::ObjectStore(_) => ("other".into(), root.to_string(), Transport),
            DataFusionError::ExecutionJoin(_) => ("other".into(), root.to_string(), Internal),
            other => ("other".into(), other.to_string(), User),
        };
        Self {
            kind,
            contexts,
            root: tag,
            message,
            peer,
        }
    }

    /// The root error rebuilt, without contexts.
    fn root_error(&self) -> DataFusionError {
        let m = self.message.clone();
        if let Some(kind) = self.root.strip_prefix("sluice.") {
            return DataFusionError::External(Box::new(SluiceFailure {
                kind: ErrorKind::from_name(kind),
                message: m,
                peer: self.peer.clone(),
            }));
        }
        if let Some(kind) = self.root.strip_prefix("io.") {
            return DataFusionError::IoError(std::io::Error::new(io_kind_from(kind), m));
        }
        if let Some(arrow) = arrow_from(&self.root, &self.message) {
            return DataFusionError::ArrowError(Box::new(arrow), None);
        }
        if let Some(parquet) = parquet_from(&self.root, &self.message) {
            return DataFusionError::ParquetError(Box::new(parquet));
        }
        match self.root.as_str() {
            "plan" => DataFusionError::Plan(m),
            "execution" | "other" => DataFusionError::Execution(m),
            "not_implemented" => DataFusionError::NotImplemented(m),
            "configuration" => DataFusionError::Configuration(m),
            "resources_exhausted" => DataFusionError::ResourcesExhausted(m),
            "internal" => DataFusionError::Internal(m),
            "sql.parser" => DataFusionError::SQL(Box::new(ParserError::ParserError(m)), None),
            "sql.tokenizer" => DataFusionError::SQL(Box::new(ParserError::TokenizerError(m)), None),
            "sql.recursion" => {
                DataFusionError::SQL(Box::new(ParserError::RecursionLimitExceeded), None)
            }
            "external" => DataFusionError::External(Box::new(RemoteText(m))),
            unknown => DataFusionError::Execution(format!("{unknown}: {m}")),
        }
    }

    /// The error rebuilt: the same variant and text it had where it was raised.
    pub fn to_error(&self) -> DataFusionError {
        self.contexts
            .iter()
            .rev()
            .fold(self.root_error(), |inner, description| {
                DataFusionError::Context(description.clone(), Box::new(inner))
            })
    }

    /// The error rebuilt and shared (cheap to clone into several streams).
    pub fn to_shared_error(&self) -> DataFusionError {
        DataFusionError::Shared(Arc::new(self.to_error()))
    }
}

#[cfg(test)]
mod tests {
    use datafusion::common::plan_datafusion_err;

    use super::*;

    fn round_trip(error: DataFusionError) -> (DataFusionError, RemoteError) {
        let remote = RemoteError::of(&error);
        let rebuilt = remote.to_error();
        assert_eq!(rebuilt.to_string(), error.to_string());
        (rebuilt, remote)
    }

    #[test]
    fn user_errors_keep_their_variant_and_text() {
        let (rebuilt, remote) = round_trip(DataFusionError::ArrowError(
            Box::new(ArrowError::DivideByZero),
            None,
        ));
        assert_eq!(rebuilt.to_string(), "Arrow error: Divide by zero error");
        assert_eq!(remote.kind, ErrorKind::User);
        assert!(matches!(rebuilt, DataFusionError::ArrowError(..)));
        let (_, remote) = round_trip(plan_datafusion_err!("no such column x"));
        assert_eq!(remote.kind, ErrorKind::User);
        let (rebuilt, _) = round_trip(DataFusionError::SQL(
            Box::new(ParserError::ParserError("Expected: an expression".into())),
            None,
        ));
        assert!(matches!(rebuilt, DataFusionError::SQL(..)));
        round_trip(DataFusionError::ParquetError(Box::new(
            ParquetError::General("bad footer".into()),
        )));
        round_trip(DataFusionError::Execution("x".into()));
        round_trip(DataFusionError::NotImplemented("y".into()));
    }

    #[test]
    fn contexts_and_wrappers_survive() {
        let inner = DataFusionError::ArrowError(
            Box::new(ArrowError::CastError("cannot cast 'a' to Int32".into())),
            None,
        );
        let error = DataFusionError::Shared(Arc::new(
            inner.context("reading table t").context("stage 1"),
        ));
        let remote = RemoteError::of(&error);
        assert_eq!(remote.contexts, ["stage 1", "reading table t"]);
        let rebuilt = remote.to_error();
        assert_eq!(rebuilt.to_string(), error.to_string());
        assert!(matches!(
            rebuilt.find_root(),
            DataFusionError::ArrowError(..)
        ));
    }

    #[test]
    fn an_unreachable_peer_survives_a_hop() {
        let error = unreachable_error("10.0.0.7:4000", "reading s from 10.0.0.7:4000: refused")
            .context("stage 2");
        let remote = RemoteError::of(&error);
        assert_eq!(remote.peer.as_deref(), Some("10.0.0.7:4000"));
        assert_eq!(remote.kind, ErrorKind::Transport);
        let again = RemoteError::of(&remote.to_error());
        assert_eq!(again, remote);
        assert_eq!(RemoteError::of(&transport_error("x")).peer, None);
    }

    #[test]
    fn kinds_decide_retries() {
        let oom = DataFusionError::ResourcesExhausted("pool full".into());
        assert_eq!(ErrorKind::of(&oom), ErrorKind::ResourcesExhausted);
        assert!(ErrorKind::of(&oom).is_retryable());
        let io = DataFusionError::IoError(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset by peer",
        ));
        let (_, remote) = round_trip(io);
        assert_eq!(remote.kind, ErrorKind::Transport);
        let read = transport_error("reading stream x from worker 2: connection refused");
        let (_, remote) = round_trip(read);
        assert_eq!(remote.kind, ErrorKind::Transport);
        assert_eq!(remote.root, "sluice.transport");
        assert!(!ErrorKind::User.is_retryable());
        assert!(!ErrorKind::Cancelled.is_retryable());
        let (_, remote) = round_trip(DataFusionError::Internal("bug".into()));
        assert_eq!(remote.kind, ErrorKind::Internal);
    }

    #[test]
    fn unknown_roots_keep_their_text() {
        let remote = RemoteError {
            kind: ErrorKind::Internal,
            contexts: vec![],
            root: "from.the.future".into(),
            message: "something new".into(),
            peer: None,
        };
        assert_eq!(
            remote.to_error().to_string(),
            "Execution error: from.the.future: something new"
        );
    }
}
