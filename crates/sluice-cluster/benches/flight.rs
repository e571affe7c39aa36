//! The Flight data path on loopback: a task stream's batches from a worker's stream store to the
//! batches its reader gets, against the same batches encoded and decoded in process, and against a
//! plain copy of their bytes.
//!
//! ```text
//!   copy        batch buffers ─► memcpy                                   (the physical limit)
//!   ipc         batch ─► encode_stream (Arrow IPC) ─► FlightData ─► decode ─► batch   (no socket)
//!   flight      stream store ─► DoGet server ─► gRPC/HTTP2 over 127.0.0.1 ─► FlightFetcher ─► batch
//! ```
//!
//! Run: `cargo bench -p sluice-cluster --bench flight`. Each case reads one stream of 24 batches of
//! 8192 rows; throughput is counted in the batches' buffer bytes:
//! - `lineitem`: TPC-H lineitem (SF 0.05), all 16 columns (string columns as `Utf8View`);
//! - `i64x4`: four Int64 columns, a shuffle of keys and measures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use datafusion::arrow::array::{ArrayRef, Int64Array, RecordBatch};
use datafusion::arrow::ipc::writer::IpcWriteOptions;
use datafusion::execution::runtime_env::RuntimeEnv;
use futures::{TryStreamExt, stream};
use sluice_cluster::{ClusterLink, ClusterSecret, FlightFetcher, encode_stream, serve_on_loopback};
use sluice_planner::{AttemptKey, JobId, OutputMode, StageId};
use sluice_runtime::StreamStore;
use sluice_runtime::transport::StreamFetcher;

/// As in the `sluice` binary (and the shuffle bench): glibc's allocator returns large freed buffers
/// to the OS and faults them back in, which would dominate a copy-bound benchmark.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROWS: usize = 8192;
const BATCHES: usize = 24;

struct Case {
    name: &'static str,
    batches: Vec<RecordBatch>,
}

impl Case {
    /// The bytes of the batches' buffers, what Arrow IPC sends (before padding).
    fn bytes(&self) -> u64 {
        let bytes: usize = self
            .batches
            .iter()
            .flat_map(|batch| batch.columns())
            .map(|column| column.to_data().get_slice_memory_size().unwrap())
            .sum();
        bytes as u64
    }
}

fn lineitem() -> Case {
    use tpchgen::generators::LineItemGenerator;
    use tpchgen_arrow::LineItemArrow;
    let batches: Vec<RecordBatch> = LineItemArrow::new(LineItemGenerator::new(0.05, 1, 1))
        .with_batch_size(ROWS)
        .take(BATCHES)
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(batches.len(), BATCHES);
    Case {
        name: "lineitem",
        batches,
    }
}

fn i64x4() -> Case {
    let mut state = 0x2545_F491_4F6C_DD1D_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 1_000_000) as i64
    };
    let batches = (0..BATCHES)
        .map(|_| {
            let column = |next: &mut dyn FnMut() -> i64| -> ArrayRef {
                Arc::new(Int64Array::from_iter_values((0..ROWS).map(|_| next())))
            };
            RecordBatch::try_from_iter([
                ("k", column(&mut next)),
                ("a", column(&mut next)),
                ("b", column(&mut next)),
                ("c", column(&mut next)),
            ])
            .unwrap()
        })
        .collect();
    Case {
        name: "i64x4",
        batches,
    }
}

/// The batches' buffers copied once: what any path that moves the bytes must at least pay.
fn copy(batches: &[RecordBatch]) -> usize {
    let mut copied = 0;
    for batch in batches {
        for column in batch.columns() {
            let data = column.to_data();
            for buffer in data.buffers() {
                copied += black_box(buffer.as_slice().to_vec()).len();
            }
        }
    }
    copied
}

/// The batches through Sluice's Flight encoding and arrow-flight's decoding, in process.
async fn ipc(batches: Vec<RecordBatch>) -> Vec<RecordBatch> {
    let schema = batches[0].schema();
    let data = encode_stream(
        schema,
        stream::iter(batches.into_iter().map(Ok)),
        IpcWriteOptions::default(),
    )
    .map_err(|e| FlightError::ExternalError(Box::new(e)));
    FlightRecordBatchStream::new_from_flight_data(data)
        .try_collect()
        .await
        .unwrap()
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let link = ClusterLink::new(ClusterSecret::random().unwrap(), None);
    let store = Arc::new(StreamStore::new(
        "bench worker",
        Arc::new(RuntimeEnv::default()),
        Duration::from_secs(5),
    ));
    let (address, _serving) = runtime
        .block_on(serve_on_loopback(Arc::clone(&store), &link, None))
        .unwrap();
    let fetcher = FlightFetcher::new(link);

    let mut group = c.benchmark_group("flight");
    group.sample_size(20);
    for (index, case) in [lineitem(), i64x4()].into_iter().enumerate() {
        let schema = case.batches[0].schema();
        // A blocking output is replayable: every iteration reads the whole stream again.
        let key = AttemptKey {
            job: JobId(1),
            stage: StageId(index),
            partition: 0,
            attempt: 0,
        };
        runtime.block_on(async {
            let sender = store
                .create_output(key, 1, 1, OutputMode::Blocking, schema.clone())
                .unwrap();
            for batch in &case.batches {
                assert!(sender.send(0, batch.clone()).await.unwrap());
            }
            sender.finish();
        });
        let id = key.stream(0).replica(0);
        let read = || async {
            fetcher
                .fetch(&address, id, schema.clone())
                .try_collect::<Vec<_>>()
                .await
                .unwrap()
        };
        // Every path gives back exactly the batches written.
        assert_eq!(runtime.block_on(read()), case.batches);
        assert_eq!(runtime.block_on(ipc(case.batches.clone())), case.batches);

        group.throughput(Throughput::Bytes(case.bytes()));
        group.bench_function(BenchmarkId::new("copy", case.name), |b| {
            b.iter(|| copy(&case.batches))
        });
        group.bench_function(BenchmarkId::new("ipc", case.name), |b| {
            b.iter(|| runtime.block_on(ipc(case.batches.clone())))
        });
        group.bench_function(BenchmarkId::new("flight", case.name), |b| {
            b.iter(|| runtime.block_on(read()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
