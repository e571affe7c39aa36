//! Writing query results to stdout in the format `--format` asks for.
//!
//! `csv`, `json` and `ndjson` stream: each batch is written as it arrives, so a large result never sits
//! in memory. `table` needs every row to size its columns, so it collects first.

use std::io::Write;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::json::{ArrayWriter, LineDelimitedWriter};
use clap::ValueEnum;

/// The result formats on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum OutputFormat {
    /// An aligned text table.
    #[default]
    Table,
    /// Comma-separated values with a header line.
    Csv,
    /// One JSON array of row objects.
    Json,
    /// One JSON object per line.
    Ndjson,
}

/// Writes one statement's result, batch by batch.
pub enum ResultWriter<W: Write> {
    /// Collects for the aligned table.
    Table {
        /// Output.
        out: W,
        /// Schema, for a header even when there are no rows.
        schema: SchemaRef,
        /// Rows so far.
        batches: Vec<RecordBatch>,
    },
    /// Streams CSV.
    Csv {
        /// The CSV writer (boxed: it is much larger than the other variants).
        writer: Box<arrow::csv::Writer<W>>,
        /// Schema, to write the header when no batch came.
        schema: SchemaRef,
        /// Whether anything (and so the header) was written.
        started: bool,
    },
    /// Streams a JSON array.
    Json(ArrayWriter<W>),
    /// Streams JSON lines.
    Ndjson(LineDelimitedWriter<W>),
}

impl<W: Write> ResultWriter<W> {
    /// A writer of `format` for results of `schema`.
    pub fn new(format: OutputFormat, schema: SchemaRef, out: W) -> Self {
        match format {
            OutputFormat::Table => Self::Table {
                out,
                schema,
                batches: Vec::new(),
            },
            OutputFormat::Csv => Self::Csv {
                writer: Box::new(
                    arrow::csv::WriterBuilder::new()
                        .with_header(true)
                        .build(out),
                ),
                schema,
                started: false,
            },
            OutputFormat::Json => Self::Json(ArrayWriter::new(out)),
            OutputFormat::Ndjson => Self::Ndjson(LineDelimitedWriter::new(out)),
        }
    }

    /// Writes (or, for tables, keeps) one batch.
    pub fn write(&mut self, batch: RecordBatch) -> Result<(), ArrowError> {
        match self {
            Self::Table { batches, .. } => batches.push(batch),
            Self::Csv {
                writer, started, ..
            } => {
                writer.write(&batch)?;
                *started = true;
            }
            Self::Json(writer) => writer.write(&batch)?,
            Self::Ndjson(writer) => writer.write(&batch)?,
        }
        Ok(())
    }

    /// Finishes the output (closing brackets, the table itself) and flushes.
    pub fn finish(self) -> Result<(), ArrowError> {
        match self {
            Self::Table {
                mut out,
                schema,
                batches,
            } => {
                if !schema.fields().is_empty() {
                    let table =
                        arrow::util::pretty::pretty_format_batches_with_schema(schema, &batches)?;
                    writeln!(out, "{table}")?;
                }
                out.flush()?;
            }
            Self::Csv {
                mut writer,
                schema,
                started,
            } => {
                if !started && !schema.fields().is_empty() {
                    writer.write(&RecordBatch::new_empty(schema))?;
                }
                writer.into_inner().flush()?;
            }
            Self::Json(mut writer) => {
                writer.finish()?;
                let mut out = writer.into_inner();
                writeln!(out)?;
                out.flush()?;
            }
            Self::Ndjson(mut writer) => {
                writer.finish()?;
                writer.into_inner().flush()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn render(format: OutputFormat, rows: &[i64]) -> String {
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]));
        let mut out = Vec::new();
        let mut writer = ResultWriter::new(format, schema.clone(), &mut out);
        if !rows.is_empty() {
            let batch =
                RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(rows.to_vec()))])
                    .unwrap();
            writer.write(batch).unwrap();
        }
        writer.finish().unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn formats_rows() {
        assert_eq!(render(OutputFormat::Csv, &[1, 2]), "n\n1\n2\n");
        assert_eq!(
            render(OutputFormat::Json, &[1, 2]),
            "[{\"n\":1},{\"n\":2}]\n"
        );
        assert_eq!(render(OutputFormat::Ndjson, &[1]), "{\"n\":1}\n");
        assert!(render(OutputFormat::Table, &[7]).contains("| 7 |"));
    }

    #[test]
    fn empty_results_keep_their_shape() {
        assert_eq!(render(OutputFormat::Csv, &[]), "n\n");
        assert_eq!(render(OutputFormat::Json, &[]), "[]\n");
        assert!(render(OutputFormat::Table, &[]).contains("| n |"));
    }
}
