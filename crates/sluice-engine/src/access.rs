//! Who may read and write what: a session's [`Access`] (its user, [`Role`] and the server's
//! [`Roots`]) decides, before a statement touches anything, whether the session may run it.
//!
//! ```text
//!  role     reads                                      writes                              else
//!  reader   registered tables, locations under a       nothing                             -
//!           read root
//!  writer   as reader                                  INSERT into registered tables;      -
//!                                                      INSERT/COPY to locations under a
//!                                                      write root
//!  admin    anything                                   anything                            DDL, SET datafusion.runtime.*
//!                                                                                          and datafusion.catalog.*
//! ```
//!
//! Two gates enforce it:
//! - A quoted path or URL (`select * from '/etc/passwd'`) becomes a table only through the session's
//!   URL table factory, which asks [`Access::may_read`] before it lists or reads anything, so a
//!   refused location is never opened (not even to infer its schema).
//! - Every statement's logical plan passes [`Access::authorize`] before the session executes it
//!   (DDL takes effect at that point), whichever door it came through.
//!
//! Invariants:
//! - Locations are compared after normalisation ([`Location`]): the form DataFusion itself reads
//!   (`ListingTableUrl`: `file://` and plain paths alike, `..` resolved, percent-encoding
//!   decoded), then, for local paths, the symbolic links of the part that exists resolved. A path
//!   is under a root when its components start with the root's.
//! - A refusal is [`SluiceError::PermissionDenied`] naming the user, the role and what was
//!   refused; no refused location is read.
//! - Without an [`Access`] (a server without user accounts, the CLI), nothing is checked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::{ListingTable, ListingTableUrl};
use datafusion::datasource::source_as_provider;
use datafusion::logical_expr::{DdlStatement, DmlStatement, LogicalPlan, Statement, WriteOp};
use url::Url;

use crate::catalog::TableSource;
use crate::delta_table::DeltaTableProvider;
use crate::error::{Result, SluiceError};

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Queries over registered tables and locations under the read roots.
    Reader,
    /// A reader that also writes into registered tables and locations under the write roots.
    Writer,
    /// Anything: DDL, any location, others' jobs, server-wide settings.
    Admin,
}

impl Role {
    /// The role named `text` (`reader`, `writer` or `admin`).
    pub fn parse(text: &str) -> Option<Role> {
        match text {
            "reader" => Some(Role::Reader),
            "writer" => Some(Role::Writer),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    /// The role's name.
    pub fn name(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Writer => "writer",
            Role::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A path or URL in the form it is compared in (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local path: absolute, without `.` or `..`, the links of its existing part resolved.
    Local(PathBuf),
    /// An object store's location: lower-case scheme, authority (`host[:port]`), decoded path
    /// segments (no empty, `.` or `..` one).
    Remote {
        /// `s3`, `gs`, `az`, `http`, …
        scheme: String,
        /// The bucket or host, with its port if it has one.
        authority: String,
        /// The path's segments.
        segments: Vec<String>,
    },
}

impl Location {
    /// The location `text` names, as DataFusion would read it (a glob's directory part only: a
    /// glob matches files below it).
    pub fn parse(text: &str) -> std::result::Result<Location, String> {
        let url = ListingTableUrl::parse(text)
            .map_err(|e| format!("'{text}' is not a path or URL: {}", e.strip_backtrace()))?;
        Self::of_url(url.as_ref())
    }

    /// The location of a parsed URL.
    pub fn of_url(url: &Url) -> std::result::Result<Location, String> {
        if url.scheme() == "file" {
            let path = url
                .to_file_path()
                .map_err(|()| format!("'{url}' is not a local path"))?;
            return Ok(Location::Local(resolve_links(&lexical(&path))));
        }
        let mut segments = Vec::new();
        for raw in url.path().split('/').filter(|s| !s.is_empty()) {
            let segment = percent_decode(raw)
                .ok_or_else(|| format!("'{url}' has a path segment that is not UTF-8"))?;
            if segment == "." || segment == ".." || segment.contains('/') {
                return Err(format!(
                    "'{url}' has a relative or encoded path segment ('{segment}')"
                ));
            }
            segments.push(segment);
        }
        let authority = match url.port() {
            Some(port) => format!("{}:{port}", url.host_str().unwrap_or_default()),
            None => url.host_str().unwrap_or_default().to_string(),
        };
        Ok(Location::Remote {
            scheme: url.scheme().to_ascii_lowercase(),
            authority,
            segments,
        })
    }

    /// Whether this location is `root` or lies below it.
    pub fn is_under(&self, root: &Location) -> bool {
        match (self, root) {
            (Location::Local(path), Location::Local(root)) => path.starts_with(root),
            (
                Location::Remote {
                    scheme,
                    authority,
                    segments,
                },
                Location::Remote {
                    scheme: root_scheme,
                    authority: root_authority,
                    segments: root_segments,
                },
            ) => {
                scheme == root_scheme
                    && authority == root_authority
                    && segments.starts_with(root_segments)
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(path) => write!(f, "{}", path.display()),
            Location::Remote {
                scheme,
                authority,
                segments,
            } => write!(f, "{scheme}://{authority}/{}", segments.join("/")),
        }
    }
}

/// `path` without `.` and `..` components (a `..` at the root stays at the root).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// `path` with the symbolic links of its longest existing ancestor resolved (the rest, which
/// does not exist yet, appended as it is).
fn resolve_links(path: &Path) -> PathBuf {
    let mut existing = path.to_path_buf();
    let mut rest = Vec::new();
    loop {
        if let Ok(canonical) = existing.canonicalize() {
            let mut resolved = canonical;
            for part in rest.iter().rev() {
                resolved.push(part);
            }
            return resolved;
        }
        match (
            existing.file_name().map(ToOwned::to_owned),
            existing.parent(),
        ) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                existing = parent.to_path_buf();
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// `%XX` sequences decoded; `None` when the result is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let hex = |i: usize| {
            bytes
                .get(i)
                .and_then(|b| char::from(*b).to_digit(16))
                .and_then(|d| u8::try_from(d).ok())
        };
        match (bytes[index], hex(index + 1), hex(index + 2)) {
            (b'%', Some(high), Some(low)) => {
                out.push(high * 16 + low);
                index += 3;
            }
            (byte, _, _) => {
                out.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The server-wide roots: where non-admins may read and where writers may write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roots {
    read: Vec<Location>,
    write: Vec<Location>,
}

impl Roots {
    /// Roots from their texts (paths or URLs); one that is not a path or URL is an error naming it.
    pub fn parse(read: &[String], write: &[String]) -> Result<Self> {
        let parse = |texts: &[String], which: &str| {
            texts
                .iter()
                .map(|text| {
                    Location::parse(text)
                        .map_err(|message| SluiceError::invalid(format!("{which} root: {message}")))
                })
                .collect::<Result<Vec<_>>>()
        };
        Ok(Self {
            read: parse(read, "read")?,
            write: parse(write, "write")?,
        })
    }

    /// The read roots.
    pub fn read(&self) -> &[Location] {
        &self.read
    }

    /// The write roots.
    pub fn write(&self) -> &[Location] {
        &self.write
    }
}

/// `roots` for messages: comma-separated, or `none`.
pub fn listed(roots: &[Location]) -> String {
    if roots.is_empty() {
        return "none".to_string();
    }
    roots
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One session's user, role and the server's roots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    user: String,
    role: Role,
    roots: Arc<Roots>,
}

impl Access {
    /// `user`'s access as `role` under `roots`.
    pub fn new(user: impl Into<String>, role: Role, roots: Arc<Roots>) -> Self {
        Self {
            user: user.into(),
            role,
            roots,
        }
    }

    /// The user's name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The user's role.
    pub fn role(&self) -> Role {
        self.role
    }

    fn denied(&self, what: impl std::fmt::Display) -> SluiceError {
        SluiceError::PermissionDenied(format!(
            "permission denied for user '{}' ({}): {what}",
            self.user, self.role
        ))
    }

    /// Whether the session may read the quoted path or URL `text` as a table: `Ok(true)` under a
    /// read root (or for an admin); `Ok(false)` for a bare name outside them (no `/`: taken for a
    /// table that does not exist, as a name without access is); otherwise a refusal naming it.
    pub fn may_read(&self, text: &str) -> Result<bool> {
        if self.role == Role::Admin {
            return Ok(true);
        }
        let bare = !text.contains('/');
        let location = match Location::parse(text) {
            Ok(location) => location,
            Err(_) if bare => return Ok(false),
            Err(message) => return Err(self.denied(message)),
        };
        if self.roots.read.iter().any(|root| location.is_under(root)) {
            return Ok(true);
        }
        if bare {
            return Ok(false);
        }
        Err(self.denied(format!(
            "cannot read '{text}' ({location}): it is not under a read root ({})",
            listed(&self.roots.read)
        )))
    }

    /// Checks every part of `plan` (and of its subqueries): DDL and runtime settings need the
    /// admin role, writes the writer role and a registered table (one of `registered`) or a
    /// location under a write root as their target.
    pub fn authorize(
        &self,
        plan: &LogicalPlan,
        registered: &BTreeMap<String, TableSource>,
    ) -> Result<()> {
        if self.role == Role::Admin {
            return Ok(());
        }
        let mut refusal = None;
        let walked = plan.apply_with_subqueries(|node| match self.check_node(node, registered) {
            Ok(()) => Ok(TreeNodeRecursion::Continue),
            Err(error) => {
                refusal = Some(error);
                Ok(TreeNodeRecursion::Stop)
            }
        });
        walked?;
        refusal.map_or(Ok(()), Err)
    }

    fn check_node(
        &self,
        node: &LogicalPlan,
        registered: &BTreeMap<String, TableSource>,
    ) -> Result<()> {
        match node {
            LogicalPlan::Ddl(ddl) => {
                Err(self.denied(format!("{} needs the admin role", ddl_statement_name(ddl))))
            }
            LogicalPlan::Statement(Statement::SetVariable(set)) => {
                self.check_setting(&set.variable)
            }
            LogicalPlan::Statement(Statement::ResetVariable(reset)) => {
                self.check_setting(&reset.variable)
            }
            LogicalPlan::Copy(copy) => {
                self.check_writer("COPY")?;
                self.check_write_location(&copy.output_url)
            }
            LogicalPlan::Dml(dml) => self.check_dml(dml, registered),
            _ => Ok(()),
        }
    }

    fn check_setting(&self, variable: &str) -> Result<()> {
        let lower = variable.to_ascii_lowercase();
        // The runtime's settings make a new memory pool or spill directory; the catalog's change
        // which schema an unqualified name resolves in (and so what "a registered table" is).
        if lower.starts_with("datafusion.runtime.") || lower.starts_with("datafusion.catalog.") {
            return Err(self.denied(format!(
                "'{variable}' is a server-wide setting: it needs the admin role"
            )));
        }
        Ok(())
    }

    fn check_writer(&self, what: &str) -> Result<()> {
        if self.role < Role::Writer {
            return Err(self.denied(format!("{what} needs the writer role")));
        }
        Ok(())
    }

    fn check_write_location(&self, text: &str) -> Result<()> {
        let location = Location::parse(text).map_err(|message| self.denied(message))?;
        if self.roots.write.iter().any(|root| location.is_under(root)) {
            return Ok(());
        }
        Err(self.denied(format!(
            "cannot write to '{text}' ({location}): it is not under a write root ({})",
            listed(&self.roots.write)
        )))
    }

    fn check_dml(
        &self,
        dml: &DmlStatement,
        registered: &BTreeMap<String, TableSource>,
    ) -> Result<()> {
        let what = format!("{} on table '{}'", write_name(&dml.op), dml.table_name);
        self.check_writer(&what)?;
        let name = &dml.table_name;
        let in_default_schema = name
            .schema()
            .is_none_or(|schema| schema.eq_ignore_ascii_case("public"));
        if in_default_schema && registered.contains_key(name.table()) {
            return Ok(());
        }
        let provider = source_as_provider(&dml.target)?;
        let urls: Vec<String> = if let Some(listing) = provider.downcast_ref::<ListingTable>() {
            listing
                .table_paths()
                .iter()
                .map(|url| url.as_str().to_string())
                .collect()
        } else if let Some(delta) = provider.downcast_ref::<DeltaTableProvider>() {
            vec![delta.url().as_str().to_string()]
        } else {
            Vec::new()
        };
        if urls.is_empty() {
            return Err(self.denied(format!(
                "cannot write {what}: it is neither a registered table nor files under a write root"
            )));
        }
        urls.iter()
            .try_for_each(|url| self.check_write_location(url))
    }
}

/// The SQL name of a write, for messages.
fn write_name(op: &WriteOp) -> &'static str {
    match op {
        WriteOp::Insert(_) => "INSERT",
        WriteOp::Delete => "DELETE",
        WriteOp::Update => "UPDATE",
        WriteOp::Ctas => "CREATE TABLE AS",
        WriteOp::Truncate => "TRUNCATE",
        WriteOp::MergeInto(_) => "MERGE",
        _ => "a write",
    }
}

/// The SQL name of a DDL statement, for messages.
fn ddl_statement_name(ddl: &DdlStatement) -> &'static str {
    match ddl {
        DdlStatement::CreateExternalTable(_) => "CREATE EXTERNAL TABLE",
        DdlStatement::CreateMemoryTable(_) => "CREATE TABLE",
        DdlStatement::CreateView(_) => "CREATE VIEW",
        DdlStatement::CreateCatalogSchema(_) => "CREATE SCHEMA",
        DdlStatement::CreateCatalog(_) => "CREATE DATABASE",
        DdlStatement::CreateIndex(_) => "CREATE INDEX",
        DdlStatement::DropTable(_) => "DROP TABLE",
        DdlStatement::DropView(_) => "DROP VIEW",
        DdlStatement::DropCatalogSchema(_) => "DROP SCHEMA",
        DdlStatement::CreateFunction(_) => "CREATE FUNCTION",
        DdlStatement::DropFunction(_) => "DROP FUNCTION",
    }
}

/// A session's access, shared with its URL table factory: `None` checks nothing. A Postgres
/// connection's session is made before its login, which then grants the user's access.
#[derive(Debug, Clone, Default)]
pub struct AccessSlot(Arc<RwLock<Option<Arc<Access>>>>);

impl AccessSlot {
    /// A slot holding `access`.
    pub fn holding(access: Option<Arc<Access>>) -> Self {
        Self(Arc::new(RwLock::new(access)))
    }

    /// The access now held.
    pub fn get(&self) -> Option<Arc<Access>> {
        match self.0.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Holds `access` from now on.
    pub fn set(&self, access: Option<Arc<Access>>) {
        match self.0.write() {
            Ok(mut guard) => *guard = access,
            Err(poisoned) => *poisoned.into_inner() = access,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn local(path: &Path) -> Location {
        Location::Local(path.canonicalize().unwrap())
    }

    #[test]
    fn locations_are_normalised_before_they_are_compared() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(data.join("sf1")).unwrap();
        let root = Location::parse(data.to_str().unwrap()).unwrap();
        assert_eq!(root, local(&data));
        let under = |text: String| Location::parse(&text).unwrap().is_under(&root);
        let d = data.display();
        assert!(under(format!("{d}/sf1/lineitem.parquet")));
        assert!(under(format!("file://{d}/sf1/")));
        assert!(under(format!("{d}/sf1/../sf1/x.csv")));
        assert!(under(format!("{d}/*.parquet")));
        assert!(!under(format!("{d}/../etc/passwd")));
        assert!(!under(format!("{d}/sf1/../../etc")));
        assert!(!under(format!("file://{d}/%2e%2e/etc")));
        assert!(!under(format!("{d}/../data2/x.csv")));
        assert!(!under("/etc/passwd".to_string()));
        // A link inside the root that points outside it is outside.
        std::os::unix::fs::symlink("/etc", data.join("etc")).unwrap();
        assert!(!under(format!("{d}/etc/passwd")));
        // A root given through a link is the directory it points at.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        assert_eq!(Location::parse(link.to_str().unwrap()).unwrap(), root);
        // Paths that do not exist yet (a COPY's target) are compared by their existing part.
        assert!(under(format!("{d}/new/dir/out.parquet")));
    }

    #[test]
    fn object_store_locations_compare_by_scheme_bucket_and_whole_segments() {
        let root = Location::parse("s3://lake/sf1/").unwrap();
        let under = |text: &str| Location::parse(text).unwrap().is_under(&root);
        assert!(under("s3://lake/sf1"));
        assert!(under("s3://lake/sf1/lineitem/part-0.parquet"));
        assert!(under("S3://lake/sf1/x"));
        assert!(!under("s3://lake/sf10/x"));
        assert!(!under("s3://other/sf1/x"));
        assert!(!under("gs://lake/sf1/x"));
        assert!(!under("s3://lake/sf1/../secret"));
        // An encoded `/` or `..` is refused (by DataFusion's parser or by the check itself).
        assert!(
            Location::parse("s3://lake/sf1/%2F..%2Fsecret")
                .unwrap_err()
                .starts_with("'s3://lake/sf1/%2F..%2Fsecret' is not a path or URL")
        );
        let encoded = Location::parse("s3://lake/sf1/%2e%2e/secret");
        assert!(
            encoded
                .as_ref()
                .is_ok_and(|location| !location.is_under(&root))
                || encoded.is_err(),
            "{encoded:?}"
        );
        assert!(!Location::parse("/tmp").unwrap().is_under(&root));
    }

    fn access(role: Role, dir: &Path) -> Access {
        let roots = Roots::parse(
            &[dir.join("data").display().to_string()],
            &[dir.join("out").display().to_string()],
        )
        .unwrap();
        Access::new("ann", role, Arc::new(roots))
    }

    #[test]
    fn a_reader_reads_under_the_read_roots_only_and_bare_names_are_unknown_tables() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        let reader = access(Role::Reader, dir.path());
        let data = dir.path().join("data").canonicalize().unwrap();
        assert!(
            reader
                .may_read(&format!("{}/t.csv", data.display()))
                .unwrap()
        );
        assert!(!reader.may_read("no_such_table").unwrap());
        let refused = reader.may_read("/etc/passwd").unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "permission denied for user 'ann' (reader): cannot read '/etc/passwd' \
                 (/etc/passwd): it is not under a read root ({})",
                data.display()
            )
        );
        assert!(matches!(refused, SluiceError::PermissionDenied(_)));
        assert!(
            access(Role::Admin, dir.path())
                .may_read("/etc/passwd")
                .unwrap()
        );
    }

    /// A session over `dir/data/t/` (registered as `t`) with `role`'s access, read root
    /// `dir/data` and write root `dir/out`.
    async fn session_as(role: Role, dir: &Path) -> crate::SluiceSession {
        let mut session = crate::SluiceSession::new(
            &crate::SluiceConfig::default(),
            Arc::new(sluice_runtime::LocalRunner),
        )
        .unwrap();
        let table = crate::catalog::table_at("t", &dir.join("data/t")).unwrap();
        session.register_table(table).await.unwrap();
        session.grant(Some(Arc::new(access(role, dir))));
        session
    }

    fn layout() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("data/t")).unwrap();
        std::fs::create_dir_all(dir.path().join("out")).unwrap();
        std::fs::write(dir.path().join("data/t/0.csv"), "a\n1\n2\n").unwrap();
        std::fs::write(dir.path().join("secret.csv"), "s\nhidden\n").unwrap();
        dir
    }

    async fn rows(session: &crate::SluiceSession, sql: &str) -> usize {
        let outputs = session.run_sql(sql).await.unwrap();
        outputs.iter().map(|o| o.row_count()).sum()
    }

    async fn refusal(session: &crate::SluiceSession, sql: &str) -> String {
        match session.run_sql(sql).await {
            Ok(_) => panic!("'{sql}' ran"),
            Err(SluiceError::PermissionDenied(message)) => message,
            Err(SluiceError::DataFusion(error)) => match error.find_root() {
                datafusion::error::DataFusionError::External(inner) => {
                    match inner.downcast_ref::<SluiceError>() {
                        Some(SluiceError::PermissionDenied(message)) => message.clone(),
                        _ => panic!("'{sql}': {error}"),
                    }
                }
                _ => panic!("'{sql}': {error}"),
            },
            Err(other) => panic!("'{sql}': {other}"),
        }
    }

    #[tokio::test]
    async fn a_reader_queries_registered_tables_and_read_roots_and_nothing_else() {
        let dir = layout();
        let reader = session_as(Role::Reader, dir.path()).await;
        let d = dir.path().canonicalize().unwrap();
        let d = d.display();
        assert_eq!(rows(&reader, "select * from t").await, 2);
        assert_eq!(
            rows(&reader, &format!("select * from '{d}/data/t/0.csv'")).await,
            2
        );
        let who = "permission denied for user 'ann' (reader)";
        assert_eq!(
            refusal(&reader, "select * from '/etc/passwd'").await,
            format!(
                "{who}: cannot read '/etc/passwd' (/etc/passwd): it is not under a read root \
                 ({d}/data)"
            )
        );
        assert_eq!(
            refusal(&reader, &format!("select * from '{d}/data/../secret.csv'")).await,
            format!(
                "{who}: cannot read '{d}/data/../secret.csv' ({d}/secret.csv): it is not under \
                 a read root ({d}/data)"
            )
        );
        assert_eq!(
            refusal(
                &reader,
                "create external table p stored as csv location '/etc/passwd'"
            )
            .await,
            format!("{who}: CREATE EXTERNAL TABLE needs the admin role")
        );
        assert_eq!(
            refusal(&reader, "create view v as select 1").await,
            format!("{who}: CREATE VIEW needs the admin role")
        );
        assert_eq!(
            refusal(&reader, &format!("copy (select 1) to '{d}/out/x.csv'")).await,
            format!("{who}: COPY needs the writer role")
        );
        assert_eq!(
            refusal(&reader, "insert into t values (3)").await,
            format!("{who}: INSERT on table 't' needs the writer role")
        );
        assert_eq!(
            refusal(&reader, "explain copy (select 1) to '/tmp/x.csv'").await,
            format!("{who}: COPY needs the writer role")
        );
        // A bare name is an unknown table, as it is without access checks.
        let unknown = reader.run_sql("select * from no_such").await.unwrap_err();
        assert_eq!(
            unknown.to_string(),
            "Error during planning: table 'datafusion.public.no_such' not found"
        );
        assert!(!dir.path().join("out/x.csv").exists());
    }

    #[tokio::test]
    async fn a_writer_writes_under_the_write_roots_and_into_registered_tables_only() {
        let dir = layout();
        let writer = session_as(Role::Writer, dir.path()).await;
        let d = dir.path().canonicalize().unwrap();
        let d = d.display();
        assert_eq!(
            rows(&writer, &format!("copy (select 1 as a) to '{d}/out/x.csv'")).await,
            1
        );
        assert!(dir.path().join("out/x.csv").exists());
        rows(&writer, "insert into t values (3)").await;
        assert_eq!(rows(&writer, "select * from t").await, 3);
        let who = "permission denied for user 'ann' (writer)";
        assert_eq!(
            refusal(&writer, &format!("copy (select 1) to '{d}/elsewhere.csv'")).await,
            format!(
                "{who}: cannot write to '{d}/elsewhere.csv' ({d}/elsewhere.csv): it is not \
                 under a write root ({d}/out)"
            )
        );
        assert_eq!(
            refusal(&writer, &format!("copy (select 1) to '{d}/out/../x.csv'")).await,
            format!(
                "{who}: cannot write to '{d}/out/../x.csv' ({d}/x.csv): it is not under a \
                 write root ({d}/out)"
            )
        );
        assert_eq!(
            refusal(&writer, "set datafusion.runtime.memory_limit = '100G'").await,
            format!(
                "{who}: 'datafusion.runtime.memory_limit' is a server-wide setting: it needs \
                 the admin role"
            )
        );
        rows(&writer, "set datafusion.execution.batch_size = 100").await;
        assert!(!dir.path().join("elsewhere.csv").exists());
    }

    #[tokio::test]
    async fn an_admin_reads_and_writes_anywhere_and_forks_keep_the_access() {
        let dir = layout();
        let admin = session_as(Role::Admin, dir.path()).await;
        let d = dir.path().canonicalize().unwrap();
        let d = d.display();
        assert_eq!(
            rows(&admin, &format!("select * from '{d}/secret.csv'")).await,
            1
        );
        rows(
            &admin,
            &format!("copy (select 1 as a) to '{d}/elsewhere.csv'"),
        )
        .await;
        assert!(dir.path().join("elsewhere.csv").exists());
        rows(
            &admin,
            &format!("create external table s stored as csv location '{d}/secret.csv'"),
        )
        .await;
        assert_eq!(rows(&admin, "select * from s").await, 1);
        let reader = session_as(Role::Reader, dir.path()).await;
        let fork = reader.fork().await.unwrap();
        assert_eq!(fork.access().unwrap().role(), Role::Reader);
        assert!(
            refusal(&fork, &format!("select * from '{d}/secret.csv'"))
                .await
                .starts_with("permission denied for user 'ann' (reader): cannot read")
        );
    }
}
