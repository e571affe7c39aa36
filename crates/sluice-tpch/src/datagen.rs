//! TPC-H data generation into Parquet.
//!
//! Layout of an output directory (one table per sub-directory, so `--data DIR` finds all eight):
//!
//! ```text
//! DIR/tpch.json                 manifest: scale factor and, per finished table, its parts and rows
//! DIR/lineitem/part-0.parquet   one file per generator part (tpchgen's `part` of `part_count`)
//! DIR/lineitem/part-1.parquet
//! DIR/nation/part-0.parquet     nation and region are tiny and fixed: always one part
//! ```
//!
//! Invariants: a table is listed in the manifest only after every one of its files was written and
//! renamed into place, so an interrupted run leaves no table that looks finished. A re-run with the same
//! scale and parts skips listed tables; a different scale in a directory that has a manifest is refused
//! unless `force` is set, in which case the old tables are removed first.
//!
//! Parts are generated in parallel on `threads` OS threads (generation is CPU-bound and synchronous).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use arrow::array::{RecordBatch, RecordBatchReader};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

use sluice_engine::{Result, SluiceError};

/// The eight TPC-H tables, largest first so that parallel generation finishes together.
pub const TPCH_TABLES: [&str; 8] = [
    "lineitem", "orders", "partsupp", "part", "customer", "supplier", "nation", "region",
];

/// The manifest file's name inside an output directory.
pub const MANIFEST: &str = "tpch.json";

/// What `tpch gen` is asked to do.
#[derive(Debug, Clone)]
pub struct GenOptions {
    /// TPC-H scale factor; 1 is about 1 GB of raw data.
    pub scale_factor: f64,
    /// The output directory.
    pub out: PathBuf,
    /// Files per large table; `None` picks `max(4, ceil(4 × SF))`.
    pub parts: Option<usize>,
    /// Replace data of another scale.
    pub force: bool,
    /// Generator threads.
    pub threads: usize,
}

/// The manifest: what a directory holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// The scale factor of every table listed.
    pub scale_factor: f64,
    /// Finished tables.
    pub tables: BTreeMap<String, TableManifest>,
}

/// One finished table.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct TableManifest {
    /// Number of files.
    pub parts: usize,
    /// Number of rows over all files.
    pub rows: u64,
}

/// Progress notifications from [`generate`].
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// Generation starts: this many files in all.
    Started {
        /// Files to write.
        files: usize,
        /// Tables skipped because they are already there.
        skipped: Vec<String>,
    },
    /// One file is written.
    FileDone {
        /// Its table.
        table: &'static str,
        /// Rows in it.
        rows: u64,
    },
    /// A table is finished.
    TableDone {
        /// The table.
        table: &'static str,
        /// Its manifest entry.
        manifest: TableManifest,
    },
}

/// Checks a scale factor given by a user.
pub fn check_scale_factor(scale_factor: f64) -> Result<()> {
    if scale_factor.is_finite() && scale_factor > 0.0 {
        Ok(())
    } else {
        Err(SluiceError::invalid(format!(
            "scale factor must be a positive number, got {scale_factor}"
        )))
    }
}

/// Reads `DIR/tpch.json` if there is one.
pub fn read_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let path = dir.join(MANIFEST);
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_manifest(&text, &path.display().to_string()).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SluiceError::io(path, e)),
    }
}

/// Parses the manifest text read from `location`.
pub fn parse_manifest(text: &str, location: &str) -> Result<Manifest> {
    serde_json::from_str(text)
        .map_err(|e| SluiceError::invalid(format!("{location}: not a Sluice TPC-H manifest: {e}")))
}

fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!(".{MANIFEST}.tmp"));
    let text = serde_json::to_string_pretty(manifest)
        .map_err(|e| SluiceError::invalid(format!("cannot encode manifest: {e}")))?;
    std::fs::write(&tmp, text).map_err(|e| SluiceError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| SluiceError::io(&path, e))
}

/// How many files `table` gets.
fn parts_for(table: &str, options: &GenOptions) -> usize {
    match table {
        "nation" | "region" | "supplier" => 1,
        _ => options
            .parts
            .unwrap_or_else(|| ((options.scale_factor * 4.0).ceil() as usize).max(4))
            .max(1),
    }
}

type BatchIter = Box<dyn RecordBatchReader + Send>;

/// The Arrow generator of one part (1-based) of `table`.
fn generator(table: &str, scale_factor: f64, part: i32, parts: i32) -> Result<BatchIter> {
    const BATCH: usize = 8192;
    Ok(match table {
        "lineitem" => Box::new(
            LineItemArrow::new(LineItemGenerator::new(scale_factor, part, parts))
                .with_batch_size(BATCH),
        ),
        "orders" => Box::new(
            OrderArrow::new(OrderGenerator::new(scale_factor, part, parts)).with_batch_size(BATCH),
        ),
        "partsupp" => Box::new(
            PartSuppArrow::new(PartSuppGenerator::new(scale_factor, part, parts))
                .with_batch_size(BATCH),
        ),
        "part" => Box::new(
            PartArrow::new(PartGenerator::new(scale_factor, part, parts)).with_batch_size(BATCH),
        ),
        "customer" => Box::new(
            CustomerArrow::new(CustomerGenerator::new(scale_factor, part, parts))
                .with_batch_size(BATCH),
        ),
        "supplier" => Box::new(
            SupplierArrow::new(SupplierGenerator::new(scale_factor, part, parts))
                .with_batch_size(BATCH),
        ),
        "nation" => Box::new(
            NationArrow::new(NationGenerator::new(scale_factor, part, parts))
                .with_batch_size(BATCH),
        ),
        "region" => Box::new(
            RegionArrow::new(RegionGenerator::new(scale_factor, part, parts))
                .with_batch_size(BATCH),
        ),
        other => {
            return Err(SluiceError::invalid(format!(
                "unknown TPC-H table '{other}'"
            )));
        }
    })
}

/// Writes one part to `path` (through a temporary name), returning its row count.
fn write_part(
    table: &str,
    options: &GenOptions,
    part: usize,
    parts: usize,
    path: &Path,
) -> Result<u64> {
    let part_i32 = i32::try_from(part + 1).map_err(|_| SluiceError::invalid("too many parts"))?;
    let parts_i32 = i32::try_from(parts).map_err(|_| SluiceError::invalid("too many parts"))?;
    let batches = generator(table, options.scale_factor, part_i32, parts_i32)?;
    let tmp = path.with_extension("parquet.tmp");
    let file = File::create(&tmp).map_err(|e| SluiceError::io(&tmp, e))?;
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let parquet_error =
        |e: parquet::errors::ParquetError| SluiceError::invalid(format!("{}: {e}", tmp.display()));
    let mut writer =
        ArrowWriter::try_new(file, batches.schema(), Some(properties)).map_err(parquet_error)?;
    let mut rows = 0u64;
    for batch in batches {
        let batch: RecordBatch = batch?;
        rows += batch.num_rows() as u64;
        writer.write(&batch).map_err(parquet_error)?;
    }
    writer.close().map_err(parquet_error)?;
    std::fs::rename(&tmp, path).map_err(|e| SluiceError::io(path, e))?;
    Ok(rows)
}

/// Prepares the output directory and decides which tables to (re)generate.
fn plan_tables(options: &GenOptions) -> Result<(Manifest, Vec<&'static str>, Vec<String>)> {
    check_scale_factor(options.scale_factor)?;
    if options.parts == Some(0) {
        return Err(SluiceError::invalid("--parts must be at least 1"));
    }
    let out = &options.out;
    std::fs::create_dir_all(out).map_err(|e| SluiceError::io(out, e))?;
    let mut manifest = match read_manifest(out)? {
        Some(existing) if existing.scale_factor != options.scale_factor => {
            if !options.force {
                return Err(SluiceError::invalid(format!(
                    "{} holds TPC-H data at scale {}; refusing to write scale {} there (use --force to replace it)",
                    out.display(),
                    existing.scale_factor,
                    options.scale_factor
                )));
            }
            Manifest {
                scale_factor: options.scale_factor,
                tables: BTreeMap::new(),
            }
        }
        Some(existing) => existing,
        None => Manifest {
            scale_factor: options.scale_factor,
            tables: BTreeMap::new(),
        },
    };
    let mut todo = Vec::new();
    let mut skipped = Vec::new();
    for table in TPCH_TABLES {
        let done = manifest.tables.get(table).is_some_and(|t| {
            t.parts == parts_for(table, options) && options.out.join(table).is_dir()
        });
        if done {
            skipped.push(table.to_string());
            continue;
        }
        manifest.tables.remove(table);
        let dir = out.join(table);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| SluiceError::io(&dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| SluiceError::io(&dir, e))?;
        todo.push(table);
    }
    write_manifest(out, &manifest)?;
    Ok((manifest, todo, skipped))
}

/// Generates the TPC-H tables into `options.out`, calling `progress` as files finish.
pub fn generate(options: &GenOptions, progress: &(dyn Fn(GenEvent) + Sync)) -> Result<Manifest> {
    let (manifest, todo, skipped) = plan_tables(options)?;
    let jobs: Vec<(&'static str, usize, usize)> = todo
        .iter()
        .flat_map(|&table| {
            let parts = parts_for(table, options);
            (0..parts).map(move |part| (table, part, parts))
        })
        .collect();
    progress(GenEvent::Started {
        files: jobs.len(),
        skipped,
    });

    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let state = Mutex::new((manifest, BTreeMap::<&str, (usize, u64)>::new()));
    let first_error: Mutex<Option<SluiceError>> = Mutex::new(None);
    let fail = |error: SluiceError| {
        stop.store(true, Ordering::SeqCst);
        if let Ok(mut slot) = first_error.lock() {
            slot.get_or_insert(error);
        }
    };

    std::thread::scope(|scope| {
        for _ in 0..options.threads.max(1) {
            scope.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    let Some(&(table, part, parts)) = jobs.get(index) else {
                        break;
                    };
                    let path = options.out.join(table).join(format!("part-{part}.parquet"));
                    let rows = match write_part(table, options, part, parts, &path) {
                        Ok(rows) => rows,
                        Err(error) => return fail(error),
                    };
                    progress(GenEvent::FileDone { table, rows });
                    let Ok(mut guard) = state.lock() else {
                        return fail(SluiceError::invalid("generator state poisoned"));
                    };
                    let (manifest, counts) = &mut *guard;
                    let entry = counts.entry(table).or_default();
                    entry.0 += 1;
                    entry.1 += rows;
                    if entry.0 == parts {
                        let done = TableManifest {
                            parts,
                            rows: entry.1,
                        };
                        manifest.tables.insert(table.to_string(), done);
                        if let Err(error) = write_manifest(&options.out, manifest) {
                            return fail(error);
                        }
                        progress(GenEvent::TableDone {
                            table,
                            manifest: done,
                        });
                    }
                }
            });
        }
    });

    if let Some(error) = first_error.into_inner().ok().flatten() {
        return Err(error);
    }
    state
        .into_inner()
        .map(|(manifest, _)| manifest)
        .map_err(|_| SluiceError::invalid("generator state poisoned"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(dir: &Path, scale_factor: f64) -> GenOptions {
        GenOptions {
            scale_factor,
            out: dir.to_path_buf(),
            parts: Some(2),
            force: false,
            threads: 2,
        }
    }

    #[test]
    fn generates_all_tables_and_skips_them_next_time() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = generate(&options(dir.path(), 0.001), &|_| {}).unwrap();
        assert_eq!(manifest.tables.len(), 8);
        assert_eq!(manifest.tables["nation"].rows, 25);
        assert_eq!(manifest.tables["region"].rows, 5);
        assert_eq!(manifest.tables["lineitem"].parts, 2);
        assert!(dir.path().join("lineitem/part-1.parquet").is_file());
        assert_eq!(read_manifest(dir.path()).unwrap(), Some(manifest.clone()));

        let skipped = Mutex::new(Vec::new());
        generate(&options(dir.path(), 0.001), &|event| {
            if let GenEvent::Started { skipped: s, .. } = event {
                skipped.lock().unwrap().extend(s);
            }
        })
        .unwrap();
        assert_eq!(skipped.into_inner().unwrap().len(), 8);
    }

    #[test]
    fn another_scale_needs_force() {
        let dir = tempfile::tempdir().unwrap();
        let mut small = options(dir.path(), 0.001);
        small.parts = Some(1);
        generate(&small, &|_| {}).unwrap();
        let error = generate(&options(dir.path(), 0.002), &|_| {}).unwrap_err();
        assert!(error.to_string().contains("--force"), "{error}");
        let mut forced = options(dir.path(), 0.002);
        forced.force = true;
        let manifest = generate(&forced, &|_| {}).unwrap();
        assert_eq!(manifest.scale_factor, 0.002);
    }

    #[test]
    fn bad_scale_factors_are_rejected() {
        for scale in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(check_scale_factor(scale).is_err(), "{scale}");
        }
    }
}
