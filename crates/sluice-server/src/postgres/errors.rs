//! Errors on the Postgres wire: every Sluice error becomes an `ErrorResponse` with the SQLSTATE of
//! its [`Failure`] kind and the text local mode gives; errors raised inside pgwire or
//! datafusion-postgres (their parser, parameter decoding) are classified the same way on their way
//! out ([`PgErrors`]), so a client never sees a bare `XX000` for a syntax error.

use datafusion::error::DataFusionError;
use datafusion::sql::sqlparser::parser::ParserError;
use pgwire::api::{ClientInfo, ErrorHandler};
use pgwire::error::{ErrorInfo, PgWireError};
use sluice_engine::SluiceError;

use crate::status::{Failure, datafusion_message, message_of};

/// SQLSTATE of a statement cancelled by its client.
pub const QUERY_CANCELED: &str = "57014";

/// The wire error for `error`.
pub fn pg_error(error: &SluiceError) -> PgWireError {
    user_error(Failure::of(error), message_of(error))
}

fn user_error(failure: Failure, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        failure.sqlstate().to_string(),
        message,
    )))
}

/// The wire error for a DataFusion error.
pub fn pg_datafusion_error(error: DataFusionError) -> PgWireError {
    pg_error(&SluiceError::from(error))
}

/// The error a cancelled statement ends with (Postgres's own text).
pub fn cancelled() -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        QUERY_CANCELED.to_string(),
        "canceling statement due to user request".to_string(),
    )))
}

/// Gives errors raised outside Sluice's code their SQLSTATE.
#[derive(Debug, Default)]
pub struct PgErrors;

impl ErrorHandler for PgErrors {
    fn on_error<C>(&self, _client: &C, error: &mut PgWireError)
    where
        C: ClientInfo,
    {
        if let Some(mapped) = classify(error) {
            *error = mapped;
        }
    }
}

/// The classified form of an error pgwire or datafusion-postgres raised, if it is one of Sluice's
/// kinds (a DataFusion or SQL parser error in an `ApiError`).
fn classify(error: &PgWireError) -> Option<PgWireError> {
    let PgWireError::ApiError(inner) = error else {
        return None;
    };
    if let Some(error) = inner.downcast_ref::<DataFusionError>() {
        return Some(user_error(
            Failure::of_datafusion(error),
            datafusion_message(error),
        ));
    }
    if let Some(error) = inner.downcast_ref::<ParserError>() {
        let error = DataFusionError::SQL(Box::new(error.clone()), None);
        return Some(user_error(Failure::Syntax, error.strip_backtrace()));
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn info(error: PgWireError) -> (String, String) {
        match error {
            PgWireError::UserError(info) => (info.code, info.message),
            other => panic!("not a user error: {other:?}"),
        }
    }

    #[test]
    fn errors_from_outside_sluice_get_their_sqlstate() {
        let parse = PgWireError::ApiError(Box::new(ParserError::ParserError(
            "Expected: an SQL statement, found: selec".into(),
        )));
        assert_eq!(
            info(classify(&parse).unwrap()),
            (
                "42601".to_string(),
                "SQL error: ParserError(\"Expected: an SQL statement, found: selec\")".to_string()
            )
        );
        let plan = PgWireError::ApiError(Box::new(DataFusionError::Plan(
            "table 'datafusion.public.nope' not found".into(),
        )));
        assert_eq!(
            info(classify(&plan).unwrap()),
            (
                "42P01".to_string(),
                "Error during planning: table 'datafusion.public.nope' not found".to_string()
            )
        );
        assert!(classify(&PgWireError::QueryCanceled).is_none());
    }

    #[test]
    fn cancellation_has_postgres_text() {
        assert_eq!(
            info(cancelled()),
            (
                "57014".to_string(),
                "canceling statement due to user request".to_string()
            )
        );
    }
}
