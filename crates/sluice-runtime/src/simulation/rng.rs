//! The simulation's seeded random numbers (SplitMix64): the same seed gives the same task times,
//! loss points and victims' ranks, with no dependency for something this small.

/// A SplitMix64 generator.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `low..=high` (`low` when `high < low`).
    pub(crate) fn between(&mut self, low: u64, high: u64) -> u64 {
        let span = high.saturating_sub(low).saturating_add(1);
        low + self.next_u64() % span
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_numbers_within_the_bounds() {
        let first: Vec<u64> = {
            let mut rng = SplitMix64::new(7);
            (0..100).map(|_| rng.between(3, 9)).collect()
        };
        let mut rng = SplitMix64::new(7);
        let again: Vec<u64> = (0..100).map(|_| rng.between(3, 9)).collect();
        assert_eq!(first, again);
        assert!(first.iter().all(|n| (3..=9).contains(n)), "{first:?}");
        // Every value of the range comes up in 100 draws of 7.
        for n in 3..=9 {
            assert!(first.contains(&n), "{n} never drawn: {first:?}");
        }
        assert_eq!(SplitMix64::new(1).between(5, 5), 5);
    }
}
