//! `KeyBloomFilterExpr`: the predicate "this row's key may be in the build side's Bloom filter",
//! one conjunct of a runtime filter's predicate (`KeySummary::predicate`) when the build side held
//! too many distinct keys to list.
//!
//! Invariants: a row whose key columns hash into the filter's bits is `true`, one with a `NULL`
//! key column `false` (such a key joins nothing); it hashes exactly as the filter's builder did
//! (`key_bloom::hash_keys`); it travels in plans through `SluiceCodec` (the filter's bytes, the key
//! columns as the extension node's inputs), and its text names the columns and the filter's size,
//! so a plan decoded on a worker prints as the driver's did.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, BooleanArray, RecordBatch};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::{DataFusionError, Result};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;

use crate::key_bloom::{KeyBloomFilter, has_null, hash_keys};

/// Keeps the rows whose key may be in `filter`; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyBloomFilterExpr {
    keys: Vec<Arc<dyn PhysicalExpr>>,
    filter: Arc<KeyBloomFilter>,
}

impl KeyBloomFilterExpr {
    /// The predicate over the probe's `keys` (pairwise with the build keys `filter` hashed).
    pub fn new(keys: Vec<Arc<dyn PhysicalExpr>>, filter: Arc<KeyBloomFilter>) -> Self {
        Self { keys, filter }
    }

    /// The filter it checks.
    pub fn filter(&self) -> &Arc<KeyBloomFilter> {
        &self.filter
    }
}

impl fmt::Display for KeyBloomFilterExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|k| k.to_string()).collect();
        write!(
            f,
            "({}) IN BLOOM FILTER ({} KiB, {} rows)",
            keys.join(", "),
            self.filter.bytes() / 1024,
            self.filter.rows()
        )
    }
}

impl PhysicalExpr for KeyBloomFilterExpr {
    fn data_type(&self, _input_schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, _input_schema: &Schema) -> Result<bool> {
        Ok(false)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        let rows = batch.num_rows();
        let arrays = self
            .keys
            .iter()
            .map(|k| k.evaluate(batch)?.into_array(rows))
            .collect::<Result<Vec<ArrayRef>>>()?;
        let mut hashes = Vec::new();
        hash_keys(&arrays, rows, &mut hashes)?;
        let nulls = arrays.iter().any(|a| a.null_count() > 0);
        let keep = BooleanBuffer::collect_bool(rows, |i| {
            (!nulls || !has_null(&arrays, i))
                && hashes.get(i).is_some_and(|h| self.filter.contains(*h))
        });
        Ok(ColumnarValue::Array(Arc::new(BooleanArray::new(
            keep, None,
        ))))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        self.keys.iter().collect()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        if children.len() != self.keys.len() {
            return Err(DataFusionError::Internal(format!(
                "a Bloom filter of {} key columns given {} children",
                self.keys.len(),
                children.len()
            )));
        }
        Ok(Arc::new(Self::new(children, Arc::clone(&self.filter))))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use datafusion::arrow::array::{Array, Int64Array};
    use datafusion::arrow::datatypes::Field;
    use datafusion::physical_expr::expressions::Column;

    use super::*;

    #[test]
    fn it_keeps_the_rows_whose_key_was_inserted_and_drops_nulls() {
        let build: ArrayRef = Arc::new(Int64Array::from_iter_values(1000..2000));
        let mut hashes = Vec::new();
        hash_keys(&[build], 1000, &mut hashes).unwrap();
        let mut filter = KeyBloomFilter::for_building();
        hashes.iter().for_each(|h| filter.insert(*h));
        let filter = Arc::new(filter.finish().unwrap());
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let expr = KeyBloomFilterExpr::new(vec![Arc::new(Column::new("k", 0))], filter);
        assert_eq!(expr.to_string(), "(k@0) IN BLOOM FILTER (8 KiB, 1000 rows)");
        let probe = Int64Array::from(vec![Some(5), Some(1000), None, Some(1999), Some(2000)]);
        let batch = RecordBatch::try_new(schema, vec![Arc::new(probe)]).unwrap();
        let keep = expr.evaluate(&batch).unwrap().into_array(5).unwrap();
        let keep = keep.as_any().downcast_ref::<BooleanArray>().unwrap();
        assert_eq!(keep.null_count(), 0);
        assert_eq!(
            keep.iter().map(Option::unwrap).collect::<Vec<_>>(),
            vec![false, true, false, true, false]
        );
    }
}
