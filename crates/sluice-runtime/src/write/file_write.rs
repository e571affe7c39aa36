//! `FileWriteExec`: one task's share of a distributed file write. Each partition writes its input
//! with the statement's file sink (Parquet, CSV or JSON, with its hive partitioning and options),
//! but into its own attempt directory of the staging prefix, and outputs one row naming what it
//! staged.
//!
//! ```text
//!   partition p of attempt a ─► sink(url = <staging>/<token>/j<job>-s<stage>-p<p>-a<a>/)
//!                            ─► one row: staged = that directory, rows, files = paths inside it
//! ```
//!
//! Invariants: nothing is written outside the attempt's own directory; the output row comes only
//! after the sink finished every file (so a reader that saw the row's end marker knows the files
//! are complete); dropping the stream stops the write (the sink's writers are `SpawnedTask`s).

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{ListBuilder, RecordBatch, StringArray, StringBuilder, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::file_format::csv::CsvSink;
use datafusion::datasource::file_format::json::JsonSink;
use datafusion::datasource::file_format::parquet::ParquetSink;
use datafusion::datasource::physical_plan::{FileSink, FileSinkConfig};
use datafusion::datasource::sink::DataSink;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{
    Boundedness, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use sluice_planner::AttemptKey;
use sluice_planner::plan::{RECOMPUTE, only_child};

use super::layout::{Staging, WriteTarget};

/// A file sink of one of the formats a distributed write supports, with its options.
#[derive(Debug, Clone)]
pub enum SinkFormat {
    /// Parquet.
    Parquet(Arc<ParquetSink>),
    /// CSV.
    Csv(Arc<CsvSink>),
    /// Newline-delimited JSON.
    Json(Arc<JsonSink>),
}

impl SinkFormat {
    /// `sink` as a supported file sink, or `None` (an in-memory table, a custom sink).
    pub fn of(sink: &dyn DataSink) -> Option<Self> {
        let any = sink as &dyn std::any::Any;
        if let Some(parquet) = any.downcast_ref::<ParquetSink>() {
            let copy =
                ParquetSink::new(parquet.config().clone(), parquet.parquet_options().clone());
            return Some(Self::Parquet(Arc::new(copy)));
        }
        if let Some(csv) = any.downcast_ref::<CsvSink>() {
            let copy = CsvSink::new(csv.config().clone(), csv.writer_options().clone());
            return Some(Self::Csv(Arc::new(copy)));
        }
        if let Some(json) = any.downcast_ref::<JsonSink>() {
            let copy = JsonSink::new(json.config().clone(), json.writer_options().clone());
            return Some(Self::Json(Arc::new(copy)));
        }
        None
    }

    /// The sink's configuration (the statement's target).
    pub fn config(&self) -> &FileSinkConfig {
        match self {
            Self::Parquet(sink) => sink.config(),
            Self::Csv(sink) => sink.config(),
            Self::Json(sink) => sink.config(),
        }
    }

    /// The sink as DataFusion's trait object (for the wire form).
    pub fn as_data_sink(&self) -> Arc<dyn DataSink> {
        match self {
            Self::Parquet(sink) => Arc::clone(sink) as Arc<dyn DataSink>,
            Self::Csv(sink) => Arc::clone(sink) as Arc<dyn DataSink>,
            Self::Json(sink) => Arc::clone(sink) as Arc<dyn DataSink>,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Parquet(_) => "parquet",
            Self::Csv(_) => "csv",
            Self::Json(_) => "json",
        }
    }

    /// The same sink writing under `url` instead of the target.
    fn writing_to(
        &self,
        url: datafusion::datasource::listing::ListingTableUrl,
    ) -> Arc<dyn FileSink> {
        let mut config = self.config().clone();
        config.original_url = url.to_string();
        config.table_paths = vec![url];
        match self {
            Self::Parquet(sink) => {
                Arc::new(ParquetSink::new(config, sink.parquet_options().clone()))
            }
            Self::Csv(sink) => Arc::new(CsvSink::new(config, sink.writer_options().clone())),
            Self::Json(sink) => Arc::new(JsonSink::new(config, sink.writer_options().clone())),
        }
    }
}

/// The schema of what a write task stages: its attempt directory, the rows it wrote and the files
/// (paths inside the directory).
pub fn staged_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("staged", DataType::Utf8, false),
        Field::new("rows", DataType::UInt64, false),
        Field::new(
            "files",
            DataType::List(Arc::new(Field::new_list_field(DataType::Utf8, true))),
            false,
        ),
    ]))
}

/// Writes each input partition into its attempt's staging directory; see the module docs.
#[derive(Debug)]
pub struct FileWriteExec {
    input: Arc<dyn ExecutionPlan>,
    format: SinkFormat,
    target: WriteTarget,
    staging: Staging,
    properties: Arc<PlanProperties>,
}

impl FileWriteExec {
    /// Writes `input` with `format`'s sink, staged under `staging`.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        format: SinkFormat,
        staging: Staging,
    ) -> Result<Self> {
        let target = WriteTarget::of(format.config())?;
        let properties = PlanProperties::new(
            EquivalenceProperties::new(staged_schema()),
            Partitioning::UnknownPartitioning(input.output_partitioning().partition_count()),
            EmissionType::Final,
            Boundedness::Bounded,
        );
        Ok(Self {
            input,
            format,
            target,
            staging,
            properties: Arc::new(properties),
        })
    }

    /// The sink format and options.
    pub fn format(&self) -> &SinkFormat {
        &self.format
    }

    /// The staging prefix.
    pub fn staging(&self) -> &Staging {
        &self.staging
    }
}

impl DisplayAs for FileWriteExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "FileWriteExec: format={}, target={}, staging={}",
            self.format.name(),
            self.target.url,
            self.staging
        )
    }
}

impl ExecutionPlan for FileWriteExec {
    fn name(&self) -> &str {
        "FileWriteExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = only_child(self.name(), children)?;
        Ok(Arc::new(Self::try_new(
            input,
            self.format.clone(),
            self.staging.clone(),
        )?))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(children, RECOMPUTE)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        // Outside a task attempt (local mode runs the plan in one process, each partition
        // once) the partition writes as attempt 0 of a job 0.
        let key = context
            .session_config()
            .get_extension::<AttemptKey>()
            .map(|key| *key)
            .unwrap_or(AttemptKey {
                job: sluice_planner::JobId(0),
                stage: sluice_planner::StageId(0),
                partition,
                attempt: 0,
            });
        let dir = self.staging.attempt_dir(&key);
        let sink = self
            .format
            .writing_to(self.staging.sink_url(&dir, &self.target)?);
        let data = without_null_partitions(
            self.input.execute(partition, Arc::clone(&context))?,
            self.format.config(),
            &self.target.url,
        );
        let store_url = self.staging.store.clone();
        let write = async move {
            let rows = DataSink::write_all(sink.as_ref(), data, &context).await?;
            let store = context.runtime_env().object_store(&store_url)?;
            let files = staged_files(store.as_ref(), &dir).await?;
            staged_batch(&dir, rows, &files)
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            staged_schema(),
            futures::stream::once(write).boxed(),
        )))
    }
}

/// `data`, failing at the first NULL in a `PARTITIONED BY` column: DataFusion's writer would
/// name its directory after the array slot's placeholder (`k=0`, `k=`, `k=false`), and the NULL
/// would read back as that value.
fn without_null_partitions(
    data: SendableRecordBatchStream,
    config: &FileSinkConfig,
    target: &str,
) -> SendableRecordBatchStream {
    let columns: Vec<String> = config
        .table_partition_cols
        .iter()
        .map(|(name, _)| name.clone())
        .collect();
    if columns.is_empty() {
        return data;
    }
    let target = target.to_string();
    let schema = data.schema();
    let checked = data.map(move |batch| {
        let batch = batch?;
        for name in &columns {
            if let Some(column) = batch.column_by_name(name)
                && column.null_count() > 0
            {
                return Err(DataFusionError::Execution(format!(
                    "the write to {target} has a NULL in its partition column {name}, which \
                     cannot name a partition directory; filter the NULLs out or replace them \
                     (coalesce) first"
                )));
            }
        }
        Ok(batch)
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, checked))
}

/// The files under `dir`, as paths inside it, sorted.
pub(crate) async fn staged_files(
    store: &dyn object_store::ObjectStore,
    dir: &Path,
) -> Result<Vec<String>> {
    let listed: Vec<object_store::ObjectMeta> = store.list(Some(dir)).try_collect().await?;
    let mut files: Vec<String> = listed
        .iter()
        .filter_map(|meta| {
            let parts: Vec<String> = meta
                .location
                .prefix_match(dir)?
                .map(|part| part.as_ref().to_string())
                .collect();
            (!parts.is_empty()).then(|| parts.join("/"))
        })
        .collect();
    files.sort();
    Ok(files)
}

pub(crate) fn staged_batch(dir: &Path, rows: u64, files: &[String]) -> Result<RecordBatch> {
    let mut list = ListBuilder::new(StringBuilder::new());
    for file in files {
        list.values().append_value(file);
    }
    list.append(true);
    Ok(RecordBatch::try_new(
        staged_schema(),
        vec![
            Arc::new(StringArray::from(vec![dir.to_string()])),
            Arc::new(UInt64Array::from(vec![rows])),
            Arc::new(list.finish()),
        ],
    )?)
}
