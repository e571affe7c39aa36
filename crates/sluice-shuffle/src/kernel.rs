//! The writer-side shuffle kernel of one producer partition: route each input batch, collect each
//! channel's rows into target-size batches, hand out completed batches per channel.
//!
//! It picks the cheapest collection strategy the schema allows: [`ChannelBuilders`] (rows gathered
//! straight into per-channel batches, one copy) when every column is fixed-width, boolean, a string or a
//! binary (offsets or views), otherwise one gather per input batch followed by per-channel
//! [`ChannelCoalescers`]. A batch whose rows all go to one channel (always, under round-robin) passes
//! through without a copy when it is at least half the target size. Either way rows keep their input
//! order within a channel and every channel's output is cut at `target_rows`.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion_common::Result;

use crate::builders::ChannelBuilders;
use crate::coalesce::ChannelCoalescers;
use crate::metrics::{ShuffleMetrics, batch_data_bytes};
use crate::partitioner::{Assignment, Partitioner, RoutingScheme};

enum Collector {
    Builders(ChannelBuilders),
    Coalescers(ChannelCoalescers),
}

/// Routing plus per-channel batching for one producer partition.
pub struct ShuffleKernel {
    partitioner: Partitioner,
    collector: Collector,
    metrics: ShuffleMetrics,
    identity: Vec<u32>,
}

impl std::fmt::Debug for ShuffleKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShuffleKernel")
            .field("partitioner", &self.partitioner)
            .field(
                "collector",
                &match self.collector {
                    Collector::Builders(_) => "builders",
                    Collector::Coalescers(_) => "coalescers",
                },
            )
            .finish()
    }
}

/// What a [`ShuffleKernel`] is built from.
#[derive(Debug, Clone)]
pub struct KernelOptions {
    /// Rows per output batch.
    pub target_rows: usize,
    /// Most rows each channel emits, if limited.
    pub limit: Option<usize>,
    /// This producer's input partition and the number of them (round-robin stagger).
    pub input_partition: usize,
    /// Number of producer partitions.
    pub num_inputs: usize,
}

impl ShuffleKernel {
    /// A kernel routing batches of `schema` by `scheme`.
    pub fn try_new(
        scheme: RoutingScheme,
        schema: SchemaRef,
        options: &KernelOptions,
        metrics: ShuffleMetrics,
    ) -> Result<Self> {
        let partitioner = Partitioner::try_new(
            scheme,
            options.input_partition,
            options.num_inputs,
            metrics.routing.clone(),
        )?;
        let channels = partitioner.channels();
        // Builders gather rows straight into channel batches: their time is gather time, and
        // coalesce time stays zero.
        let collector = match ChannelBuilders::try_new(
            schema.clone(),
            channels,
            options.target_rows,
            options.limit,
            metrics.routing.gathering.clone(),
        ) {
            Some(builders) => Collector::Builders(builders),
            None => Collector::Coalescers(ChannelCoalescers::new(
                schema,
                channels,
                options.target_rows,
                options.limit,
                metrics.coalescing.clone(),
            )),
        };
        Ok(Self {
            partitioner,
            collector,
            metrics,
            identity: Vec::new(),
        })
    }

    /// Number of output channels.
    pub fn channels(&self) -> usize {
        self.partitioner.channels()
    }

    /// Routes and collects one input batch.
    pub fn push(&mut self, batch: &RecordBatch) -> Result<()> {
        match &mut self.collector {
            Collector::Builders(builders) => match self.partitioner.assign(batch)? {
                Assignment::Empty => Ok(()),
                Assignment::Whole(channel) => {
                    if self.identity.len() < batch.num_rows() {
                        self.identity = (0..batch.num_rows() as u32).collect();
                    }
                    builders.push_whole(channel, batch, &self.identity)
                }
                Assignment::Grouped { indices, ranges } => {
                    builders.gather_grouped(batch, indices, ranges)
                }
            },
            Collector::Coalescers(coalescers) => {
                for (channel, slice) in self.partitioner.route(batch)?.slices() {
                    coalescers.push(channel, slice)?;
                }
                Ok(())
            }
        }
    }

    /// Flushes every channel's partial batch (call once, after the last input batch).
    pub fn finish(&mut self) -> Result<()> {
        match &mut self.collector {
            Collector::Builders(builders) => builders.finish(),
            Collector::Coalescers(coalescers) => coalescers.finish(),
        }
    }

    /// The next completed batch and its channel.
    pub fn next_completed(&mut self) -> Option<(usize, RecordBatch)> {
        let (channel, batch) = match &mut self.collector {
            Collector::Builders(builders) => builders.next_completed(),
            Collector::Coalescers(coalescers) => coalescers.next_completed(),
        }?;
        if let Some(rows) = self.metrics.rows_per_channel.get(channel) {
            rows.add(batch.num_rows());
        }
        if let Some(batches) = self.metrics.batches_per_channel.get(channel) {
            batches.add(1);
        }
        if let Some(bytes) = self.metrics.bytes_per_channel.get(channel) {
            bytes.add(batch_data_bytes(&batch));
        }
        Some((channel, batch))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion_physical_expr::expressions::col;
    use datafusion_physical_plan::metrics::ExecutionPlanMetricsSet;

    use super::*;

    fn run(schema: SchemaRef, batches: &[RecordBatch], channels: usize) -> Vec<Vec<i64>> {
        let set = ExecutionPlanMetricsSet::new();
        let scheme = RoutingScheme::Hash {
            keys: vec![col("k", &schema).unwrap()],
            channels,
        };
        let options = KernelOptions {
            target_rows: 64,
            limit: None,
            input_partition: 0,
            num_inputs: 1,
        };
        let mut kernel = ShuffleKernel::try_new(
            scheme,
            schema,
            &options,
            ShuffleMetrics::new(&set, 0, channels),
        )
        .unwrap();
        let mut out = vec![Vec::new(); channels];
        for batch in batches {
            kernel.push(batch).unwrap();
        }
        kernel.finish().unwrap();
        while let Some((channel, batch)) = kernel.next_completed() {
            let keys = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            out[channel].extend(keys.values().iter().copied());
        }
        let total: usize = set
            .clone_inner()
            .sum_by_name("channel_rows")
            .unwrap()
            .as_usize();
        assert_eq!(total, out.iter().map(Vec::len).sum::<usize>());
        out
    }

    #[test]
    fn both_collectors_give_the_same_channels_in_input_order() {
        let fixed = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let mixed = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let keys = |start: i64| Int64Array::from_iter_values(start..start + 500);
        let fixed_batches: Vec<RecordBatch> = (0..3)
            .map(|i| RecordBatch::try_new(fixed.clone(), vec![Arc::new(keys(i * 500))]).unwrap())
            .collect();
        let mixed_batches: Vec<RecordBatch> = (0..3)
            .map(|i| {
                let strings: Vec<String> = (0..500).map(|j| format!("r{j}")).collect();
                RecordBatch::try_new(
                    mixed.clone(),
                    vec![
                        Arc::new(keys(i * 500)),
                        Arc::new(StringArray::from(strings)),
                    ],
                )
                .unwrap()
            })
            .collect();
        let a = run(fixed, &fixed_batches, 5);
        let b = run(mixed, &mixed_batches, 5);
        assert_eq!(a, b);
        for channel in &a {
            assert!(channel.windows(2).all(|w| w[0] < w[1]), "input order kept");
        }
        assert_eq!(a.iter().map(Vec::len).sum::<usize>(), 1500);
    }
}
