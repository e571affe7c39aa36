//! Turning result batches into sqllogictest cells, the way DataFusion's own runner does, so that the
//! expected output in DataFusion's `.slt` files applies unchanged.
//!
//! Conventions: NULL prints `NULL`; an empty string prints `(empty)` and trailing newlines of strings are
//! dropped; floats print as the shortest decimal, rounded to 12 fractional digits, trailing zeros removed
//! (`NaN`, `Infinity`, `-Infinity` for the special values); decimals print their value without trailing
//! zeros; a last cell that spans several lines becomes extra rows numbered `01)`, `02)`, … with leading
//! spaces turned into `-`; everything else uses Arrow's display with DataFusion's default format options.
//! Column types: `I` integers, `R` floats and decimals, `T` strings, `B` booleans, `D` dates and times,
//! `P` timestamps, `?` anything else.

use std::str::FromStr;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{
    DataType, Decimal32Type, Decimal64Type, Decimal128Type, Decimal256Type, DecimalType, Fields,
    Float16Type, Float32Type, Float64Type,
};
use arrow::error::ArrowError;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use bigdecimal::BigDecimal;
use sqllogictest::ColumnType;

/// The column type letters of sqllogictest, as DataFusion's files use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SltColumnType {
    /// `B`
    Boolean,
    /// `D`: dates and times of day.
    DateTime,
    /// `I`
    Integer,
    /// `R`: floats and decimals.
    Float,
    /// `T`
    Text,
    /// `P`
    Timestamp,
    /// `?`
    Another,
}

impl ColumnType for SltColumnType {
    fn from_char(value: char) -> Option<Self> {
        Some(match value {
            'B' => Self::Boolean,
            'D' => Self::DateTime,
            'I' => Self::Integer,
            'R' => Self::Float,
            'T' => Self::Text,
            'P' => Self::Timestamp,
            _ => Self::Another,
        })
    }

    fn to_char(&self) -> char {
        match self {
            Self::Boolean => 'B',
            Self::DateTime => 'D',
            Self::Integer => 'I',
            Self::Float => 'R',
            Self::Text => 'T',
            Self::Timestamp => 'P',
            Self::Another => '?',
        }
    }
}

fn is_string(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

/// The sqllogictest type of an Arrow type.
pub fn column_type(data_type: &DataType) -> SltColumnType {
    match data_type {
        DataType::Boolean => SltColumnType::Boolean,
        t if t.is_integer() => SltColumnType::Integer,
        DataType::Float16 | DataType::Float32 | DataType::Float64 => SltColumnType::Float,
        DataType::Decimal32(..)
        | DataType::Decimal64(..)
        | DataType::Decimal128(..)
        | DataType::Decimal256(..) => SltColumnType::Float,
        t if is_string(t) => SltColumnType::Text,
        DataType::Date32 | DataType::Date64 | DataType::Time32(_) | DataType::Time64(_) => {
            SltColumnType::DateTime
        }
        DataType::Timestamp(..) => SltColumnType::Timestamp,
        DataType::Dictionary(key, value) if key.is_integer() && is_string(value) => {
            SltColumnType::Text
        }
        _ => SltColumnType::Another,
    }
}

/// The sqllogictest types of a schema's fields.
pub fn column_types(fields: &Fields) -> Vec<SltColumnType> {
    fields.iter().map(|f| column_type(f.data_type())).collect()
}

/// Rounds a plain decimal string to `digits` fractional digits and drops trailing zeros.
fn decimal_text(text: &str, digits: i64) -> Result<String, ArrowError> {
    let value = BigDecimal::from_str(text)
        .map_err(|e| ArrowError::ComputeError(format!("cannot format number '{text}': {e}")))?;
    Ok(value.round(digits).normalized().to_plain_string())
}

fn float_text(value: f64, shortest: String) -> Result<String, ArrowError> {
    if value.is_nan() {
        Ok("NaN".into())
    } else if value.is_infinite() {
        Ok(if value > 0.0 { "Infinity" } else { "-Infinity" }.into())
    } else {
        decimal_text(&shortest, 12)
    }
}

fn decimal_cell<T: DecimalType>(
    array: &dyn Array,
    row: usize,
    scale: i8,
) -> Result<String, ArrowError> {
    let value = array.as_primitive::<T>().value(row);
    decimal_text(&T::format_decimal(value, u8::MAX, scale), i64::from(scale))
}

fn string_cell(value: &str) -> String {
    if value.is_empty() {
        "(empty)".into()
    } else {
        value.trim_end_matches('\n').replace('\u{0}', "\\0")
    }
}

/// One cell as text.
pub fn cell_text(column: &ArrayRef, row: usize) -> Result<String, ArrowError> {
    if column.is_null(row) {
        return Ok("NULL".into());
    }
    match column.data_type() {
        DataType::Null => Ok("NULL".into()),
        DataType::Boolean => Ok(column.as_boolean().value(row).to_string()),
        DataType::Float16 => {
            let value = column.as_primitive::<Float16Type>().value(row);
            float_text(value.to_f64(), value.to_string())
        }
        DataType::Float32 => {
            let value = column.as_primitive::<Float32Type>().value(row);
            float_text(f64::from(value), value.to_string())
        }
        DataType::Float64 => {
            let value = column.as_primitive::<Float64Type>().value(row);
            float_text(value, value.to_string())
        }
        DataType::Decimal32(_, scale) => decimal_cell::<Decimal32Type>(column, row, *scale),
        DataType::Decimal64(_, scale) => decimal_cell::<Decimal64Type>(column, row, *scale),
        DataType::Decimal128(_, scale) => decimal_cell::<Decimal128Type>(column, row, *scale),
        DataType::Decimal256(_, scale) => decimal_cell::<Decimal256Type>(column, row, *scale),
        DataType::Utf8 => Ok(string_cell(column.as_string::<i32>().value(row))),
        DataType::LargeUtf8 => Ok(string_cell(column.as_string::<i64>().value(row))),
        DataType::Utf8View => Ok(string_cell(column.as_string_view().value(row))),
        DataType::Dictionary(..) => {
            let dictionary = column.as_any_dictionary();
            let key = dictionary.normalized_keys()[row];
            cell_text(dictionary.values(), key)
        }
        _ => {
            // DataFusion's default display options, with NULL spelled out.
            let options = datafusion::config::FormatOptions {
                null: "NULL".into(),
                ..Default::default()
            };
            let options: FormatOptions<'_> = (&options)
                .try_into()
                .map_err(|e| ArrowError::ComputeError(format!("display options: {e}")))?;
            Ok(ArrayFormatter::try_new(column.as_ref(), &options)?
                .value(row)
                .to_string())
        }
    }
}

/// A last cell with line breaks becomes one extra row per line, numbered, indentation shown as `-`.
fn expand_multiline(mut row: Vec<String>) -> Vec<Vec<String>> {
    let Some(last) = row.last() else {
        return vec![row];
    };
    if !last.contains('\n') {
        return vec![row];
    }
    let last = row.pop().unwrap_or_default();
    let mut rows = vec![row];
    for (index, line) in last.split('\n').enumerate() {
        let content = line.trim_start();
        let indent = "-".repeat(line.len() - content.len());
        rows.push(vec![format!("{:02}){indent}{content}", index + 1)]);
    }
    rows
}

/// All rows of `batches` as cells.
pub fn batch_rows(batches: &[RecordBatch]) -> Result<Vec<Vec<String>>, ArrowError> {
    let mut rows = Vec::new();
    for batch in batches {
        for row in 0..batch.num_rows() {
            let cells = batch
                .columns()
                .iter()
                .map(|column| cell_text(column, row))
                .collect::<Result<Vec<_>, _>>()?;
            rows.extend(expand_multiline(cells));
        }
    }
    Ok(rows)
}

/// Compares result rows with the expected lines: each row's cells joined by one space, trailing blanks
/// ignored on both sides. `<slt:ignore>` in the expected text matches anything.
pub fn rows_match(actual: &[Vec<String>], expected: &[String]) -> bool {
    const IGNORE: &str = "<slt:ignore>";
    let expected: Vec<&str> = expected.iter().map(|line| line.trim_end()).collect();
    let actual: Vec<String> = actual
        .iter()
        .map(|row| row.join(" ").trim_end().to_string())
        .collect();
    if !expected.iter().any(|line| line.contains(IGNORE)) {
        return actual == expected;
    }
    let expected = expected.join("\n");
    let actual = actual.join("\n");
    let mut position = 0;
    let fragments: Vec<&str> = expected.split(IGNORE).collect();
    for (index, fragment) in fragments.iter().enumerate() {
        if fragment.is_empty() {
            continue;
        }
        if index == 0 {
            if !actual.starts_with(fragment) {
                return false;
            }
            position = fragment.len();
        } else if let Some(found) = actual[position..].find(fragment) {
            position += found + fragment.len();
        } else {
            return false;
        }
    }
    fragments.last().is_some_and(|f| f.is_empty()) || position == actual.len()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{
        BooleanArray, Date32Array, Decimal128Array, DictionaryArray, Float64Array, StringArray,
    };
    use arrow::datatypes::Int8Type;

    use super::*;

    fn cells(column: ArrayRef) -> Vec<String> {
        (0..column.len())
            .map(|row| cell_text(&column, row).unwrap())
            .collect()
    }

    #[test]
    fn floats_round_to_twelve_digits() {
        let column = Arc::new(Float64Array::from(vec![
            Some(1.0),
            Some(0.1 + 0.2),
            Some(-2.5),
            Some(f64::NAN),
            Some(f64::NEG_INFINITY),
            None,
            Some(1e21),
        ]));
        assert_eq!(
            cells(column),
            vec![
                "1",
                "0.3",
                "-2.5",
                "NaN",
                "-Infinity",
                "NULL",
                "1000000000000000000000"
            ]
        );
    }

    #[test]
    fn decimals_drop_trailing_zeros() {
        let column = Arc::new(
            Decimal128Array::from(vec![150, -5, 0])
                .with_precision_and_scale(10, 2)
                .unwrap(),
        );
        assert_eq!(cells(column), vec!["1.5", "-0.05", "0"]);
    }

    #[test]
    fn strings_booleans_and_dictionaries() {
        let strings = Arc::new(StringArray::from(vec![Some(""), Some("a\n"), None]));
        assert_eq!(cells(strings), vec!["(empty)", "a", "NULL"]);
        let booleans = Arc::new(BooleanArray::from(vec![true, false]));
        assert_eq!(cells(booleans), vec!["true", "false"]);
        let dictionary: DictionaryArray<Int8Type> = vec!["x", "y", "x"].into_iter().collect();
        assert_eq!(cells(Arc::new(dictionary)), vec!["x", "y", "x"]);
        let dates = Arc::new(Date32Array::from(vec![0]));
        assert_eq!(cells(dates), vec!["1970-01-01"]);
    }

    #[test]
    fn column_types_follow_datafusion() {
        assert_eq!(column_type(&DataType::Int64), SltColumnType::Integer);
        assert_eq!(
            column_type(&DataType::Decimal128(5, 2)),
            SltColumnType::Float
        );
        assert_eq!(column_type(&DataType::Utf8View), SltColumnType::Text);
        assert_eq!(
            column_type(&DataType::List(Arc::new(arrow::datatypes::Field::new(
                "item",
                DataType::Int32,
                true
            )))),
            SltColumnType::Another
        );
    }

    #[test]
    fn multiline_cells_expand() {
        let rows = expand_multiline(vec!["plan".into(), "A\n  B".into()]);
        assert_eq!(
            rows,
            vec![
                vec!["plan".to_string()],
                vec!["01)A".into()],
                vec!["02)--B".into()]
            ]
        );
    }

    #[test]
    fn matching_ignores_trailing_blanks_and_honours_ignore_markers() {
        let actual = vec![vec!["1".to_string(), "a".to_string()]];
        assert!(rows_match(&actual, &["1 a  ".to_string()]));
        assert!(!rows_match(&actual, &["1 b".to_string()]));
        let actual = vec![vec!["metrics=[rows=5, time=3ms]".to_string()]];
        assert!(rows_match(
            &actual,
            &["metrics=[rows=5, <slt:ignore>]".to_string()]
        ));
        assert!(!rows_match(
            &actual,
            &["metrics=[rows=6, <slt:ignore>]".to_string()]
        ));
    }
}
