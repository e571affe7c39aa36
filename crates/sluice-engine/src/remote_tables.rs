//! Tables at object-store URLs: the rules of [`crate::catalog`] applied to a listing.
//!
//! `--data s3://bucket/sf1/` lists the prefix once, with a delimiter: each data object directly
//! under it is a table named after its stem, each sub-prefix holding data objects of one format
//! (at any depth) a table named after the sub-prefix. `--table t=s3://bucket/trips/` names one
//! table; a URL ending in a data extension is one object. Names starting with `.` or `_` are
//! skipped, as on local disks. The driver lists; the plan carries the objects it found, and
//! workers only read byte ranges of them.
//!
//! Errors name the URL and the store's reason in one line (a missing bucket, a refused key, an
//! unreachable endpoint); the store's limits ([`sluice_runtime::object_stores::StoreLimits`])
//! bound how long that takes. No credential is ever part of a message.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use url::Url;

use crate::catalog::{TableFormat, TableSource, is_hidden_name, table_name};
use crate::error::{Result, SluiceError};

/// A prefix of one object store: the store, the URL of its root and the path under it.
struct Prefix {
    store: Arc<dyn ObjectStore>,
    /// `scheme://authority`, without a trailing `/`.
    root: String,
    path: ObjectPath,
}

impl Prefix {
    /// The prefix `location` names, with its store from `runtime`'s registry (built on first use).
    fn open(runtime: &RuntimeEnv, location: &str) -> Result<Self> {
        let url = Url::parse(location)
            .map_err(|e| SluiceError::invalid(format!("{location}: not a URL ({e})")))?;
        let root = format!("{}://{}", url.scheme(), url.authority());
        let store_url = ObjectStoreUrl::parse(&root)
            .map_err(|e| SluiceError::invalid(format!("{location}: {e}")))?;
        let store = runtime
            .object_store(&store_url)
            .map_err(|e| SluiceError::invalid(format!("{location}: {}", one_line(&e))))?;
        let path = ObjectPath::from_url_path(url.path())
            .map_err(|e| SluiceError::invalid(format!("{location}: {e}")))?;
        Ok(Self { store, root, path })
    }

    /// The URL of `path` in this store; a directory's ends with `/`.
    fn url_of(&self, path: &ObjectPath, directory: bool) -> String {
        let slash = if directory { "/" } else { "" };
        format!("{}/{path}{slash}", self.root)
    }
}

/// The store's error as one line; an S3-style XML error body shrinks to its code and message.
fn one_line(error: &dyn std::fmt::Display) -> String {
    let text = error.to_string();
    let Some(start) = text.find("<?xml") else {
        return crate::error::one_line(&text);
    };
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let from = text.find(&open)? + open.len();
        let to = text[from..].find(&format!("</{name}>"))? + from;
        Some(text[from..to].to_string())
    };
    let body = [tag("Code"), tag("Message")]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(": ");
    crate::error::one_line(&format!("{}{body}", &text[..start]))
}

/// `.ext` of an object's name, empty without one.
fn dotted_extension(path: &ObjectPath) -> String {
    path.extension()
        .map(|e| format!(".{e}"))
        .unwrap_or_default()
}

fn format_of(path: &ObjectPath) -> Option<TableFormat> {
    TableFormat::from_path(std::path::Path::new(path.filename()?))
}

/// The format and extension of the data objects below `path`, `None` if it holds none; a Delta
/// table's when it holds `_delta_log/`.
async fn prefix_format(
    prefix: &Prefix,
    path: &ObjectPath,
    location: &str,
) -> Result<Option<(TableFormat, String)>> {
    let objects: Vec<_> = prefix
        .store
        .list(Some(path))
        .try_collect()
        .await
        .map_err(|e| SluiceError::invalid(format!("{location}: {}", one_line(&e))))?;
    let delta_log = path.clone().join(sluice_runtime::delta::LOG_DIR);
    if objects
        .iter()
        .any(|object| object.location.prefix_matches(&delta_log))
    {
        return Ok(Some((TableFormat::Delta, String::new())));
    }
    let mut found: BTreeMap<String, (TableFormat, ObjectPath)> = BTreeMap::new();
    for object in objects {
        let Some(relative) = object.location.prefix_match(path) else {
            continue;
        };
        if relative
            .into_iter()
            .any(|part| is_hidden_name(part.as_ref()))
        {
            continue;
        }
        if let (Some(format), Some(ext)) =
            (format_of(&object.location), object.location.extension())
        {
            found
                .entry(format!(".{ext}"))
                .or_insert_with(|| (format, object.location.clone()));
        }
    }
    let mut kinds = found.into_iter();
    let Some((extension, (format, _))) = kinds.next() else {
        return Ok(None);
    };
    if let Some((_, (_, other))) = kinds.next() {
        return Err(SluiceError::invalid(format!(
            "{location}: a table directory must hold files of one kind, but it has *{extension} \
             and {}",
            prefix.url_of(&other, false)
        )));
    }
    Ok(Some((format, extension)))
}

/// The table the object or prefix at `location` forms, named `name`.
pub async fn table_at_url(ctx: &SessionContext, name: &str, location: &str) -> Result<TableSource> {
    let prefix = Prefix::open(&ctx.runtime_env(), location)?;
    let failed = |message: String| SluiceError::Table {
        name: name.to_string(),
        location: location.to_string(),
        message,
    };
    if !location.ends_with('/')
        && let Some(format) = format_of(&prefix.path)
    {
        prefix
            .store
            .head(&prefix.path)
            .await
            .map_err(|e| failed(one_line(&e)))?;
        let extension = dotted_extension(&prefix.path);
        return Ok(TableSource {
            name: name.to_string(),
            location: location.to_string(),
            format,
            extension,
        });
    }
    let (format, extension) = prefix_format(&prefix, &prefix.path, location)
        .await?
        .ok_or_else(|| failed("no .parquet or .csv objects under it".into()))?;
    Ok(TableSource {
        name: name.to_string(),
        location: prefix.url_of(&prefix.path, true),
        format,
        extension,
    })
}

/// Every table under the prefix `location`, by the rules in this module's docs.
pub async fn discover_tables_at_url(
    ctx: &SessionContext,
    location: &str,
) -> Result<Vec<TableSource>> {
    let prefix = Prefix::open(&ctx.runtime_env(), location)?;
    let listing = prefix
        .store
        .list_with_delimiter(Some(&prefix.path))
        .await
        .map_err(|e| SluiceError::invalid(format!("{location}: {}", one_line(&e))))?;
    let mut tables: BTreeMap<String, TableSource> = BTreeMap::new();
    let mut add = |source: TableSource| -> Result<()> {
        if let Some(previous) = tables.get(&source.name) {
            return Err(SluiceError::invalid(format!(
                "{} and {} both make table '{}': rename one or use --table",
                previous.location, source.location, source.name
            )));
        }
        tables.insert(source.name.clone(), source);
        Ok(())
    };
    let mut objects = listing.objects;
    objects.sort_by(|a, b| a.location.cmp(&b.location));
    for object in objects {
        let Some(file) = object.location.filename() else {
            continue;
        };
        let Some(format) = format_of(&object.location).filter(|_| !is_hidden_name(file)) else {
            continue;
        };
        let stem = file.rsplit_once('.').map_or(file, |(stem, _)| stem);
        add(TableSource {
            name: table_name(stem),
            location: prefix.url_of(&object.location, false),
            format,
            extension: dotted_extension(&object.location),
        })?;
    }
    let mut directories = listing.common_prefixes;
    directories.sort();
    for directory in directories {
        let Some(dir_name) = directory.filename().filter(|n| !is_hidden_name(n)) else {
            continue;
        };
        let Some((format, extension)) = prefix_format(&prefix, &directory, location).await? else {
            continue;
        };
        add(TableSource {
            name: table_name(dir_name),
            location: prefix.url_of(&directory, true),
            format,
            extension,
        })?;
    }
    if tables.is_empty() {
        return Err(SluiceError::invalid(format!(
            "{location}: no .parquet or .csv tables found"
        )));
    }
    Ok(tables.into_values().collect())
}

/// The text of the object at `location`, `None` if there is none (a manifest beside the tables).
pub async fn read_object_text(ctx: &SessionContext, location: &str) -> Result<Option<String>> {
    let prefix = Prefix::open(&ctx.runtime_env(), location)?;
    let failed =
        |e: &dyn std::fmt::Display| SluiceError::invalid(format!("{location}: {}", one_line(e)));
    let object = match prefix.store.get(&prefix.path).await {
        Ok(object) => object,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(failed(&e)),
    };
    let bytes = object.bytes().await.map_err(|e| failed(&e))?;
    String::from_utf8(bytes.to_vec())
        .map(Some)
        .map_err(|e| failed(&e))
}

/// Uploads every file under the local directory `local` to the prefix `location`, keeping their
/// relative paths, each file one upload (multipart when large), `last` (a manifest) after all the
/// others so that a reader who finds it finds everything. Returns the number of files uploaded.
pub async fn upload_directory(
    runtime: &RuntimeEnv,
    local: &std::path::Path,
    location: &str,
    last: &str,
) -> Result<usize> {
    let prefix = Prefix::open(runtime, location)?;
    let mut files = Vec::new();
    let mut pending = vec![local.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| SluiceError::io(&dir, e))? {
            let path = entry.map_err(|e| SluiceError::io(&dir, e))?.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    // Sorted, with `last` at the end.
    files.sort_by_key(|path| (path.ends_with(last), path.clone()));
    for file in &files {
        let relative = file
            .strip_prefix(local)
            .map_err(|e| SluiceError::invalid(format!("{}: {e}", file.display())))?;
        let mut target = prefix.path.clone();
        for part in relative.iter() {
            target = target.join(part.to_string_lossy().as_ref());
        }
        let url = prefix.url_of(&target, false);
        let failed =
            |e: &dyn std::fmt::Display| SluiceError::invalid(format!("{url}: {}", one_line(e)));
        let mut source = tokio::fs::File::open(file)
            .await
            .map_err(|e| SluiceError::io(file, e))?;
        let mut upload = object_store::buffered::BufWriter::new(Arc::clone(&prefix.store), target);
        if let Err(e) = tokio::io::copy(&mut source, &mut upload).await {
            // A multipart upload begun is aborted, not left behind.
            let _ = upload.abort().await;
            return Err(failed(&e));
        }
        tokio::io::AsyncWriteExt::shutdown(&mut upload)
            .await
            .map_err(|e| failed(&e))?;
    }
    Ok(files.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_xml_error_body_becomes_its_code_and_message() {
        let error = "Generic S3 error: GET http://h/lake in 3ms - 404 Not Found: <?xml \
                     version=\"1.0\"?>\n<Error><Code>NoSuchBucket</Code><Message>The specified \
                     bucket does not exist</Message><RequestId>x</RequestId></Error>";
        assert_eq!(
            one_line(&error),
            "Generic S3 error: GET http://h/lake in 3ms - 404 Not Found: NoSuchBucket: The \
             specified bucket does not exist"
        );
        assert_eq!(one_line(&"a\n  b"), "a b");
    }
    use object_store::PutPayload;
    use object_store::memory::InMemory;

    /// A context whose `mem://bucket` store holds `objects`.
    async fn context_with(objects: &[&str]) -> SessionContext {
        let ctx = SessionContext::new();
        let store = Arc::new(InMemory::new());
        for object in objects {
            store
                .put(
                    &ObjectPath::from(*object),
                    PutPayload::from_static(b"a\n1\n"),
                )
                .await
                .unwrap();
        }
        ctx.register_object_store(&Url::parse("mem://bucket").unwrap(), store);
        ctx
    }

    #[tokio::test]
    async fn a_prefix_lists_tables_by_the_local_rules() {
        let ctx = context_with(&[
            "sf/Orders.csv",
            "sf/lineitem/part-0.parquet",
            "sf/lineitem/part-1.parquet",
            "sf/nested/year=2024/a.csv",
            "sf/notes.txt",
            "sf/_SUCCESS",
            "sf/.hidden.csv",
            "sf/skipped/_tmp/a.parquet",
            "other/x.csv",
        ])
        .await;
        let tables = discover_tables_at_url(&ctx, "mem://bucket/sf/")
            .await
            .unwrap();
        let summary: Vec<_> = tables
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.format,
                    t.extension.as_str(),
                    t.location.as_str(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "lineitem",
                    TableFormat::Parquet,
                    ".parquet",
                    "mem://bucket/sf/lineitem/"
                ),
                (
                    "nested",
                    TableFormat::Csv,
                    ".csv",
                    "mem://bucket/sf/nested/"
                ),
                (
                    "orders",
                    TableFormat::Csv,
                    ".csv",
                    "mem://bucket/sf/Orders.csv"
                ),
            ]
        );
    }

    #[tokio::test]
    async fn a_table_url_is_one_object_or_a_prefix_and_must_hold_data() {
        let ctx = context_with(&[
            "t/a.parquet",
            "t/b.parquet",
            "mixed/a.csv",
            "mixed/b.parquet",
        ])
        .await;
        let one = table_at_url(&ctx, "one", "mem://bucket/t/a.parquet")
            .await
            .unwrap();
        assert_eq!(
            (one.format, one.location.as_str()),
            (TableFormat::Parquet, "mem://bucket/t/a.parquet")
        );
        let all = table_at_url(&ctx, "all", "mem://bucket/t").await.unwrap();
        assert_eq!(all.location, "mem://bucket/t/");
        let missing = table_at_url(&ctx, "m", "mem://bucket/t/none.parquet")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            missing.starts_with("table 'm' (mem://bucket/t/none.parquet): ")
                && missing.contains("not found"),
            "{missing}"
        );
        let empty = table_at_url(&ctx, "e", "mem://bucket/nothing/")
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            empty,
            "table 'e' (mem://bucket/nothing/): no .parquet or .csv objects under it"
        );
        let mixed = table_at_url(&ctx, "x", "mem://bucket/mixed/")
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            mixed,
            "mem://bucket/mixed/: a table directory must hold files of one kind, but it has \
             *.csv and mem://bucket/mixed/b.parquet"
        );
    }
}
