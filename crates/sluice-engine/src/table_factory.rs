//! `CREATE EXTERNAL TABLE ... LOCATION 'dir/'` over a directory reads only the files of its format.
//!
//! DataFusion's listing factory lists every file of a directory location (an empty extension
//! filter), so a `_SUCCESS` manifest (which Sluice's distributed writes leave, as Spark's do) or
//! any other stray file breaks its hive-partition inference ("mixed partition values") or is read
//! as data. For a single directory location this factory gives the table its format's extension
//! (`.parquet`, `.csv`, `.csv.gz`, ...), as Sluice's `--data` and quoted paths already do; every
//! other location goes to DataFusion's factory unchanged.
//!
//! Invariants: the table is the one DataFusion's factory would build (same options, partition
//! columns typed `Dictionary(UInt16, Utf8)` when inferred, definition, constraints, defaults,
//! sort order), except for its extension filter.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::DataType;
use datafusion::catalog::{Session, TableProvider, TableProviderFactory, UrlTableFactory};
use datafusion::common::{DataFusionError, Result, arrow_datafusion_err};
use datafusion::datasource::dynamic_file::DynamicListTableFactory;
use datafusion::datasource::listing::ListingTableConfigExt;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::listing_table_factory::ListingTableFactory;
use datafusion::execution::context::SessionState;
use datafusion::logical_expr::CreateExternalTable;
use datafusion_session::SessionStore;

use crate::access::AccessSlot;
use futures::TryStreamExt;

/// See the module docs.
#[derive(Debug, Default)]
pub struct DataFilesFactory {
    datafusion: ListingTableFactory,
}

#[async_trait]
impl TableProviderFactory for DataFilesFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        let [location] = cmd.locations.as_slice() else {
            return self.datafusion.create(state, cmd).await;
        };
        let url = ListingTableUrl::parse(location)?.with_table_ref(cmd.name.clone());
        let Some(session) = state.as_any().downcast_ref::<SessionState>() else {
            return self.datafusion.create(state, cmd).await;
        };
        if !url.is_collection() || url.get_glob().is_some() {
            return self.datafusion.create(state, cmd).await;
        }
        let format = session
            .get_file_format_factory(cmd.file_type.as_str())
            .ok_or_else(|| {
                DataFusionError::Plan(format!("no file format is named {}", cmd.file_type))
            })?
            .create(session, &cmd.options)?;
        let extension = match format.compression_type() {
            Some(compression) => format.get_ext_with_compression(&compression)?,
            None => format.get_ext(),
        };
        let options = ListingOptions::new(format).with_file_extension(format!(".{extension}"));
        let (options, schema) = if cmd.schema.fields().is_empty() {
            let inferred = cmd.table_partition_cols.is_empty()
                && session
                    .config_options()
                    .execution
                    .listing_table_factory_infer_partitions;
            let partitions = if inferred {
                options.infer_partitions(session, &url).await?
            } else {
                cmd.table_partition_cols.clone()
            };
            let dictionary =
                DataType::Dictionary(Box::new(DataType::UInt16), Box::new(DataType::Utf8));
            let options = options.with_table_partition_cols(
                partitions
                    .into_iter()
                    .map(|name| (name, dictionary.clone()))
                    .collect(),
            );
            options.validate_partitions(session, &url).await?;
            let schema = options.infer_schema(session, &url).await?;
            (options, schema)
        } else {
            // Declared partition columns are part of the declared schema but not of the files.
            let declared = cmd.schema.inner();
            let mut partitions = Vec::new();
            for name in &cmd.table_partition_cols {
                let field = declared
                    .field_with_name(name)
                    .map_err(|e| arrow_datafusion_err!(e))?;
                partitions.push((name.clone(), field.data_type().clone()));
            }
            let in_files: Vec<usize> = (0..declared.fields().len())
                .filter(|i| !cmd.table_partition_cols.contains(declared.field(*i).name()))
                .collect();
            let options = options.with_table_partition_cols(partitions);
            options.validate_partitions(session, &url).await?;
            (options, Arc::new(declared.project(&in_files)?))
        };
        let config = ListingTableConfig::new(url)
            .with_listing_options(options.with_file_sort_order(cmd.order_exprs.clone()))
            .with_schema(schema);
        let table = ListingTable::try_new(config)?
            .with_cache(
                session
                    .runtime_env()
                    .cache_manager
                    .get_file_statistic_cache(),
            )
            .with_definition(cmd.definition.clone())
            .with_constraints(cmd.constraints.clone())
            .with_column_defaults(cmd.column_defaults.clone());
        Ok(Arc::new(table))
    }
}

/// A quoted directory path or URL (`select * from 's3://bucket/out/'`) is a table of its data
/// files: DataFusion's URL tables take the format of the directory's first listed file, which
/// may be a `_SUCCESS` manifest or another hidden file (names starting with `.` or `_` sort
/// among the data files'). This factory takes the format of the first file that is not hidden
/// (as Sluice's `--data` does) and reads only files of that extension (a hidden file with the
/// data's own extension is still read, as DataFusion reads it); a directory holding a Delta log
/// is its Delta table at the newest version; a file URL, or a directory without such a file, goes
/// to DataFusion's factory unchanged.
///
/// A location the session's access does not let it read is refused before anything is listed
/// or read ([`crate::access`]).
#[derive(Debug)]
pub struct DataFilesUrlFactory {
    datafusion: DynamicListTableFactory,
    access: AccessSlot,
}

impl DataFilesUrlFactory {
    /// A factory for the session `store` will hold, limited by the session's `access`.
    pub fn new(store: SessionStore, access: AccessSlot) -> Self {
        Self {
            datafusion: DynamicListTableFactory::new(store),
            access,
        }
    }

    /// The store that must be given the session's state.
    pub fn session_store(&self) -> &SessionStore {
        self.datafusion.session_store()
    }

    /// The first data file under directory `url` (its URL), skipping hidden names.
    async fn first_data_file(state: &SessionState, url: &ListingTableUrl) -> Option<String> {
        let store = state.runtime_env().object_store(url.object_store()).ok()?;
        let mut files: Vec<object_store::path::Path> = store
            .list(Some(url.prefix()))
            .map_ok(|meta| meta.location)
            .try_collect()
            .await
            .ok()?;
        files.sort();
        files
            .into_iter()
            .find(|file| {
                file.prefix_match(url.prefix()).is_some_and(|mut parts| {
                    parts.all(|part| !crate::catalog::is_hidden_name(part.as_ref()))
                }) && file.extension().is_some()
            })
            .map(|file| format!("{}{file}", url.object_store().as_str()))
    }
}

#[async_trait]
impl UrlTableFactory for DataFilesUrlFactory {
    async fn try_new(&self, url: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        if let Some(access) = self.access.get()
            && !access
                .may_read(url)
                .map_err(|e| DataFusionError::External(Box::new(e)))?
        {
            return Ok(None);
        }
        let Ok(directory) = ListingTableUrl::parse(url) else {
            return Ok(None);
        };
        let state = self
            .session_store()
            .get_session()
            .upgrade()
            .and_then(|s| s.read().as_any().downcast_ref::<SessionState>().cloned());
        let (Some(state), true) = (state, directory.is_collection()) else {
            return self.datafusion.try_new(url).await;
        };
        if crate::delta_table::is_delta_table(state.runtime_env(), url).await {
            let table =
                crate::delta_table::DeltaTableProvider::open(state.runtime_env(), url, None)
                    .await?;
            return Ok(Some(Arc::new(table)));
        }
        let Some(file) = Self::first_data_file(&state, &directory).await else {
            return self.datafusion.try_new(url).await;
        };
        // The options (format, extension, compression) the first data file implies.
        let Ok(from_file) = ListingTableConfig::new(ListingTableUrl::parse(&file)?)
            .infer_options(&state)
            .await
        else {
            return Ok(None);
        };
        let Some(options) = from_file.options.clone() else {
            return Ok(None);
        };
        let config = ListingTableConfig::new(directory)
            .with_listing_options(options)
            .infer_partitions_from_path(&state)
            .await?
            .infer_schema(&state)
            .await?;
        Ok(Some(Arc::new(ListingTable::try_new(config)?)))
    }
}
