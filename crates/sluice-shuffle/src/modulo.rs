//! Exact `hash % n` without a division instruction.
//!
//! Hash routing must put every row exactly where DataFusion's `hash % n` puts it, so this is an exact
//! remainder, not a range reduction. Powers of two use a mask. Other divisors use a precomputed 64-bit
//! reciprocal: the quotient is `((x - hi) / 2 + hi) >> shift` with `hi = mulhi(x, magic)`
//! (the "round-up, add" variant, exact for every 64-bit `x`), and the remainder `x - q * n`.

/// `x % n` for a fixed `n`, strength-reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastModulo {
    /// `n` is a power of two: `x & (n - 1)`.
    Mask(u64),
    /// Any other `n ≥ 3`.
    Reciprocal {
        /// The divisor.
        divisor: u64,
        /// `2^(64 + shift + 1) / n` rounded up, minus `2^64` (fits in 64 bits).
        magic: u64,
        /// `floor(log2(n))`.
        shift: u32,
    },
}

impl FastModulo {
    /// The reducer for `divisor` (at least 1).
    pub fn new(divisor: u64) -> Self {
        let divisor = divisor.max(1);
        if divisor.is_power_of_two() {
            return FastModulo::Mask(divisor - 1);
        }
        let shift = 63 - divisor.leading_zeros();
        // (2^(64 + shift)) / divisor fits in 64 bits because divisor > 2^shift.
        let numerator = 1u128 << (64 + shift);
        let quotient = numerator / u128::from(divisor);
        let remainder = numerator % u128::from(divisor);
        // Double the quotient, rounding up if the doubled remainder passes the divisor: this is
        // 2^(65 + shift) / divisor rounded up, minus 2^64 once `+ 1` below is applied.
        let mut proposed = (quotient as u64).wrapping_add(quotient as u64);
        let twice_remainder = remainder * 2;
        if twice_remainder >= u128::from(divisor) {
            proposed = proposed.wrapping_add(1);
        }
        FastModulo::Reciprocal {
            divisor,
            magic: proposed.wrapping_add(1),
            shift,
        }
    }

    /// `value / divisor`.
    #[inline(always)]
    pub fn quotient(self, value: u64) -> u64 {
        match self {
            FastModulo::Mask(mask) => value >> mask.count_ones(),
            FastModulo::Reciprocal { magic, shift, .. } => {
                let high = ((u128::from(value) * u128::from(magic)) >> 64) as u64;
                (((value - high) >> 1) + high) >> shift
            }
        }
    }

    /// `value % divisor`.
    #[inline(always)]
    pub fn remainder(self, value: u64) -> u64 {
        match self {
            FastModulo::Mask(mask) => value & mask,
            FastModulo::Reciprocal { divisor, .. } => value - self.quotient(value) * divisor,
        }
    }

    /// Writes `hash % n` for every hash into `out` (cleared first).
    pub fn remainders(self, hashes: &[u64], out: &mut Vec<u32>) {
        out.clear();
        out.reserve(hashes.len());
        match self {
            FastModulo::Mask(mask) => out.extend(hashes.iter().map(|h| (h & mask) as u32)),
            FastModulo::Reciprocal {
                divisor,
                magic,
                shift,
            } => out.extend(hashes.iter().map(|&h| {
                let high = ((u128::from(h) * u128::from(magic)) >> 64) as u64;
                let quotient = (((h - high) >> 1) + high) >> shift;
                (h - quotient * divisor) as u32
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const EDGES: [u64; 8] = [
        0,
        1,
        2,
        u64::MAX,
        u64::MAX - 1,
        1 << 63,
        (1 << 63) - 1,
        (1 << 63) + 1,
    ];

    #[test]
    fn exact_for_small_divisors_and_edge_values() {
        for divisor in 1..=1025u64 {
            let reducer = FastModulo::new(divisor);
            for value in EDGES.iter().copied().chain(0..2000) {
                assert_eq!(
                    reducer.remainder(value),
                    value % divisor,
                    "{value} % {divisor}"
                );
                assert_eq!(
                    reducer.quotient(value),
                    value / divisor,
                    "{value} / {divisor}"
                );
            }
        }
    }

    #[test]
    fn batch_remainders_match() {
        let hashes: Vec<u64> = (0..10_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for divisor in [3u64, 7, 16, 100, 255, 256, 1000] {
            let mut out = Vec::new();
            FastModulo::new(divisor).remainders(&hashes, &mut out);
            let expected: Vec<u32> = hashes.iter().map(|h| (h % divisor) as u32).collect();
            assert_eq!(out, expected);
        }
    }

    proptest! {
        #[test]
        fn exact_for_any_value(value in any::<u64>(), divisor in 1u64..=u64::from(u32::MAX)) {
            let reducer = FastModulo::new(divisor);
            prop_assert_eq!(reducer.remainder(value), value % divisor);
        }

        #[test]
        fn exact_for_large_divisors(value in any::<u64>(), divisor in 1u64..) {
            prop_assert_eq!(FastModulo::new(divisor).remainder(value), value % divisor);
        }
    }
}
