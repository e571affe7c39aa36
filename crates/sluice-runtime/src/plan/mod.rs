//! The plan nodes a task adds around its stage plan: a writer at the root, readers at the leaves,
//! and, in a runtime filter's source stage, a key summary under the writer; in a pipelined
//! target stage of one, a wait for its filters (`await_filters`) on top of the stage plan.

pub mod await_filters;
pub mod key_summary;
pub mod shuffle_reader;
pub mod shuffle_writer;
