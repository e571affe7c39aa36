//! Sluice's engine library.
//!
//! Where each step of the pipeline lives (see ARCHITECTURE.md for the whole map):
//!
//! ```text
//!   files ──► catalog (table discovery) ──► session (SQL → physical plan, EXPLAIN DISTRIBUTED)
//!                                               │
//!                            sluice_runtime::JobRunner (the mode's runner, chosen by the front end)
//!                                               │
//!                                   record-batch stream to the caller
//! ```
//!
//! `config` holds the typed, layered configuration; `joins` the join-algorithm rule it selects;
//! `scan_balance` re-cuts Parquet scans into row-group-aligned, equal-row groups for distributed runs. The engine knows no runner beyond the trait:
//! the front end (the CLI) builds the runner of the configured mode and hands it to the session.

pub mod access;
pub mod catalog;
pub mod config;
pub mod delta_table;
pub mod error;
pub mod join_fallback;
pub mod joins;
pub mod remote_tables;
pub mod scan_balance;
pub mod session;
pub mod system_tables;
pub mod table_factory;

pub use config::{ExecutionMode, SluiceConfig};
pub use error::{Result, SluiceError};
pub use session::{ExplainFormat, PlannedStatement, SluiceSession, SluiceStatement};
