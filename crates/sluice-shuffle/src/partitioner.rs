//! Routing: which output channel each row of a batch goes to, and moving the rows there.
//!
//! ```text
//!  input batch ──keys──► hashes (DataFusion's create_hashes, REPARTITION_RANDOM_STATE)
//!       │                  │ exact hash % n (FastModulo)
//!       │                  ▼
//!       │            channel id per row ──► histogram ──► prefix sums ──► one index array,
//!       │                                                                 rows grouped by channel
//!       └──────────── one gather (take) per column ◄───────────────────────┘
//!                          │
//!            zero-copy slices, one per non-empty channel ──► (channel, RecordBatch)
//! ```
//!
//! Invariants: hash routing is row-for-row identical to DataFusion's `BatchPartitioner` (so a reader may
//! declare `Partitioning::Hash`); rows keep their input order within a channel; bytes are moved at most
//! once per input batch, and not at all when every row goes to one channel. Scratch buffers (hashes,
//! channel ids, counts, indices) are reused from batch to batch.
//!
//! Round-robin sends whole batches, starting at `input_partition * n / num_inputs` so that several inputs
//! do not all begin with channel 0. Range routing sends a row to the channel whose split-point interval
//! holds its key: channel `i` gets keys `k` with `split[i-1] <= k < split[i]` in the key's sort order.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, RecordBatchOptions, UInt32Array};
use arrow::buffer::ScalarBuffer;
use arrow::compute::take_arrays;
use arrow::row::{OwnedRow, RowConverter, SortField};
use datafusion_common::hash_utils::create_hashes;
use datafusion_common::{DataFusionError, Result};
use datafusion_physical_expr::PhysicalExpr;
use datafusion_physical_plan::metrics::Time;
use datafusion_physical_plan::repartition::REPARTITION_RANDOM_STATE;

use crate::grouping::ChannelGrouping;
use crate::modulo::FastModulo;

/// How rows are assigned to channels.
#[derive(Debug, Clone)]
pub enum RoutingScheme {
    /// By hash of the key expressions, exactly as DataFusion's hash repartitioning.
    Hash {
        /// Key expressions, evaluated against each batch.
        keys: Vec<Arc<dyn PhysicalExpr>>,
        /// Number of channels.
        channels: usize,
    },
    /// Whole batches in turn.
    RoundRobin {
        /// Number of channels.
        channels: usize,
    },
    /// By key ranges.
    Range {
        /// Key expressions.
        keys: Vec<Arc<dyn PhysicalExpr>>,
        /// Sort order of each key.
        sort_fields: Vec<SortField>,
        /// Split points, one row per boundary, ascending in the sort order; `split.len() + 1` channels.
        split_points: Vec<ArrayRef>,
    },
}

impl RoutingScheme {
    /// Number of output channels.
    pub fn channels(&self) -> usize {
        match self {
            RoutingScheme::Hash { channels, .. } | RoutingScheme::RoundRobin { channels } => {
                *channels
            }
            RoutingScheme::Range { split_points, .. } => {
                split_points.first().map_or(0, |a| a.len()) + 1
            }
        }
    }
}

/// Time spent in each routing step.
#[derive(Debug, Clone, Default)]
pub struct RoutingTimes {
    /// Evaluating keys and hashing them.
    pub hashing: Time,
    /// Channel ids, histogram and index scatter.
    pub routing: Time,
    /// The gather (`take`) of every column.
    pub gathering: Time,
}

/// A routed batch: `batch` holds the rows grouped by channel; `ranges` says where each channel's rows are.
#[derive(Debug, Clone)]
pub struct RoutedBatch {
    batch: RecordBatch,
    ranges: Vec<(usize, usize, usize)>,
}

impl RoutedBatch {
    /// `(channel, rows)` for every channel that received rows, in channel order; slices share the
    /// gathered batch's buffers.
    pub fn slices(&self) -> impl Iterator<Item = (usize, RecordBatch)> + '_ {
        self.ranges
            .iter()
            .map(|&(channel, offset, len)| (channel, self.batch.slice(offset, len)))
    }

    /// How many channels received rows.
    pub fn channel_count(&self) -> usize {
        self.ranges.len()
    }
}

/// Where a batch's rows go, before any row is moved.
#[derive(Debug, Clone, Copy)]
pub enum Assignment<'a> {
    /// The batch has no rows.
    Empty,
    /// Every row goes to this channel.
    Whole(usize),
    /// Rows grouped by channel: `indices[offset..offset + len]` are the input rows of `channel`, in input
    /// order, for each `(channel, offset, len)` in `ranges` (channels ascending, none empty).
    Grouped {
        /// Input row numbers, grouped by channel.
        indices: &'a [u32],
        /// `(channel, offset, len)` into `indices`.
        ranges: &'a [(usize, usize, usize)],
    },
}

enum State {
    Hash {
        keys: Vec<Arc<dyn PhysicalExpr>>,
        modulo: FastModulo,
        hashes: Vec<u64>,
    },
    RoundRobin {
        next: usize,
    },
    Range {
        keys: Vec<Arc<dyn PhysicalExpr>>,
        converter: RowConverter,
        splits: Vec<OwnedRow>,
    },
}

/// Routes batches to channels; one per producer (it keeps round-robin position and scratch buffers).
pub struct Partitioner {
    state: State,
    channels: usize,
    times: RoutingTimes,
    ids: Vec<u32>,
    grouping: ChannelGrouping,
}

impl std::fmt::Debug for Partitioner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partitioner")
            .field("channels", &self.channels)
            .finish_non_exhaustive()
    }
}

impl Partitioner {
    /// A partitioner for `scheme`, for input partition `input_partition` of `num_inputs`.
    pub fn try_new(
        scheme: RoutingScheme,
        input_partition: usize,
        num_inputs: usize,
        times: RoutingTimes,
    ) -> Result<Self> {
        let channels = scheme.channels();
        if channels == 0 {
            return Err(DataFusionError::Plan(
                "a shuffle needs at least one output channel".into(),
            ));
        }
        let state = match scheme {
            RoutingScheme::Hash { keys, channels } => State::Hash {
                keys,
                modulo: FastModulo::new(channels as u64),
                hashes: Vec::new(),
            },
            RoutingScheme::RoundRobin { channels } => State::RoundRobin {
                next: input_partition * channels / num_inputs.max(1) % channels,
            },
            RoutingScheme::Range {
                keys,
                sort_fields,
                split_points,
            } => {
                if keys.len() != sort_fields.len() || keys.len() != split_points.len() {
                    return Err(DataFusionError::Plan(format!(
                        "range routing has {} keys, {} sort fields and {} split columns",
                        keys.len(),
                        sort_fields.len(),
                        split_points.len()
                    )));
                }
                let converter = RowConverter::new(sort_fields)?;
                let rows = converter.convert_columns(&split_points)?;
                let splits: Vec<OwnedRow> = rows.iter().map(|r| r.owned()).collect();
                if splits.windows(2).any(|w| w[0] > w[1]) {
                    return Err(DataFusionError::Plan(
                        "range split points must be sorted".into(),
                    ));
                }
                State::Range {
                    keys,
                    converter,
                    splits,
                }
            }
        };
        Ok(Self {
            state,
            channels,
            times,
            ids: Vec::new(),
            grouping: ChannelGrouping::default(),
        })
    }

    /// Number of output channels.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Routes one batch: assigns rows to channels, then gathers them once.
    pub fn route(&mut self, batch: &RecordBatch) -> Result<RoutedBatch> {
        match self.assign(batch)? {
            Assignment::Empty => return Ok(whole(batch, 0)),
            Assignment::Whole(channel) => return Ok(whole(batch, channel)),
            Assignment::Grouped { .. } => {}
        }
        let timer = self.times.gathering.timer();
        let indices = UInt32Array::new(ScalarBuffer::from(self.grouping.take_indices()), None);
        let columns = take_arrays(batch.columns(), &indices, None)?;
        let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        let gathered = RecordBatch::try_new_with_options(batch.schema(), columns, &options)?;
        // Keep the index buffer for the next batch when nothing else holds it.
        let (_, buffer, _) = indices.into_parts();
        self.grouping
            .restore(buffer.into_inner().into_vec().unwrap_or_default());
        timer.done();
        Ok(RoutedBatch {
            batch: gathered,
            ranges: self.grouping.ranges().to_vec(),
        })
    }

    /// Decides where each row of `batch` goes without moving any row.
    pub fn assign(&mut self, batch: &RecordBatch) -> Result<Assignment<'_>> {
        let rows = batch.num_rows();
        if rows == 0 {
            return Ok(Assignment::Empty);
        }
        match &mut self.state {
            State::RoundRobin { next } => {
                let channel = *next;
                *next = (*next + 1) % self.channels;
                return Ok(Assignment::Whole(channel));
            }
            State::Hash {
                keys,
                modulo,
                hashes,
            } => {
                let timer = self.times.hashing.timer();
                let arrays = evaluate(keys, batch)?;
                hashes.clear();
                hashes.resize(rows, 0);
                create_hashes(&arrays, REPARTITION_RANDOM_STATE.random_state(), hashes)?;
                timer.done();
                let timer = self.times.routing.timer();
                modulo.remainders(hashes, &mut self.ids);
                timer.done();
            }
            State::Range {
                keys,
                converter,
                splits,
            } => {
                let timer = self.times.routing.timer();
                let arrays = evaluate(keys, batch)?;
                let converted = converter.convert_columns(&arrays)?;
                self.ids.clear();
                self.ids.extend(
                    converted
                        .iter()
                        .map(|row| splits.partition_point(|split| split.row() <= row) as u32),
                );
                timer.done();
            }
        }
        Ok(self.group_by_channel())
    }

    /// Groups row numbers by channel id (see [`crate::grouping`]).
    fn group_by_channel(&mut self) -> Assignment<'_> {
        let _timer = self.times.routing.timer();
        self.grouping.group(&self.ids, self.channels)
    }
}

fn whole(batch: &RecordBatch, channel: usize) -> RoutedBatch {
    let ranges = if batch.num_rows() == 0 {
        Vec::new()
    } else {
        vec![(channel, 0, batch.num_rows())]
    };
    RoutedBatch {
        batch: batch.clone(),
        ranges,
    }
}

fn evaluate(keys: &[Arc<dyn PhysicalExpr>], batch: &RecordBatch) -> Result<Vec<ArrayRef>> {
    keys.iter()
        .map(|key| key.evaluate(batch)?.into_array(batch.num_rows()))
        .collect()
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion_physical_expr::expressions::col;

    use super::*;

    fn batch(keys: Vec<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let strings: Vec<String> = keys.iter().map(|k| format!("v{k}")).collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(StringArray::from(strings)),
            ],
        )
        .unwrap()
    }

    fn keys_of(batch: &RecordBatch) -> Vec<i64> {
        batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .values()
            .to_vec()
    }

    #[test]
    fn round_robin_staggers_and_rotates() {
        let scheme = RoutingScheme::RoundRobin { channels: 4 };
        let mut p = Partitioner::try_new(scheme, 1, 2, RoutingTimes::default()).unwrap();
        let b = batch(vec![1, 2, 3]);
        let channels: Vec<usize> = (0..5)
            .map(|_| p.route(&b).unwrap().slices().next().unwrap().0)
            .collect();
        assert_eq!(channels, vec![2, 3, 0, 1, 2]);
    }

    #[test]
    fn hash_keeps_row_order_within_channels_and_loses_nothing() {
        let b = batch((0..1000).collect());
        let schema = b.schema();
        let scheme = RoutingScheme::Hash {
            keys: vec![col("k", &schema).unwrap()],
            channels: 7,
        };
        let mut p = Partitioner::try_new(scheme, 0, 1, RoutingTimes::default()).unwrap();
        let routed = p.route(&b).unwrap();
        let mut all = Vec::new();
        for (_, slice) in routed.slices() {
            let keys = keys_of(&slice);
            assert!(keys.windows(2).all(|w| w[0] < w[1]));
            all.extend(keys);
        }
        all.sort();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn range_routes_by_split_points() {
        let b = batch(vec![5, 10, 15, 20, 25, -3]);
        let schema = b.schema();
        let scheme = RoutingScheme::Range {
            keys: vec![col("k", &schema).unwrap()],
            sort_fields: vec![SortField::new(DataType::Int64)],
            split_points: vec![Arc::new(Int64Array::from(vec![10, 20]))],
        };
        let mut p = Partitioner::try_new(scheme, 0, 1, RoutingTimes::default()).unwrap();
        let routed: Vec<(usize, Vec<i64>)> = p
            .route(&b)
            .unwrap()
            .slices()
            .map(|(c, s)| (c, keys_of(&s)))
            .collect();
        assert_eq!(
            routed,
            vec![(0, vec![5, -3]), (1, vec![10, 15]), (2, vec![20, 25])]
        );
    }

    #[test]
    fn one_channel_means_no_gather() {
        let b = batch(vec![1, 1, 1]);
        let schema = b.schema();
        let scheme = RoutingScheme::Hash {
            keys: vec![col("k", &schema).unwrap()],
            channels: 3,
        };
        let mut p = Partitioner::try_new(scheme, 0, 1, RoutingTimes::default()).unwrap();
        let routed = p.route(&b).unwrap();
        assert_eq!(routed.channel_count(), 1);
        let (_, slice) = routed.slices().next().unwrap();
        assert!(slice.column(0).to_data().ptr_eq(&b.column(0).to_data()));
    }

    #[test]
    fn unsorted_splits_and_zero_channels_are_errors() {
        let schema = batch(vec![]).schema();
        let unsorted = RoutingScheme::Range {
            keys: vec![col("k", &schema).unwrap()],
            sort_fields: vec![SortField::new(DataType::Int64)],
            split_points: vec![Arc::new(Int64Array::from(vec![20, 10]))],
        };
        assert!(Partitioner::try_new(unsorted, 0, 1, RoutingTimes::default()).is_err());
        let none = RoutingScheme::RoundRobin { channels: 0 };
        assert!(Partitioner::try_new(none, 0, 1, RoutingTimes::default()).is_err());
    }
}
