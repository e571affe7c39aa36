//! Grouping row numbers by channel: a stable counting sort of one batch's channel ids.
//!
//! ```text
//!  ids (one channel id per row), cut into 4 lanes of consecutive rows
//!   lane 0: rows 0..q    lane 1: rows q..2q    lane 2: ...    lane 3: ...
//!      │ per-lane histograms (4 independent counter sets)
//!      ▼
//!  channel c's output region = [lane 0's rows of c][lane 1's rows of c][lane 2's][lane 3's]
//!      │ one scatter that advances the 4 lanes in step
//!      ▼
//!  indices: row numbers grouped by channel, input order kept within every channel
//! ```
//!
//! Why lanes: a plain counting sort increments `count[id]` once per row, and with few channels
//! consecutive rows hit the same counter, so every increment waits for the previous store. Four lanes
//! with their own counters give the CPU four independent chains. Because lane `l` holds earlier rows
//! than lane `l + 1` and its rows are placed first in every channel, the sort stays stable.

use crate::partitioner::Assignment;

/// Rows per batch below which one lane is used (the setup of four lanes does not pay off).
const MIN_ROWS_FOR_LANES: usize = 256;
const LANES: usize = 4;

/// Scratch space of the counting sort, reused from batch to batch.
#[derive(Debug, Default)]
pub(crate) struct ChannelGrouping {
    counts: Vec<u32>,
    indices: Vec<u32>,
    ranges: Vec<(usize, usize, usize)>,
}

impl ChannelGrouping {
    /// Groups the rows of a batch whose channel ids are `ids` (each `< channels`); a batch whose rows
    /// all share one channel gets [`Assignment::Whole`] and no index array.
    pub(crate) fn group(&mut self, ids: &[u32], channels: usize) -> Assignment<'_> {
        if ids.is_empty() {
            return Assignment::Empty;
        }
        let lane_len = if ids.len() < MIN_ROWS_FOR_LANES {
            ids.len()
        } else {
            ids.len().div_ceil(LANES)
        };
        let lanes: Vec<&[u32]> = ids.chunks(lane_len).collect();

        // Per-lane histograms, lane-major: counts[lane * channels + id].
        self.counts.clear();
        self.counts.resize(lanes.len() * channels, 0);
        if let [a, b, c, d] = lanes[..] {
            let (ca, rest) = self.counts.split_at_mut(channels);
            let (cb, rest) = rest.split_at_mut(channels);
            let (cc, cd) = rest.split_at_mut(channels);
            for (((&ia, &ib), &ic), &id) in a.iter().zip(b).zip(c).zip(d) {
                ca[ia as usize] += 1;
                cb[ib as usize] += 1;
                cc[ic as usize] += 1;
                cd[id as usize] += 1;
            }
            // Lanes are equally long except possibly the last, so only `d` can be shorter.
            for (lane, counts) in [(a, ca), (b, cb), (c, cc)] {
                for &id in &lane[d.len()..] {
                    counts[id as usize] += 1;
                }
            }
        } else {
            for (lane, ids) in lanes.iter().enumerate() {
                let counts = &mut self.counts[lane * channels..(lane + 1) * channels];
                for &id in ids.iter() {
                    counts[id as usize] += 1;
                }
            }
        }

        // Prefix sums: channel-major over lanes, so that each counter becomes its lane's first slot.
        self.ranges.clear();
        let mut offset = 0u32;
        for channel in 0..channels {
            let start = offset;
            for lane in 0..lanes.len() {
                let slot = &mut self.counts[lane * channels + channel];
                let len = *slot;
                *slot = offset;
                offset += len;
            }
            if offset > start {
                self.ranges
                    .push((channel, start as usize, (offset - start) as usize));
            }
        }
        if let [(channel, _, _)] = self.ranges[..] {
            return Assignment::Whole(channel);
        }

        self.indices.clear();
        self.indices.resize(ids.len(), 0);
        let indices = &mut self.indices[..];
        if let [a, b, c, d] = lanes[..] {
            let (ca, rest) = self.counts.split_at_mut(channels);
            let (cb, rest) = rest.split_at_mut(channels);
            let (cc, cd) = rest.split_at_mut(channels);
            let bases = [0, lane_len, 2 * lane_len, 3 * lane_len].map(|b| b as u32);
            for (i, (((&ia, &ib), &ic), &id)) in a.iter().zip(b).zip(c).zip(d).enumerate() {
                let i = i as u32;
                place(indices, &mut ca[ia as usize], bases[0] + i);
                place(indices, &mut cb[ib as usize], bases[1] + i);
                place(indices, &mut cc[ic as usize], bases[2] + i);
                place(indices, &mut cd[id as usize], bases[3] + i);
            }
            for ((lane, counts), base) in [(a, ca), (b, cb), (c, cc)].into_iter().zip(bases) {
                for (i, &id) in lane.iter().enumerate().skip(d.len()) {
                    place(indices, &mut counts[id as usize], base + i as u32);
                }
            }
        } else {
            for (lane, ids) in lanes.iter().enumerate() {
                let counts = &mut self.counts[lane * channels..(lane + 1) * channels];
                let base = (lane * lane_len) as u32;
                for (i, &id) in ids.iter().enumerate() {
                    place(indices, &mut counts[id as usize], base + i as u32);
                }
            }
        }
        Assignment::Grouped {
            indices: &self.indices,
            ranges: &self.ranges,
        }
    }

    /// Takes the index array out (to lend it to an Arrow array); give it back with [`Self::restore`].
    pub(crate) fn take_indices(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.indices)
    }

    /// Returns an index array taken by [`Self::take_indices`], so its allocation is reused.
    pub(crate) fn restore(&mut self, indices: Vec<u32>) {
        self.indices = indices;
    }

    /// The ranges of the last grouping.
    pub(crate) fn ranges(&self) -> &[(usize, usize, usize)] {
        &self.ranges
    }
}

#[inline(always)]
fn place(indices: &mut [u32], slot: &mut u32, row: u32) {
    if let Some(target) = indices.get_mut(*slot as usize) {
        *target = row;
    }
    *slot += 1;
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The obvious stable grouping: for each channel, its rows in input order.
    fn reference(ids: &[u32], channels: usize) -> (Vec<u32>, Vec<(usize, usize, usize)>) {
        let mut indices = Vec::new();
        let mut ranges = Vec::new();
        for channel in 0..channels {
            let start = indices.len();
            indices.extend(
                ids.iter()
                    .enumerate()
                    .filter(|&(_, &id)| id as usize == channel)
                    .map(|(row, _)| row as u32),
            );
            if indices.len() > start {
                ranges.push((channel, start, indices.len() - start));
            }
        }
        (indices, ranges)
    }

    fn check(ids: &[u32], channels: usize) {
        let (indices, ranges) = reference(ids, channels);
        let mut grouping = ChannelGrouping::default();
        match grouping.group(ids, channels) {
            Assignment::Empty => assert!(ids.is_empty()),
            Assignment::Whole(channel) => {
                assert_eq!(ranges, vec![(channel, 0, ids.len())]);
            }
            Assignment::Grouped {
                indices: got,
                ranges: got_ranges,
            } => {
                assert_eq!(got, &indices[..]);
                assert_eq!(got_ranges, &ranges[..]);
            }
        }
    }

    #[test]
    fn lanes_of_unequal_length_and_single_channels() {
        for rows in [0, 1, 255, 256, 257, 1001, 8192] {
            for channels in [1, 2, 3, 16] {
                let ids: Vec<u32> = (0..rows as u32)
                    .map(|r| r.wrapping_mul(2_654_435_761) % channels as u32)
                    .collect();
                check(&ids, channels);
            }
            check(&vec![5; rows], 8);
        }
    }

    proptest! {
        #[test]
        fn stable_grouping(channels in 1usize..40, seed in any::<u64>(), rows in 0usize..3000) {
            let mut state = seed | 1;
            let ids: Vec<u32> = (0..rows)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % channels as u64) as u32
                })
                .collect();
            check(&ids, channels);
        }
    }
}
