//! The plan nodes a task adds around its stage plan: a writer at the root, readers at the leaves,
//! and, in a runtime filter's source stage, a key summary under the writer.

pub mod key_summary;
pub mod shuffle_reader;
pub mod shuffle_writer;
