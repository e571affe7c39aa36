//! Sluice's shuffle kernels: everything between "a stage produced a batch" and "a consumer task reads it".
//!
//! ```text
//!  batch ─► partitioner (route rows to channels) ─► coalesce (per-channel target-size batches)
//!                                                        │
//!                                channels (bounded memory, backpressure, spill) ─► consumers
//! ```
//!
//! - [`modulo`]: exact `hash % n` by multiplication.
//! - [`partitioner`]: hash / round-robin / range routing; hash routing equals DataFusion's row for row.
//! - `grouping` (private): the stable counting sort that groups a batch's rows by channel.
//! - [`coalesce`]: per-channel `BatchCoalescer`s with an optional row limit.
//! - [`builders`]: per-channel builders that gather routed rows straight into output batches;
//!   `byte_builders` (private) holds their string and binary columns, copying each value once.
//! - [`kernel`]: a producer partition's routing + batching, choosing builders or coalescers.
//! - [`channels`]: channel buffers with a memory budget, DataFusion-style backpressure and lz4 IPC spill.
//! - [`replay`]: replayable channel buffers for blocking outputs (read any number of times, spill).
//! - [`stream_end`]: explicit stream ends: a stream ends cleanly only when its writer finishes it;
//!   a failed or vanished writer fails its readers ([`IncompleteStream`]).
//! - [`metrics`]: rows/bytes per channel, routing and coalescing time, spill, as a DataFusion `MetricsSet`.
//!
//! This crate depends only on arrow and DataFusion's physical-plan layer, so it builds and benchmarks
//! without the SQL front end.

pub mod builders;
mod byte_builders;
pub mod channels;
pub mod coalesce;
mod grouping;
pub mod kernel;
pub mod metrics;
pub mod modulo;
pub mod partitioner;
pub mod replay;
pub mod stream_end;

pub use builders::ChannelBuilders;
pub use channels::{ChannelReceiver, ChannelSender, channel_set};
pub use coalesce::ChannelCoalescers;
pub use kernel::{KernelOptions, ShuffleKernel};
pub use metrics::{ShuffleMetrics, batch_data_bytes};
pub use modulo::FastModulo;
pub use partitioner::{Partitioner, RoutedBatch, RoutingScheme, RoutingTimes};
pub use replay::{ReplayReader, ReplayableOutput, Residence};
pub use stream_end::IncompleteStream;
