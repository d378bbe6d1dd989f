//! Randomness for the choice: the [`RandomSource`] trait selection draws from and the
//! seedable [`SelectionRng`] (SplitMix64) that makes selection reproducible under a seed.

/// A source of uniform random bits for [`choose`]: the small part of an RNG interface
/// selection needs. Implemented by [`SelectionRng`]; hosts may plug in their own.
///
/// [`choose`]: super::choose
pub trait RandomSource {
    /// 64 uniformly random bits.
    fn next_u64(&mut self) -> u64;

    /// Uniform in [0, 1): the top 53 bits of [`next_u64`](Self::next_u64) scaled by 2^-53.
    #[inline]
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n`, without modulo bias (Lemire's multiply-and-reject). Returns 0 for
    /// `n == 0` rather than panicking (callers never ask for that).
    #[inline]
    fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        let mut low = m as u64;
        if low < n {
            // 2^64 mod n: the size of the biased sliver at the bottom of each bucket.
            let threshold = n.wrapping_neg() % n;
            while low < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
                low = m as u64;
            }
        }
        (m >> 64) as u64
    }
}

impl<R: RandomSource + ?Sized> RandomSource for &mut R {
    #[inline]
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

/// A tiny seedable RNG (SplitMix64) so selection is deterministic under a fixed seed.
///
/// Why SplitMix64: 8 bytes of state, a handful of instructions per draw, every seed
/// (including 0) gives a full-period, well-mixed stream, and it needs no dependency. It
/// is not cryptographic, which selection does not need. It is not `Sync`-shared: keep one
/// per thread (or per selection) and seed it from wherever determinism is wanted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectionRng {
    state: u64,
}

impl SelectionRng {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// An RNG whose whole output stream is a function of `seed`.
    #[inline]
    pub const fn from_seed(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(Self::GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        RandomSource::next_f64(self)
    }
}

impl RandomSource for SelectionRng {
    #[inline]
    fn next_u64(&mut self) -> u64 {
        SelectionRng::next_u64(self)
    }
}
