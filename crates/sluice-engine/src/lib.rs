//! Sluice's engine library.
//!
//! Where each step of the pipeline lives (see ARCHITECTURE.md for the whole map):
//!
//! ```text
//!   files ──► catalog (table discovery) ──► session (SQL → physical plan)
//!                                               │
//!                                   runner::JobRunner (one per execution mode)
//!                                               │
//!                                   record-batch stream to the caller
//! ```
//!
//! `config` holds the typed, layered configuration; `tpch` the built-in benchmark (data, queries,
//! answers, timing harness).

pub mod catalog;
pub mod config;
pub mod error;
pub mod runner;
pub mod session;
pub mod tpch;

pub use config::{ExecutionMode, SluiceConfig};
pub use error::{Result, SluiceError};
pub use session::SluiceSession;
