//! Key summaries and the predicates built from them: what a runtime filter's source tasks saw of
//! their build keys, merged by the driver into one predicate over the probe keys.
//!
//! ```text
//!   source task 0: KeySummaryBuilder ─► KeySummary {min, max per column; ≤ 256 distinct keys;
//!   source task 1: KeySummaryBuilder ─► KeySummary  a Bloom filter of every key}
//!                                                       │ encode (in TaskMetrics)
//!                                                       ▼
//!   driver: KeySummary::merge(all tasks) ─► predicate: p1 >= min1 AND p1 <= max1
//!                                            [AND p1 IN (..) | AND (p1, ..) IN BLOOM FILTER] …
//! ```
//!
//! Invariants: a summary covers every row of its task's output, or there is none (the builder's
//! `finish` is called only at the end of the output); a key with a `NULL` column is left out, since
//! it matches nothing; a predicate keeps every probe row whose key some summarised build row has
//! (bounds always; an `IN` list when every task listed all of its distinct keys and the union
//! lists at most [`MAX_LISTED_KEYS`]; otherwise the union of the tasks' Bloom filters
//! (`key_bloom`), when every task sent one and it is sparse enough to drop rows).

use std::cmp::Ordering;
use std::collections::HashSet;
use std::io::Cursor;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, RecordBatch};
use datafusion::arrow::datatypes::{Field, Schema, SchemaRef};
use datafusion::arrow::ipc::reader::StreamReader;
use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::config::ConfigOptions;
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::{Accumulator, Operator};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, in_list, lit};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::filter_pushdown::FilterPushdown;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::limit::{GlobalLimitExec, LocalLimitExec};
use sluice_planner::job_graph::runtime_filters::replace_at;

use crate::key_bloom::{KeyBloomFilter, MAX_ROWS as MAX_BLOOM_ROWS, has_null, hash_keys};
use crate::key_bloom_expr::KeyBloomFilterExpr;

/// The most distinct keys a summary lists; beyond, its bounds and Bloom filter stand for them.
pub const MAX_LISTED_KEYS: usize = 256;

/// The most bytes an encoded summary takes in a task's report (see `KeySummary::encode_within`).
pub const MAX_SUMMARY_BYTES: usize = 256 * 1024;

/// The largest share of set bits with which a Bloom filter still goes into a predicate: about 6 %
/// false positives at worst; a fuller one costs its checks and drops little.
pub const MAX_USEFUL_BLOOM_FILL: f64 = 0.7;

/// The largest share of the integers within the bounds that the build rows may hold for a Bloom
/// filter to go into a predicate: keys denser than that (every customer of a table, say) leave the
/// filter next to nothing to drop that the bounds keep.
pub const MAX_BLOOM_DENSITY: f64 = 0.5;

/// What some rows held in their key columns; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct KeySummary {
    /// Per key column, the smallest and largest non-null value (`None`: no key without a `NULL`).
    pub bounds: Vec<Option<(ScalarValue, ScalarValue)>>,
    /// Every distinct key without a `NULL` (one value per column), if there are at most
    /// [`MAX_LISTED_KEYS`] (beyond, the Bloom filter and the bounds stand for them).
    pub keys: Option<Vec<Vec<ScalarValue>>>,
    /// Every key without a `NULL`, hashed into a Bloom filter (`None` from a summary that could
    /// not carry it, see [`KeySummary::encode_within`]).
    pub bloom: Option<KeyBloomFilter>,
}

/// Builds the summary of one task's output, batch by batch.
pub struct KeySummaryBuilder {
    columns: Vec<usize>,
    mins: Vec<MinAccumulator>,
    maxs: Vec<MaxAccumulator>,
    converter: RowConverter,
    /// The distinct keys so far (in the row format); `None` once there were more than
    /// [`MAX_LISTED_KEYS`].
    keys: Option<HashSet<Box<[u8]>>>,
    /// The Bloom filter so far; `None` past `key_bloom::MAX_ROWS` rows.
    bloom: Option<KeyBloomFilter>,
    /// Rows taken in (with `NULL` keys too: the cap does not depend on the batches' order).
    rows: u64,
    hashes: Vec<u64>,
}

impl std::fmt::Debug for KeySummaryBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySummaryBuilder")
            .field("columns", &self.columns)
            .finish_non_exhaustive()
    }
}

impl KeySummaryBuilder {
    /// A builder of `columns` of rows of `schema`.
    pub fn try_new(schema: &SchemaRef, columns: &[usize]) -> Result<Self> {
        let types = columns
            .iter()
            .map(|c| {
                schema
                    .fields()
                    .get(*c)
                    .map(|f| f.data_type().clone())
                    .ok_or_else(|| {
                        DataFusionError::Internal(format!(
                            "a key summary of column {c} of a {}-column output",
                            schema.fields().len()
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            columns: columns.to_vec(),
            mins: types
                .iter()
                .map(MinAccumulator::try_new)
                .collect::<Result<_>>()?,
            maxs: types
                .iter()
                .map(MaxAccumulator::try_new)
                .collect::<Result<_>>()?,
            converter: RowConverter::new(types.into_iter().map(SortField::new).collect())?,
            keys: Some(HashSet::new()),
            bloom: Some(KeyBloomFilter::for_building()),
            rows: 0,
            hashes: Vec::new(),
        })
    }

    /// Takes in one batch.
    pub fn update(&mut self, batch: &RecordBatch) -> Result<()> {
        let arrays: Vec<ArrayRef> = self
            .columns
            .iter()
            .map(|c| Arc::clone(batch.column(*c)))
            .collect();
        for ((array, min), max) in arrays.iter().zip(&mut self.mins).zip(&mut self.maxs) {
            min.update_batch(std::slice::from_ref(array))?;
            max.update_batch(std::slice::from_ref(array))?;
        }
        self.rows = self.rows.saturating_add(batch.num_rows() as u64);
        if let Some(bloom) = &mut self.bloom {
            if self.rows > MAX_BLOOM_ROWS {
                self.bloom = None;
            } else {
                hash_keys(&arrays, batch.num_rows(), &mut self.hashes)?;
                let nulls = arrays.iter().any(|a| a.null_count() > 0);
                for (i, hash) in self.hashes.iter().enumerate() {
                    if !nulls || !has_null(&arrays, i) {
                        bloom.insert(*hash);
                    }
                }
            }
        }
        if let Some(keys) = &mut self.keys {
            let rows = self.converter.convert_columns(&arrays)?;
            for (i, row) in rows.iter().enumerate() {
                if arrays.iter().any(|a| a.is_null(i)) {
                    continue;
                }
                let bytes: &[u8] = row.as_ref();
                if !keys.contains(bytes) {
                    if keys.len() == MAX_LISTED_KEYS {
                        self.keys = None;
                        break;
                    }
                    keys.insert(bytes.into());
                }
            }
        }
        Ok(())
    }

    /// The summary of every batch taken in.
    pub fn finish(mut self) -> Result<KeySummary> {
        let mut bounds = Vec::with_capacity(self.columns.len());
        for (min, max) in self.mins.iter_mut().zip(&mut self.maxs) {
            let (min, max) = (min.evaluate()?, max.evaluate()?);
            bounds.push((!min.is_null() && !max.is_null()).then_some((min, max)));
        }
        let keys = match self.keys {
            Some(keys) => {
                let parser = self.converter.parser();
                let arrays = self
                    .converter
                    .convert_rows(keys.iter().map(|bytes| parser.parse(bytes)))?;
                Some(
                    (0..keys.len())
                        .map(|i| {
                            arrays
                                .iter()
                                .map(|a| ScalarValue::try_from_array(a, i))
                                .collect::<Result<Vec<_>>>()
                        })
                        .collect::<Result<Vec<_>>>()?,
                )
            }
            None => None,
        };
        Ok(KeySummary {
            bounds,
            keys,
            bloom: self.bloom.map(KeyBloomFilter::finish).transpose()?,
        })
    }
}

/// Schema metadata key telling whether the encoded rows after the bounds list every key.
const LISTED: &str = "sluice.keys_listed";

/// The first bytes of an encoded summary.
const MAGIC: &[u8; 4] = b"SKS1";

impl KeySummary {
    /// [`MAGIC`], the length of the bounds and keys (u32, little-endian) and those in Arrow IPC (one
    /// batch, one column per key column; row 0 the minimums, row 1 the maximums, `NULL` where a
    /// column has no bounds, then the listed keys), then the Bloom filter's bytes, if any.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let ipc = self.encode_ipc()?;
        let length = u32::try_from(ipc.len()).map_err(|_| {
            DataFusionError::Internal(format!("a key summary of {} bytes", ipc.len()))
        })?;
        let bloom = self.bloom.as_ref().map(KeyBloomFilter::to_bytes);
        let mut bytes = Vec::with_capacity(8 + ipc.len() + bloom.as_ref().map_or(0, Vec::len));
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&length.to_le_bytes());
        bytes.extend_from_slice(&ipc);
        bytes.extend(bloom.into_iter().flatten());
        Ok(bytes)
    }

    fn encode_ipc(&self) -> Result<Vec<u8>> {
        let columns = self.bounds.len();
        let mut values: Vec<Vec<ScalarValue>> = vec![Vec::new(); columns];
        for (c, bounds) in self.bounds.iter().enumerate() {
            let (min, max) = match bounds {
                Some((min, max)) => (min.clone(), max.clone()),
                None => (ScalarValue::Null, ScalarValue::Null),
            };
            values[c].extend([min, max]);
        }
        for key in self.keys.iter().flatten() {
            for (c, value) in key.iter().enumerate() {
                if let Some(column) = values.get_mut(c) {
                    column.push(value.clone());
                }
            }
        }
        let arrays = values
            .into_iter()
            .enumerate()
            .map(|(c, column)| {
                let data_type = column
                    .iter()
                    .find(|v| !v.is_null())
                    .map(ScalarValue::data_type)
                    .unwrap_or(datafusion::arrow::datatypes::DataType::Null);
                let column = column
                    .into_iter()
                    .map(|v| {
                        if v.is_null() {
                            ScalarValue::try_from(&data_type)
                        } else {
                            Ok(v)
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((format!("k{c}"), ScalarValue::iter_to_array(column)?))
            })
            .collect::<Result<Vec<(String, ArrayRef)>>>()?;
        let fields: Vec<Field> = arrays
            .iter()
            .map(|(name, a)| Field::new(name, a.data_type().clone(), true))
            .collect();
        let metadata = [(LISTED.to_string(), self.keys.is_some().to_string())].into();
        let schema = Arc::new(Schema::new_with_metadata(fields, metadata));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            arrays.into_iter().map(|(_, a)| a).collect(),
        )?;
        let mut bytes = Vec::new();
        let mut writer = StreamWriter::try_new(&mut bytes, &schema)?;
        writer.write(&batch)?;
        writer.finish()?;
        drop(writer);
        Ok(bytes)
    }

    /// A summary [`encode`](Self::encode) wrote.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let malformed = |what: &str| {
            DataFusionError::Internal(format!(
                "a malformed key summary ({} bytes): {what}",
                bytes.len()
            ))
        };
        let (magic, rest) = bytes
            .split_first_chunk::<4>()
            .ok_or_else(|| malformed("no header"))?;
        let (length, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| malformed("no header"))?;
        if magic != MAGIC {
            return Err(malformed("not a key summary"));
        }
        let length =
            usize::try_from(u32::from_le_bytes(*length)).map_err(|_| malformed("too long"))?;
        if rest.len() < length {
            return Err(malformed("cut short"));
        }
        let (ipc, bloom) = rest.split_at(length);
        let bloom = if bloom.is_empty() {
            None
        } else {
            Some(KeyBloomFilter::from_bytes(bloom)?)
        };
        let mut summary = Self::decode_ipc(ipc, &malformed)?;
        summary.bloom = bloom;
        Ok(summary)
    }

    fn decode_ipc(bytes: &[u8], malformed: &dyn Fn(&str) -> DataFusionError) -> Result<Self> {
        let mut reader = StreamReader::try_new(Cursor::new(bytes), None)?;
        let listed = reader.schema().metadata().get(LISTED).map(String::as_str) == Some("true");
        let batch = reader.next().ok_or_else(|| malformed("no batch"))??;
        if batch.num_rows() < 2 {
            return Err(malformed("fewer than two rows"));
        }
        let value = |c: usize, row: usize| ScalarValue::try_from_array(batch.column(c), row);
        let bounds = (0..batch.num_columns())
            .map(|c| {
                let (min, max) = (value(c, 0)?, value(c, 1)?);
                Ok((!min.is_null() && !max.is_null()).then_some((min, max)))
            })
            .collect::<Result<Vec<_>>>()?;
        let keys = if listed {
            Some(
                (2..batch.num_rows())
                    .map(|row| (0..batch.num_columns()).map(|c| value(c, row)).collect())
                    .collect::<Result<Vec<_>>>()?,
            )
        } else {
            None
        };
        Ok(Self {
            bounds,
            keys,
            bloom: None,
        })
    }

    /// [`encode`](Self::encode)d within `max_bytes`: without the listed keys if they do not fit,
    /// then without the Bloom filter too, `None` if even the bounds do not (long strings), which
    /// leaves the filter out.
    pub fn encode_within(&self, max_bytes: usize) -> Result<Option<Vec<u8>>> {
        let fits = |bytes: Vec<u8>| (bytes.len() <= max_bytes).then_some(bytes);
        if let Some(bytes) = fits(self.encode()?) {
            return Ok(Some(bytes));
        }
        let mut smaller = Self {
            bounds: self.bounds.clone(),
            keys: None,
            bloom: self.bloom.clone(),
        };
        if let Some(bytes) = fits(smaller.encode()?) {
            return Ok(Some(bytes));
        }
        smaller.bloom = None;
        Ok(fits(smaller.encode()?))
    }

    /// The Bloom filter its predicate checks: when it lists no keys, the filter is sparse enough
    /// to drop rows ([`MAX_USEFUL_BLOOM_FILL`]), and for integer keys its rows (duplicates
    /// counted, so a build side with repeated keys may look denser than it is) are few against the
    /// integers within the bounds ([`MAX_BLOOM_DENSITY`]).
    pub fn membership_filter(&self) -> Option<&KeyBloomFilter> {
        let bloom = self.bloom.as_ref()?;
        if self.keys.is_some() || bloom.fill() > MAX_USEFUL_BLOOM_FILL {
            return None;
        }
        match self.integer_span() {
            Some(span) if bloom.rows() as f64 > MAX_BLOOM_DENSITY * span => None,
            _ => Some(bloom),
        }
    }

    /// How many keys fit within the bounds when every key column is an integer: the product of
    /// the columns' `max - min + 1`; `None` otherwise.
    fn integer_span(&self) -> Option<f64> {
        self.bounds.iter().try_fold(1.0, |span, bounds| {
            let (min, max) = bounds.as_ref()?;
            if !min.data_type().is_integer() {
                return None;
            }
            Some(span * (min.distance(max)? as f64 + 1.0))
        })
    }

    /// Whether every key this summary saw passes the predicate `applied` made: within its bounds,
    /// if it listed keys each column's value among its listed values, and if it checked a Bloom
    /// filter every key this one hashed in it.
    pub fn covered_by(&self, applied: &KeySummary) -> bool {
        if self.bounds.len() != applied.bounds.len() {
            return false;
        }
        let within = self
            .bounds
            .iter()
            .zip(&applied.bounds)
            .all(|(own, applied)| match (own, applied) {
                (None, _) => true,
                (Some(_), None) => false,
                (Some((min, max)), Some((lo, hi))) => min >= lo && max <= hi,
            });
        let listed = match (&self.keys, &applied.keys) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(own), Some(applied)) => own.iter().all(|key| {
                key.iter()
                    .enumerate()
                    .all(|(c, value)| applied.iter().any(|k| k.get(c) == Some(value)))
            }),
        };
        let hashed = match (applied.membership_filter(), &self.bloom) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(applied), Some(own)) => applied.covers(own),
        };
        within && listed && hashed
    }

    /// The summary of all the rows `summaries` summarised (at least one).
    pub fn merge(summaries: &[KeySummary]) -> Result<Self> {
        let Some(first) = summaries.first() else {
            return Err(DataFusionError::Internal(
                "merging no key summaries".to_string(),
            ));
        };
        let columns = first.bounds.len();
        if summaries.iter().any(|s| s.bounds.len() != columns) {
            return Err(DataFusionError::Internal(
                "merging key summaries of different key columns".to_string(),
            ));
        }
        let mut bounds = Vec::with_capacity(columns);
        for c in 0..columns {
            let mut merged: Option<(ScalarValue, ScalarValue)> = None;
            for (min, max) in summaries.iter().filter_map(|s| s.bounds[c].as_ref()) {
                merged = Some(match merged {
                    None => (min.clone(), max.clone()),
                    Some((lo, hi)) => (
                        if min < &lo { min.clone() } else { lo },
                        if max > &hi { max.clone() } else { hi },
                    ),
                });
            }
            bounds.push(merged);
        }
        let mut keys: Option<HashSet<Vec<ScalarValue>>> = Some(HashSet::new());
        for summary in summaries {
            match (&mut keys, &summary.keys) {
                (Some(all), Some(listed)) => {
                    all.extend(listed.iter().cloned());
                    if all.len() > MAX_LISTED_KEYS {
                        keys = None;
                    }
                }
                _ => keys = None,
            }
        }
        let bloom = match summaries
            .iter()
            .map(|s| s.bloom.as_ref())
            .collect::<Option<Vec<_>>>()
        {
            Some(filters) => Some(KeyBloomFilter::union(filters)?),
            None => None,
        };
        Ok(Self {
            bounds,
            bloom,
            keys: keys.map(|k| {
                let mut keys: Vec<Vec<ScalarValue>> = k.into_iter().collect();
                keys.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
                keys
            }),
        })
    }

    /// The predicate keeping the rows of `schema` whose `columns` (pairwise with the summarised
    /// ones) hold a summarised key: `false` when there was none.
    pub fn predicate(&self, schema: &Schema, columns: &[usize]) -> Result<Arc<dyn PhysicalExpr>> {
        if columns.len() != self.bounds.len() {
            return Err(DataFusionError::Internal(format!(
                "a key summary of {} columns filters {} columns",
                self.bounds.len(),
                columns.len()
            )));
        }
        let mut conjuncts: Vec<Arc<dyn PhysicalExpr>> = Vec::new();
        for (c, (&index, bounds)) in columns.iter().zip(&self.bounds).enumerate() {
            let Some((min, max)) = bounds else {
                return Ok(lit(false));
            };
            let (field, column) = key_column(schema, index)?;
            if field.data_type() != &min.data_type() {
                return Err(DataFusionError::Internal(format!(
                    "a runtime filter compares {} ({}) with keys of type {}",
                    field.name(),
                    field.data_type(),
                    min.data_type()
                )));
            }
            let compare = |op, value: &ScalarValue| -> Arc<dyn PhysicalExpr> {
                Arc::new(BinaryExpr::new(Arc::clone(&column), op, lit(value.clone())))
            };
            if let Some(keys) = &self.keys {
                let mut values: Vec<&ScalarValue> = keys.iter().filter_map(|k| k.get(c)).collect();
                values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
                values.dedup();
                if let [only] = values.as_slice() {
                    // The listed value, not the minimum: the bounds also count build rows whose
                    // key has a `NULL` in another column, which the list leaves out.
                    conjuncts.push(compare(Operator::Eq, only));
                    continue;
                }
                conjuncts.push(compare(Operator::GtEq, min));
                conjuncts.push(compare(Operator::LtEq, max));
                let list = values.into_iter().map(|v| lit(v.clone())).collect();
                conjuncts.push(in_list(Arc::clone(&column), list, &false, schema)?);
            } else {
                conjuncts.push(compare(Operator::GtEq, min));
                conjuncts.push(compare(Operator::LtEq, max));
            }
        }
        if let Some(bloom) = self.membership_filter() {
            let keys = columns
                .iter()
                .map(|&index| key_column(schema, index).map(|(_, column)| column))
                .collect::<Result<Vec<_>>>()?;
            conjuncts.push(Arc::new(KeyBloomFilterExpr::new(
                keys,
                Arc::new(bloom.clone()),
            )));
        }
        Ok(conjuncts
            .into_iter()
            .reduce(|a, b| Arc::new(BinaryExpr::new(a, Operator::And, b)))
            .unwrap_or_else(|| lit(true)))
    }
}

/// The field at `index` of `schema` and the column naming it: one key of a runtime filter (a
/// predicate's columns and a filter's children are made here alike, so they compare equal).
pub(crate) fn key_column(schema: &Schema, index: usize) -> Result<(&Field, Arc<dyn PhysicalExpr>)> {
    let field = schema.fields().get(index).ok_or_else(|| {
        DataFusionError::Internal(format!(
            "a runtime filter on column {index} of a {}-column plan",
            schema.fields().len()
        ))
    })?;
    Ok((field.as_ref(), Arc::new(Column::new(field.name(), index))))
}

/// `plan` with a `FilterExec` of `predicate` on top of the node at `path` (child indices from the
/// root), pushed down within that node's subtree (DataFusion's `FilterPushdown`: a Parquet scan
/// prunes files, row groups and pages with it).
///
/// DataFusion runs its filter pushdown before limits are pushed into plans: past a node with a
/// limit it could filter rows before the limit counts them, so such a subtree keeps the filter on
/// top, which is always right.
pub(crate) fn filter_at(
    plan: Arc<dyn ExecutionPlan>,
    path: &[usize],
    predicate: &Arc<dyn PhysicalExpr>,
    options: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    replace_at(plan, path, &mut |node| {
        let filtered: Arc<dyn ExecutionPlan> =
            Arc::new(FilterExec::try_new(Arc::clone(predicate), node)?);
        if has_limit(&filtered) {
            Ok(filtered)
        } else {
            FilterPushdown::new().optimize(filtered, options)
        }
    })
}

/// Whether a node of `plan` limits its rows (a fetch or a limit node).
fn has_limit(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.fetch().is_some()
        || plan.downcast_ref::<GlobalLimitExec>().is_some()
        || plan.downcast_ref::<LocalLimitExec>().is_some()
        || plan.children().into_iter().any(has_limit)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use datafusion::arrow::array::{Int64Array, StringArray};
    use datafusion::arrow::datatypes::DataType;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]))
    }

    fn batch(keys: Vec<Option<i64>>, names: Vec<Option<&str>>) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(StringArray::from(names)),
            ],
        )
        .unwrap()
    }

    fn summary_of(batches: &[RecordBatch], columns: &[usize]) -> KeySummary {
        let mut builder = KeySummaryBuilder::try_new(&schema(), columns).unwrap();
        for b in batches {
            builder.update(b).unwrap();
        }
        builder.finish().unwrap()
    }

    #[test]
    fn a_summary_has_bounds_and_distinct_keys_without_nulls_and_survives_encoding() {
        let summary = summary_of(
            &[
                batch(
                    vec![Some(5), None, Some(3)],
                    vec![Some("b"), Some("z"), Some("a")],
                ),
                batch(vec![Some(5), Some(9)], vec![Some("b"), None]),
            ],
            &[0, 1],
        );
        assert_eq!(
            summary.bounds,
            vec![
                Some((ScalarValue::Int64(Some(3)), ScalarValue::Int64(Some(9)))),
                Some((ScalarValue::from("a"), ScalarValue::from("z"))),
            ]
        );
        let mut keys = summary.keys.clone().unwrap();
        keys.sort_by(|a, b| a.partial_cmp(b).unwrap());
        // (NULL, "z") and (9, NULL) match nothing; (5, "b") twice is one key.
        assert_eq!(
            keys,
            vec![
                vec![ScalarValue::Int64(Some(3)), ScalarValue::from("a")],
                vec![ScalarValue::Int64(Some(5)), ScalarValue::from("b")],
            ]
        );
        let back = KeySummary::decode(&summary.encode().unwrap()).unwrap();
        assert_eq!(back.bounds, summary.bounds);
        let mut back_keys = back.keys.unwrap();
        back_keys.sort_by(|a, b| a.partial_cmp(b).unwrap());
        assert_eq!(back_keys, keys);
    }

    #[test]
    fn more_distinct_keys_than_listed_keep_bounds_and_a_bloom_filter() {
        let many: Vec<Option<i64>> = (0..=MAX_LISTED_KEYS as i64).map(Some).collect();
        let names = vec![Some("x"); many.len()];
        let summary = summary_of(&[batch(many, names)], &[0]);
        assert_eq!(summary.keys, None);
        let bloom = summary.bloom.as_ref().unwrap();
        assert_eq!((bloom.rows(), bloom.bytes()), (257, 8192));
        assert_eq!(
            summary.bounds,
            vec![Some((
                ScalarValue::Int64(Some(0)),
                ScalarValue::Int64(Some(MAX_LISTED_KEYS as i64))
            ))]
        );
        let back = KeySummary::decode(&summary.encode().unwrap()).unwrap();
        assert_eq!(back, summary);
    }

    #[test]
    fn merged_summaries_widen_the_bounds_and_list_keys_only_if_every_task_did() {
        let a = summary_of(&[batch(vec![Some(4), Some(7)], vec![None, None])], &[0]);
        let b = summary_of(&[batch(vec![Some(2), Some(4)], vec![None, None])], &[0]);
        let empty = summary_of(&[batch(vec![None], vec![None])], &[0]);
        let merged = KeySummary::merge(&[a.clone(), b.clone(), empty.clone()]).unwrap();
        assert_eq!(
            merged.bounds,
            vec![Some((
                ScalarValue::Int64(Some(2)),
                ScalarValue::Int64(Some(7))
            ))]
        );
        assert_eq!(
            merged.keys,
            Some(vec![
                vec![ScalarValue::Int64(Some(2))],
                vec![ScalarValue::Int64(Some(4))],
                vec![ScalarValue::Int64(Some(7))],
            ])
        );
        let unlisted = KeySummary {
            keys: None,
            ..b.clone()
        };
        assert_eq!(KeySummary::merge(&[a, unlisted]).unwrap().keys, None);
        assert_eq!(KeySummary::merge(&[empty]).unwrap().bounds, vec![None]);
    }

    #[test]
    fn a_column_with_one_listed_value_is_compared_with_that_value_not_its_minimum() {
        // (1, NULL) matches nothing, so only (5, "x") is listed, but column k's bounds are 1..5.
        let summary = summary_of(
            &[batch(vec![Some(1), Some(5)], vec![None, Some("x")])],
            &[0, 1],
        );
        let predicate = summary.predicate(&schema(), &[0, 1]).unwrap();
        assert_eq!(predicate.to_string(), "k@0 = 5 AND s@1 = x");
        let probe = batch(vec![Some(5), Some(1)], vec![Some("x"), Some("x")]);
        let kept = predicate.evaluate(&probe).unwrap().into_array(2).unwrap();
        let kept = datafusion::arrow::array::as_boolean_array(&kept);
        assert_eq!((kept.value(0), kept.value(1)), (true, false));
    }

    #[test]
    fn a_rerun_is_covered_only_by_a_filter_that_keeps_all_of_its_keys() {
        let applied = summary_of(&[batch(vec![Some(2), Some(40)], vec![None, None])], &[0]);
        let same = summary_of(&[batch(vec![Some(40)], vec![None])], &[0]);
        let other = summary_of(&[batch(vec![Some(3)], vec![None])], &[0]);
        let wider = summary_of(&[batch(vec![Some(99)], vec![None])], &[0]);
        let empty = summary_of(&[batch(vec![None], vec![None])], &[0]);
        assert!(same.covered_by(&applied));
        assert!(empty.covered_by(&applied));
        // Within the bounds but not listed: the IN list would have dropped its matches.
        assert!(!other.covered_by(&applied));
        assert!(!wider.covered_by(&applied));
        let bounds_only = KeySummary {
            keys: None,
            bloom: None,
            ..applied.clone()
        };
        assert!(other.covered_by(&bounds_only));
        assert!(!wider.covered_by(&bounds_only));
        // Not listed but hashed: the Bloom filter drops 3.
        let hashed = KeySummary {
            keys: None,
            ..applied.clone()
        };
        assert!(same.covered_by(&hashed));
        assert!(empty.covered_by(&hashed));
        assert!(!other.covered_by(&hashed));
        let unhashed_rerun = KeySummary {
            bloom: None,
            ..same.clone()
        };
        assert!(!unhashed_rerun.covered_by(&hashed));
    }

    #[test]
    fn a_summary_too_large_for_a_report_drops_its_keys_then_itself() {
        let names: Vec<String> = (0..200).map(|i| format!("{i:0>1000}")).collect();
        let summary = summary_of(
            &[batch(
                (0..200).map(Some).collect(),
                names.iter().map(|n| Some(n.as_str())).collect(),
            )],
            &[1],
        );
        assert_eq!(summary.keys.as_ref().map(Vec::len), Some(200));
        // Without its keys it fits in 16 KiB with its Bloom filter (8 KiB); in 8 KiB with neither.
        let capped = summary.encode_within(16 * 1024).unwrap().unwrap();
        let back = KeySummary::decode(&capped).unwrap();
        assert_eq!(
            (back.keys, back.bounds, back.bloom),
            (None, summary.bounds.clone(), summary.bloom.clone())
        );
        let capped = summary.encode_within(8 * 1024).unwrap().unwrap();
        let back = KeySummary::decode(&capped).unwrap();
        assert_eq!(
            (back.keys, back.bounds, back.bloom),
            (None, summary.bounds.clone(), None)
        );
        assert_eq!(summary.encode_within(1000).unwrap(), None);
        assert!(summary.encode_within(MAX_SUMMARY_BYTES).unwrap().is_some());
    }

    #[test]
    fn the_predicate_keeps_exactly_the_summarised_keys() {
        let summary = summary_of(
            &[batch(
                vec![Some(3), Some(9), Some(5)],
                vec![None, None, None],
            )],
            &[0],
        );
        let probe = Schema::new(vec![
            Field::new("x", DataType::Utf8, true),
            Field::new("p", DataType::Int64, true),
        ]);
        let predicate = summary.predicate(&probe, &[1]).unwrap();
        assert_eq!(
            predicate.to_string(),
            "p@1 >= 3 AND p@1 <= 9 AND p@1 IN (SET) ([3, 5, 9])"
        );
        let rows = RecordBatch::try_new(
            Arc::new(probe.clone()),
            vec![
                Arc::new(StringArray::from(vec![None::<&str>; 5])),
                Arc::new(Int64Array::from(vec![
                    Some(3),
                    Some(4),
                    None,
                    Some(9),
                    Some(10),
                ])),
            ],
        )
        .unwrap();
        let kept = predicate.evaluate(&rows).unwrap().into_array(5).unwrap();
        let kept = datafusion::arrow::array::as_boolean_array(&kept);
        let kept: Vec<bool> = (0..5).map(|i| kept.is_valid(i) && kept.value(i)).collect();
        assert_eq!(kept, [true, false, false, true, false]);

        let bounds_only = KeySummary {
            keys: None,
            bloom: None,
            ..summary.clone()
        };
        assert_eq!(
            bounds_only.predicate(&probe, &[1]).unwrap().to_string(),
            "p@1 >= 3 AND p@1 <= 9"
        );
        let nothing = summary_of(&[batch(vec![None], vec![None])], &[0]);
        assert_eq!(
            nothing.predicate(&probe, &[1]).unwrap().to_string(),
            "false"
        );
        let error = summary.predicate(&probe, &[0]).unwrap_err().to_string();
        assert!(
            error.contains("compares x (Utf8) with keys of type Int64"),
            "{error}"
        );
    }

    fn int_keys(keys: impl Iterator<Item = i64>) -> RecordBatch {
        let keys: Vec<Option<i64>> = keys.map(Some).collect();
        let names = vec![None; keys.len()];
        batch(keys, names)
    }

    fn kept_keys(predicate: &Arc<dyn PhysicalExpr>, probe: std::ops::Range<i64>) -> Vec<i64> {
        let rows = int_keys(probe.clone());
        let kept = predicate
            .evaluate(&rows)
            .unwrap()
            .into_array(rows.num_rows())
            .unwrap();
        let kept = datafusion::arrow::array::as_boolean_array(&kept);
        probe
            .zip(kept.iter())
            .filter_map(|(key, keep)| (keep == Some(true)).then_some(key))
            .collect()
    }

    #[test]
    fn more_keys_than_listed_filter_by_the_union_of_the_tasks_bloom_filters() {
        // Two tasks' multiples of 3, 600 in all: too many to list, so their Bloom filters (8 KiB
        // each, 300 rows) are OR-ed, and the predicate drops every other key within the bounds.
        let a = summary_of(&[int_keys((0..900).step_by(3))], &[0]);
        let b = summary_of(&[int_keys((900..1800).step_by(3))], &[0]);
        let merged = KeySummary::merge(&[a, b]).unwrap();
        assert_eq!(merged.keys, None);
        let merged = KeySummary::decode(&merged.encode().unwrap()).unwrap();
        let predicate = merged.predicate(&schema(), &[0]).unwrap();
        assert_eq!(
            predicate.to_string(),
            "k@0 >= 0 AND k@0 <= 1797 AND (k@0) IN BLOOM FILTER (8 KiB, 600 rows)"
        );
        assert_eq!(
            kept_keys(&predicate, -10..1900),
            (0..1800).step_by(3).collect::<Vec<i64>>()
        );
    }

    #[test]
    fn a_key_of_two_columns_filters_by_the_bloom_filter_of_both() {
        // 300 keys (k, s) = (i, "n{i % 2}"): a probe row matches only with the same pair.
        let names: Vec<String> = (0..600).map(|i| format!("n{}", i % 2)).collect();
        let build = |range: std::ops::Range<usize>| {
            batch(
                range.clone().map(|i| Some(i as i64 * 10)).collect(),
                range.map(|i| Some(names[i].as_str())).collect(),
            )
        };
        let a = summary_of(&[build(0..150)], &[0, 1]);
        let b = summary_of(&[build(150..300)], &[0, 1]);
        let merged = KeySummary::merge(&[a, b]).unwrap();
        let predicate = merged.predicate(&schema(), &[0, 1]).unwrap();
        assert_eq!(
            predicate.to_string(),
            "k@0 >= 0 AND k@0 <= 2990 AND s@1 >= n0 AND s@1 <= n1 AND (k@0, s@1) IN BLOOM FILTER \
             (8 KiB, 300 rows)"
        );
        // Every pair of k in 0..3000 and s in {n0, n1, n2}: only the 300 built pairs pass.
        let probe: Vec<(i64, String)> = (0..3000)
            .flat_map(|k| ["n0", "n1", "n2"].map(|s| (k, s.to_string())))
            .collect();
        let rows = batch(
            probe.iter().map(|(k, _)| Some(*k)).collect(),
            probe.iter().map(|(_, s)| Some(s.as_str())).collect(),
        );
        let kept = predicate
            .evaluate(&rows)
            .unwrap()
            .into_array(rows.num_rows())
            .unwrap();
        let kept = datafusion::arrow::array::as_boolean_array(&kept);
        let kept: Vec<(i64, String)> = probe
            .into_iter()
            .zip(kept.iter())
            .filter_map(|(row, keep)| (keep == Some(true)).then_some(row))
            .collect();
        let built: Vec<(i64, String)> = (0..300)
            .map(|i| (i as i64 * 10, format!("n{}", i % 2)))
            .collect();
        assert_eq!(kept, built);
    }

    #[test]
    fn integer_keys_dense_within_their_bounds_filter_by_the_bounds_only() {
        // 600 of the 1,000 integers within the bounds: over half of them.
        let dense = summary_of(&[int_keys(0..300), int_keys(700..1000)], &[0]);
        assert_eq!(dense.bloom.as_ref().map(KeyBloomFilter::rows), Some(600));
        assert_eq!(dense.membership_filter(), None);
        assert_eq!(
            dense.predicate(&schema(), &[0]).unwrap().to_string(),
            "k@0 >= 0 AND k@0 <= 999"
        );
        // 300 of the 1,000: the filter goes in.
        let sparse = summary_of(&[int_keys(0..150), int_keys(850..1000)], &[0]);
        assert!(sparse.membership_filter().is_some());
        // Strings have no density: the filter goes in.
        let names: Vec<String> = (0..600).map(|i| format!("{i:04}")).collect();
        let strings = summary_of(
            &[batch(
                vec![None; 600],
                names.iter().map(|n| Some(n.as_str())).collect(),
            )],
            &[1],
        );
        assert!(strings.membership_filter().is_some());
    }

    #[test]
    fn a_build_side_of_more_rows_than_a_bloom_filter_takes_has_none() {
        let most = summary_of(&[int_keys(0..MAX_BLOOM_ROWS as i64)], &[0]);
        assert_eq!(
            most.bloom.as_ref().map(KeyBloomFilter::rows),
            Some(MAX_BLOOM_ROWS)
        );
        let more = summary_of(
            &[
                int_keys(0..100_000),
                int_keys(100_000..MAX_BLOOM_ROWS as i64 + 1),
            ],
            &[0],
        );
        assert_eq!((more.keys, more.bloom), (None, None));
    }

    #[test]
    fn a_bloom_filter_too_full_to_drop_rows_stays_out_of_the_predicate() {
        // 60,000 keys (sparse in their bounds) folded into the 8 KiB of a task that saw 3: nearly
        // every bit is set.
        let large = summary_of(&[int_keys((0..60_000).map(|k| k * 10))], &[0]);
        let small = summary_of(&[int_keys(0..3)], &[0]);
        let merged = KeySummary::merge(&[large, small]).unwrap();
        let bloom = merged.bloom.as_ref().unwrap();
        assert_eq!(bloom.bytes(), 8192);
        assert!(bloom.fill() > MAX_USEFUL_BLOOM_FILL, "{}", bloom.fill());
        assert_eq!(merged.membership_filter(), None);
        assert_eq!(
            merged.predicate(&schema(), &[0]).unwrap().to_string(),
            "k@0 >= 0 AND k@0 <= 599990"
        );
    }

    #[test]
    fn a_malformed_summary_is_an_error_naming_what_is_wrong() {
        let summary = summary_of(&[int_keys(0..10)], &[0]);
        let bytes = summary.encode().unwrap();
        for (bad, what) in [
            (&bytes[..3], "no header"),
            (&bytes[..20], "cut short"),
            (&b"PAR1\0\0\0\0"[..], "not a key summary"),
        ] {
            let err = KeySummary::decode(bad).unwrap_err().to_string();
            assert!(
                err.contains(&format!(
                    "a malformed key summary ({} bytes): {what}",
                    bad.len()
                )),
                "{err}"
            );
        }
        let err = KeySummary::decode(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("a malformed Bloom filter"), "{err}");
    }
}
