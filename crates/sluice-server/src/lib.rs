//! Sluice's front door: the Arrow Flight SQL endpoint of `sluice server`.
//!
//! ```text
//!  client ── Handshake (basic) ─────────► sessions: token → SluiceSession (own settings, own DDL)
//!         ── GetFlightInfo(statement) ──► session.plan(sql) → queries: handle → planned statement
//!         ◄─ FlightInfo(schema, ticket) ─┘
//!         ── DoGet(ticket) ─────────────► queries.take(handle) → session.run → job output stream
//!         ◄─ FlightData … (while the job runs; dropping the call cancels the job)
//!         ── PollFlightInfo(…) ─────────► queries: planned / queued (position) / running (tasks
//!                                          done of total, from the driver) / finished
//! ```
//!
//! Invariants:
//! - Every statement runs through its session's [`sluice_runtime::JobRunner`], the same path the CLI
//!   uses, so a front-door query returns exactly what `sluice sql` returns in the server's mode; the
//!   schema a `FlightInfo` announces is the physical plan's (nullability included).
//! - A ticket belongs to the session that planned it and is used once; tickets nobody fetched
//!   expire ([`queries::PENDING_TTL`]).
//! - Errors are mapped to gRPC codes in one place ([`status::status_of`]) with the text local mode
//!   prints.

pub mod admission;
pub mod cancellable;
pub mod client;
#[cfg(test)]
mod fuzz_tests;
pub mod limits;
pub mod login_limit;
pub mod metadata;
pub mod poll;
pub mod postgres;
pub mod prometheus;
pub mod queries;
pub mod rest;
pub mod rest_guard;
pub mod scram;
pub mod server;
pub mod service;
pub mod sessions;
pub mod status;
pub mod tls;
pub mod ui;
pub mod users;

pub use client::{RemoteOutput, RemoteSession};
pub use postgres::{PgEndpoint, PgOptions};
pub use server::{FlightSqlEndpoint, FlightSqlOptions};
pub use sessions::{SessionFactory, Sessions};
/// The status type of every front-door error (tonic's).
pub use tonic::Status;
