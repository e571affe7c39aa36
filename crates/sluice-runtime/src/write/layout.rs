//! Where a distributed file write puts things: its target, and its staging prefix beside the
//! target (one per statement, named by a token; one directory per task attempt inside it).
//!
//! ```text
//!   target     s3://bucket/lake/out/                 (a directory; or one file: …/out.parquet)
//!   staging    s3://bucket/lake/.sluice-staging/out/<token>/j<job>-s<stage>-p<partition>-a<attempt>/…
//!   manifest   s3://bucket/lake/out/_SUCCESS           (directory targets only)
//! ```
//!
//! Invariants: a staging prefix never lies under its target (readers of the target never see a
//! staged file), except for a target at the root of its store, whose staging is the hidden
//! `.sluice-staging/` inside it; a token is unique per statement across driver processes (time,
//! process id and a counter); an attempt directory belongs to exactly one task attempt.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::datasource::physical_plan::FileSinkConfig;
use datafusion::execution::object_store::ObjectStoreUrl;
use object_store::path::Path;
use sluice_planner::AttemptKey;

/// The name of the staging directory beside a target.
pub const STAGING_DIR: &str = ".sluice-staging";
/// The manifest a committed directory write leaves at its target's root.
pub const MANIFEST: &str = "_SUCCESS";

/// Where a write's files end up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteTarget {
    /// The store (`s3://bucket/`, `file:///`).
    pub store: ObjectStoreUrl,
    /// The target's path in the store: a directory, or the one file of a single-file write.
    pub path: Path,
    /// One file at exactly `path` (otherwise files with generated names under it).
    pub single_file: bool,
    /// The target as the statement named it, for messages.
    pub url: String,
}

impl WriteTarget {
    /// The target of a file sink's configuration (exactly one table path).
    pub fn of(config: &FileSinkConfig) -> Result<Self> {
        let [url] = config.table_paths.as_slice() else {
            return Err(DataFusionError::Plan(format!(
                "a distributed write takes exactly one target; {} given",
                config.table_paths.len()
            )));
        };
        Ok(Self {
            store: config.object_store_url.clone(),
            path: url.prefix().clone(),
            single_file: config.file_output_mode.single_file_output(url),
            url: url.as_str().to_string(),
        })
    }

    /// Where the staged file at `relative` (a path inside an attempt directory) is committed to.
    pub fn committed_path(&self, relative: &str) -> Result<Path> {
        if self.single_file {
            return Ok(self.path.clone());
        }
        join(&self.path, relative)
    }

    /// The manifest's path (directory targets).
    pub fn manifest(&self) -> Path {
        self.path.clone().join(MANIFEST)
    }
}

/// A statement's staging prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staging {
    /// The store the target is in.
    pub store: ObjectStoreUrl,
    /// Every write to the target stages under this (`<parent>/.sluice-staging/<name>`).
    pub root: Path,
    /// This statement's token.
    pub token: String,
}

impl Staging {
    /// A new staging prefix for a write to `target`.
    pub fn beside(target: &WriteTarget) -> Result<Self> {
        let root = match (target.path.parent(), target.path.filename()) {
            (Some(parent), Some(name)) => join(&parent, &format!("{STAGING_DIR}/{name}"))?,
            _ => join(&Path::default(), &format!("{STAGING_DIR}/_root"))?,
        };
        Ok(Self {
            store: target.store.clone(),
            root,
            token: new_token(),
        })
    }

    /// This statement's staging directory.
    pub fn dir(&self) -> Path {
        self.root.clone().join(self.token.as_str())
    }

    /// The directory attempt `key` writes into.
    pub fn attempt_dir(&self, key: &AttemptKey) -> Path {
        self.dir().join(format!(
            "j{}-s{}-p{}-a{}",
            key.job, key.stage.0, key.partition, key.attempt
        ))
    }

    /// `dir` as a URL a file sink writes under (a collection: it ends with `/`), or, for a
    /// single-file target, the file named as the target inside it.
    pub fn sink_url(&self, dir: &Path, target: &WriteTarget) -> Result<ListingTableUrl> {
        let path = if target.single_file {
            let name = target.path.filename().ok_or_else(|| {
                DataFusionError::Plan(format!("the write target {} names no file", target.url))
            })?;
            format!("{dir}/{name}")
        } else {
            format!("{dir}/")
        };
        ListingTableUrl::parse(format!("{}{path}", self.store.as_str()))
    }

    /// A key naming this statement's staging in every store (the commit ledger's key).
    pub fn key(&self) -> String {
        format!("{}{}", self.store.as_str(), self.dir())
    }
}

impl fmt::Display for Staging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.store.as_str(), self.dir())
    }
}

/// `base` joined with `relative` (segments already in object-store form, `/`-separated).
pub fn join(base: &Path, relative: &str) -> Result<Path> {
    let joined = if base.as_ref().is_empty() {
        relative.to_string()
    } else {
        format!("{base}/{relative}")
    };
    Path::parse(&joined).map_err(|e| {
        DataFusionError::Internal(format!("{joined} is not an object-store path: {e}"))
    })
}

/// A token unique per statement: this process's clock, its id and a counter.
fn new_token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "w{nanos:x}-{:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use sluice_planner::{JobId, StageId};

    use super::*;

    fn target(url: &str, path: &str, single_file: bool) -> WriteTarget {
        WriteTarget {
            store: ObjectStoreUrl::parse(url).unwrap(),
            path: Path::from(path),
            single_file,
            url: format!("{url}{path}"),
        }
    }

    #[test]
    fn staging_lies_beside_the_target_and_names_the_job_and_attempt() {
        let target = target("s3://bucket", "lake/out", false);
        let staging = Staging::beside(&target).unwrap();
        assert_eq!(staging.root, Path::from("lake/.sluice-staging/out"));
        let key = AttemptKey {
            job: JobId(7),
            stage: StageId(2),
            partition: 3,
            attempt: 1,
        };
        assert_eq!(
            staging.attempt_dir(&key).to_string(),
            format!("lake/.sluice-staging/out/{}/j7-s2-p3-a1", staging.token)
        );
        assert_eq!(
            staging.sink_url(&staging.dir(), &target).unwrap().as_str(),
            format!("s3://bucket/lake/.sluice-staging/out/{}/", staging.token)
        );
        assert_ne!(Staging::beside(&target).unwrap().token, staging.token);
    }

    #[test]
    fn a_target_at_the_stores_root_stages_in_a_hidden_directory_inside_it() {
        let staging = Staging::beside(&target("s3://bucket", "", false)).unwrap();
        assert_eq!(staging.root, Path::from(".sluice-staging/_root"));
    }

    #[test]
    fn a_single_file_target_stages_its_file_under_the_same_name() {
        let target = target("s3://bucket", "lake/out.parquet", true);
        let staging = Staging::beside(&target).unwrap();
        let dir = staging.dir();
        assert_eq!(
            staging.sink_url(&dir, &target).unwrap().as_str(),
            format!("s3://bucket/{dir}/out.parquet")
        );
        assert_eq!(
            target.committed_path("whatever.parquet").unwrap(),
            Path::from("lake/out.parquet")
        );
    }

    #[test]
    fn staged_files_commit_to_the_same_relative_path_under_a_directory_target() {
        let target = target("file:///", "tmp/out", false);
        assert_eq!(
            target.committed_path("l_returnflag=A/x_0.parquet").unwrap(),
            Path::from("tmp/out/l_returnflag=A/x_0.parquet")
        );
        assert_eq!(target.manifest(), Path::from("tmp/out/_SUCCESS"));
    }
}
