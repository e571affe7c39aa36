//! Balanced Parquet scans for distributed runs: each task of a scan gets an equal share of the
//! scan's rows, cut at row-group boundaries.
//!
//! DataFusion splits a scan's files into `target_partitions` byte ranges of equal size, and a
//! Parquet reader reads the row groups whose first page lies in its range. The cut points ignore
//! where row groups start, so a range of a few bytes at the head of a file takes that file's whole
//! first row group. In one process this hardly matters: the partitions steal unopened files from
//! each other. A distributed task runs one partition and cannot steal (see
//! `sluice_planner::DISTRIBUTED_SETTINGS`), so the task that drew the extra row group holds up its
//! stage. TPC-H SF 1's lineitem (4 files of 1 048 576 + 451 739 rows) on two tasks:
//!
//! ```text
//!   DataFusion's ranges:  task 0 [f0, f1, f2 bytes 0..30339]   task 1 [f2 bytes 30339.., f3]
//!   row groups read:      task 0 f0 f1 f2.rg0 = 4 048 247     task 1 f2.rg1 f3 = 1 952 968
//!   balanced:             task 0 f0 f1        = 3 000 607     task 1 f2 f3     = 3 000 608
//! ```
//!
//! [`balance_scans`] reads each file's row-group layout (through DataFusion's file metadata cache)
//! and assigns the row groups the scan reads, in file order, to contiguous groups of about equal
//! rows; each piece is a whole file, or the byte range from its first row group's first page to the
//! next row group's, which holds exactly its row groups' first pages.
//!
//! Invariants: a balanced scan reads exactly the row groups the original scan read (a range the
//! plan had keeps its bounds), each once; the partition count, schema, projection, predicate and
//! every other setting of the scan stay as they were; only scans whose groups carry no meaning are
//! touched (no declared output ordering or partitioning, no order-preserving read); a scan is
//! replaced only when its largest group gets smaller, and left alone when any file's metadata
//! cannot be read (the scan itself then reports the error) or when two of its pieces read the same
//! row group.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::listing::{FileRange, PartitionedFile};
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig};
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::cache::cache_manager::FileMetadataCache;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::object_store::ObjectMeta;
use datafusion::object_store::ObjectStore;
use datafusion::parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use datafusion::physical_plan::ExecutionPlan;
use futures::{StreamExt, TryStreamExt, stream};

/// Files whose metadata is fetched at once when a scan is balanced.
const CONCURRENT_FETCHES: usize = 16;

/// `plan` with every balanceable Parquet scan's file groups replaced by row-group-aligned groups
/// of about equal rows (see the module docs).
pub async fn balance_scans(
    plan: Arc<dyn ExecutionPlan>,
    runtime: &Arc<RuntimeEnv>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut scans = Vec::new();
    plan.apply(|node| {
        if let Some(config) = balanceable(node.as_ref()) {
            scans.push(config.clone());
        }
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    })?;
    if scans.is_empty() {
        return Ok(plan);
    }
    let mut balanced = Vec::with_capacity(scans.len());
    for scan in &scans {
        balanced.push(match layouts(scan, runtime).await {
            Ok(layouts) => balanced_groups(scan, &layouts),
            Err(error) => {
                tracing::debug!(%error, "scan left as planned: its file metadata cannot be read");
                None
            }
        });
    }
    let mut next = 0;
    plan.transform_up(|node| {
        if balanceable(node.as_ref()).is_none() {
            return Ok(Transformed::no(node));
        }
        let groups = balanced.get_mut(next).and_then(Option::take);
        next += 1;
        let (Some(groups), Some(scan)) = (groups, node.downcast_ref::<DataSourceExec>()) else {
            return Ok(Transformed::no(node));
        };
        let Some(config) = scan.data_source().downcast_ref::<FileScanConfig>() else {
            return Ok(Transformed::no(node));
        };
        let mut config = config.clone();
        config.file_groups = groups;
        Ok(Transformed::yes(
            DataSourceExec::from_data_source(config) as Arc<dyn ExecutionPlan>
        ))
    })
    .map(|t| t.data)
}

/// The scan `node` is, if its file groups may be re-cut: Parquet, more than one group, and nothing
/// in the plan relies on which file a group holds.
fn balanceable(node: &dyn ExecutionPlan) -> Option<&FileScanConfig> {
    let scan = node.downcast_ref::<DataSourceExec>()?;
    let config = scan.data_source().downcast_ref::<FileScanConfig>()?;
    let free = config.file_source().file_type() == "parquet"
        && config.file_groups.len() > 1
        && !config.preserve_order
        && config.output_ordering.is_empty()
        && config.output_partitioning.is_none();
    free.then_some(config)
}

/// Where one row group's first page lies in its file, and how many rows it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowGroup {
    offset: i64,
    rows: u64,
}

/// The row groups of each of `scan`'s files (by location), in file order.
async fn layouts(
    scan: &FileScanConfig,
    runtime: &Arc<RuntimeEnv>,
) -> Result<HashMap<String, Vec<RowGroup>>> {
    let store = runtime.object_store(&scan.object_store_url)?;
    let cache = runtime.cache_manager.get_file_metadata_cache();
    let mut files: Vec<(ObjectMeta, Option<usize>)> = Vec::new();
    for file in scan.file_groups.iter().flat_map(FileGroup::iter) {
        if !files
            .iter()
            .any(|(meta, _)| meta.location == file.object_meta.location)
        {
            files.push((file.object_meta.clone(), file.metadata_size_hint));
        }
    }
    let fetches = files
        .into_iter()
        .map(|(meta, hint)| layout(Arc::clone(&store), Arc::clone(&cache), meta, hint));
    stream::iter(fetches)
        .buffer_unordered(CONCURRENT_FETCHES)
        .try_collect()
        .await
}

/// One file's location and row groups, its metadata read through `cache`.
async fn layout(
    store: Arc<dyn ObjectStore>,
    cache: Arc<FileMetadataCache>,
    meta: ObjectMeta,
    hint: Option<usize>,
) -> Result<(String, Vec<RowGroup>)> {
    let metadata = DFParquetMetadata::new(store.as_ref(), &meta)
        .with_metadata_size_hint(hint)
        .with_file_metadata_cache(Some(cache))
        .with_page_index_policy(Some(PageIndexPolicy::Skip))
        .fetch_metadata()
        .await?;
    Ok((meta.location.to_string(), row_groups(&metadata)))
}

/// A file's row groups sorted by offset, each placed where DataFusion's Parquet reader looks for it
/// when it decides which range reads it: the first page (dictionary, else data) of its first column.
fn row_groups(metadata: &ParquetMetaData) -> Vec<RowGroup> {
    let mut groups: Vec<RowGroup> = metadata
        .row_groups()
        .iter()
        .filter(|group| group.num_columns() > 0)
        .map(|group| {
            let column = group.column(0);
            RowGroup {
                offset: column
                    .dictionary_page_offset()
                    .unwrap_or_else(|| column.data_page_offset()),
                rows: u64::try_from(group.num_rows()).unwrap_or(0),
            }
        })
        .collect();
    groups.sort_by_key(|group| group.offset);
    groups
}

/// One row group a scan reads: its file (an index into the scan's distinct files), its position
/// in that file's row groups, and the group itself.
#[derive(Debug, Clone, Copy)]
struct Unit {
    file: usize,
    index: usize,
    group: RowGroup,
}

/// `scan`'s files re-cut into as many groups as it has, of about equal rows, or `None` when that
/// does not make its largest group smaller.
fn balanced_groups(
    scan: &FileScanConfig,
    layouts: &HashMap<String, Vec<RowGroup>>,
) -> Option<Vec<FileGroup>> {
    let partitions = scan.file_groups.len();
    // The distinct files in plan order, and the row groups each group of the plan reads.
    let mut files: Vec<&PartitionedFile> = Vec::new();
    let mut units: Vec<Unit> = Vec::new();
    let mut planned_rows = vec![0u64; partitions];
    for (partition, group) in scan.file_groups.iter().enumerate() {
        for piece in group.iter() {
            let location = piece.object_meta.location.to_string();
            let layout = layouts.get(&location)?;
            let file = match files
                .iter()
                .position(|f| f.object_meta.location == piece.object_meta.location)
            {
                Some(file) => file,
                None => {
                    files.push(piece);
                    files.len() - 1
                }
            };
            for (index, row_group) in layout.iter().enumerate() {
                let read = piece
                    .range
                    .as_ref()
                    .is_none_or(|r| r.start <= row_group.offset && row_group.offset < r.end);
                if !read {
                    continue;
                }
                // A row group two pieces read would be read once after balancing: leave it.
                if units.iter().any(|u| u.file == file && u.index == index) {
                    return None;
                }
                planned_rows[partition] += row_group.rows;
                units.push(Unit {
                    file,
                    index,
                    group: *row_group,
                });
            }
        }
    }
    // Keep file order, and row-group order within a file.
    units.sort_by_key(|unit| (unit.file, unit.index));
    let assigned = assign(&units, partitions);
    let mut balanced_rows = vec![0u64; partitions];
    for (unit, partition) in units.iter().zip(&assigned) {
        balanced_rows[*partition] += unit.group.rows;
    }
    let largest = |rows: &[u64]| rows.iter().copied().max().unwrap_or(0);
    if largest(&balanced_rows) >= largest(&planned_rows) {
        return None;
    }
    let mut groups: Vec<Vec<PartitionedFile>> = vec![Vec::new(); partitions];
    let mut run: Option<(usize, Unit, Unit)> = None;
    // A run of a file's row groups is the whole file, or the bytes from its first row group's first
    // page up to the next row group's (or the file's end).
    let close = |run: (usize, Unit, Unit), groups: &mut Vec<Vec<PartitionedFile>>| {
        let (partition, first, last) = run;
        let file = files[first.file];
        let mut piece = file.clone();
        let layout = layouts
            .get(&file.object_meta.location.to_string())
            .map_or(&[][..], Vec::as_slice);
        piece.range = if first.index == 0 && last.index + 1 == layout.len() {
            None
        } else {
            let end = layout.get(last.index + 1).map_or_else(
                || i64::try_from(file.object_meta.size).unwrap_or(i64::MAX),
                |next| next.offset,
            );
            Some(FileRange {
                start: first.group.offset,
                end,
            })
        };
        groups[partition].push(piece);
    };
    for (unit, partition) in units.iter().zip(&assigned) {
        run = match run {
            Some((p, first, last))
                if p == *partition && last.file == unit.file && last.index + 1 == unit.index =>
            {
                Some((p, first, *unit))
            }
            Some(done) => {
                close(done, &mut groups);
                Some((*partition, *unit, *unit))
            }
            None => Some((*partition, *unit, *unit)),
        };
    }
    if let Some(done) = run {
        close(done, &mut groups);
    }
    Some(groups.into_iter().map(FileGroup::new).collect())
}

/// The group of each unit: contiguous runs of about `total / partitions` rows, a unit going to the
/// group its middle row falls in.
fn assign(units: &[Unit], partitions: usize) -> Vec<usize> {
    let total: u64 = units.iter().map(|u| u.group.rows).sum();
    let mut before = 0u64;
    units
        .iter()
        .map(|unit| {
            let middle = before as f64 + unit.group.rows as f64 / 2.0;
            before += unit.group.rows;
            if total == 0 {
                return 0;
            }
            let share = (middle * partitions as f64 / total as f64) as usize;
            share.min(partitions - 1)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    use datafusion::physical_plan::{ExecutionPlanProperties, collect_partitioned};
    use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

    fn unit(file: usize, index: usize, rows: u64) -> Unit {
        Unit {
            file,
            index,
            group: RowGroup {
                offset: 4 + index as i64 * 1000,
                rows,
            },
        }
    }

    #[test]
    fn row_groups_go_to_the_group_their_middle_row_falls_in() {
        // TPC-H SF 1 lineitem: 4 files of 1 048 576 + 451 739 rows, on two and three tasks.
        let units: Vec<Unit> = (0..4)
            .flat_map(|file| [unit(file, 0, 1_048_576), unit(file, 1, 451_739)])
            .collect();
        assert_eq!(assign(&units, 2), [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(assign(&units, 3), [0, 0, 1, 1, 1, 2, 2, 2]);
        // More groups than row groups: some stay empty.
        let few = [unit(0, 0, 10), unit(1, 0, 10)];
        assert_eq!(assign(&few, 4), [1, 3]);
        assert_eq!(assign(&[], 3), Vec::<usize>::new());
        assert_eq!(assign(&[unit(0, 0, 0), unit(0, 1, 0)], 2), [0, 0]);
    }

    /// Table `t` in a fresh directory: one Parquet file per entry of `files`, each with row groups
    /// of the given sizes; column `v` numbers the rows 0, 1, 2, … across the files.
    async fn table(files: &[&[usize]], partitions: usize) -> (tempfile::TempDir, SessionContext) {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let mut next = 0i64;
        for (i, groups) in files.iter().enumerate() {
            let path = dir.path().join(format!("f{i}.parquet"));
            let mut writer = ArrowWriter::try_new(
                std::fs::File::create(path).unwrap(),
                Arc::clone(&schema),
                Some(WriterProperties::builder().build()),
            )
            .unwrap();
            for rows in groups.iter() {
                let values: Vec<i64> = (next..next + *rows as i64).collect();
                next += *rows as i64;
                let batch = RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![Arc::new(Int64Array::from(values))],
                )
                .unwrap();
                writer.write(&batch).unwrap();
                writer.flush().unwrap();
            }
            writer.close().unwrap();
        }
        // Small files are split into byte ranges as DataFusion splits large ones; each partition
        // reads only its own group, as a task does.
        let config = SessionConfig::new()
            .with_target_partitions(partitions)
            .set_usize("datafusion.optimizer.repartition_file_min_size", 0)
            .set_bool(
                "datafusion.execution.enable_file_stream_work_stealing",
                false,
            );
        let ctx = SessionContext::new_with_config(config);
        ctx.register_parquet(
            "t",
            dir.path().to_str().unwrap(),
            ParquetReadOptions::default(),
        )
        .await
        .unwrap();
        (dir, ctx)
    }

    async fn scan_plan(ctx: &SessionContext) -> Arc<dyn ExecutionPlan> {
        ctx.sql("SELECT v FROM t WHERE v >= 0")
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap()
    }

    /// The values each partition of `plan` returns.
    async fn partitions(plan: &Arc<dyn ExecutionPlan>, ctx: &SessionContext) -> Vec<Vec<i64>> {
        collect_partitioned(Arc::clone(plan), ctx.task_ctx())
            .await
            .unwrap()
            .iter()
            .map(|batches| {
                batches
                    .iter()
                    .flat_map(|b| {
                        let column = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                        column.values().to_vec()
                    })
                    .collect()
            })
            .collect()
    }

    fn counts(partitions: &[Vec<i64>]) -> Vec<usize> {
        partitions.iter().map(Vec::len).collect()
    }

    /// Every value of `partitions`, sorted.
    fn all(partitions: &[Vec<i64>]) -> Vec<i64> {
        let mut values: Vec<i64> = partitions.concat();
        values.sort_unstable();
        values
    }

    fn scan_config(plan: &Arc<dyn ExecutionPlan>) -> FileScanConfig {
        let mut found = None;
        plan.apply(|node| {
            if let Some(config) = balanceable(node.as_ref()) {
                found = Some(config.clone());
            }
            Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
        })
        .unwrap();
        found.expect("a balanceable scan")
    }

    #[tokio::test]
    async fn a_head_range_no_longer_takes_a_whole_row_group_and_every_row_is_read_once() {
        // Lineitem's shape: files of a large and a small row group, the second file a little
        // smaller, so DataFusion's equal byte ranges cut a few bytes into the third file.
        let (_dir, ctx) = table(&[&[1000, 430], &[1000, 420], &[1000, 430], &[1000, 430]], 2).await;
        let plan = scan_plan(&ctx).await;
        let planned = partitions(&plan, &ctx).await;
        // Those few bytes hold the first page of file 2's large row group: the first partition
        // reads files 0, 1 and that row group.
        assert_eq!(counts(&planned), [3850, 1860]);

        let balanced = balance_scans(Arc::clone(&plan), &ctx.runtime_env())
            .await
            .unwrap();
        assert!(!Arc::ptr_eq(&balanced, &plan));
        assert_eq!(balanced.output_partitioning().partition_count(), 2);
        let read = partitions(&balanced, &ctx).await;
        assert_eq!(counts(&read), [2850, 2860]);
        assert_eq!(all(&read), (0..5710).collect::<Vec<i64>>());
        // Files 0 and 1, in order, then files 2 and 3.
        assert_eq!(read[0], (0..2850).collect::<Vec<i64>>());
        assert_eq!(read[1], (2850..5710).collect::<Vec<i64>>());
    }

    #[tokio::test]
    async fn a_scan_that_is_already_balanced_or_cannot_be_split_is_left_as_planned() {
        // Equal files that DataFusion's ranges already split at file boundaries.
        let (_dir, ctx) = table(&[&[500], &[500], &[500], &[500]], 2).await;
        let plan = scan_plan(&ctx).await;
        assert_eq!(counts(&partitions(&plan, &ctx).await), [1000, 1000]);
        let same = balance_scans(Arc::clone(&plan), &ctx.runtime_env())
            .await
            .unwrap();
        assert!(Arc::ptr_eq(&same, &plan));
        // One row group cannot be shared by two tasks.
        let (_dir, ctx) = table(&[&[900]], 2).await;
        let plan = scan_plan(&ctx).await;
        let same = balance_scans(Arc::clone(&plan), &ctx.runtime_env())
            .await
            .unwrap();
        assert!(Arc::ptr_eq(&same, &plan));
        assert_eq!(
            all(&partitions(&same, &ctx).await),
            (0..900).collect::<Vec<i64>>()
        );
    }

    #[tokio::test]
    async fn ranges_the_plan_had_keep_their_bounds_and_a_row_group_read_twice_is_left_alone() {
        let (_dir, ctx) = table(&[&[100, 200, 300], &[400]], 2).await;
        let plan = scan_plan(&ctx).await;
        let config = scan_config(&plan);
        let layouts = layouts(&config, &ctx.runtime_env()).await.unwrap();
        let files: Vec<PartitionedFile> = config
            .file_groups
            .iter()
            .flat_map(FileGroup::iter)
            .cloned()
            .collect();
        let f0 = files
            .iter()
            .find(|f| f.object_meta.location.as_ref().ends_with("f0.parquet"))
            .unwrap();
        let f1 = files
            .iter()
            .find(|f| f.object_meta.location.as_ref().ends_with("f1.parquet"))
            .unwrap();
        let groups_of_f0 = layouts.get(&f0.object_meta.location.to_string()).unwrap();
        assert_eq!(
            groups_of_f0.iter().map(|g| g.rows).collect::<Vec<_>>(),
            [100, 200, 300]
        );
        // A plan that reads only f0's last two row groups and all of f1, all in its first group.
        let tail = f0.clone().with_range(groups_of_f0[1].offset, i64::MAX);
        let mut narrowed = config.clone();
        narrowed.file_groups = vec![
            FileGroup::new(vec![tail.clone(), f1.clone()]),
            FileGroup::new(Vec::new()),
        ];
        let groups = balanced_groups(&narrowed, &layouts).expect("900 / 0 rows can be cut");
        // f0 from its second row group to its end, then all of f1.
        let size = i64::try_from(f0.object_meta.size).unwrap();
        assert_eq!(groups[0].len(), 1);
        assert_eq!(groups[0][0].object_meta.location, f0.object_meta.location);
        assert_eq!(
            groups[0][0].range,
            Some(FileRange {
                start: groups_of_f0[1].offset,
                end: size
            })
        );
        assert_eq!(groups[1].len(), 1);
        assert_eq!(groups[1][0].object_meta.location, f1.object_meta.location);
        assert_eq!(groups[1][0].range, None);
        let mut balanced = narrowed.clone();
        balanced.file_groups = groups;
        let plan = DataSourceExec::from_data_source(balanced) as Arc<dyn ExecutionPlan>;
        let read = partitions(&plan, &ctx).await;
        // f0's row groups of 200 and 300 rows, then f1's 400; f0's first row group stays unread.
        assert_eq!(counts(&read), [500, 400]);
        assert_eq!(all(&read), (100..1000).collect::<Vec<i64>>());

        // The same row group in two pieces: left as planned.
        narrowed.file_groups = vec![
            FileGroup::new(vec![tail.clone()]),
            FileGroup::new(vec![tail, f1.clone()]),
        ];
        assert!(balanced_groups(&narrowed, &layouts).is_none());
    }

    #[tokio::test]
    async fn ordered_scans_are_not_balanced_and_unreadable_files_leave_the_scan_as_planned() {
        let (dir, ctx) = table(&[&[1000, 430], &[1000, 430], &[1000, 430], &[1000, 430]], 2).await;
        let sql = format!(
            "CREATE EXTERNAL TABLE sorted (v BIGINT NOT NULL) STORED AS PARQUET \
             WITH ORDER (v ASC) LOCATION '{}'",
            dir.path().display()
        );
        ctx.sql(&sql).await.unwrap();
        let plan = ctx
            .sql("SELECT v FROM sorted ORDER BY v")
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let same = balance_scans(Arc::clone(&plan), &ctx.runtime_env())
            .await
            .unwrap();
        assert!(Arc::ptr_eq(&same, &plan));

        let plan = scan_plan(&ctx).await;
        std::fs::remove_file(dir.path().join("f3.parquet")).unwrap();
        let same = balance_scans(Arc::clone(&plan), &ctx.runtime_env())
            .await
            .unwrap();
        assert!(Arc::ptr_eq(&same, &plan));
    }
}
