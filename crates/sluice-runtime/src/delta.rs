//! Delta Lake tables through the Delta kernel (`deltalake-core`): opening a table's log at a
//! version with this process's own object stores, and the one log commit of a distributed write.
//!
//! ```text
//!   driver:  open(url, version) ─► log replay (checkpoint + commits) ─► the active files
//!            commit_append(url, files) ─► <table>/_delta_log/<next version>.json
//!                                         (put-if-absent: a concurrent commit is retried
//!                                          by the kernel on top of the newer version)
//! ```
//!
//! Invariants: the log is read and written only through the process's object store registry
//! ([`crate::object_stores`]), so credentials never leave the process and a Delta table on S3
//! uses the same limits as any other object; a write commits at most once (its token is the
//! commit's application transaction, checked against the log before committing); a commit
//! adds files and removes none (appends only).

use std::collections::HashMap;
use std::sync::{Arc, Once};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use deltalake_core::DeltaTable;
use deltalake_core::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake_core::kernel::{Action, Add, Transaction};
use deltalake_core::logstore::{
    LogStore, LogStoreFactory, ObjectStoreRef, StorageConfig, default_logstore, logstore_factories,
};
use deltalake_core::protocol::{DeltaOperation, SaveMode};
use deltalake_core::table::builder::DeltaTableBuilder;
use url::Url;

/// The directory of a table's log.
pub const LOG_DIR: &str = "_delta_log";

/// The URL a Delta table at `location` (a local path or an object store's URL) is opened by.
pub fn table_url(location: &str) -> Result<Url> {
    let trimmed = location.trim_end_matches('/');
    let url = if crate::object_stores::is_remote(location) || trimmed.starts_with("file://") {
        Url::parse(trimmed)
            .map_err(|e| DataFusionError::Plan(format!("{location} is not a URL: {e}")))?
    } else {
        let path = std::path::absolute(trimmed)
            .map_err(|e| DataFusionError::Plan(format!("{location}: {e}")))?;
        Url::from_directory_path(&path)
            .map_err(|()| DataFusionError::Plan(format!("{location} is not an absolute path")))?
    };
    // The kernel joins paths onto the table's URL: it must end with `/`.
    let text = url.as_str().trim_end_matches('/');
    Url::parse(&format!("{text}/"))
        .map_err(|e| DataFusionError::Plan(format!("{location} is not a URL: {e}")))
}

/// The store a table's URL lives in (`s3://bucket/`, `file:///`).
pub fn store_url(url: &Url) -> Result<ObjectStoreUrl> {
    ObjectStoreUrl::parse(format!("{}://{}", url.scheme(), url.authority()))
}

/// The kernel's own log stores cover only `file://` and `memory://`: every other scheme gets
/// its plain log store (commits by put-if-absent) over the store Sluice hands it.
fn register_log_stores() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for scheme in crate::object_stores::REMOTE_SCHEMES {
            if let Ok(url) = Url::parse(&format!("{scheme}://")) {
                logstore_factories().insert(url, Arc::new(PutIfAbsentLogStores));
            }
        }
    });
}

/// Log stores that commit with a conditional put (`If-None-Match: *` on S3).
#[derive(Debug)]
struct PutIfAbsentLogStores;

impl LogStoreFactory for PutIfAbsentLogStores {
    fn with_options(
        &self,
        prefixed_store: ObjectStoreRef,
        root_store: ObjectStoreRef,
        location: &Url,
        options: &StorageConfig,
    ) -> deltalake_core::DeltaResult<Arc<dyn LogStore>> {
        Ok(default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}

/// One line for a kernel error, naming the table.
pub fn delta_error(url: &Url, error: impl std::fmt::Display) -> DataFusionError {
    let text = error.to_string();
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    DataFusionError::Execution(format!("Delta table {url}: {line}"))
}

/// The table at `url`, its log read up to `version` (the newest without one).
pub async fn open(runtime: &RuntimeEnv, url: &Url, version: Option<u64>) -> Result<DeltaTable> {
    register_log_stores();
    let store = runtime.object_store(store_url(url)?)?;
    let mut builder = DeltaTableBuilder::from_url(url.clone())
        .map_err(|e| delta_error(url, e))?
        .with_storage_backend(store, url.clone());
    if let Some(version) = version {
        builder = builder.with_version(version);
    }
    builder.load().await.map_err(|e| match e {
        deltalake_core::DeltaTableError::NotATable(_) => DataFusionError::Plan(format!(
            "Delta table {url}: there is no Delta log ({LOG_DIR}/) there"
        )),
        other => delta_error(url, other),
    })
}

/// A data file a write adds to a table.
#[derive(Debug, Clone, PartialEq)]
pub struct AddedFile {
    /// Its path relative to the table's root, as the store spells it.
    pub path: String,
    /// Its size in bytes.
    pub size: i64,
    /// Its partition values, by partition column (`None`: null).
    pub partition_values: HashMap<String, Option<String>>,
    /// The rows in it.
    pub rows: u64,
}

/// Commits `files` to the table at `url` as one append, unless the write `token` names was
/// committed already; the table's new version (or the one that committed it).
pub async fn commit_append(
    runtime: &RuntimeEnv,
    url: &Url,
    token: &str,
    files: &[AddedFile],
) -> Result<u64> {
    let table = open(runtime, url, None).await?;
    let app_id = format!("sluice-{token}");
    let snapshot = table.snapshot().map_err(|e| delta_error(url, e))?;
    let log_store = table.log_store();
    if snapshot
        .transaction_version(log_store.as_ref(), &app_id)
        .await
        .map_err(|e| delta_error(url, e))?
        .is_some()
    {
        return Ok(snapshot.version());
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let actions: Vec<Action> = files
        .iter()
        .map(|file| {
            Action::Add(Add {
                path: file.path.clone(),
                partition_values: file.partition_values.clone(),
                size: file.size,
                modification_time: now,
                data_change: true,
                stats: Some(format!("{{\"numRecords\":{}}}", file.rows)),
                ..Default::default()
            })
        })
        .collect();
    let partition_by = snapshot.metadata().partition_columns().to_vec();
    let operation = DeltaOperation::Write {
        mode: SaveMode::Append,
        partition_by: (!partition_by.is_empty()).then_some(partition_by),
        predicate: None,
    };
    let properties = CommitProperties::default()
        .with_application_transaction(Transaction::new(&app_id, 1))
        .with_create_checkpoint(false);
    let committed = CommitBuilder::from(properties)
        .with_actions(actions)
        .build(Some(snapshot), log_store, operation)
        .await
        .map_err(|e| delta_error(url, e))?;
    Ok(committed.version())
}
