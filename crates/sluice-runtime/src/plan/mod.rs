//! The plan nodes a task adds around its stage plan: a writer at the root, readers at the leaves.

pub mod shuffle_reader;
pub mod shuffle_writer;
