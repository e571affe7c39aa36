//! Shuffle metrics, registered in a DataFusion `ExecutionPlanMetricsSet` so that the writer node shows
//! them in `EXPLAIN ANALYZE` like any other operator's.

use datafusion_physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, SpillMetrics, Time,
};

use arrow::array::{Array, RecordBatch};

use crate::partitioner::RoutingTimes;

/// The bytes of data `batch` holds: the part of each buffer its rows use (a slice counts only its
/// rows; capacity that builders reserved and never filled does not count). This is what the
/// metrics call bytes sent and read; the memory pool accounts capacity instead.
pub fn batch_data_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|column| {
            column
                .to_data()
                .get_slice_memory_size()
                .unwrap_or_else(|_| column.get_array_memory_size())
        })
        .sum()
}

/// Everything one producer partition of a shuffle records.
#[derive(Debug, Clone)]
pub struct ShuffleMetrics {
    /// Rows sent to each channel.
    pub rows_per_channel: Vec<Count>,
    /// Batches sent to each channel.
    pub batches_per_channel: Vec<Count>,
    /// Bytes of data sent to each channel ([`batch_data_bytes`]: the rows' buffers, not the
    /// capacity the builders allocated).
    pub bytes_per_channel: Vec<Count>,
    /// Hashing, routing and gathering time (`gather_time` includes the per-channel builders, which
    /// gather rows straight into channel batches).
    pub routing: RoutingTimes,
    /// Time in the per-channel coalescers (zero when the schema uses builders).
    pub coalescing: Time,
    /// Spill files, bytes and rows.
    pub spill: SpillMetrics,
}

impl ShuffleMetrics {
    /// Registers the metrics of producer `partition` with `channels` channels in `set`.
    pub fn new(set: &ExecutionPlanMetricsSet, partition: usize, channels: usize) -> Self {
        let per_channel = |prefix: &str| {
            (0..channels)
                .map(|channel| {
                    MetricBuilder::new(set)
                        .with_new_label("channel", channel.to_string())
                        .counter(prefix.to_string(), partition)
                })
                .collect()
        };
        let time = |name: &'static str| MetricBuilder::new(set).subset_time(name, partition);
        Self {
            rows_per_channel: per_channel("channel_rows"),
            batches_per_channel: per_channel("channel_batches"),
            bytes_per_channel: per_channel("channel_bytes"),
            routing: RoutingTimes {
                hashing: time("hash_time"),
                routing: time("route_time"),
                gathering: time("gather_time"),
            },
            coalescing: time("coalesce_time"),
            spill: SpillMetrics::new(set, partition),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_bytes_count_the_rows_not_the_capacity() {
        use std::sync::Arc;

        use arrow::array::{ArrayRef, Int64Array, Int64Builder, StringArray};
        use arrow::datatypes::{DataType, Field, Schema};

        let mut builder = Int64Builder::with_capacity(8192);
        builder.append_slice(&[1, 2, 3]);
        let ints: ArrayRef = Arc::new(builder.finish());
        let strings: ArrayRef = Arc::new(StringArray::from(vec!["ab", "cde", "f"]));
        let schema = Arc::new(Schema::new(vec![
            Field::new("i", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(schema, vec![ints, strings]).unwrap();
        // 3 × 8 bytes of ints; 4 × 4 bytes of offsets and 6 bytes of string data.
        assert_eq!(batch_data_bytes(&batch), 24 + 16 + 6);
        assert_eq!(batch_data_bytes(&batch.slice(1, 1)), 8 + 8 + 3);
        assert!(datafusion_common::utils::memory::get_record_batch_memory_size(&batch) > 8192 * 8);
        let empty = Arc::new(Int64Array::from(Vec::<i64>::new())) as ArrayRef;
        assert_eq!(empty.to_data().get_slice_memory_size().unwrap(), 0);
    }

    #[test]
    fn metrics_show_in_the_set() {
        let set = ExecutionPlanMetricsSet::new();
        let metrics = ShuffleMetrics::new(&set, 0, 2);
        metrics.rows_per_channel[1].add(5);
        metrics.spill.spill_file_count.add(1);
        let snapshot = set.clone_inner();
        assert_eq!(
            snapshot.sum_by_name("channel_rows").map(|v| v.as_usize()),
            Some(5)
        );
        assert_eq!(snapshot.spill_count(), Some(1));
        assert!(snapshot.sum_by_name("hash_time").is_some());
    }
}
