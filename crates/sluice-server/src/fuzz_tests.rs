//! Fuzzing of the decoders that face the network: Postgres frontend messages (pgwire's decoder in
//! each of its states), the SCRAM messages of a Postgres login, Flight SQL commands, statement
//! tickets and handles, SQL text, and the REST API's credentials, Host names and JSON bodies.
//! Whatever a client sends decodes to a value or to one error, never a panic.
//!
//! proptest drives it: 256 cases per property by default (CI), more with `PROPTEST_CASES=N` (a
//! longer run). A failing input is saved under `proptest-regressions/` and replayed first on every
//! later run, so the inputs that found bugs stay as regression tests.

use std::sync::Arc;

use arrow_flight::sql::{Any, Command};
use arrow_flight::{FlightEndpoint, FlightInfo, Ticket};
use bytes::BytesMut;
use pgwire::messages::{DecodeContext, PgWireFrontendMessage, ProtocolVersion};
use proptest::collection::vec;
use proptest::prelude::*;
use prost::Message;
use sluice_engine::{SluiceConfig, SluiceSession};

use crate::queries::QueryHandle;
use crate::rest::credentials_of_json;
use crate::rest_guard::{Guard, basic_credentials, token_of};
use crate::scram::ServerFirst;
use crate::users::Verifier;

/// Decodes every message `bytes` hold in the decoder state `state` (0: a new connection, 1: after
/// the TLS answer, 2: logged in), as pgwire's codec does: until it needs more bytes or errs.
fn decode_frontend(bytes: &[u8], state: u8) {
    let mut context = DecodeContext::new(ProtocolVersion::PROTOCOL3_0);
    context.awaiting_frontend_ssl = state == 0;
    context.awaiting_frontend_startup = state <= 1;
    let mut buffer = BytesMut::from(bytes);
    for _ in 0..64 {
        match PgWireFrontendMessage::decode(&mut buffer, &context) {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
    }
}

/// A message that starts like a real one: a type byte and a length, then `body`.
fn framed(kind: u8, length: i32, body: &[u8]) -> Vec<u8> {
    let mut bytes = vec![kind];
    bytes.extend_from_slice(&length.to_be_bytes());
    bytes.extend_from_slice(body);
    bytes
}

fn verifier() -> Verifier {
    Verifier::new("pencil", b"0123456789abcdef", 16)
}

proptest! {
    #[test]
    fn any_bytes_are_postgres_messages_or_an_error(bytes in vec(any::<u8>(), 0..512), state in 0u8..3) {
        decode_frontend(&bytes, state);
    }

    #[test]
    fn framed_postgres_messages_with_any_length_and_body_decode_or_fail(
        kind in prop::sample::select(b"QPBEDCSHFXcdfp".to_vec()),
        length in any::<i32>(),
        body in vec(any::<u8>(), 0..256),
    ) {
        decode_frontend(&framed(kind, length, &body), 2);
    }

    #[test]
    fn any_scram_client_messages_are_answered_or_refused(first in "\\PC{0,120}", last in "\\PC{0,160}") {
        if let Ok(answer) = ServerFirst::answer(&first, &verifier(), true, "servernonce") {
            let _ = answer.finish(&last);
        }
        let shaped = format!("n,,n=ann,r={first}");
        if let Ok(answer) = ServerFirst::answer(&shaped, &verifier(), true, "servernonce") {
            let _ = answer.finish(&format!("c=biws,r={first}servernonce,p={last}"));
        }
    }

    #[test]
    fn any_bytes_are_a_flight_sql_command_a_ticket_or_an_error(bytes in vec(any::<u8>(), 0..256)) {
        if let Ok(any) = Any::decode(bytes.as_slice()) {
            let _ = Command::try_from(any);
        }
        let _ = QueryHandle::from_bytes(&bytes);
        let info = FlightInfo::new().with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(bytes)));
        prop_assert!(crate::poll::statement_of(&info).is_err());
    }

    #[test]
    fn any_text_is_a_statement_handle_or_an_error(text in "sluice-query-\\PC{0,40}") {
        let _ = QueryHandle::from_bytes(text.as_bytes());
    }

    #[test]
    fn any_sql_text_parses_or_fails_with_a_message(sql in "[a-zA-Z0-9_ (),.*'\";$=<>+-]{0,200}") {
        let session = session();
        if let Err(error) = session.parse_sql(&sql) {
            prop_assert!(!error.to_string().is_empty());
        }
    }

    #[test]
    fn any_rest_credentials_hosts_and_bodies_decode_or_fail(
        header in "\\PC{0,80}",
        body in vec(any::<u8>(), 0..256),
    ) {
        let guard = Guard::new("127.0.0.1:8080".parse().unwrap(), &[], false, false);
        let _ = guard.answers_to(&header);
        if let Ok(value) = axum::http::HeaderValue::from_str(&format!("Basic {header}")) {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert(axum::http::header::AUTHORIZATION, value);
            let _ = basic_credentials(&headers);
        }
        if let Ok(value) = axum::http::HeaderValue::from_str(&header) {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert(axum::http::header::COOKIE, value);
            let _ = token_of(&headers);
        }
        if let Err(message) = credentials_of_json(&body) {
            prop_assert!(message.starts_with("expected a JSON body"), "{message}");
        }
    }
}

fn session() -> Arc<SluiceSession> {
    static SESSION: std::sync::OnceLock<Arc<SluiceSession>> = std::sync::OnceLock::new();
    SESSION
        .get_or_init(|| {
            Arc::new(
                SluiceSession::new(
                    &SluiceConfig::default(),
                    Arc::new(sluice_runtime::LocalRunner),
                )
                .unwrap(),
            )
        })
        .clone()
}
