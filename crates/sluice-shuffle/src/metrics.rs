//! Shuffle metrics, registered in a DataFusion `ExecutionPlanMetricsSet` so that the writer node shows
//! them in `EXPLAIN ANALYZE` like any other operator's.

use datafusion_physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, SpillMetrics, Time,
};

use crate::partitioner::RoutingTimes;

/// Everything one producer partition of a shuffle records.
#[derive(Debug, Clone)]
pub struct ShuffleMetrics {
    /// Rows sent to each channel.
    pub rows_per_channel: Vec<Count>,
    /// Bytes (Arrow memory size) sent to each channel.
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
