//! Per-channel column builders for variable-width columns: strings and binaries, with offsets
//! (`Utf8`, `LargeUtf8`, `Binary`, `LargeBinary`) or views (`Utf8View`, `BinaryView`).
//!
//! ```text
//!  source column (offsets or views + data) ──rows of one channel──► channel's offsets/views
//!                                                                 + channel's own data blocks
//! ```
//!
//! Each value's bytes are copied once, straight from the input batch into the channel's data (a
//! gather-then-coalesce pipeline copies them twice). Short values are copied as one fixed-size chunk
//! when the source has the bytes to spare, which the compiler turns into a few register moves instead of
//! a `memcpy` call per value.
//!
//! Invariants: a built array holds exactly the values of the gathered rows, in gather order; a view array
//! references only its own data blocks (never the input's buffers, so a channel's batch does not pin its
//! inputs and its memory size is its real size); inline views (12 bytes or fewer) are copied verbatim.

use std::mem::MaybeUninit;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, GenericByteArray, GenericByteViewArray, NullBufferBuilder,
};
use arrow::buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use arrow::datatypes::{ArrowNativeType, ByteArrayType, ByteViewType, DataType};
use datafusion_common::{DataFusionError, Result};

use crate::builders::{ColumnBuilder, gather_nulls};

/// Longest value stored inside its view.
const MAX_INLINE_LEN: u32 = 12;
/// First data block size of a view column; blocks double up to [`MAX_BLOCK`]. Blocks stay below 128 KiB
/// (with the copy slack) because allocators hand larger ones back to the OS when freed, and the next
/// block then pays a page fault per 4 KiB: measured at 16 % of the `utf8view_16` benchmark with 2 MiB
/// blocks.
const FIRST_BLOCK: usize = 8 * 1024;
const MAX_BLOCK: usize = 128 * 1024 - COPY_SLACK;
/// Bytes a fixed-size chunk copy may write past a value's end.
const COPY_SLACK: usize = 32;

/// Builds `Utf8`, `LargeUtf8`, `Binary` or `LargeBinary` columns.
pub(crate) struct OffsetBytesBuilder<T: ByteArrayType> {
    /// Rows per built batch.
    target_rows: usize,
    offsets: Vec<T::Offset>,
    values: Vec<u8>,
    nulls: NullBufferBuilder,
    data_type: DataType,
}

impl<T: ByteArrayType> OffsetBytesBuilder<T> {
    pub(crate) fn new(data_type: &DataType, capacity: usize) -> Self {
        let mut offsets = Vec::with_capacity(capacity + 1);
        offsets.push(T::Offset::usize_as(0));
        Self {
            target_rows: capacity,
            offsets,
            values: Vec::new(),
            nulls: NullBufferBuilder::new(capacity),
            data_type: data_type.clone(),
        }
    }
}

impl<T: ByteArrayType> ColumnBuilder for OffsetBytesBuilder<T> {
    #[expect(
        unsafe_code,
        reason = "commits the value bytes written into spare capacity (see `commit`)"
    )]
    fn gather(&mut self, source: &dyn Array, rows: &[u32]) -> Result<()> {
        let source = source.as_bytes_opt::<T>().ok_or_else(|| {
            DataFusionError::Internal(format!("expected {} column", self.data_type))
        })?;
        let offsets: &[T::Offset] = source.value_offsets();
        let data: &[u8] = source.values();
        // One pass for the total size, so that the data vector grows at most once per gather.
        let total: usize = rows
            .iter()
            .map(|&row| {
                let row = row as usize;
                match (offsets.get(row), offsets.get(row + 1)) {
                    (Some(start), Some(end)) => end.as_usize().saturating_sub(start.as_usize()),
                    _ => 0,
                }
            })
            .sum();
        let end_of_data = self.values.len() + total;
        if T::Offset::from_usize(end_of_data).is_none() {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "a shuffle batch of {} would hold {end_of_data} bytes, more than its offsets can \
                 address; use the Large variant of the type or a smaller batch size",
                self.data_type
            )));
        }
        // The values are written into the vector's spare capacity at a position kept in a register
        // (and committed once at the end), and the offsets come from `extend`, which keeps that
        // vector's length in a register too.
        let base = self.values.len();
        let first_offset = self.offsets.len();
        if self.values.capacity() == 0 && !rows.is_empty() {
            // A new batch without history: size it from these rows, so that it does not grow (and
            // copy itself) a dozen times on the way to `target_rows` rows.
            let estimate = total.div_ceil(rows.len()) * self.target_rows;
            self.values.reserve(estimate + estimate / 8 + COPY_SLACK);
        }
        self.values.reserve(total + COPY_SLACK);
        let out = self.values.spare_capacity_mut();
        let mut written = 0;
        let mut failure = None;
        self.offsets.extend(rows.iter().map(|&row| {
            let row = row as usize;
            let (Some(start), Some(end)) = (offsets.get(row), offsets.get(row + 1)) else {
                failure.get_or_insert_with(|| {
                    DataFusionError::Internal(format!(
                        "row {row} outside a {} column of {} rows",
                        self.data_type,
                        source.len()
                    ))
                });
                return T::Offset::usize_as(0);
            };
            let (start, len) = (
                start.as_usize(),
                end.as_usize().saturating_sub(start.as_usize()),
            );
            let target = out.get_mut(written..).unwrap_or_default();
            if let Err(e) = copy_value(target, data, start, len) {
                failure.get_or_insert(e);
                return T::Offset::usize_as(0);
            }
            written += len;
            // Cannot overflow: the total was checked above.
            T::Offset::usize_as(base + written)
        }));
        if let Some(e) = failure {
            self.offsets.truncate(first_offset);
            return Err(e);
        }
        // SAFETY: the values were written back to back from `base` on, each covering its own bytes,
        // and `written` is where the last one ended (a failed copy returned above).
        unsafe { commit(&mut self.values, base + written) }?;
        gather_nulls(&mut self.nulls, source.nulls(), rows);
        Ok(())
    }

    fn finish(&mut self, capacity: usize) -> Result<ArrayRef> {
        let mut offsets = Vec::with_capacity(capacity + 1);
        offsets.push(T::Offset::usize_as(0));
        let offsets = std::mem::replace(&mut self.offsets, offsets);
        // The next batch likely needs about as many bytes as this one; an eighth more spares it a
        // reallocation (and the copy that comes with it) when it needs a little more.
        let next = Vec::with_capacity(self.values.len() + self.values.len() / 8 + COPY_SLACK);
        let values = std::mem::replace(&mut self.values, next);
        let nulls = self.nulls.finish();
        build_offset_array::<T>(ScalarBuffer::from(offsets), Buffer::from_vec(values), nulls)
    }
}

/// The array of `offsets` into `values`.
///
/// Safety argument for skipping validation (a pass over the offsets, and for strings a UTF-8 check of
/// every byte, 4 % and more of a gather): the offsets start at 0, and each one is the previous plus the
/// length of a value copied whole from a valid array of the same type, so they never decrease, end at
/// `values.len()`, and delimit exactly the copied values; each value is (for strings) valid UTF-8 on
/// its own, and a concatenation of valid UTF-8 strings split at their boundaries is valid too. Debug
/// builds (and so every test) validate fully; release builds check, at O(1), that the offsets start
/// at 0 and end at `values.len()`, the invariant every other one follows from.
#[expect(
    unsafe_code,
    reason = "skips a full validation whose invariants hold by construction (see above)"
)]
fn build_offset_array<T: ByteArrayType>(
    offsets: ScalarBuffer<T::Offset>,
    values: Buffer,
    nulls: Option<arrow::buffer::NullBuffer>,
) -> Result<ArrayRef> {
    let (first, last) = (offsets.first().copied(), offsets.last().copied());
    if first.map(|o| o.as_usize()) != Some(0) || last.map(|o| o.as_usize()) != Some(values.len()) {
        return Err(DataFusionError::Internal(format!(
            "shuffle builder produced a {} column whose offsets run from {:?} to {:?} over {} value \
             bytes",
            T::DATA_TYPE,
            first.map(|o| o.as_usize()),
            last.map(|o| o.as_usize()),
            values.len()
        )));
    }
    // SAFETY: see the function's docs: the offsets are non-negative and non-decreasing.
    let offsets = unsafe { OffsetBuffer::new_unchecked(offsets) };
    #[cfg(debug_assertions)]
    debug_check(
        GenericByteArray::<T>::try_new(offsets.clone(), values.clone(), nulls.clone()),
        &T::DATA_TYPE,
    );
    // SAFETY: see the function's docs; offsets and values satisfy `GenericByteArray`'s invariants.
    Ok(Arc::new(unsafe {
        GenericByteArray::<T>::new_unchecked(offsets, values, nulls)
    }))
}

/// The data blocks of one view column under construction.
///
/// `current` is an empty vector with `COPY_SLACK` bytes more capacity than the values it may take;
/// values are written into its spare capacity at a position kept in a register, and `used` says how
/// many bytes were written (`limit` is the size of the last block opened). Pushing onto the vector
/// instead stores and reloads its length around every copy, and zero-filling a block first costs a
/// pass over it: both measured slower.
#[derive(Default)]
struct ViewBlocks {
    closed: Vec<Buffer>,
    current: Vec<u8>,
    used: usize,
    limit: usize,
}

impl ViewBlocks {
    /// Closes the current block (if it holds anything) and opens one with room for `needed` bytes.
    fn open(&mut self, needed: usize, data_type: &DataType) -> Result<()> {
        self.close();
        let size = (self.limit * 2).clamp(FIRST_BLOCK, MAX_BLOCK).max(needed);
        if u32::try_from(size + COPY_SLACK).is_err() {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "a {data_type} value of {needed} bytes is too long for a view"
            )));
        }
        self.current = Vec::with_capacity(size + COPY_SLACK);
        self.used = 0;
        self.limit = size;
        Ok(())
    }

    #[expect(
        unsafe_code,
        reason = "commits the block's bytes written into spare capacity (see `commit`)"
    )]
    fn close(&mut self) {
        if self.used > 0 {
            let mut full = std::mem::take(&mut self.current);
            // SAFETY: `used` bytes were written into the block's spare capacity, back to back.
            // A length past the capacity is refused by `commit` and leaves the block out.
            if unsafe { commit(&mut full, self.used) }.is_ok() {
                self.closed.push(Buffer::from_vec(full));
            }
        }
        self.current = Vec::new();
        self.used = 0;
    }

    /// The finished blocks; the next batch starts with a new block no smaller than half the last one.
    fn finish(&mut self) -> Vec<Buffer> {
        self.close();
        self.limit = self.limit.min(MAX_BLOCK) / 2;
        std::mem::take(&mut self.closed)
    }
}

/// Builds `Utf8View` or `BinaryView` columns, copying out-of-line values into the channel's own blocks.
pub(crate) struct ViewBytesBuilder<T: ByteViewType> {
    views: Vec<u128>,
    blocks: ViewBlocks,
    nulls: NullBufferBuilder,
    data_type: DataType,
    _type: std::marker::PhantomData<T>,
}

impl<T: ByteViewType> ViewBytesBuilder<T> {
    pub(crate) fn new(data_type: &DataType, capacity: usize) -> Self {
        Self {
            views: Vec::with_capacity(capacity),
            blocks: ViewBlocks::default(),
            nulls: NullBufferBuilder::new(capacity),
            data_type: data_type.clone(),
            _type: std::marker::PhantomData,
        }
    }
}

impl<T: ByteViewType> ColumnBuilder for ViewBytesBuilder<T> {
    fn gather(&mut self, source: &dyn Array, rows: &[u32]) -> Result<()> {
        let source = source.as_byte_view_opt::<T>().ok_or_else(|| {
            DataFusionError::Internal(format!("expected {} column", self.data_type))
        })?;
        let views: &[u128] = source.views();
        // Checked up front (a vectorized pass), so the copy loop below may read a missing view as 0.
        if let Some(row) = rows.iter().copied().max()
            && row as usize >= views.len()
        {
            return Err(DataFusionError::Internal(format!(
                "row {row} outside a {} column of {} rows",
                self.data_type,
                views.len()
            )));
        }
        // One pass: the view, then its value. This needs the view rewritten with shifts (see
        // `relocated`); with that, it measured faster than gathering the views first, like a `take`,
        // and copying the values in a second pass (0.82-0.92 of DataFusion against 0.94-0.96).
        let first = self.views.len();
        let copied = self.copy_rows(source, views, rows);
        if copied.is_err() {
            // Views pushed by this call may point at bytes that were never committed: drop them, so
            // that a later `finish` builds only what is valid.
            self.views.truncate(first);
            return copied;
        }
        gather_nulls(&mut self.nulls, source.nulls(), rows);
        Ok(())
    }

    fn finish(&mut self, capacity: usize) -> Result<ArrayRef> {
        let blocks = self.blocks.finish();
        let views = std::mem::replace(&mut self.views, Vec::with_capacity(capacity));
        let nulls = self.nulls.finish();
        build_view_array::<T>(ScalarBuffer::from(views), blocks, nulls)
    }
}

impl<T: ByteViewType> ViewBytesBuilder<T> {
    /// Appends the views of `rows`, copying their out-of-line values into this builder's blocks.
    fn copy_rows(
        &mut self,
        source: &GenericByteViewArray<T>,
        views: &[u128],
        rows: &[u32],
    ) -> Result<()> {
        let data = source.data_buffers();
        let blocks = &mut self.blocks;
        let mut used = blocks.used;
        let mut spare = blocks.current.spare_capacity_mut();
        self.views.reserve(rows.len());
        for &row in rows {
            let view = views.get(row as usize).copied().unwrap_or(0);
            let len = view as u32;
            if len <= MAX_INLINE_LEN {
                self.views.push(view);
                continue;
            }
            let len = len as usize;
            let (buffer_index, offset) = view_location(view);
            if used + len + COPY_SLACK > spare.len() {
                blocks.used = used;
                blocks.open(len, &self.data_type)?;
                spare = blocks.current.spare_capacity_mut();
                used = 0;
            }
            let block = data.get(buffer_index as usize).ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "a view names data buffer {buffer_index} of {}",
                    data.len()
                ))
            })?;
            copy_value(
                spare.get_mut(used..).unwrap_or_default(),
                block.as_slice(),
                offset as usize,
                len,
            )?;
            self.views
                .push(relocated(view, blocks.closed.len() as u32, used as u32));
            used += len;
        }
        blocks.used = used;
        Ok(())
    }
}

/// The data buffer index and offset of an out-of-line view.
///
/// Views are taken apart and put together with shifts: going through `ByteView`'s four `u32` fields
/// made the compiler store them one by one and reload them as one `u128`, a failed store-to-load
/// forward on every row (40 % of the gather's time, measured).
#[inline(always)]
fn view_location(view: u128) -> (u32, u32) {
    ((view >> 64) as u32, (view >> 96) as u32)
}

/// `view` (length and prefix kept) pointing at `offset` in data buffer `buffer_index`.
#[inline(always)]
fn relocated(view: u128, buffer_index: u32, offset: u32) -> u128 {
    (view & u128::from(u64::MAX)) | (u128::from(buffer_index) << 64) | (u128::from(offset) << 96)
}

/// Copies `source[start..start + len]` to the front of `out`, which has at least `len + COPY_SLACK`
/// bytes. Values of up to 32 bytes are copied as one 32-byte chunk when `source` extends that far.
#[inline(always)]
fn copy_value(out: &mut [MaybeUninit<u8>], source: &[u8], start: usize, len: usize) -> Result<()> {
    let tail = source.get(start..).unwrap_or_default();
    // One chunk size only: with a 16-byte branch as well, the compiler merged the two copies into one
    // `memcpy` call of variable size (22 % of `utf8view_16`, measured).
    if len <= COPY_SLACK
        && let (Some(chunk), Some(target)) = (tail.first_chunk::<32>(), out.first_chunk_mut::<32>())
    {
        copy_chunk(target, chunk);
        return Ok(());
    }
    copy_long(out, source, start, len)
}

/// The exact-length copy of [`copy_value`], kept out of line: inlined, the compiler merged it with the
/// chunk copy into one `memcpy` call of variable size (20 % of `utf8view_16`, measured).
#[inline(never)]
fn copy_long(out: &mut [MaybeUninit<u8>], source: &[u8], start: usize, len: usize) -> Result<()> {
    let value = source.get(start..start + len).ok_or_else(|| {
        DataFusionError::Internal(format!(
            "value bytes {start}..{} outside a data buffer of {} bytes",
            start + len,
            source.len()
        ))
    })?;
    let target = out.get_mut(..len).ok_or_else(|| {
        DataFusionError::Internal(format!("no room for a {len}-byte value in a data block"))
    })?;
    target.write_copy_of_slice(value);
    Ok(())
}

/// A fixed-size copy; with `N` known the compiler emits a few vector moves. The safe spellings
/// (`write_copy_of_slice`, `array::map`, an element loop) became a `memcpy` call, an out-of-line
/// function or a byte loop, all measured slower.
#[expect(
    unsafe_code,
    reason = "a fixed-size copy the safe spellings compile to a slower call"
)]
#[inline(always)]
fn copy_chunk<const N: usize>(target: &mut [MaybeUninit<u8>; N], chunk: &[u8; N]) {
    // SAFETY: both are arrays of exactly `N` bytes, distinct (one is borrowed mutably, the other
    // shared), and any byte is a valid `MaybeUninit<u8>`.
    unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), target.as_mut_ptr().cast::<u8>(), N) }
}

/// Makes the first `len` bytes of `bytes`' capacity its contents; a `len` past the capacity is an
/// error (checked in every build) and changes nothing.
///
/// # Safety
///
/// Every byte of `bytes` below `len` must have been written (initialized). Callers write values back
/// to back from the vector's length on, each write covering its own bytes, and pass where the last
/// write ended; a failed write returns an error before this is called.
#[expect(
    unsafe_code,
    reason = "commits bytes written into spare capacity without zero-filling them first"
)]
unsafe fn commit(bytes: &mut Vec<u8>, len: usize) -> Result<()> {
    if len > bytes.capacity() {
        return Err(DataFusionError::Internal(format!(
            "shuffle builder committing {len} bytes into a buffer of {}",
            bytes.capacity()
        )));
    }
    // SAFETY: `len` is within the capacity (checked above) and the caller guarantees the bytes up to
    // it are initialized.
    unsafe { bytes.set_len(len) };
    Ok(())
}

/// Debug builds (and so every test) validate each array this module builds without validation; an
/// invalid one is a bug here and must fail loudly.
#[cfg(debug_assertions)]
fn debug_check<A>(
    validated: std::result::Result<A, arrow::error::ArrowError>,
    data_type: &DataType,
) {
    if let Err(e) = validated {
        debug_assert!(
            false,
            "shuffle builder produced an invalid {data_type} array: {e}"
        );
    }
}

/// The view array of `views` over `blocks`.
///
/// Safety argument for skipping validation: an inline view was copied verbatim from a valid array of the
/// same type; an out-of-line view keeps its source's length and prefix and points at the block and
/// offset where exactly that value's bytes were copied, so each view is in bounds, its prefix matches
/// and (for strings) its bytes are valid UTF-8. Debug builds (and so every test) validate fully;
/// release builds check (one pass over the views, no byte touched) that every out-of-line view
/// points inside one of the blocks.
#[expect(
    unsafe_code,
    reason = "skips a full validation whose invariants hold by construction (see above)"
)]
fn build_view_array<T: ByteViewType>(
    views: ScalarBuffer<u128>,
    blocks: Vec<Buffer>,
    nulls: Option<arrow::buffer::NullBuffer>,
) -> Result<ArrayRef> {
    if let Some(bad) = views
        .iter()
        .position(|view| !view_in_bounds(*view, &blocks))
    {
        return Err(DataFusionError::Internal(format!(
            "shuffle builder produced a {} view (row {bad}) outside its {} data blocks",
            T::DATA_TYPE,
            blocks.len()
        )));
    }
    #[cfg(debug_assertions)]
    debug_check(
        GenericByteViewArray::<T>::try_new(views.clone(), blocks.clone(), nulls.clone()),
        &T::DATA_TYPE,
    );
    // SAFETY: see the function's docs; views, blocks and nulls satisfy `GenericByteViewArray`'s
    // invariants.
    Ok(Arc::new(unsafe {
        GenericByteViewArray::<T>::new_unchecked(views, blocks, nulls)
    }))
}

/// Whether an out-of-line view's bytes lie inside its block (inline views always do).
fn view_in_bounds(view: u128, blocks: &[Buffer]) -> bool {
    let len = view as u32 as usize;
    if len <= 12 {
        return true;
    }
    let block = (view >> 64) as u32 as usize;
    let offset = (view >> 96) as u32 as usize;
    blocks
        .get(block)
        .is_some_and(|b| offset.checked_add(len).is_some_and(|end| end <= b.len()))
}

/// A builder for a variable-width `data_type`, if it is one of the supported ones.
pub(crate) fn byte_builder_for(
    data_type: &DataType,
    capacity: usize,
) -> Option<Box<dyn ColumnBuilder>> {
    use arrow::datatypes::{
        BinaryType, BinaryViewType, LargeBinaryType, LargeUtf8Type, StringViewType, Utf8Type,
    };
    let builder: Box<dyn ColumnBuilder> = match data_type {
        DataType::Utf8 => Box::new(OffsetBytesBuilder::<Utf8Type>::new(data_type, capacity)),
        DataType::LargeUtf8 => Box::new(OffsetBytesBuilder::<LargeUtf8Type>::new(
            data_type, capacity,
        )),
        DataType::Binary => Box::new(OffsetBytesBuilder::<BinaryType>::new(data_type, capacity)),
        DataType::LargeBinary => Box::new(OffsetBytesBuilder::<LargeBinaryType>::new(
            data_type, capacity,
        )),
        DataType::Utf8View => {
            Box::new(ViewBytesBuilder::<StringViewType>::new(data_type, capacity))
        }
        DataType::BinaryView => {
            Box::new(ViewBytesBuilder::<BinaryViewType>::new(data_type, capacity))
        }
        _ => return None,
    };
    Some(builder)
}

#[cfg(test)]
mod tests {
    use arrow::array::{LargeBinaryArray, StringArray, StringViewArray, UInt32Array};
    use arrow::compute::take;

    use super::*;

    #[test]
    #[expect(unsafe_code, reason = "calls `commit` with a length it must refuse")]
    fn release_checks_refuse_offsets_and_views_that_do_not_fit_their_bytes() {
        let short = build_offset_array::<arrow::datatypes::Utf8Type>(
            ScalarBuffer::from(vec![0i32, 3, 7]),
            Buffer::from_vec(vec![b'a'; 6]),
            None,
        )
        .unwrap_err();
        assert!(
            short
                .to_string()
                .contains("offsets run from Some(0) to Some(7) over 6 value bytes"),
            "{short}"
        );
        // A 20-byte value at offset 8 of block 0 (bits 64..96), which holds 16 bytes.
        let view = 20u128 | (8u128 << 96);
        let outside = build_view_array::<arrow::datatypes::StringViewType>(
            ScalarBuffer::from(vec![view]),
            vec![Buffer::from_vec(vec![b'x'; 16])],
            None,
        )
        .unwrap_err();
        assert!(
            outside
                .to_string()
                .contains("view (row 0) outside its 1 data blocks"),
            "{outside}"
        );
        let mut bytes = Vec::with_capacity(4);
        // SAFETY: nothing is committed: the length is past the capacity and refused.
        let refused = unsafe { commit(&mut bytes, 5) };
        assert!(refused.is_err());
        assert!(bytes.is_empty());
    }

    /// Gathers `rows` of `source` in chunks of `chunk` rows into one builder and checks the result
    /// against Arrow's `take`, with full validation.
    fn check(source: ArrayRef, rows: &[u32], chunk: usize) {
        let mut builder = byte_builder_for(source.data_type(), rows.len()).unwrap();
        for part in rows.chunks(chunk) {
            builder.gather(source.as_ref(), part).unwrap();
        }
        let built = builder.finish(rows.len()).unwrap();
        built.to_data().validate_full().unwrap();
        let expected = take(source.as_ref(), &UInt32Array::from(rows.to_vec()), None).unwrap();
        assert_eq!(built.as_ref(), expected.as_ref());
    }

    fn values(n: usize) -> Vec<Option<String>> {
        (0..n)
            .map(|i| (i % 7 != 3).then(|| "ü".repeat(i % 90) + &i.to_string()))
            .collect()
    }

    #[test]
    fn long_values_fill_several_view_blocks() {
        let strings = values(3000);
        let source: ArrayRef = Arc::new(StringViewArray::from(strings.clone()));
        let rows: Vec<u32> = (0..3000u32).rev().step_by(2).chain(0..1000).collect();
        check(source, &rows, 333);
    }

    #[test]
    fn offsets_of_strings_and_large_binaries() {
        let strings = values(2000);
        let rows: Vec<u32> = (0..2000u32).map(|i| (i * 7919) % 2000).collect();
        check(Arc::new(StringArray::from(strings.clone())), &rows, 500);
        let bytes: LargeBinaryArray = strings
            .iter()
            .map(|s| s.as_deref().map(str::as_bytes))
            .collect();
        check(Arc::new(bytes), &rows, 2000);
    }

    #[test]
    fn values_at_the_end_of_a_sliced_source() {
        // The last values have no 32 bytes after them in the source buffer: the exact copy is used.
        let strings: Vec<Option<String>> = (0..50).map(|i| Some("x".repeat(i))).collect();
        let source = StringViewArray::from(strings.clone()).slice(10, 40);
        check(Arc::new(source), &[39, 38, 0, 20], 1);
        let source = StringArray::from(strings).slice(10, 40);
        check(Arc::new(source), &[39, 38, 0, 20], 3);
    }

    #[test]
    fn a_row_outside_the_source_is_an_error() {
        let source: ArrayRef = Arc::new(StringViewArray::from(vec!["a", "b"]));
        let mut builder = byte_builder_for(source.data_type(), 4).unwrap();
        let error = builder.gather(source.as_ref(), &[0, 5]).unwrap_err();
        assert!(error.to_string().contains("row 5 outside"), "{error}");
        let source: ArrayRef = Arc::new(StringArray::from(vec!["a", "b"]));
        let mut builder = byte_builder_for(source.data_type(), 4).unwrap();
        let error = builder.gather(source.as_ref(), &[2]).unwrap_err();
        assert!(error.to_string().contains("row 2 outside"), "{error}");
    }
}
