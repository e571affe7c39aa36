//! TPC-H built in: data generation, the 22 queries with validation parameters, the official answers, and
//! a timing harness that runs queries through a [`sluice_engine::SluiceSession`] of any mode.

pub mod answers;
pub mod bench;
pub mod datagen;
pub mod queries;

pub use answers::{ANSWER_SCALE_FACTOR, Answer, compare, format_rows, official_answer};
pub use datagen::{GenEvent, GenOptions, Manifest, TPCH_TABLES, generate, read_manifest};
pub use queries::{QUERY_NUMBERS, TpchQuery, tpch_query};
