//! A Bloom filter of join keys: the membership part of a runtime filter whose build side held more
//! distinct keys than a summary lists (`runtime_filter::MAX_LISTED_KEYS`).
//!
//! ```text
//!   source task i: key columns ─► create_hashes (fixed seed) ─► set 8 bits in one 256-bit block
//!                  finish: fold to a size for its row count (≥ MIN_BLOCKS)
//!   driver:        union = fold every task's filter to the smallest, OR the blocks
//!   target task:   key columns ─► the same hashes ─► keep a row iff its 8 bits are all set
//! ```
//!
//! The layout is the split-block filter of the Parquet specification (eight 32-bit words per block,
//! one bit per word chosen by multiplying the hash's low half by a fixed odd constant); a hash's
//! block is its high half masked to the block count, a power of two, so a filter halves by OR-ing
//! its two halves and keeps every key it held ("folding").
//!
//! Invariants: no false negatives (every inserted key passes, after any folding and union); hashes
//! are DataFusion's `create_hashes` with one fixed seed, so every process of one build agrees, and
//! a build key and a probe key of the same type and value hash alike, as a hash join's own table
//! needs; a filter's block count is a power of two between 1 and [`MAX_BLOCKS`].

use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::common::hash_utils::{RandomState, create_hashes};
use datafusion::common::{DataFusionError, Result};

/// The blocks a filter starts with while it is built (128 KiB).
pub const MAX_BLOCKS: usize = 4096;

/// The fewest blocks a built filter is folded to (8 KiB), so that filters of tasks with few rows
/// do not shrink the union of a stage's filters.
pub const MIN_BLOCKS: usize = 256;

/// The most rows a filter is built from: past them, even at [`MAX_BLOCKS`] it would hold under 8
/// bits per key and drop too few rows to pay for its checks, so its builder gives it up.
pub const MAX_ROWS: u64 = 1 << 17;

/// Bits per inserted row a built filter keeps (about 0.1 % false positives).
const BITS_PER_ROW: usize = 16;

const WORDS: usize = 8;
const BLOCK_BITS: usize = WORDS * 32;

/// The specification's odd constants, one per word of a block.
const SALT: [u32; WORDS] = [
    0x47b6_137b,
    0x4497_4d91,
    0x8824_ad5b,
    0xa2b7_289d,
    0x7054_95c7,
    0x2df1_424b,
    0x9efc_4947,
    0x5c6b_fb31,
];

/// The seed of the key hashes; differs from the shuffle's, so a hash partition's keys do not
/// crowd into some blocks.
const SEED: u64 = 0x51ce_b100;

/// The hashes of `arrays`' rows (one key per row, its columns combined), into `hashes`.
pub fn hash_keys(arrays: &[ArrayRef], rows: usize, hashes: &mut Vec<u64>) -> Result<()> {
    hashes.clear();
    hashes.resize(rows, 0);
    create_hashes(arrays, &RandomState::with_seed(SEED), hashes)?;
    Ok(())
}

/// Whether row `i` has a `NULL` in one of `arrays` (such a key matches nothing).
pub fn has_null(arrays: &[ArrayRef], i: usize) -> bool {
    arrays.iter().any(|a| a.null_count() > 0 && a.is_null(i))
}

/// A split-block Bloom filter over key hashes; see the module docs.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KeyBloomFilter {
    blocks: Vec<[u32; WORDS]>,
    /// Rows inserted, summed over unions (an upper bound of the distinct keys).
    rows: u64,
}

impl std::fmt::Debug for KeyBloomFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyBloomFilter")
            .field("blocks", &self.blocks.len())
            .field("rows", &self.rows)
            .finish()
    }
}

impl KeyBloomFilter {
    /// An empty filter of `blocks` blocks, rounded up to a power of two within 1..=[`MAX_BLOCKS`].
    pub fn with_blocks(blocks: usize) -> Self {
        let blocks = blocks.clamp(1, MAX_BLOCKS).next_power_of_two();
        Self {
            blocks: vec![[0; WORDS]; blocks],
            rows: 0,
        }
    }

    /// An empty filter to build: [`MAX_BLOCKS`] until [`finish`](Self::finish)ed.
    pub fn for_building() -> Self {
        Self::with_blocks(MAX_BLOCKS)
    }

    /// The number of blocks.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The size in bytes.
    pub fn bytes(&self) -> usize {
        self.blocks.len() * WORDS * 4
    }

    /// Rows inserted (an upper bound of the distinct keys it holds).
    pub fn rows(&self) -> u64 {
        self.rows
    }

    fn block_of(&self, hash: u64) -> usize {
        // The high half picks the block; the mask keeps folding exact.
        ((hash >> 32) as usize) & (self.blocks.len() - 1)
    }

    fn mask(hash: u64) -> [u32; WORDS] {
        let key = hash as u32;
        SALT.map(|salt| 1u32 << (key.wrapping_mul(salt) >> 27))
    }

    /// Adds the key whose hash is `hash`.
    pub fn insert(&mut self, hash: u64) {
        let index = self.block_of(hash);
        let mask = Self::mask(hash);
        if let Some(block) = self.blocks.get_mut(index) {
            for (word, bit) in block.iter_mut().zip(mask) {
                *word |= bit;
            }
        }
        self.rows += 1;
    }

    /// Whether the key whose hash is `hash` may have been added (never false for one that was).
    pub fn contains(&self, hash: u64) -> bool {
        let mask = Self::mask(hash);
        self.blocks
            .get(self.block_of(hash))
            .is_some_and(|block| block.iter().zip(mask).all(|(word, bit)| word & bit != 0))
    }

    /// This filter halved until it has `blocks` blocks (a power of two no larger than its own).
    pub fn folded_to(&self, blocks: usize) -> Result<Self> {
        let size = self.blocks.len();
        if blocks == 0 || !blocks.is_power_of_two() || blocks > size {
            return Err(DataFusionError::Internal(format!(
                "a Bloom filter of {size} blocks cannot fold to {blocks}"
            )));
        }
        let mut folded = self.blocks[..blocks].to_vec();
        for chunk in self.blocks[blocks..].chunks(blocks) {
            for (into, block) in folded.iter_mut().zip(chunk) {
                for (word, bits) in into.iter_mut().zip(block) {
                    *word |= bits;
                }
            }
        }
        Ok(Self {
            blocks: folded,
            rows: self.rows,
        })
    }

    /// The built filter: folded to about [`BITS_PER_ROW`] bits per inserted row, at least
    /// [`MIN_BLOCKS`].
    pub fn finish(self) -> Result<Self> {
        let rows = usize::try_from(self.rows).unwrap_or(usize::MAX);
        let wanted = rows
            .saturating_mul(BITS_PER_ROW)
            .div_ceil(BLOCK_BITS)
            .clamp(MIN_BLOCKS, MAX_BLOCKS)
            .next_power_of_two()
            .min(self.blocks.len());
        self.folded_to(wanted)
    }

    /// The filter holding every key of `filters` (at least one): each folded to the smallest's
    /// size, then OR-ed.
    pub fn union<'a>(filters: impl IntoIterator<Item = &'a KeyBloomFilter>) -> Result<Self> {
        let filters: Vec<&KeyBloomFilter> = filters.into_iter().collect();
        let Some(smallest) = filters.iter().map(|f| f.blocks.len()).min() else {
            return Err(DataFusionError::Internal(
                "a union of no Bloom filters".to_string(),
            ));
        };
        let mut union = Self::with_blocks(smallest);
        for filter in filters {
            let folded = filter.folded_to(smallest)?;
            for (into, block) in union.blocks.iter_mut().zip(&folded.blocks) {
                for (word, bits) in into.iter_mut().zip(block) {
                    *word |= bits;
                }
            }
            union.rows = union.rows.saturating_add(filter.rows);
        }
        Ok(union)
    }

    /// Whether every key `other` holds passes this filter: `other`, folded to this size, sets no
    /// bit this filter lacks. `false` when `other` is smaller (it cannot be unfolded).
    pub fn covers(&self, other: &KeyBloomFilter) -> bool {
        let Ok(folded) = other.folded_to(self.blocks.len()) else {
            return false;
        };
        self.blocks.iter().zip(&folded.blocks).all(|(own, theirs)| {
            own.iter()
                .zip(theirs)
                .all(|(own, theirs)| theirs & !own == 0)
        })
    }

    /// The share of its bits that are set (false positives grow with it).
    pub fn fill(&self) -> f64 {
        let set: u64 = self
            .blocks
            .iter()
            .flatten()
            .map(|w| u64::from(w.count_ones()))
            .sum();
        set as f64 / (self.blocks.len() * BLOCK_BITS) as f64
    }

    /// Little-endian: the rows inserted (8 bytes), then the blocks' words.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(8 + self.bytes());
        bytes.extend_from_slice(&self.rows.to_le_bytes());
        for word in self.blocks.iter().flatten() {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes
    }

    /// A filter [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let malformed = || {
            DataFusionError::Internal(format!("a malformed Bloom filter of {} bytes", bytes.len()))
        };
        let (rows, body) = bytes.split_first_chunk::<8>().ok_or_else(malformed)?;
        let block_bytes = WORDS * 4;
        let blocks = body.len() / block_bytes;
        if body.len() % block_bytes != 0
            || blocks == 0
            || !blocks.is_power_of_two()
            || blocks > MAX_BLOCKS
        {
            return Err(malformed());
        }
        let blocks = body
            .chunks_exact(block_bytes)
            .map(|block| {
                let mut words = [0u32; WORDS];
                for (word, bytes) in words.iter_mut().zip(block.chunks_exact(4)) {
                    let mut le = [0u8; 4];
                    le.copy_from_slice(bytes);
                    *word = u32::from_le_bytes(le);
                }
                words
            })
            .collect();
        Ok(Self {
            blocks,
            rows: u64::from_le_bytes(*rows),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::Arc;

    use datafusion::arrow::array::{Int64Array, StringArray};

    use super::*;

    fn hashes(keys: impl IntoIterator<Item = i64>) -> Vec<u64> {
        let array: ArrayRef = Arc::new(Int64Array::from_iter_values(keys));
        let mut hashes = Vec::new();
        hash_keys(&[Arc::clone(&array)], array.len(), &mut hashes).unwrap();
        hashes
    }

    fn built(keys: impl IntoIterator<Item = i64>) -> KeyBloomFilter {
        let mut filter = KeyBloomFilter::for_building();
        for hash in hashes(keys) {
            filter.insert(hash);
        }
        filter.finish().unwrap()
    }

    fn false_positives(filter: &KeyBloomFilter, absent: std::ops::Range<i64>) -> usize {
        hashes(absent)
            .into_iter()
            .filter(|h| filter.contains(*h))
            .count()
    }

    #[test]
    fn a_built_filter_keeps_every_key_and_few_others() {
        let filter = built(0..10_000);
        // 10,000 rows at 16 bits each: 625 blocks, rounded up to 1,024 (32 KiB).
        assert_eq!(
            (filter.blocks(), filter.bytes(), filter.rows()),
            (1024, 32768, 10_000)
        );
        assert!(hashes(0..10_000).into_iter().all(|h| filter.contains(h)));
        let fp = false_positives(&filter, 1_000_000..1_100_000);
        assert!(fp < 100, "{fp} of 100,000 absent keys passed (over 0.1 %)");
    }

    #[test]
    fn a_filter_of_few_rows_folds_to_the_smallest_size_and_keeps_its_keys() {
        let filter = built([7, 11, 13]);
        assert_eq!(filter.blocks(), MIN_BLOCKS);
        assert!(hashes([7, 11, 13]).into_iter().all(|h| filter.contains(h)));
        assert_eq!(false_positives(&filter, 1_000..101_000), 0);
    }

    #[test]
    fn a_union_folds_to_the_smallest_filter_and_holds_every_key() {
        let (small, large) = (built(0..100), built(100..20_000));
        assert_eq!((small.blocks(), large.blocks()), (256, 2048));
        let union = KeyBloomFilter::union([&large, &small]).unwrap();
        assert_eq!((union.blocks(), union.rows()), (256, 20_000));
        assert!(hashes(0..20_000).into_iter().all(|h| union.contains(h)));
        assert!(union.covers(&small) && union.covers(&large));
        assert!(!small.covers(&large));
        // A smaller filter cannot be unfolded to check it against a larger one.
        assert!(!large.covers(&small));
    }

    #[test]
    fn a_filter_does_not_cover_one_with_other_keys() {
        let filter = built(0..1_000);
        assert!(filter.covers(&built(0..500)));
        assert!(!filter.covers(&built(5_000..5_100)));
    }

    #[test]
    fn bytes_round_trip_and_malformed_bytes_are_an_error() {
        let filter = built(0..3_000);
        let bytes = filter.to_bytes();
        assert_eq!(bytes.len(), 8 + filter.bytes());
        assert_eq!(KeyBloomFilter::from_bytes(&bytes).unwrap(), filter);
        for bad in [&bytes[..7], &bytes[..41], &bytes[..8 + 3 * 32]] {
            let err = KeyBloomFilter::from_bytes(bad).unwrap_err().to_string();
            assert!(
                err.contains(&format!("a malformed Bloom filter of {} bytes", bad.len())),
                "{err}"
            );
        }
    }

    #[test]
    fn keys_of_several_columns_hash_as_one_and_nulls_are_found() {
        let a: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), Some(1), None]));
        let b: ArrayRef = Arc::new(StringArray::from(vec![Some("x"), Some("y"), Some("x")]));
        let mut hashes = Vec::new();
        hash_keys(&[Arc::clone(&a), Arc::clone(&b)], 3, &mut hashes).unwrap();
        assert_eq!(hashes.len(), 3);
        assert_ne!(hashes[0], hashes[1]);
        assert_eq!(
            (0..3)
                .map(|i| has_null(&[Arc::clone(&a), Arc::clone(&b)], i))
                .collect::<Vec<_>>(),
            vec![false, false, true]
        );
    }
}
