//! Hash routing must equal DataFusion's `BatchPartitioner` row for row, for any schema, batch size and
//! channel count: downstream operators rely on `Partitioning::Hash` meaning exactly DataFusion's routing.
//! The whole kernel (routing plus per-channel batching, with whichever collector the schema gets) must
//! then deliver every channel's rows in that order, cut at the target size.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryArray, DictionaryArray, Int32Array, Int64Array, LargeStringArray, RecordBatch,
    StringArray, StringViewArray,
};
use arrow::compute::concat_batches;
use arrow::datatypes::{DataType, Field, Int32Type, Schema, SchemaRef};
use datafusion_physical_expr::PhysicalExpr;
use datafusion_physical_expr::expressions::col;
use datafusion_physical_plan::Partitioning;
use datafusion_physical_plan::metrics::{ExecutionPlanMetricsSet, Time};
use datafusion_physical_plan::repartition::BatchPartitioner;
use proptest::prelude::*;
use sluice_shuffle::{
    ChannelBuilders, KernelOptions, Partitioner, RoutingScheme, RoutingTimes, ShuffleKernel,
    ShuffleMetrics,
};

#[derive(Debug, Clone, Copy)]
enum Kind {
    Int32,
    Int64,
    Utf8,
    LargeUtf8,
    Binary,
    Utf8View,
    BinaryView,
    Dictionary,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Int32),
        Just(Kind::Int64),
        Just(Kind::Utf8),
        Just(Kind::LargeUtf8),
        Just(Kind::Binary),
        Just(Kind::Utf8View),
        Just(Kind::BinaryView),
        Just(Kind::Dictionary),
    ]
}

/// Small value domains so that keys repeat and several rows share a channel.
fn column(kind: Kind, values: &[Option<u8>]) -> (DataType, ArrayRef) {
    let text = |v: &Option<u8>| v.map(|v| format!("s{}", v % 17));
    match kind {
        Kind::Int32 => (
            DataType::Int32,
            Arc::new(
                values
                    .iter()
                    .map(|v| v.map(i32::from))
                    .collect::<Int32Array>(),
            ),
        ),
        Kind::Int64 => (
            DataType::Int64,
            Arc::new(
                values
                    .iter()
                    .map(|v| v.map(|v| i64::from(v) * 1_000_003))
                    .collect::<Int64Array>(),
            ),
        ),
        Kind::Utf8 => (
            DataType::Utf8,
            Arc::new(values.iter().map(text).collect::<StringArray>()),
        ),
        Kind::LargeUtf8 => (
            DataType::LargeUtf8,
            Arc::new(values.iter().map(varied).collect::<LargeStringArray>()),
        ),
        Kind::Binary => (
            DataType::Binary,
            Arc::new(BinaryArray::from(
                values.iter().map(varied).collect::<StringArray>(),
            )),
        ),
        Kind::Utf8View => (
            DataType::Utf8View,
            Arc::new(values.iter().map(varied).collect::<StringViewArray>()),
        ),
        Kind::BinaryView => (
            DataType::BinaryView,
            Arc::new(
                values
                    .iter()
                    .map(varied)
                    .collect::<StringViewArray>()
                    .to_binary_view(),
            ),
        ),
        Kind::Dictionary => {
            let strings: Vec<Option<String>> = values.iter().map(text).collect();
            let array: DictionaryArray<Int32Type> = strings.iter().map(|v| v.as_deref()).collect();
            (
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
                Arc::new(array),
            )
        }
    }
}

/// Values from empty to 60 bytes: inline views (up to 12), chunk-copied ones (up to 32) and longer.
fn varied(v: &Option<u8>) -> Option<String> {
    v.map(|v| {
        let len = usize::from(v) % 61;
        format!("{v:03}{}", "é·x".repeat(20))
            .chars()
            .take(len)
            .collect()
    })
}

fn cell() -> impl Strategy<Value = Option<u8>> {
    prop_oneof![1 => Just(None), 6 => any::<u8>().prop_map(Some)]
}

/// Column kinds, their cells, the key column numbers, and the channel count.
type Case = (Vec<Kind>, Vec<Vec<Option<u8>>>, Vec<usize>, usize);

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(kind(), 1..5),
        0usize..400,
        1usize..300,
    )
        .prop_flat_map(|(kinds, rows, channels)| {
            let n = kinds.len();
            (
                Just(kinds),
                prop::collection::vec(prop::collection::vec(cell(), rows), n),
                prop::collection::vec(0..n, 1..=n),
                Just(channels),
            )
        })
}

fn by_channel(
    parts: impl Iterator<Item = (usize, RecordBatch)>,
) -> BTreeMap<usize, Vec<RecordBatch>> {
    let mut map: BTreeMap<usize, Vec<RecordBatch>> = BTreeMap::new();
    for (channel, batch) in parts {
        if batch.num_rows() > 0 {
            map.entry(channel).or_default().push(batch);
        }
    }
    map
}

/// The batch of a generated case (columns `c0`, `c1`, …), its schema and its key expressions.
fn batch_and_keys(
    kinds: &[Kind],
    columns: &[Vec<Option<u8>>],
    key_columns: &[usize],
) -> (SchemaRef, RecordBatch, Vec<Arc<dyn PhysicalExpr>>) {
    let mut fields = Vec::new();
    let mut arrays = Vec::new();
    for (i, (kind, values)) in kinds.iter().zip(columns).enumerate() {
        let (data_type, array) = column(*kind, values);
        fields.push(Field::new(format!("c{i}"), data_type, true));
        arrays.push(array);
    }
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), arrays).unwrap();
    let keys = key_columns
        .iter()
        .map(|i| col(&format!("c{i}"), &schema).unwrap())
        .collect();
    (schema, batch, keys)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn hash_routing_equals_datafusion((kinds, columns, key_columns, channels) in case()) {
        let (_, batch, keys) = batch_and_keys(&kinds, &columns, &key_columns);

        let mut theirs = BatchPartitioner::try_new(
            Partitioning::Hash(keys.clone(), channels),
            Time::new(),
            0,
            1,
        )
        .unwrap();
        let expected = by_channel(
            theirs.partition_iter(batch.clone()).unwrap().map(|r| r.unwrap()),
        );

        let mut ours = Partitioner::try_new(
            RoutingScheme::Hash { keys, channels },
            0,
            1,
            RoutingTimes::default(),
        )
        .unwrap();
        let routed = ours.route(&batch).unwrap();
        let actual = by_channel(routed.slices());

        prop_assert_eq!(actual, expected);
    }

    #[test]
    fn kernel_delivers_datafusions_channels_in_target_size_batches(
        (kinds, columns, key_columns, channels) in case(),
        target_rows in 1usize..70,
        cut in 0usize..400,
    ) {
        let (schema, batch, keys) = batch_and_keys(&kinds, &columns, &key_columns);
        // Two pushes (the second a slice with an offset), so channels carry state across inputs.
        let cut = cut.min(batch.num_rows());
        let inputs = [batch.slice(0, cut), batch.slice(cut, batch.num_rows() - cut)];

        let mut theirs = BatchPartitioner::try_new(
            Partitioning::Hash(keys.clone(), channels),
            Time::new(),
            0,
            1,
        )
        .unwrap();
        let mut expected: BTreeMap<usize, Vec<RecordBatch>> = BTreeMap::new();
        for input in &inputs {
            for (channel, part) in theirs.partition_iter(input.clone()).unwrap().map(|r| r.unwrap()) {
                expected.entry(channel).or_default().push(part);
            }
        }

        let set = ExecutionPlanMetricsSet::new();
        let options = KernelOptions { target_rows, limit: None, input_partition: 0, num_inputs: 1 };
        let mut kernel = ShuffleKernel::try_new(
            RoutingScheme::Hash { keys, channels },
            schema.clone(),
            &options,
            ShuffleMetrics::new(&set, 0, channels),
        )
        .unwrap();
        let mut actual: BTreeMap<usize, Vec<RecordBatch>> = BTreeMap::new();
        for input in &inputs {
            kernel.push(input).unwrap();
            while let Some((channel, out)) = kernel.next_completed() {
                actual.entry(channel).or_default().push(out);
            }
        }
        kernel.finish().unwrap();
        while let Some((channel, out)) = kernel.next_completed() {
            actual.entry(channel).or_default().push(out);
        }

        let concat = |map: &BTreeMap<usize, Vec<RecordBatch>>| -> BTreeMap<usize, RecordBatch> {
            map.iter()
                .map(|(c, batches)| (*c, concat_batches(&schema, batches).unwrap()))
                .filter(|(_, b)| b.num_rows() > 0)
                .collect()
        };
        prop_assert_eq!(concat(&actual), concat(&expected));
        // Builders cut exactly, except for a whole input batch of at least half the target, which
        // passes through; coalescers pass any slice above half the target through whole (one
        // input batch's rows of one channel). Nothing else is larger than the target.
        let exact = ChannelBuilders::supports(&schema);
        let input_sizes: Vec<usize> = inputs.iter().map(|b| b.num_rows()).collect();
        let largest_input = input_sizes.iter().copied().max().unwrap_or(0);
        let passed_through = |b: &RecordBatch| {
            let whole = if exact {
                input_sizes.contains(&b.num_rows())
            } else {
                b.num_rows() <= largest_input
            };
            whole && b.num_rows() * 2 >= target_rows
        };
        for batches in actual.values() {
            let (last, full) = batches.split_last().unwrap();
            for b in batches {
                prop_assert!(
                    b.num_rows() <= target_rows || passed_through(b),
                    "a batch of {} rows (target {target_rows}, inputs {input_sizes:?})",
                    b.num_rows()
                );
            }
            if exact {
                for b in full {
                    prop_assert!(
                        b.num_rows() == target_rows || passed_through(b),
                        "a {}-row batch before the last (target {target_rows}, inputs {input_sizes:?})",
                        b.num_rows()
                    );
                }
            }
            prop_assert!(last.num_rows() > 0);
            for b in batches {
                for column in b.columns() {
                    column.to_data().validate_full().unwrap();
                }
            }
        }
    }
}
