//! `FileCommitExec`: the driver's end of a distributed file write. It reads what every write task
//! staged (one row per accepted attempt: the job output's exactly-once reads only ever hand it
//! the attempts its region accepted), and commits exactly those files.
//!
//! ```text
//!   staged rows (accepted attempts) ─► move each file into the target (rename; copy + delete on S3)
//!                                   ─► _SUCCESS at the target's root, listing them (directories),
//!                                      or one Delta log commit adding them (a Delta table)
//!                                   ─► remove this statement's staging, and stale ones of the target
//!                                   ─► one row: count (the rows written)
//! ```
//!
//! Invariants: a statement commits at most once (the ledger: a region retried after its commit
//! returns the committed count and moves nothing; one retried while its commit ran fails the
//! statement rather than commit a second time); a commit that fails part-way removes the files
//! it already moved, so a failed write leaves nothing new under its target; staging of statements
//! still running in this process is never removed (two drivers must not write one target at once,
//! as with Spark's committers).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};

use datafusion::arrow::array::{Array, AsArray, RecordBatch, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, UInt64Type};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{
    Boundedness, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, PlanProperties,
};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use sluice_planner::plan::{RECOMPUTE, only_child};
use sluice_planner::{DistributedExec, NodeDistribution};
use tokio::sync::watch;

use super::layout::{Staging, WriteTarget, join};

/// What a commit records once the files are in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitLog {
    /// `_SUCCESS` at a directory target's root, listing the files (nothing for one file).
    Manifest,
    /// One Delta log commit that adds the files to the table at this URL (the target).
    Delta(url::Url),
}

/// Commits the staged files of its input; see the module docs.
#[derive(Debug)]
pub struct FileCommitExec {
    input: Arc<dyn ExecutionPlan>,
    target: WriteTarget,
    staging: Staging,
    log: CommitLog,
    properties: Arc<PlanProperties>,
}

impl FileCommitExec {
    /// Commits what `input` (one partition of staged rows) names into `target`.
    pub fn new(input: Arc<dyn ExecutionPlan>, target: WriteTarget, staging: Staging) -> Self {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "count",
            DataType::UInt64,
            false,
        )]));
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            Boundedness::Bounded,
        );
        Self {
            input,
            target,
            staging,
            log: CommitLog::Manifest,
            properties: Arc::new(properties),
        }
    }

    /// The same commit, recording it with `log`.
    pub fn with_log(mut self, log: CommitLog) -> Self {
        self.log = log;
        self
    }

    /// Where the write stages.
    pub fn staging(&self) -> &Staging {
        &self.staging
    }
}

impl DistributedExec for FileCommitExec {
    /// The commit needs every task's staged row and the driver's view of the job: it runs on the
    /// driver over its input read from workers.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: false,
        }
    }
}

impl DisplayAs for FileCommitExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let log = match self.log {
            CommitLog::Manifest => "",
            CommitLog::Delta(_) => ", log=delta",
        };
        write!(
            f,
            "FileCommitExec: target={}{log}, staging={}",
            self.target.url, self.staging
        )
    }
}

impl ExecutionPlan for FileCommitExec {
    fn name(&self) -> &str {
        "FileCommitExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn required_input_distribution(&self) -> Vec<Distribution> {
        vec![Distribution::SinglePartition]
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
        Ok(Arc::new(
            Self::new(input, self.target.clone(), self.staging.clone()).with_log(self.log.clone()),
        ))
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
        if partition != 0 {
            return internal_err!("FileCommitExec has one partition; {partition} asked");
        }
        let staged = self.input.execute(0, Arc::clone(&context))?;
        let target = self.target.clone();
        let staging = self.staging.clone();
        let log = self.log.clone();
        let schema = self.schema();
        let out = Arc::clone(&schema);
        let commit = async move {
            let batches: Vec<RecordBatch> = staged.try_collect().await?;
            let runtime = context.runtime_env();
            let store = runtime.object_store(&staging.store)?;
            let statement = Statement {
                store,
                runtime,
                log,
                target,
                staging,
            };
            let rows = statement.commit_once(batches).await?;
            Ok(RecordBatch::try_new(
                out,
                vec![Arc::new(UInt64Array::from(vec![rows]))],
            )?)
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            futures::stream::once(commit).boxed(),
        )))
    }
}

/// Statements committed in this process (by staging key), newest last, with their row counts.
static COMMITTED: LazyLock<Mutex<VecDeque<(String, u64)>>> =
    LazyLock::new(|| Mutex::new(VecDeque::new()));
/// How many committed statements the ledger remembers.
const LEDGER_SIZE: usize = 1024;
/// Statements of this process whose writes may still be staging (by staging key).
static LIVE: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// The rows `staging`'s statement committed, if it did.
pub fn committed_rows(staging: &Staging) -> Option<u64> {
    let key = staging.key();
    COMMITTED
        .lock()
        .ok()?
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, rows)| *rows)
}

fn record_commit(staging: &Staging, rows: u64) {
    if let Ok(mut ledger) = COMMITTED.lock() {
        if ledger.len() >= LEDGER_SIZE {
            ledger.pop_front();
        }
        ledger.push_back((staging.key(), rows));
    }
}

/// How a statement's commit ended: its rows, or why it failed.
type Outcome = std::result::Result<u64, Arc<DataFusionError>>;

/// The commits started in this process (by staging key), until their statement ends: every run
/// of a statement's commit (its region run again) waits for the one commit.
static COMMITS: LazyLock<Mutex<HashMap<String, watch::Receiver<Option<Outcome>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Whether `staging`'s commit started in this process: from then on the commit owns the
/// statement's staging (it removes it whether it succeeds or fails).
pub fn commit_started(staging: &Staging) -> bool {
    COMMITS
        .lock()
        .is_ok_and(|commits| commits.contains_key(&staging.key()))
}

/// Marks `staging`'s statement as running (its staging is not stale) until [`finished`].
pub fn started(staging: &Staging) {
    if let Ok(mut live) = LIVE.lock() {
        live.insert(staging.key());
    }
}

/// Marks `staging`'s statement as ended.
pub fn finished(staging: &Staging) {
    if let Ok(mut live) = LIVE.lock() {
        live.remove(&staging.key());
    }
    if let Ok(mut commits) = COMMITS.lock() {
        commits.remove(&staging.key());
    }
}

/// A staged file: where it is and where it goes.
struct Move {
    from: Path,
    to: Path,
}

/// A statement's write, as its commit needs it.
#[derive(Clone)]
struct Statement {
    store: Arc<dyn ObjectStore>,
    runtime: Arc<RuntimeEnv>,
    log: CommitLog,
    target: WriteTarget,
    staging: Staging,
}

impl Statement {
    /// Commits the statement's staged files named in `batches`, once: the commit runs on a task
    /// of its own, so a statement cancelled (or a region stopped) while it moves files never
    /// leaves part of them under the target; a process about to exit waits for it (see
    /// [`super::finish_detached_work`]). A second run while the statement lives returns the
    /// first one's outcome.
    async fn commit_once(&self, batches: Vec<RecordBatch>) -> Result<u64> {
        if let Some(rows) = committed_rows(&self.staging) {
            return Ok(rows);
        }
        let mut outcome = {
            let mut commits = COMMITS
                .lock()
                .map_err(|_| DataFusionError::Internal("the commit registry is poisoned".into()))?;
            commits
                .entry(self.staging.key())
                .or_insert_with(|| {
                    let (sender, receiver) = watch::channel(None);
                    let statement = self.clone();
                    // Detached on purpose (not a SpawnedTask): dropping the statement must not
                    // stop a commit half-way; `keep_until_exit` tracks it instead.
                    super::keep_until_exit(tokio::spawn(async move {
                        let outcome = statement.commit(&batches).await.map_err(Arc::new);
                        let _ = sender.send(Some(outcome));
                    }));
                    receiver
                })
                .clone()
        };
        let ended = outcome.wait_for(Option::is_some).await.map_err(|_| {
            DataFusionError::Execution(format!(
                "the commit of the write to {} stopped before it ended",
                self.target.url
            ))
        })?;
        match ended.as_ref() {
            Some(Ok(rows)) => Ok(*rows),
            Some(Err(error)) => Err(DataFusionError::Shared(Arc::clone(error))),
            None => internal_err!("a commit ended without an outcome"),
        }
    }

    async fn commit(&self, batches: &[RecordBatch]) -> Result<u64> {
        let store = self.store.as_ref();
        let (target, staging) = (&self.target, &self.staging);
        let (rows, moves) = staged_moves(target, staging, batches)?;
        match self.move_and_record(&moves).await {
            Ok(()) => {
                record_commit(staging, rows);
                remove_staging(store, staging).await;
                Ok(rows)
            }
            Err(error) => {
                for moved in &moves {
                    let _ = store.delete(&moved.to).await;
                }
                remove_staging(store, staging).await;
                Err(DataFusionError::Execution(format!(
                    "the write to {} could not be committed (nothing of it was kept): {error}",
                    target.url
                )))
            }
        }
    }

    /// Moves the staged files into the target and records them (a manifest, or a Delta commit).
    async fn move_and_record(&self, moves: &[Move]) -> Result<()> {
        let (store, target) = (self.store.as_ref(), &self.target);
        for file in moves {
            store.rename(&file.from, &file.to).await?;
        }
        match &self.log {
            CommitLog::Manifest if !target.single_file => {
                let manifest = serde_manifest(target, moves);
                store
                    .put(&target.manifest(), PutPayload::from(manifest.into_bytes()))
                    .await?;
            }
            CommitLog::Manifest => {}
            CommitLog::Delta(url) => {
                let mut files = Vec::with_capacity(moves.len());
                for file in moves {
                    files.push(added_file(&self.store, target, &file.to).await?);
                }
                let token = &self.staging.token;
                crate::delta::commit_append(&self.runtime, url, token, &files).await?;
            }
        }
        Ok(())
    }
}

/// The rows written and the file moves of the staged rows in `batches`.
fn staged_moves(
    target: &WriteTarget,
    staging: &Staging,
    batches: &[RecordBatch],
) -> Result<(u64, Vec<Move>)> {
    let mut rows = 0u64;
    let mut moves = Vec::new();
    let mut seen = HashSet::new();
    let prefix = staging.dir();
    for batch in batches {
        let [dirs, counts, files] = batch.columns() else {
            return internal_err!("a staged row has {} columns, not 3", batch.num_columns());
        };
        let dirs = dirs.as_string::<i32>();
        let counts = counts.as_primitive::<UInt64Type>();
        let files = files.as_list::<i32>();
        for row in 0..batch.num_rows() {
            let dir = Path::parse(dirs.value(row))
                .map_err(|e| DataFusionError::Internal(format!("a staged directory: {e}")))?;
            if !dir.prefix_matches(&prefix) {
                return internal_err!("{dir} is not under this write's staging {prefix}");
            }
            rows += counts.value(row);
            let names = files.value(row);
            let names = names.as_string::<i32>();
            for index in 0..names.len() {
                let relative = names.value(index);
                let to = target.committed_path(relative)?;
                if !seen.insert(to.clone()) {
                    return internal_err!("two staged files would both become {to}");
                }
                moves.push(Move {
                    from: join(&dir, relative)?,
                    to,
                });
            }
        }
    }
    Ok((rows, moves))
}

/// The Delta `add` of the committed file `path`: its path in the table, size, rows (from its
/// footer) and partition values (from its `column=value` directories).
async fn added_file(
    store: &Arc<dyn ObjectStore>,
    target: &WriteTarget,
    path: &Path,
) -> Result<crate::delta::AddedFile> {
    let parts: Vec<String> = path
        .prefix_match(&target.path)
        .map(|parts| parts.map(|part| part.as_ref().to_string()).collect())
        .unwrap_or_default();
    let Some((_, directories)) = parts.split_last() else {
        return internal_err!("{path} is not under the table {}", target.url);
    };
    let mut partition_values = std::collections::HashMap::new();
    for directory in directories {
        let Some((column, value)) = directory.split_once('=') else {
            return internal_err!("{path}: {directory} is not a column=value directory");
        };
        let value = percent_encoding::percent_decode_str(value)
            .decode_utf8_lossy()
            .into_owned();
        // Delta reads an empty partition value as null (DataFusion writes a null string so).
        partition_values.insert(column.to_string(), (!value.is_empty()).then_some(value));
    }
    let meta = store.head(path).await?;
    let rows = DFParquetMetadata::new(store.as_ref(), &meta)
        .fetch_metadata()
        .await?
        .file_metadata()
        .num_rows();
    Ok(crate::delta::AddedFile {
        path: parts.join("/"),
        size: meta.size as i64,
        partition_values,
        rows: rows.max(0) as u64,
    })
}

/// The manifest: one committed path per line, relative to the target.
fn serde_manifest(target: &WriteTarget, moves: &[Move]) -> String {
    moves
        .iter()
        .map(|file| {
            file.to
                .prefix_match(&target.path)
                .map(|parts| {
                    parts
                        .map(|part| part.as_ref().to_string())
                        .collect::<Vec<_>>()
                        .join("/")
                })
                .unwrap_or_else(|| file.to.to_string())
                + "\n"
        })
        .collect()
}

/// Removes `staging`'s objects, and those of earlier statements to the same target that no
/// statement of this process still runs (a driver that died mid-write left them). Best effort:
/// what cannot be removed now, the next write to the target removes.
pub async fn remove_staging(store: &dyn ObjectStore, staging: &Staging) {
    let live = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
    let Ok(objects) = store
        .list(Some(&staging.root))
        .try_collect::<Vec<_>>()
        .await
    else {
        return;
    };
    for object in objects {
        let token = object
            .location
            .prefix_match(&staging.root)
            .and_then(|mut parts| parts.next())
            .map(|part| part.as_ref().to_string());
        let Some(token) = token else { continue };
        if removable(staging, token, &live) {
            let _ = store.delete(&object.location).await;
        }
    }
    remove_local_leftovers(staging, &live);
}

/// Whether the staging directory `token` beside `staging`'s is removed with it: it is the
/// statement's own, or no statement of this process still runs in it.
fn removable(staging: &Staging, token: String, live: &HashSet<String>) -> bool {
    let other = Staging {
        token,
        ..staging.clone()
    };
    other.token == staging.token || !live.contains(&other.key())
}

/// A local file system keeps the directories of deleted files, and the `name#N` part files of
/// uploads a killed process never finished (its store's listing hides them): remove those under
/// every staging directory this call removed, then the directories left empty (never one that
/// still holds a file of a live statement).
fn remove_local_leftovers(staging: &Staging, live: &HashSet<String>) {
    if staging.store.as_str() != "file:///" {
        return;
    }
    let root = std::path::PathBuf::from(format!("/{}", staging.root));
    if let Ok(entries) = std::fs::read_dir(&root) {
        for entry in entries.flatten() {
            let token = entry.file_name().to_string_lossy().into_owned();
            if removable(staging, token, live) {
                remove_unfinished_uploads(&entry.path());
            }
        }
    }
    remove_empty_dirs(&root);
    if let Some(parent) = root.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

/// Whether `name` is the part file of an unfinished local upload (`file.parquet#3`).
fn is_unfinished_upload(name: &str) -> bool {
    name.rsplit_once('#')
        .is_some_and(|(_, suffix)| !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()))
}

fn remove_unfinished_uploads(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_unfinished_uploads(&path);
        } else if is_unfinished_upload(&entry.file_name().to_string_lossy()) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

fn remove_empty_dirs(dir: &std::path::Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_dirs(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use datafusion::execution::object_store::ObjectStoreUrl;
    use object_store::memory::InMemory;

    use super::*;
    use crate::write::file_write::staged_files;

    async fn stage(
        store: &InMemory,
        staging: &Staging,
        attempt: &str,
        files: &[&str],
    ) -> RecordBatch {
        let dir = staging.dir().join(attempt);
        for file in files {
            let path = join(&dir, file).unwrap();
            store.put(&path, PutPayload::from("x")).await.unwrap();
        }
        let names = staged_files(store, &dir).await.unwrap();
        crate::write::file_write::staged_batch(&dir, files.len() as u64, &names).unwrap()
    }

    fn statement(store: &Arc<InMemory>, target: &WriteTarget, staging: &Staging) -> Statement {
        Statement {
            store: Arc::clone(store) as Arc<dyn ObjectStore>,
            runtime: Arc::new(RuntimeEnv::default()),
            log: CommitLog::Manifest,
            target: target.clone(),
            staging: staging.clone(),
        }
    }

    async fn commit_in(
        store: &Arc<InMemory>,
        target: &WriteTarget,
        staging: &Staging,
        batches: &[RecordBatch],
    ) -> Result<u64> {
        statement(store, target, staging)
            .commit_once(batches.to_vec())
            .await
    }

    fn setup() -> (Arc<InMemory>, WriteTarget, Staging) {
        let target = WriteTarget {
            store: ObjectStoreUrl::parse("memory://").unwrap(),
            path: Path::from("lake/out"),
            single_file: false,
            url: "memory:///lake/out/".into(),
        };
        let staging = Staging::beside(&target).unwrap();
        (Arc::new(InMemory::new()), target, staging)
    }

    async fn keys(store: &InMemory) -> Vec<String> {
        let mut keys: Vec<String> = store
            .list(None)
            .map_ok(|meta| meta.location.to_string())
            .try_collect()
            .await
            .unwrap();
        keys.sort();
        keys
    }

    #[tokio::test]
    async fn removing_a_local_staging_also_removes_the_part_files_of_a_killed_upload() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let target = WriteTarget {
            store: ObjectStoreUrl::parse("file://").unwrap(),
            path: Path::from_filesystem_path(&out).unwrap(),
            single_file: false,
            url: format!("{}/", out.display()),
        };
        let staging = Staging::beside(&target).unwrap();
        let attempt =
            std::path::PathBuf::from(format!("/{}", staging.dir())).join("j1-s0-p0-a0/k=A");
        std::fs::create_dir_all(&attempt).unwrap();
        std::fs::write(attempt.join("done.parquet"), "x").unwrap();
        // What object_store's local upload leaves when its process is killed mid-write.
        std::fs::write(attempt.join("part.parquet#1"), "x").unwrap();
        let store = object_store::local::LocalFileSystem::new();
        remove_staging(&store, &staging).await;
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["out".to_string()]);
        assert!(is_unfinished_upload("a.parquet#12"));
        assert!(!is_unfinished_upload("a#b.parquet"));
        assert!(!is_unfinished_upload("a.parquet#"));
    }

    #[tokio::test]
    async fn a_commit_moves_only_the_named_attempts_files_once_and_removes_the_staging() {
        let (store, target, staging) = setup();
        let accepted = stage(&store, &staging, "j1-s0-p0-a1", &["k=A/f1.parquet"]).await;
        // A replaced attempt's files are staged too, but no accepted row names them.
        stage(&store, &staging, "j1-s0-p0-a0", &["k=A/f0.parquet"]).await;
        let rows = commit_in(&store, &target, &staging, std::slice::from_ref(&accepted))
            .await
            .unwrap();
        assert_eq!(rows, 1);
        assert_eq!(
            keys(&store).await,
            ["lake/out/_SUCCESS", "lake/out/k=A/f1.parquet"]
        );
        // A second run of the same statement's commit (its region ran again) moves nothing.
        let again = stage(&store, &staging, "j1-s0-p0-a2", &["k=A/f2.parquet"]).await;
        assert_eq!(
            commit_in(&store, &target, &staging, &[again])
                .await
                .unwrap(),
            1
        );
        let manifest = store
            .get(&target.manifest())
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&manifest[..], b"k=A/f1.parquet\n");
        finished(&staging);
    }

    #[tokio::test]
    async fn a_commit_whose_run_is_dropped_part_way_still_ends_and_a_second_run_shares_it() {
        let (store, target, staging) = setup();
        started(&staging);
        let first = stage(&store, &staging, "j1-s0-p0-a1", &["f1.csv"]).await;
        let second = stage(&store, &staging, "j1-s0-p0-a2", &["f2.csv"]).await;
        let statement = statement(&store, &target, &staging);
        // The first run starts the commit (on this one-thread runtime its task has not run yet)
        // and is dropped, as a cancelled statement's stream is.
        let mut run = Box::pin(statement.commit_once(vec![first]));
        assert!(futures::poll!(run.as_mut()).is_pending());
        drop(run);
        assert!(commit_started(&staging));
        // A second run (a region run again) gets the first commit's rows and moves nothing else.
        assert_eq!(statement.commit_once(vec![second]).await.unwrap(), 1);
        assert_eq!(
            keys(&store).await,
            vec![
                "lake/out/_SUCCESS".to_string(),
                "lake/out/f1.csv".to_string()
            ]
        );
        finished(&staging);
        assert!(!commit_started(&staging));
    }
}
