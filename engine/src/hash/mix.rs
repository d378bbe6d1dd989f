//! The hasher of kvr's own maps, whose keys are already random (block hashes) or small
//! and sequential (ranks, selection ids). Below the index so every layer can use it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A hasher for 64-bit keys that are already random (hashes) or small and sequential
/// (ranks, selection ids): one folded 128-bit multiply per word, so hashbrown gets good
/// high (tag) and low (bucket) bits. Deterministic, so loom replays see one map layout.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HashMix(u64);

impl Hasher for HashMix {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        let m = u128::from(x ^ self.0 ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15u128;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
}

/// SplitMix64's finalizer: a bijective mix of a 64-bit word, for picking a shard from ids
/// that are small or sequential (selection ids, minted in blocks).
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A `HashMap` keyed through [`HashMix`].
pub(crate) type HashMixMap<K, V> = HashMap<K, V, BuildHasherDefault<HashMix>>;
