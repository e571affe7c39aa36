//! The interactive shell of `sluice sql` (rustyline).
//!
//! Lines accumulate until one ends with `;`, then the statements run. Ctrl-C while a query runs cancels
//! that query and returns to the prompt; Ctrl-C at the prompt clears the pending input; Ctrl-D or `\q`
//! quits. History persists in `~/.sluice_history`.

use std::path::PathBuf;

use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;
use sluice_engine::{Result, SluiceError, SluiceSession};
use tokio::runtime::Runtime;

use crate::cancel::until_ctrl_c;
use crate::commands::{run_remote, run_statements};
use crate::output::OutputFormat;
use crate::remote::Remote;

const HELP: &str = "\
End each statement with ';' (it may span several lines).
  \\d      list tables
  \\?      this help
  \\q      quit (or Ctrl-D)
Ctrl-C cancels the running query, or clears the current input.";

fn history_path() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".sluice_history"))
}

/// `name` as SQL names it from the default schema (`public`): bare there, qualified elsewhere
/// (`sluice.jobs`).
fn shown_name(schema: &str, name: &str) -> String {
    if schema == "public" {
        name.to_string()
    } else {
        format!("{schema}.{name}")
    }
}

fn list_tables(session: &SluiceSession) {
    let ctx = session.context();
    for catalog_name in ctx.catalog_names() {
        let Some(catalog) = ctx.catalog(&catalog_name) else {
            continue;
        };
        let mut schemas = catalog.schema_names();
        schemas.sort_by_key(|schema| (schema != "public", schema.clone()));
        for schema_name in schemas {
            if schema_name == "information_schema" {
                continue;
            }
            let Some(schema) = catalog.schema(&schema_name) else {
                continue;
            };
            let mut names = schema.table_names();
            names.sort();
            for name in names {
                match session.tables().get(&name) {
                    Some(source) => {
                        println!("{name}  ({}, {})", source.format.name(), source.location)
                    }
                    None => println!("{}", shown_name(&schema_name, &name)),
                }
            }
        }
    }
}

/// What the shell runs statements on.
pub enum Target<'a> {
    /// A session of this process.
    Local(&'a SluiceSession),
    /// A session on a `sluice server`.
    Remote(Box<Remote>),
}

impl Target<'_> {
    fn banner(&self) -> String {
        match self {
            Target::Local(session) => format!(
                "{} mode · {} tables",
                session.runner().mode_name(),
                session.tables().len()
            ),
            Target::Remote(remote) => format!("connected to {}", remote.url()),
        }
    }

    fn list_tables(&self, runtime: &Runtime) {
        match self {
            Target::Local(session) => list_tables(session),
            Target::Remote(remote) => {
                let sql = "select table_schema, table_name from information_schema.tables \
                           where table_schema <> 'information_schema' \
                           order by table_schema <> 'public', table_schema, table_name";
                match runtime.block_on(remote.run(sql)) {
                    Ok(output) => {
                        for batch in &output.batches {
                            for row in 0..batch.num_rows() {
                                let cell = |column: usize| {
                                    arrow::util::display::array_value_to_string(
                                        batch.column(column),
                                        row,
                                    )
                                    .unwrap_or_default()
                                };
                                println!("{}", shown_name(&cell(0), &cell(1)));
                            }
                        }
                    }
                    Err(error) => eprintln!("error: {error}"),
                }
            }
        }
    }

    fn run(&self, sql: &str, runtime: &Runtime, format: OutputFormat) -> Result<()> {
        match self {
            Target::Local(session) => {
                runtime.block_on(until_ctrl_c(run_statements(session, sql, format)))
            }
            Target::Remote(remote) => {
                runtime.block_on(until_ctrl_c(run_remote(remote, sql, format)))
            }
        }
    }
}

/// Runs the shell until `\q` or end of input.
pub fn run(target: &Target<'_>, runtime: &Runtime, format: OutputFormat) -> Result<()> {
    let readline_error = |e: ReadlineError| SluiceError::invalid(format!("shell: {e}"));
    let mut editor = DefaultEditor::new().map_err(readline_error)?;
    let history = history_path();
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    eprintln!(
        "Sluice {} · {}. End statements with ';', \\? for help, \\q to quit.",
        env!("CARGO_PKG_VERSION"),
        target.banner()
    );
    let mut buffer = String::new();
    loop {
        let prompt = if buffer.is_empty() {
            "sluice> "
        } else {
            "     -> "
        };
        match editor.readline(prompt) {
            Ok(line) => {
                let trimmed = line.trim();
                if buffer.is_empty() && trimmed.starts_with('\\') {
                    match trimmed {
                        "\\q" => break,
                        "\\d" => target.list_tables(runtime),
                        "\\?" | "\\h" => eprintln!("{HELP}"),
                        other => eprintln!("unknown command {other}; \\? lists them"),
                    }
                    continue;
                }
                if trimmed.is_empty() && buffer.is_empty() {
                    continue;
                }
                buffer.push_str(&line);
                buffer.push('\n');
                if trimmed.ends_with(';') {
                    let sql = std::mem::take(&mut buffer);
                    let _ = editor.add_history_entry(sql.trim());
                    match target.run(&sql, runtime, format) {
                        Ok(()) => {}
                        Err(SluiceError::Cancelled) => eprintln!("query cancelled"),
                        Err(error) => eprintln!("error: {error}"),
                    }
                }
            }
            Err(ReadlineError::Interrupted) => buffer.clear(),
            Err(ReadlineError::Eof) => break,
            Err(error) => return Err(readline_error(error)),
        }
    }
    if let Some(path) = &history {
        let _ = editor.save_history(path);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_outside_the_default_schema_are_shown_qualified() {
        assert_eq!(shown_name("public", "lineitem"), "lineitem");
        assert_eq!(shown_name("sluice", "tasks"), "sluice.tasks");
    }
}
