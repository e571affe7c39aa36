//! Delta Lake tables: `CREATE EXTERNAL TABLE t STORED AS DELTA LOCATION 'url'`, `--table t=dir`
//! of a directory holding `_delta_log/`, on local paths and object stores.
//!
//! The driver replays the table's log once, at the version asked for (`OPTIONS ('version' '3')`,
//! else the newest), through the Delta kernel. A scan is then a plain Parquet `DataSourceExec`
//! over exactly the log's active files, with their partition values: it has DataFusion's wire
//! form, so its tasks run on workers like any file scan, which read byte ranges and never the log.
//!
//! ```text
//!   driver: _delta_log ─► active files (path, size, partition values, stats)
//!             ─► prune files (filters vs partition values and min/max/null stats)
//!             ─► DataSourceExec(Parquet, file groups, partition columns)  ─► tasks on workers
//!   INSERT: FileCommitExec(log = Delta) ◄─ CoalescePartitionsExec ◄─ FileWriteExec (Parquet,
//!           the table's partition columns as column=value directories)
//! ```
//!
//! Invariants: a scan reads exactly the files of one log version (never a listing of the
//! directory, which holds removed and uncommitted files too); a file is skipped only when its
//! partition values or statistics prove no row can match (strings whose statistics may be
//! truncated and timestamps, whose statistics are rounded to milliseconds, prune nothing);
//! tables whose files a plain Parquet read would misread (column mapping, deletion vectors in
//! use) are refused with the reason, never read wrongly.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, RecordBatch, UInt64Array};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, FieldRef, Schema, SchemaRef};
use datafusion::catalog::{Session, TableProvider, TableProviderFactory};
use datafusion::common::pruning::PruningStatistics;
use datafusion::common::{
    Column, DFSchema, DataFusionError, Result, ScalarValue, Statistics, not_impl_err,
};
use datafusion::datasource::TableType;
use datafusion::datasource::file_format::FileFormat;
use datafusion::datasource::file_format::parquet::{ParquetFormat, ParquetSink};
use datafusion::datasource::listing::{ListingTableUrl, PartitionedFile};
use datafusion::datasource::physical_plan::{
    FileGroup, FileOutputMode, FileScanConfigBuilder, FileSinkConfig, ParquetSource,
};
use datafusion::datasource::table_schema::TableSchema;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::dml::InsertOp;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{CreateExternalTable, Expr, TableProviderFilterPushDown};
use datafusion::physical_optimizer::pruning::PruningPredicateBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::empty::EmptyExec;
use futures::StreamExt;
use object_store::path::Path;
use sluice_runtime::delta;
use sluice_runtime::write::{CommitLog, SinkFormat, staged_write};
use url::Url;

/// The option naming the version to read.
pub const VERSION_OPTION: &str = "version";

/// A Delta table at one version of its log; see the module docs.
pub struct DeltaTableProvider {
    url: Url,
    store: ObjectStoreUrl,
    version: u64,
    /// The table's columns, in the log's order.
    schema: SchemaRef,
    /// The columns stored in the data files (the table's, less its partition columns).
    file_schema: SchemaRef,
    /// The partition columns, in the log's order.
    partition_fields: Vec<FieldRef>,
    /// The active files, one row each: `path`, `size_bytes`, `num_records`, `min.c`, `max.c`,
    /// `null_count.c`, `partition.c` (the kernel's flattened add actions).
    files: RecordBatch,
}

impl fmt::Debug for DeltaTableProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeltaTableProvider")
            .field("url", &self.url.as_str())
            .field("version", &self.version)
            .field("files", &self.files.num_rows())
            .finish()
    }
}

impl DeltaTableProvider {
    /// The table at `location`, at `version` (the newest without one).
    pub async fn open(
        runtime: &datafusion::execution::runtime_env::RuntimeEnv,
        location: &str,
        version: Option<u64>,
    ) -> Result<Self> {
        use deltalake_core::kernel::engine::arrow_conversion::TryIntoArrow;
        let url = delta::table_url(location)?;
        let table = delta::open(runtime, &url, version).await?;
        let state = table.snapshot().map_err(|e| delta::delta_error(&url, e))?;
        let failed = |e: &dyn fmt::Display| delta::delta_error(&url, e);
        let mode = state
            .metadata()
            .configuration()
            .get("delta.columnMapping.mode")
            .cloned()
            .unwrap_or_default();
        if !mode.is_empty() && mode != "none" {
            return Err(DataFusionError::NotImplemented(format!(
                "Delta table {url}: column mapping (mode {mode}) is not supported yet"
            )));
        }
        let schema: Schema = state
            .schema()
            .as_ref()
            .try_into_arrow()
            .map_err(|e| failed(&e))?;
        let files = state.add_actions_table(true).map_err(|e| failed(&e))?;
        if let Some(cardinality) = files.column_by_name("deletion_vector.cardinality")
            && cardinality.null_count() < cardinality.len()
        {
            return Err(DataFusionError::NotImplemented(format!(
                "Delta table {url} at version {}: files with deletion vectors are not read yet",
                state.version()
            )));
        }
        let partition_columns: Vec<String> = state.metadata().partition_columns().to_vec();
        let partition_fields = partition_columns
            .iter()
            .map(|name| Ok(Arc::new(schema.field_with_name(name)?.clone())))
            .collect::<Result<Vec<FieldRef>>>()?;
        let file_schema = Schema::new(
            schema
                .fields()
                .iter()
                .filter(|f| !partition_columns.contains(f.name()))
                .cloned()
                .collect::<Vec<_>>(),
        );
        Ok(Self {
            store: delta::store_url(&url)?,
            version: state.version(),
            schema: Arc::new(schema),
            file_schema: Arc::new(file_schema),
            partition_fields,
            files,
            url,
        })
    }

    /// The log version this table reads.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Where the table lives (the directory holding `_delta_log/`).
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The table's root in its store.
    fn root(&self) -> Result<Path> {
        Path::from_url_path(self.url.path())
            .map_err(|e| DataFusionError::Plan(format!("Delta table {}: {e}", self.url)))
    }

    /// Which files may hold rows matching `filters` (all, without a usable filter).
    fn kept_files(&self, state: &dyn Session, filters: &[Expr]) -> Result<Vec<bool>> {
        let all = vec![true; self.files.num_rows()];
        let Some(filter) = conjunction(filters.iter().cloned()) else {
            return Ok(all);
        };
        let df_schema = DFSchema::try_from(Arc::clone(&self.schema))?;
        let Ok(predicate) = state.create_physical_expr(filter, &df_schema) else {
            return Ok(all);
        };
        let Some(pruning) = PruningPredicateBuilder::new()
            .with_file_schema(Arc::clone(&self.schema))
            .build(predicate)
        else {
            return Ok(all);
        };
        let stats = FileStatistics { table: self };
        Ok(pruning.prune(&stats).unwrap_or(all))
    }

    /// The file at row `row` of the add actions, with its partition values.
    fn partitioned_file(&self, root: &Path, row: usize) -> Result<PartitionedFile> {
        let column = |name: &str| {
            self.files.column_by_name(name).ok_or_else(|| {
                DataFusionError::Internal(format!("the Delta add actions have no {name}"))
            })
        };
        let path = ScalarValue::try_from_array(column("path")?, row)?;
        let size = ScalarValue::try_from_array(column("size_bytes")?, row)?;
        let (Some(path), ScalarValue::Int64(Some(size))) = (path.try_as_str().flatten(), size)
        else {
            return Err(DataFusionError::Internal(format!(
                "Delta table {}: an add action without a path or size",
                self.url
            )));
        };
        let location = if path.contains("://") {
            let url = Url::parse(path).map_err(|e| {
                DataFusionError::Plan(format!("Delta table {}: file {path}: {e}", self.url))
            })?;
            if delta::store_url(&url)? != self.store {
                return not_impl_err!(
                    "Delta table {}: file {path} lies in another store",
                    self.url
                );
            }
            Path::from_url_path(url.path())
        } else {
            Path::from_url_path(format!("{root}/{path}"))
        }
        .map_err(|e| {
            DataFusionError::Plan(format!("Delta table {}: file {path}: {e}", self.url))
        })?;
        let mut values = Vec::with_capacity(self.partition_fields.len());
        for field in &self.partition_fields {
            let value = match self
                .files
                .column_by_name(&format!("partition.{}", field.name()))
            {
                Some(array) => ScalarValue::try_from_array(array, row)?,
                None => ScalarValue::Null,
            };
            values.push(value.cast_to(field.data_type())?);
        }
        let mut file = PartitionedFile::new(String::new(), size.max(0) as u64);
        file.object_meta.location = location;
        file.partition_values = values;
        let mut statistics = Statistics::new_unknown(&self.schema);
        if let Some(rows) = self.files.column_by_name("num_records")
            && let ScalarValue::Int64(Some(rows)) = ScalarValue::try_from_array(rows, row)?
        {
            statistics.num_rows =
                datafusion::common::stats::Precision::Inexact(rows.max(0) as usize);
        }
        statistics.total_byte_size =
            datafusion::common::stats::Precision::Inexact(size.max(0) as usize);
        file.statistics = Some(Arc::new(statistics));
        Ok(file)
    }
}

/// Spreads `files` over `groups` groups of about equal bytes (largest first).
fn file_groups(mut files: Vec<PartitionedFile>, groups: usize) -> Vec<FileGroup> {
    files.sort_by_key(|file| std::cmp::Reverse(file.object_meta.size));
    let mut out: Vec<(u64, Vec<PartitionedFile>)> = Vec::new();
    for file in files {
        let size = file.object_meta.size;
        if out.len() < groups.max(1) {
            out.push((size, vec![file]));
        } else if let Some(smallest) = out.iter_mut().min_by_key(|(bytes, _)| *bytes) {
            smallest.0 += size;
            smallest.1.push(file);
        }
    }
    out.into_iter()
        .map(|(_, files)| FileGroup::new(files))
        .collect()
}

/// The add actions' statistics as DataFusion's pruning reads them: one container per file.
struct FileStatistics<'a> {
    table: &'a DeltaTableProvider,
}

impl FileStatistics<'_> {
    /// The statistic `kind` (`min`, `max`) of `column` if it bounds every value of its file: a
    /// partition column's value; not a string's bound (the log may keep a truncated prefix) nor
    /// a timestamp's (kept in milliseconds).
    fn bound(&self, kind: &str, column: &Column) -> Option<ArrayRef> {
        let field = self.table.schema.field_with_name(&column.name).ok()?;
        let partition = format!("partition.{}", column.name);
        if let Some(values) = self.table.files.column_by_name(&partition) {
            return cast(values, field.data_type()).ok();
        }
        match field.data_type() {
            DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
            | DataType::Timestamp(_, _) => None,
            data_type if data_type.is_nested() => None,
            data_type => {
                let values = self
                    .table
                    .files
                    .column_by_name(&format!("{kind}.{}", column.name))?;
                cast(values, data_type).ok()
            }
        }
    }
}

impl PruningStatistics for FileStatistics<'_> {
    fn min_values(&self, column: &Column) -> Option<ArrayRef> {
        self.bound("min", column)
    }

    fn max_values(&self, column: &Column) -> Option<ArrayRef> {
        self.bound("max", column)
    }

    fn num_containers(&self) -> usize {
        self.table.files.num_rows()
    }

    fn null_counts(&self, column: &Column) -> Option<ArrayRef> {
        let partition = format!("partition.{}", column.name);
        if let Some(values) = self.table.files.column_by_name(&partition) {
            // A partition value is null for every row of its file, or for none.
            let rows = self.row_counts()?;
            let rows = rows.as_any().downcast_ref::<UInt64Array>()?;
            let counts: UInt64Array = (0..values.len())
                .map(|i| {
                    if values.is_null(i) {
                        rows.is_valid(i).then(|| rows.value(i))
                    } else {
                        Some(0)
                    }
                })
                .collect();
            return Some(Arc::new(counts));
        }
        let counts = self
            .table
            .files
            .column_by_name(&format!("null_count.{}", column.name))?;
        cast(counts, &DataType::UInt64).ok()
    }

    fn row_counts(&self) -> Option<ArrayRef> {
        let rows = self.table.files.column_by_name("num_records")?;
        cast(rows, &DataType::UInt64).ok()
    }

    fn contained(&self, _column: &Column, _values: &HashSet<ScalarValue>) -> Option<BooleanArray> {
        None
    }
}

#[async_trait]
impl TableProvider for DeltaTableProvider {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        // Filters prune files; each row is filtered again above the scan.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let kept = self.kept_files(state, filters)?;
        let root = self.root()?;
        let mut files = Vec::new();
        for (row, keep) in kept.into_iter().enumerate() {
            if keep {
                files.push(self.partitioned_file(&root, row)?);
            }
        }
        // The scan's columns: the files' columns, then the partition columns; the table's
        // order (and the projection) is restored by index.
        let scan_index = |table_index: usize| -> Result<usize> {
            let name = self.schema.field(table_index).name();
            if let Ok(index) = self.file_schema.index_of(name) {
                return Ok(index);
            }
            self.partition_fields
                .iter()
                .position(|f| f.name() == name)
                .map(|i| self.file_schema.fields().len() + i)
                .ok_or_else(|| DataFusionError::Internal(format!("no column {name}")))
        };
        let indices = match projection {
            Some(projection) => projection.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        let indices = indices
            .into_iter()
            .map(scan_index)
            .collect::<Result<Vec<_>>>()?;
        if files.is_empty() {
            let schema = self.schema.project(
                &projection
                    .cloned()
                    .unwrap_or_else(|| (0..self.schema.fields().len()).collect()),
            )?;
            return Ok(Arc::new(EmptyExec::new(Arc::new(schema))));
        }
        let groups = file_groups(files, state.config().target_partitions());
        let table_schema = TableSchema::builder(Arc::clone(&self.file_schema))
            .with_table_partition_cols(self.partition_fields.clone())
            .build();
        let source = Arc::new(ParquetSource::new(table_schema));
        let config = FileScanConfigBuilder::new(self.store.clone(), source)
            .with_file_groups(groups)
            .with_projection_indices(Some(indices))?
            .with_limit(limit)
            .build();
        let format = ParquetFormat::default().with_options(state.table_options().parquet.clone());
        format.create_physical_plan(state, config).await
    }

    async fn insert_into(
        &self,
        state: &dyn Session,
        input: Arc<dyn ExecutionPlan>,
        insert_op: InsertOp,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if insert_op != InsertOp::Append {
            return not_impl_err!(
                "Delta table {}: only INSERT INTO (append) is supported, not {insert_op}",
                self.url
            );
        }
        let table_url = ListingTableUrl::parse(self.url.as_str())?;
        let config = FileSinkConfig {
            original_url: self.url.to_string(),
            object_store_url: self.store.clone(),
            file_group: FileGroup::default(),
            table_paths: vec![table_url],
            output_schema: Arc::clone(&self.schema),
            table_partition_cols: self
                .partition_fields
                .iter()
                .map(|f| (f.name().clone(), f.data_type().clone()))
                .collect(),
            insert_op,
            keep_partition_by_columns: false,
            file_extension: "parquet".into(),
            file_output_mode: FileOutputMode::Directory,
        };
        let sink = ParquetSink::new(config, state.table_options().parquet.clone());
        staged_write(
            input,
            SinkFormat::Parquet(Arc::new(sink)),
            CommitLog::Delta(self.url.clone()),
        )
    }
}

/// `CREATE EXTERNAL TABLE ... STORED AS DELTA LOCATION 'url' [OPTIONS ('version' 'N')]`.
#[derive(Debug, Default)]
pub struct DeltaTableFactory;

#[async_trait]
impl TableProviderFactory for DeltaTableFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        let [location] = cmd.locations.as_slice() else {
            return Err(DataFusionError::Plan(format!(
                "a Delta table has one location; {} given",
                cmd.locations.len()
            )));
        };
        let mut version = None;
        for (key, value) in &cmd.options {
            let key = key.strip_prefix("format.").unwrap_or(key);
            if key != VERSION_OPTION {
                return Err(DataFusionError::Plan(format!(
                    "Delta table {location}: unknown option '{key}' (a Delta table takes \
                     '{VERSION_OPTION}')"
                )));
            }
            version = Some(value.parse::<u64>().map_err(|_| {
                DataFusionError::Plan(format!(
                    "Delta table {location}: version '{value}' is not a number"
                ))
            })?);
        }
        let table = DeltaTableProvider::open(state.runtime_env(), location, version).await?;
        if !cmd.schema.fields().is_empty() {
            let declared: Vec<&String> = cmd.schema.fields().iter().map(|f| f.name()).collect();
            let actual: Vec<&String> = table.schema.fields().iter().map(|f| f.name()).collect();
            if declared != actual {
                return Err(DataFusionError::Plan(format!(
                    "Delta table {location}: the declared columns {declared:?} are not the \
                     log's {actual:?} (leave them out to take the log's)"
                )));
            }
        }
        Ok(Arc::new(table))
    }
}

/// Whether the local directory or object-store prefix `location` holds a Delta log.
pub async fn is_delta_table(
    runtime: &datafusion::execution::runtime_env::RuntimeEnv,
    location: &str,
) -> bool {
    let Ok(url) = delta::table_url(location) else {
        return false;
    };
    let (Ok(store_url), Ok(root)) = (delta::store_url(&url), Path::from_url_path(url.path()))
    else {
        return false;
    };
    let Ok(store) = runtime.object_store(store_url) else {
        return false;
    };
    let log = root.clone().join(delta::LOG_DIR);
    matches!(store.list(Some(&log)).next().await, Some(Ok(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_spread_over_groups_by_bytes() {
        let files = [50u64, 40, 30, 20, 10]
            .iter()
            .map(|size| PartitionedFile::new(format!("f{size}"), *size))
            .collect();
        let groups = file_groups(files, 2);
        let bytes: Vec<u64> = groups
            .iter()
            .map(|g| g.iter().map(|f| f.object_meta.size).sum())
            .collect();
        assert_eq!(bytes, vec![80, 70]);
    }
}
