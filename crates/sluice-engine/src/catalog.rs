//! Table discovery: which files become which tables.
//!
//! Rules (`--data DIR`): every `*.parquet` or `*.csv` file directly in `DIR` becomes a table named after
//! the file's stem; every sub-directory holding such files (at any depth, one format only) becomes a table
//! named after the directory. Names are lower-cased with anything but `[a-z0-9_]` turned into `_`, so
//! that unquoted SQL identifiers find them. Entries starting with `.` or `_` are ignored, like Spark's
//! `_SUCCESS` markers. Two entries that map to one name are an error, never a silent pick. A
//! sub-directory holding `_delta_log/` is a Delta table ([`crate::delta_table`]): its log, never a
//! listing, says which of its files are the table.
//!
//! `--table NAME=PATH` names one table explicitly; PATH is a file or a directory. Either may be an
//! object store's URL instead (`s3://bucket/sf1/`): [`crate::remote_tables`] applies the same rules
//! to a listing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionContext};

use sluice_runtime::object_stores::is_remote;

use crate::delta_table::DeltaTableProvider;
use crate::error::{Result, SluiceError};
use crate::remote_tables;

/// The file formats Sluice reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// Apache Parquet.
    Parquet,
    /// Comma-separated values with a header line.
    Csv,
    /// A Delta Lake table (a directory holding `_delta_log/`), read at its newest version.
    Delta,
}

impl TableFormat {
    /// The format a file's extension says, if it is one Sluice reads.
    pub fn from_path(path: &Path) -> Option<TableFormat> {
        let extension = path.extension()?.to_str()?.to_ascii_lowercase();
        match extension.as_str() {
            "parquet" | "parq" | "pq" => Some(TableFormat::Parquet),
            "csv" => Some(TableFormat::Csv),
            _ => None,
        }
    }

    /// A human name for messages.
    pub fn name(self) -> &'static str {
        match self {
            TableFormat::Parquet => "parquet",
            TableFormat::Csv => "csv",
            TableFormat::Delta => "delta",
        }
    }
}

/// A table to register: its name, where its data lives and in which format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSource {
    /// The SQL name.
    pub name: String,
    /// A file or a directory of files: a local path, or a URL of an object store (a directory's
    /// URL ends with `/`).
    pub location: String,
    /// The format of every file.
    pub format: TableFormat,
    /// The extension of the files to read (with the leading dot), e.g. `.parquet`.
    pub extension: String,
}

/// Turns a file or directory name into a table name that unquoted SQL finds.
pub fn table_name(raw: &str) -> String {
    raw.chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Whether a file or directory name is skipped (`.hidden`, `_SUCCESS`), locally and in stores.
pub(crate) fn is_hidden_name(name: &str) -> bool {
    name.starts_with('.') || name.starts_with('_')
}

fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(is_hidden_name)
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| SluiceError::io(dir, e))? {
        let entry = entry.map_err(|e| SluiceError::io(dir, e))?;
        entries.push(entry.path());
    }
    entries.sort();
    Ok(entries)
}

/// The data files' format and extension below `dir`, `None` if it holds none.
fn directory_format(dir: &Path) -> Result<Option<(TableFormat, String)>> {
    let mut found: BTreeMap<String, (TableFormat, PathBuf)> = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        for path in read_dir_sorted(&current)? {
            if is_hidden(&path) {
                continue;
            }
            if path.is_dir() {
                pending.push(path);
            } else if let Some(format) = TableFormat::from_path(&path)
                && let Some(ext) = path.extension().and_then(|e| e.to_str())
            {
                found
                    .entry(format!(".{ext}"))
                    .or_insert_with(|| (format, path.clone()));
            }
        }
    }
    let mut kinds = found.into_iter();
    let Some((extension, (format, _))) = kinds.next() else {
        return Ok(None);
    };
    if let Some((_, (_, other))) = kinds.next() {
        return Err(SluiceError::invalid(format!(
            "{}: a table directory must hold files of one kind, but it has *{extension} and {}",
            dir.display(),
            other.display()
        )));
    }
    Ok(Some((format, extension)))
}

/// Whether the local directory `dir` is a Delta table (it holds `_delta_log/`).
fn is_delta_dir(dir: &Path) -> bool {
    dir.join(sluice_runtime::delta::LOG_DIR).is_dir()
}

/// The table a single file or directory forms, named `name`.
pub fn table_at(name: &str, path: &Path) -> Result<TableSource> {
    let metadata = std::fs::metadata(path).map_err(|e| SluiceError::io(path, e))?;
    let (format, extension) = if metadata.is_dir() && is_delta_dir(path) {
        (TableFormat::Delta, String::new())
    } else if metadata.is_dir() {
        directory_format(path)?.ok_or_else(|| SluiceError::Table {
            name: name.to_string(),
            location: path.display().to_string(),
            message: "the directory holds no .parquet or .csv files".into(),
        })?
    } else {
        let format = TableFormat::from_path(path).ok_or_else(|| SluiceError::Table {
            name: name.to_string(),
            location: path.display().to_string(),
            message: "cannot tell the format: name the file *.parquet or *.csv".into(),
        })?;
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .map(|e| format!(".{e}"))
            .unwrap_or_default();
        (format, extension)
    };
    Ok(TableSource {
        name: name.to_string(),
        location: path.display().to_string(),
        format,
        extension,
    })
}

/// Splits `NAME=LOCATION` as given to `--table`, checking the name.
fn split_table_arg(arg: &str) -> Result<(&str, &str)> {
    let (name, location) = arg
        .split_once('=')
        .ok_or_else(|| SluiceError::invalid(format!("--table '{arg}': expected NAME=PATH")))?;
    if name.is_empty() || table_name(name) != name {
        return Err(SluiceError::invalid(format!(
            "--table '{arg}': table names are lower-case letters, digits and '_' (try '{}')",
            table_name(name)
        )));
    }
    Ok((name, location))
}

/// Parses `NAME=PATH` as given to `--table`, PATH a local file or directory.
pub fn parse_table_arg(arg: &str) -> Result<TableSource> {
    let (name, path) = split_table_arg(arg)?;
    table_at(name, Path::new(path))
}

/// The table `--table NAME=LOCATION` names: a local path, or an object store's URL (listed with
/// `ctx`'s object stores, [`crate::remote_tables`]).
pub async fn resolve_table_arg(ctx: &SessionContext, arg: &str) -> Result<TableSource> {
    let (name, location) = split_table_arg(arg)?;
    if is_remote(location) {
        remote_tables::table_at_url(ctx, name, location).await
    } else {
        table_at(name, Path::new(location))
    }
}

/// Every table under `location` (`--data`): a local directory, or an object store's prefix.
pub async fn discover_tables_at(ctx: &SessionContext, location: &str) -> Result<Vec<TableSource>> {
    if is_remote(location) {
        remote_tables::discover_tables_at_url(ctx, location).await
    } else {
        discover_tables(Path::new(location))
    }
}

/// Every table in `dir`, by the rules in this module's docs.
pub fn discover_tables(dir: &Path) -> Result<Vec<TableSource>> {
    let metadata = std::fs::metadata(dir).map_err(|e| SluiceError::io(dir, e))?;
    if !metadata.is_dir() {
        return Err(SluiceError::invalid(format!(
            "{}: --data expects a directory (use --table NAME=PATH for a single file)",
            dir.display()
        )));
    }
    let mut tables: BTreeMap<String, TableSource> = BTreeMap::new();
    for path in read_dir_sorted(dir)? {
        if is_hidden(&path) {
            continue;
        }
        let stem = if path.is_dir() {
            path.file_name()
        } else if TableFormat::from_path(&path).is_some() {
            path.file_stem()
        } else {
            None
        };
        let Some(stem) = stem.and_then(|s| s.to_str()) else {
            continue;
        };
        let name = table_name(stem);
        let source = if path.is_dir() && is_delta_dir(&path) {
            TableSource {
                name,
                location: path.display().to_string(),
                format: TableFormat::Delta,
                extension: String::new(),
            }
        } else if path.is_dir() {
            // Walk the directory once: a directory without data files is not a table.
            let Some((format, extension)) = directory_format(&path)? else {
                continue;
            };
            TableSource {
                name,
                location: path.display().to_string(),
                format,
                extension,
            }
        } else {
            table_at(&name, &path)?
        };
        if let Some(previous) = tables.get(&source.name) {
            return Err(SluiceError::invalid(format!(
                "{} and {} both make table '{}': rename one or use --table",
                previous.location, source.location, source.name
            )));
        }
        tables.insert(source.name.clone(), source);
    }
    if tables.is_empty() {
        return Err(SluiceError::invalid(format!(
            "{}: no .parquet or .csv tables found",
            dir.display()
        )));
    }
    Ok(tables.into_values().collect())
}

/// Registers `source` with `ctx`, reading its schema now so that a corrupt or unreadable file is
/// reported here, naming the table and its path.
pub async fn register_table(ctx: &SessionContext, source: &TableSource) -> Result<()> {
    let location = source.location.as_str();
    let registered = match source.format {
        TableFormat::Parquet => {
            let options = ParquetReadOptions::default().file_extension(&source.extension);
            ctx.register_parquet(&source.name, location, options).await
        }
        TableFormat::Csv => {
            let options = CsvReadOptions::new()
                .has_header(true)
                .file_extension(&source.extension);
            ctx.register_csv(&source.name, location, options).await
        }
        TableFormat::Delta => {
            match DeltaTableProvider::open(&ctx.runtime_env(), location, None).await {
                Ok(table) => ctx
                    .register_table(&source.name, Arc::new(table))
                    .map(|_| ()),
                Err(error) => Err(error),
            }
        }
    };
    registered.map_err(|e| SluiceError::Table {
        name: source.name.clone(),
        location: source.location.clone(),
        message: SluiceError::from(e).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path) {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(path, b"a\n1\n").unwrap();
    }

    #[test]
    fn files_and_directories_become_tables() {
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("Orders.csv"));
        touch(&dir.path().join("lineitem/part-0.parquet"));
        touch(&dir.path().join("lineitem/part-1.parquet"));
        touch(&dir.path().join("nested/year=2024/a.csv"));
        touch(&dir.path().join("notes.txt"));
        touch(&dir.path().join("_SUCCESS"));
        touch(&dir.path().join(".hidden.csv"));
        std::fs::create_dir_all(dir.path().join("empty")).unwrap();

        let tables = discover_tables(dir.path()).unwrap();
        let summary: Vec<_> = tables
            .iter()
            .map(|t| (t.name.as_str(), t.format, t.extension.as_str()))
            .collect();
        assert_eq!(
            summary,
            vec![
                ("lineitem", TableFormat::Parquet, ".parquet"),
                ("nested", TableFormat::Csv, ".csv"),
                ("orders", TableFormat::Csv, ".csv"),
            ]
        );
    }

    #[test]
    fn clashing_names_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("t.csv"));
        touch(&dir.path().join("t.parquet"));
        let error = discover_tables(dir.path()).unwrap_err().to_string();
        assert!(error.contains("both make table 't'"), "{error}");
    }

    #[test]
    fn mixed_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("t/a.csv"));
        touch(&dir.path().join("t/b.parquet"));
        let error = discover_tables(dir.path()).unwrap_err().to_string();
        assert!(error.contains("one kind"), "{error}");
    }

    #[test]
    fn missing_directory_names_the_path() {
        let error = discover_tables(Path::new("/no/such/dir"))
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("/no/such/dir:"), "{error}");
    }

    #[test]
    fn empty_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let error = discover_tables(dir.path()).unwrap_err().to_string();
        assert!(error.contains("no .parquet or .csv tables"), "{error}");
    }

    #[test]
    fn table_args_parse() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.pq");
        touch(&file);
        let source = parse_table_arg(&format!("t1={}", file.display())).unwrap();
        assert_eq!(source.format, TableFormat::Parquet);
        assert_eq!(source.extension, ".pq");
        assert!(parse_table_arg("no_equals").is_err());
        assert!(parse_table_arg(&format!("Bad-Name={}", file.display())).is_err());
        let unknown = dir.path().join("x.json");
        touch(&unknown);
        assert!(parse_table_arg(&format!("t={}", unknown.display())).is_err());
    }

    #[test]
    fn names_are_sql_friendly() {
        assert_eq!(table_name("Line-Item 2024"), "line_item_2024");
    }
}
