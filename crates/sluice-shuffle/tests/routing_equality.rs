//! Hash routing must equal DataFusion's `BatchPartitioner` row for row, for any schema, batch size and
//! channel count: downstream operators rely on `Partitioning::Hash` meaning exactly DataFusion's routing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, DictionaryArray, Int32Array, Int64Array, RecordBatch, StringArray, StringViewArray,
};
use arrow::datatypes::{DataType, Field, Int32Type, Schema};
use datafusion_physical_expr::PhysicalExpr;
use datafusion_physical_expr::expressions::col;
use datafusion_physical_plan::Partitioning;
use datafusion_physical_plan::metrics::Time;
use datafusion_physical_plan::repartition::BatchPartitioner;
use proptest::prelude::*;
use sluice_shuffle::{Partitioner, RoutingScheme, RoutingTimes};

#[derive(Debug, Clone, Copy)]
enum Kind {
    Int32,
    Int64,
    Utf8,
    Utf8View,
    Dictionary,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Int32),
        Just(Kind::Int64),
        Just(Kind::Utf8),
        Just(Kind::Utf8View),
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
        Kind::Utf8View => (
            DataType::Utf8View,
            Arc::new(
                values
                    .iter()
                    .map(|v| v.map(|v| format!("a fairly long string value {v}")))
                    .collect::<StringViewArray>(),
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn hash_routing_equals_datafusion((kinds, columns, key_columns, channels) in case()) {
        let mut fields = Vec::new();
        let mut arrays = Vec::new();
        for (i, (kind, values)) in kinds.iter().zip(&columns).enumerate() {
            let (data_type, array) = column(*kind, values);
            fields.push(Field::new(format!("c{i}"), data_type, true));
            arrays.push(array);
        }
        let schema = Arc::new(Schema::new(fields));
        let batch = RecordBatch::try_new(schema.clone(), arrays).unwrap();
        let keys: Vec<Arc<dyn PhysicalExpr>> = key_columns
            .iter()
            .map(|i| col(&format!("c{i}"), &schema).unwrap())
            .collect();

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
}
