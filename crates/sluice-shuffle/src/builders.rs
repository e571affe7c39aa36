//! Per-channel builders: gather routed rows straight from the input batch into each channel's growing
//! output batch, so that every byte is copied exactly once and a small slice costs no per-slice overhead.
//!
//! ```text
//!  input column ──indices of channel 0──► channel 0 values/nulls ──(target rows)──► batch
//!               ──indices of channel 1──► channel 1 values/nulls ──(target rows)──► batch
//! ```
//!
//! This is the wide fan-out alternative to "gather once, slice, then coalesce each slice": with many
//! channels each slice is tiny and the coalescer's per-push overhead (and its second copy) dominates. It
//! handles fixed-width columns (integers, floats, decimals, dates, times, timestamps, durations,
//! intervals), booleans, and strings and binaries with offsets or views (`crate::byte_builders`);
//! [`ChannelBuilders::supports`] says whether a schema qualifies, and other schemas (dictionaries,
//! nested types) use [`crate::ChannelCoalescers`]. Output batches have exactly `target_rows` rows
//! except the final flush and whole input batches passed through by [`ChannelBuilders::push_whole`]; a
//! row limit caps each channel like the coalescers' does.

use std::collections::VecDeque;
use std::sync::Arc;

use arrow::array::downcast_primitive;
use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, BooleanArray, BooleanBufferBuilder,
    NullBufferBuilder, PrimitiveArray, RecordBatch, RecordBatchOptions,
};
use arrow::buffer::NullBuffer;
use arrow::datatypes::{DataType, SchemaRef};
use datafusion_common::{DataFusionError, Result};
use datafusion_physical_plan::metrics::Time;

use crate::byte_builders::byte_builder_for;

/// One column of one channel under construction.
pub(crate) trait ColumnBuilder: Send {
    /// Appends `source[i]` for every `i` in `rows`.
    fn gather(&mut self, source: &dyn Array, rows: &[u32]) -> Result<()>;
    /// The built column; the builder starts over, with room for `capacity` rows.
    fn finish(&mut self, capacity: usize) -> Result<ArrayRef>;
}

/// Appends the validity of `rows` of a column whose null buffer is `nulls`.
pub(crate) fn gather_nulls(
    builder: &mut NullBufferBuilder,
    nulls: Option<&NullBuffer>,
    rows: &[u32],
) {
    match nulls {
        Some(nulls) if nulls.null_count() > 0 => {
            for &row in rows {
                builder.append(nulls.is_valid(row as usize));
            }
        }
        _ => builder.append_n_non_nulls(rows.len()),
    }
}

struct PrimitiveBuilder<T: ArrowPrimitiveType> {
    values: Vec<T::Native>,
    nulls: NullBufferBuilder,
    data_type: DataType,
}

impl<T: ArrowPrimitiveType> ColumnBuilder for PrimitiveBuilder<T> {
    fn gather(&mut self, source: &dyn Array, rows: &[u32]) -> Result<()> {
        let source = source.as_primitive_opt::<T>().ok_or_else(|| {
            DataFusionError::Internal(format!("expected {} column", self.data_type))
        })?;
        // A plain slice keeps its length in a register; indexing the `ScalarBuffer` would reload it
        // after every store, since the store might alias it.
        let values: &[T::Native] = source.values();
        self.values
            .extend(rows.iter().map(|&row| values[row as usize]));
        gather_nulls(&mut self.nulls, source.nulls(), rows);
        Ok(())
    }

    fn finish(&mut self, capacity: usize) -> Result<ArrayRef> {
        let values = std::mem::replace(&mut self.values, Vec::with_capacity(capacity));
        let nulls = self.nulls.finish();
        Ok(Arc::new(
            PrimitiveArray::<T>::new(values.into(), nulls).with_data_type(self.data_type.clone()),
        ))
    }
}

struct BoolBuilder {
    values: BooleanBufferBuilder,
    nulls: NullBufferBuilder,
}

impl ColumnBuilder for BoolBuilder {
    fn gather(&mut self, source: &dyn Array, rows: &[u32]) -> Result<()> {
        let source = source
            .as_boolean_opt()
            .ok_or_else(|| DataFusionError::Internal("expected a boolean column".into()))?;
        let values = source.values();
        for &row in rows {
            self.values.append(values.value(row as usize));
        }
        gather_nulls(&mut self.nulls, source.nulls(), rows);
        Ok(())
    }

    fn finish(&mut self, capacity: usize) -> Result<ArrayRef> {
        let values = std::mem::replace(&mut self.values, BooleanBufferBuilder::new(capacity));
        let mut values = values;
        Ok(Arc::new(BooleanArray::new(
            values.finish(),
            self.nulls.finish(),
        )))
    }
}

fn builder_for(data_type: &DataType, capacity: usize) -> Option<Box<dyn ColumnBuilder>> {
    macro_rules! primitive {
        ($t:ty) => {
            Some(Box::new(PrimitiveBuilder::<$t> {
                values: Vec::with_capacity(capacity),
                nulls: NullBufferBuilder::new(capacity),
                data_type: data_type.clone(),
            }) as Box<dyn ColumnBuilder>)
        };
    }
    if *data_type == DataType::Boolean {
        return Some(Box::new(BoolBuilder {
            values: BooleanBufferBuilder::new(capacity),
            nulls: NullBufferBuilder::new(capacity),
        }));
    }
    downcast_primitive! {
        data_type => (primitive),
        _ => byte_builder_for(data_type, capacity),
    }
}

struct ChannelState {
    columns: Vec<Box<dyn ColumnBuilder>>,
    rows: usize,
    accepted: usize,
}

/// Per-channel builders for schemas of fixed-width, boolean, string and binary columns.
pub struct ChannelBuilders {
    schema: SchemaRef,
    target_rows: usize,
    limit: Option<usize>,
    channels: Vec<Option<ChannelState>>,
    completed: VecDeque<(usize, RecordBatch)>,
    time: Time,
}

impl std::fmt::Debug for ChannelBuilders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelBuilders")
            .field("channels", &self.channels.len())
            .field("target_rows", &self.target_rows)
            .finish_non_exhaustive()
    }
}

impl ChannelBuilders {
    /// Whether every column of `schema` can be built here.
    pub fn supports(schema: &SchemaRef) -> bool {
        schema
            .fields()
            .iter()
            .all(|f| builder_for(f.data_type(), 0).is_some())
    }

    /// Builders for `channels` channels, or `None` if the schema has a column type they cannot build.
    pub fn try_new(
        schema: SchemaRef,
        channels: usize,
        target_rows: usize,
        limit: Option<usize>,
        time: Time,
    ) -> Option<Self> {
        if !Self::supports(&schema) {
            return None;
        }
        Some(Self {
            schema,
            target_rows: target_rows.max(1),
            limit,
            channels: (0..channels).map(|_| None).collect(),
            completed: VecDeque::new(),
            time,
        })
    }

    fn new_channel(&self) -> Result<ChannelState> {
        let columns = self
            .schema
            .fields()
            .iter()
            .map(|f| {
                builder_for(f.data_type(), self.target_rows).ok_or_else(|| {
                    DataFusionError::Internal(format!("no builder for {}", f.data_type()))
                })
            })
            .collect::<Result<_>>()?;
        Ok(ChannelState {
            columns,
            rows: 0,
            accepted: 0,
        })
    }

    /// Appends the rows of every channel of one routed batch: `indices[offset..offset + len]` go to
    /// `channel` for each `(channel, offset, len)` in `ranges`.
    ///
    /// Ranges that fit in their channel's current batch are gathered column by column (one source
    /// column stays in cache while every channel takes its rows from it); a range that completes a
    /// batch, or any range under a row limit, goes through [`Self::gather`].
    pub fn gather_grouped(
        &mut self,
        batch: &RecordBatch,
        indices: &[u32],
        ranges: &[(usize, usize, usize)],
    ) -> Result<()> {
        let time = self.time.clone();
        let _timer = time.timer();
        let mut fitting = Vec::with_capacity(ranges.len());
        let mut overflowing = Vec::new();
        for &(channel, offset, len) in ranges {
            if channel >= self.channels.len() {
                return Err(DataFusionError::Internal(format!(
                    "channel {channel} out of range"
                )));
            }
            if self.channels[channel].is_none() {
                self.channels[channel] = Some(self.new_channel()?);
            }
            let fits = self.limit.is_none()
                && self.channels[channel]
                    .as_ref()
                    .is_some_and(|state| state.rows + len < self.target_rows);
            if fits {
                fitting.push((channel, offset, len));
            } else {
                overflowing.push((channel, offset, len));
            }
        }
        for (column_index, column) in batch.columns().iter().enumerate() {
            for &(channel, offset, len) in &fitting {
                if let Some(state) = self.channels[channel].as_mut()
                    && let Some(builder) = state.columns.get_mut(column_index)
                {
                    builder.gather(column.as_ref(), &indices[offset..offset + len])?;
                }
            }
        }
        for &(channel, _, len) in &fitting {
            if let Some(state) = self.channels[channel].as_mut() {
                state.rows += len;
                state.accepted += len;
            }
        }
        for (channel, offset, len) in overflowing {
            self.gather_untimed(channel, batch, &indices[offset..offset + len])?;
        }
        Ok(())
    }

    /// Hands a whole input batch to `channel`: passed on without a copy when the channel has no rows
    /// pending, no row limit applies and the batch holds at least half the target (as the coalescers
    /// do); otherwise its rows are gathered. `identity` must hold `0..n` for at least the batch's rows.
    pub fn push_whole(
        &mut self,
        channel: usize,
        batch: &RecordBatch,
        identity: &[u32],
    ) -> Result<()> {
        let pending = self
            .channels
            .get(channel)
            .and_then(Option::as_ref)
            .map_or(0, |state| state.rows);
        if self.limit.is_none()
            && pending == 0
            && channel < self.channels.len()
            && batch.num_rows() * 2 >= self.target_rows
        {
            self.completed.push_back((channel, batch.clone()));
            return Ok(());
        }
        let rows = identity.get(..batch.num_rows()).ok_or_else(|| {
            DataFusionError::Internal("identity indices shorter than the batch".into())
        })?;
        self.gather(channel, batch, rows)
    }

    /// Appends the input rows `rows` (row numbers of `batch`) to `channel`.
    pub fn gather(&mut self, channel: usize, batch: &RecordBatch, rows: &[u32]) -> Result<()> {
        let time = self.time.clone();
        let _timer = time.timer();
        self.gather_untimed(channel, batch, rows)
    }

    fn gather_untimed(&mut self, channel: usize, batch: &RecordBatch, rows: &[u32]) -> Result<()> {
        if channel >= self.channels.len() {
            return Err(DataFusionError::Internal(format!(
                "channel {channel} out of range"
            )));
        }
        if self.channels[channel].is_none() {
            self.channels[channel] = Some(self.new_channel()?);
        }
        let target = self.target_rows;
        let limit = self.limit;
        let Some(state) = self.channels[channel].as_mut() else {
            return Ok(());
        };
        let allowed = limit.map_or(rows.len(), |l| {
            l.saturating_sub(state.accepted).min(rows.len())
        });
        let mut rows = &rows[..allowed];
        state.accepted += rows.len();
        while !rows.is_empty() {
            let take = (target - state.rows).min(rows.len());
            let (now, later) = rows.split_at(take);
            for (builder, column) in state.columns.iter_mut().zip(batch.columns()) {
                builder.gather(column.as_ref(), now)?;
            }
            state.rows += take;
            rows = later;
            if state.rows == target {
                let batch = build(&self.schema, state, target)?;
                self.completed.push_back((channel, batch));
            }
        }
        Ok(())
    }

    /// Takes the next completed batch.
    pub fn next_completed(&mut self) -> Option<(usize, RecordBatch)> {
        self.completed.pop_front()
    }

    /// Whether `channel` has taken all the rows its limit allows.
    pub fn is_full(&self, channel: usize) -> bool {
        match (self.limit, self.channels.get(channel)) {
            (Some(limit), Some(Some(state))) => state.accepted >= limit,
            _ => false,
        }
    }

    /// Flushes every channel's partial batch.
    pub fn finish(&mut self) -> Result<()> {
        let _timer = self.time.timer();
        for channel in 0..self.channels.len() {
            if let Some(state) = self.channels[channel].as_mut()
                && state.rows > 0
            {
                let batch = build(&self.schema, state, self.target_rows)?;
                self.completed.push_back((channel, batch));
            }
        }
        Ok(())
    }
}

fn build(schema: &SchemaRef, state: &mut ChannelState, capacity: usize) -> Result<RecordBatch> {
    let columns = state
        .columns
        .iter_mut()
        .map(|c| c.finish(capacity))
        .collect::<Result<Vec<_>>>()?;
    let options = RecordBatchOptions::new().with_row_count(Some(state.rows));
    state.rows = 0;
    Ok(RecordBatch::try_new_with_options(
        schema.clone(),
        columns,
        &options,
    )?)
}

#[cfg(test)]
mod tests {
    use arrow::array::{Date32Array, Decimal128Array, Int64Array};
    use arrow::datatypes::{Field, Schema};

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("d", DataType::Decimal128(15, 2), false),
            Field::new("day", DataType::Date32, false),
            Field::new("b", DataType::Boolean, true),
        ]))
    }

    fn input() -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(Int64Array::from(vec![
                    Some(1),
                    None,
                    Some(3),
                    Some(4),
                    Some(5),
                ])),
                Arc::new(
                    Decimal128Array::from(vec![100, 200, 300, 400, 500])
                        .with_precision_and_scale(15, 2)
                        .unwrap(),
                ),
                Arc::new(Date32Array::from(vec![10, 20, 30, 40, 50])),
                Arc::new(BooleanArray::from(vec![
                    Some(true),
                    Some(false),
                    None,
                    Some(true),
                    Some(false),
                ])),
            ],
        )
        .unwrap()
    }

    fn take(batch: &RecordBatch, rows: Vec<u32>) -> RecordBatch {
        arrow::compute::take_record_batch(batch, &arrow::array::UInt32Array::from(rows)).unwrap()
    }

    #[test]
    fn grouped_gathering_equals_gathering_channel_by_channel() {
        let batch = input();
        // Channel 0 gets rows 0, 3; channel 1 rows 4, 1, 2; channel 2 row 1 (target 2: cuts happen
        // inside ranges and at range ends, across two pushes).
        let indices = [0u32, 3, 4, 1, 2, 1];
        let ranges = [(0, 0, 2), (1, 2, 3), (2, 5, 1)];
        let run = |grouped: bool| {
            let mut builders = ChannelBuilders::try_new(schema(), 3, 2, None, Time::new()).unwrap();
            for _ in 0..2 {
                if grouped {
                    builders.gather_grouped(&batch, &indices, &ranges).unwrap();
                } else {
                    for &(channel, offset, len) in &ranges {
                        builders
                            .gather(channel, &batch, &indices[offset..offset + len])
                            .unwrap();
                    }
                }
            }
            builders.finish().unwrap();
            let mut out: Vec<(usize, RecordBatch)> =
                std::iter::from_fn(|| builders.next_completed()).collect();
            out.sort_by_key(|(channel, _)| *channel);
            out
        };
        let by_channel = |out: &[(usize, RecordBatch)], channel: usize| -> Vec<RecordBatch> {
            out.iter()
                .filter(|(c, _)| *c == channel)
                .map(|(_, b)| b.clone())
                .collect()
        };
        let (grouped, plain) = (run(true), run(false));
        for channel in 0..3 {
            assert_eq!(by_channel(&grouped, channel), by_channel(&plain, channel));
        }
        assert_eq!(
            by_channel(&grouped, 1)
                .iter()
                .map(RecordBatch::num_rows)
                .collect::<Vec<_>>(),
            [2, 2, 2]
        );
    }

    #[test]
    fn gathers_rows_in_the_given_order_and_cuts_at_the_target() {
        let mut builders = ChannelBuilders::try_new(schema(), 2, 2, None, Time::new()).unwrap();
        let batch = input();
        builders.gather(1, &batch, &[4, 1, 2]).unwrap();
        builders.gather(0, &batch, &[0]).unwrap();
        builders.finish().unwrap();
        let out: Vec<(usize, RecordBatch)> =
            std::iter::from_fn(|| builders.next_completed()).collect();
        assert_eq!(
            out,
            vec![
                (1, take(&batch, vec![4, 1])),
                (0, take(&batch, vec![0])),
                (1, take(&batch, vec![2])),
            ]
        );
    }

    #[test]
    fn row_limit_caps_a_channel() {
        let mut builders =
            ChannelBuilders::try_new(schema(), 1, 100, Some(3), Time::new()).unwrap();
        let batch = input();
        builders.gather(0, &batch, &[0, 1]).unwrap();
        builders.gather(0, &batch, &[2, 3, 4]).unwrap();
        assert!(builders.is_full(0));
        builders.finish().unwrap();
        let (_, out) = builders.next_completed().unwrap();
        assert_eq!(out, batch.slice(0, 3));
    }

    #[test]
    fn strings_are_supported_and_dictionaries_are_not() {
        let strings = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8, false),
            Field::new("v", DataType::Utf8View, true),
            Field::new("b", DataType::LargeBinary, true),
        ]));
        assert!(ChannelBuilders::supports(&strings));
        let dictionary = Arc::new(Schema::new(vec![Field::new(
            "d",
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            false,
        )]));
        assert!(!ChannelBuilders::supports(&dictionary));
    }
}
