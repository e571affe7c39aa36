//! Shuffle-kernel benchmark: route + per-channel batching of the same input, Sluice's kernel against
//! DataFusion's public `BatchPartitioner` followed by the same per-channel coalescing, plus a plain copy of
//! the input's bytes as the physical limit.
//!
//! Run: `cargo bench -p sluice-shuffle --bench partition`. Each case is 16 batches of 8192 rows:
//! - `i64_N`: key Int64, payload Int64 + Float64, N channels;
//! - `i64_utf8_16`: keys Int64 + Utf8, payload Float64;
//! - `utf8view_16`: key Utf8View (20–30 bytes), payload Int64;
//! - `lineitem_16`: TPC-H lineitem (SF 0.01) projected to l_orderkey, l_partkey, l_suppkey, l_quantity,
//!   l_extendedprice, l_discount, l_shipdate, keyed on l_orderkey.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, StringViewArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use datafusion_physical_expr::PhysicalExpr;
use datafusion_physical_expr::expressions::col;
use datafusion_physical_plan::Partitioning;
use datafusion_physical_plan::metrics::{ExecutionPlanMetricsSet, Time};
use datafusion_physical_plan::repartition::BatchPartitioner;
use sluice_shuffle::{
    ChannelCoalescers, KernelOptions, RoutingScheme, ShuffleKernel, ShuffleMetrics,
};

/// Both sides allocate through mimalloc, as the `sluice` binary does: glibc's allocator returns freed
/// batch buffers to the OS and faults them back in, which on this VM costs more than the routing itself.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROWS: usize = 8192;
const BATCHES: usize = 16;

struct Case {
    name: String,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    keys: Vec<&'static str>,
    channels: usize,
}

/// Deterministic pseudo-random numbers (xorshift), so every run sees the same data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn generated(name: &str, fields: Vec<Field>, keys: Vec<&'static str>, channels: usize) -> Case {
    let schema = Arc::new(Schema::new(fields));
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let batches = (0..BATCHES)
        .map(|_| {
            let columns: Vec<ArrayRef> =
                schema
                    .fields()
                    .iter()
                    .map(|field| -> ArrayRef {
                        match field.data_type() {
                            DataType::Int64 => Arc::new(Int64Array::from_iter_values(
                                (0..ROWS).map(|_| (rng.next() % 1_000_000) as i64),
                            )),
                            DataType::Float64 => Arc::new(Float64Array::from_iter_values(
                                (0..ROWS).map(|_| (rng.next() % 100_000) as f64 / 7.0),
                            )),
                            DataType::Utf8 => Arc::new(StringArray::from_iter_values(
                                (0..ROWS).map(|_| format!("customer-{}", rng.next() % 50_000)),
                            )),
                            _ => Arc::new(StringViewArray::from_iter_values((0..ROWS).map(|_| {
                                format!("a longer string key #{:08}", rng.next() % 100_000)
                            }))),
                        }
                    })
                    .collect();
            RecordBatch::try_new(schema.clone(), columns).unwrap()
        })
        .collect();
    Case {
        name: name.to_string(),
        schema,
        batches,
        keys,
        channels,
    }
}

fn lineitem() -> Case {
    use tpchgen::generators::LineItemGenerator;
    use tpchgen_arrow::LineItemArrow;
    let columns = [0usize, 1, 2, 4, 5, 6, 10];
    let mut batches: Vec<RecordBatch> = LineItemArrow::new(LineItemGenerator::new(0.01, 1, 1))
        .with_batch_size(ROWS)
        .map(|b| b.unwrap().project(&columns).unwrap())
        .filter(|b| b.num_rows() == ROWS)
        .collect();
    batches.truncate(BATCHES);
    Case {
        name: "lineitem_16".into(),
        schema: batches[0].schema(),
        batches,
        keys: vec!["l_orderkey"],
        channels: 16,
    }
}

fn cases() -> Vec<Case> {
    let i64_fields = || {
        vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
            Field::new("f", DataType::Float64, false),
        ]
    };
    let mut cases: Vec<Case> = [4, 16, 64, 256]
        .into_iter()
        .map(|n| generated(&format!("i64_{n}"), i64_fields(), vec!["k"], n))
        .collect();
    cases.push(generated(
        "i64_utf8_16",
        vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
            Field::new("f", DataType::Float64, false),
        ],
        vec!["k", "s"],
        16,
    ));
    cases.push(generated(
        "utf8view_16",
        vec![
            Field::new("s", DataType::Utf8View, false),
            Field::new("v", DataType::Int64, false),
        ],
        vec!["s"],
        16,
    ));
    cases.push(lineitem());
    cases
}

fn key_exprs(case: &Case) -> Vec<Arc<dyn PhysicalExpr>> {
    case.keys
        .iter()
        .map(|k| col(k, &case.schema).unwrap())
        .collect()
}

fn run_sluice(case: &Case) -> usize {
    let set = ExecutionPlanMetricsSet::new();
    let scheme = RoutingScheme::Hash {
        keys: key_exprs(case),
        channels: case.channels,
    };
    let options = KernelOptions {
        target_rows: ROWS,
        limit: None,
        input_partition: 0,
        num_inputs: 1,
    };
    let metrics = ShuffleMetrics::new(&set, 0, case.channels);
    let mut kernel =
        ShuffleKernel::try_new(scheme, case.schema.clone(), &options, metrics).unwrap();
    let mut rows = 0;
    for batch in &case.batches {
        kernel.push(batch).unwrap();
        while let Some((_, out)) = kernel.next_completed() {
            rows += black_box(out).num_rows();
        }
    }
    kernel.finish().unwrap();
    while let Some((_, out)) = kernel.next_completed() {
        rows += black_box(out).num_rows();
    }
    rows
}

fn run_datafusion(case: &Case) -> usize {
    let mut partitioner = BatchPartitioner::try_new(
        Partitioning::Hash(key_exprs(case), case.channels),
        Time::new(),
        0,
        1,
    )
    .unwrap();
    let mut coalescers =
        ChannelCoalescers::new(case.schema.clone(), case.channels, ROWS, None, Time::new());
    let mut rows = 0;
    for batch in &case.batches {
        for part in partitioner.partition_iter(batch.clone()).unwrap() {
            let (channel, slice) = part.unwrap();
            coalescers.push(channel, slice).unwrap();
        }
        while let Some((_, out)) = coalescers.next_completed() {
            rows += black_box(out).num_rows();
        }
    }
    coalescers.finish().unwrap();
    while let Some((_, out)) = coalescers.next_completed() {
        rows += black_box(out).num_rows();
    }
    rows
}

fn input_bytes(case: &Case) -> u64 {
    case.batches
        .iter()
        .map(|b| b.get_array_memory_size() as u64)
        .sum()
}

fn copy_bytes(case: &Case, out: &mut Vec<u8>) -> usize {
    out.clear();
    for batch in &case.batches {
        for column in batch.columns() {
            let data = column.to_data();
            for buffer in data.buffers() {
                out.extend_from_slice(buffer.as_slice());
            }
            if let Some(nulls) = data.nulls() {
                out.extend_from_slice(nulls.buffer().as_slice());
            }
        }
    }
    out.len()
}

fn bench(c: &mut Criterion) {
    let cases = cases();
    for case in &cases {
        assert_eq!(run_sluice(case), run_datafusion(case), "{}", case.name);
    }
    let mut group = c.benchmark_group("partition");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(4));
    group.warm_up_time(Duration::from_secs(1));
    for case in &cases {
        group.throughput(Throughput::Bytes(input_bytes(case)));
        group.bench_with_input(BenchmarkId::new("sluice", &case.name), case, |b, case| {
            b.iter(|| run_sluice(case))
        });
        group.bench_with_input(
            BenchmarkId::new("datafusion", &case.name),
            case,
            |b, case| b.iter(|| run_datafusion(case)),
        );
    }
    group.finish();

    let mut group = c.benchmark_group("memcpy");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(2));
    group.warm_up_time(Duration::from_millis(500));
    let mut buffer = Vec::new();
    for case in &cases {
        group.throughput(Throughput::Bytes(input_bytes(case)));
        group.bench_with_input(BenchmarkId::new("copy", &case.name), case, |b, case| {
            b.iter(|| copy_bytes(case, &mut buffer))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
