//! Dynamo-compatible block hashing (REFERENCE.md §1).
//!
//! A prompt is cut into complete blocks of `block_size` u32 tokens (a trailing partial
//! block is not hashed). Each block gets a *local* hash: xxh3-64 over its tokens as
//! little-endian bytes, seeded with 1337 plus the LoRA and cache-namespace salts. The
//! *sequence* hash chains the local hashes so that equal sequence hashes mean equal
//! prefixes: `seq[0] = local[0]`, `seq[i] = xxh3(LE(seq[i-1]) ‖ LE(local[i]), 1337)`.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

pub(crate) mod extra;
pub(crate) mod lookahead;
pub(crate) mod mix;

pub use extra::{
    cache_salt_key, mm_key, opaque_key, prompt_embeds_key, BlockExtras, TooManyExtraKeys,
    MAX_BLOCK_KEYS, MAX_MM_SPANS,
};
pub use lookahead::{lookahead_key, lookahead_local_hashes};
pub use mix::splitmix64;

/// Hash of one block's content (and salt), independent of its position.
pub type LocalHash = u64;
/// Hash of a whole prefix ending at a block: the chain of local hashes.
pub type SequenceHash = u64;

/// The base seed of every local hash and the fixed seed of the sequence chain.
pub const BASE_SEED: u64 = 1337;

/// The seed of a partition's local hashes: 1337 salted by LoRA name and cache namespace.
///
/// Empty names count as absent, as in Dynamo.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HashSalt(u64);

impl HashSalt {
    /// No LoRA adapter, no cache namespace.
    pub const NONE: HashSalt = HashSalt(BASE_SEED);

    /// The salt of a LoRA adapter and a cache namespace; `None` or an empty name adds
    /// nothing.
    pub fn new(lora_name: Option<&str>, cache_namespace: Option<&str>) -> Self {
        let mut seed = BASE_SEED;
        if let Some(name) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0));
        }
        if let Some(ns) = cache_namespace.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
        }
        HashSalt(seed)
    }

    /// The xxh3 seed local hashes use.
    pub fn seed(self) -> u64 {
        self.0
    }
}

impl Default for HashSalt {
    fn default() -> Self {
        Self::NONE
    }
}

/// Local hash of one block of tokens.
#[inline]
pub fn local_block_hash(tokens: &[u32], salt: HashSalt) -> LocalHash {
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(tokens_as_le_bytes(tokens), salt.0)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut h = Xxh3::with_seed(salt.0);
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.digest()
    }
}

/// Local hash of a multimodal block: its tokens followed by the block's multimodal
/// content hashes, sorted ascending, each as LE u64. The caller's slice is not reordered.
pub fn local_block_hash_mm(tokens: &[u32], mm_hashes: &[u64], salt: HashSalt) -> LocalHash {
    if mm_hashes.is_empty() {
        return local_block_hash(tokens, salt);
    }
    let mut sorted: smallvec::SmallVec<[u64; 8]> = mm_hashes.iter().copied().collect();
    sorted.sort_unstable();
    let mut h = Xxh3::with_seed(salt.0);
    #[cfg(target_endian = "little")]
    h.update(tokens_as_le_bytes(tokens));
    #[cfg(not(target_endian = "little"))]
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    for m in &sorted {
        h.update(&m.to_le_bytes());
    }
    h.digest()
}

/// One link of the sequence chain.
#[inline]
pub fn chain_hash(parent: SequenceHash, local: LocalHash) -> SequenceHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, BASE_SEED)
}

/// The sequence hash of a block with local hash `local` after the prefix ending at `prev`
/// (`None` = the block starts the prompt, so its sequence hash is its local hash).
#[inline]
pub fn next_sequence_hash(prev: Option<SequenceHash>, local: LocalHash) -> SequenceHash {
    match prev {
        None => local,
        Some(p) => chain_hash(p, local),
    }
}

/// Sequence hashes of a run of local hashes that continues `parent` (`None` = from the
/// start of the prompt). Appends to `out`.
pub fn extend_sequence_hashes(
    parent: Option<SequenceHash>,
    locals: &[LocalHash],
    out: &mut Vec<SequenceHash>,
) {
    out.reserve(locals.len());
    let mut prev = parent;
    for &l in locals {
        let s = next_sequence_hash(prev, l);
        out.push(s);
        prev = Some(s);
    }
}

/// Sequence hashes of a whole prompt's local hashes.
pub fn sequence_hashes(locals: &[LocalHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(locals.len());
    extend_sequence_hashes(None, locals, &mut out);
    out
}

/// Tokens → local and sequence hashes in one pass, for a fixed block size and salt.
#[derive(Clone, Copy, Debug)]
pub struct BlockHasher {
    block_size: usize,
    salt: HashSalt,
}

/// A block size of zero cannot cut a prompt into blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroBlockSize;

impl std::fmt::Display for ZeroBlockSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("block size must be at least 1 token")
    }
}

impl std::error::Error for ZeroBlockSize {}

impl BlockHasher {
    /// A hasher of `block_size`-token blocks under `salt`; a block size of 0 is refused.
    pub fn new(block_size: usize, salt: HashSalt) -> Result<Self, ZeroBlockSize> {
        if block_size == 0 {
            return Err(ZeroBlockSize);
        }
        Ok(Self { block_size, salt })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The salt its local hashes are seeded with.
    pub fn salt(&self) -> HashSalt {
        self.salt
    }

    /// Number of complete blocks in `n_tokens` tokens.
    pub fn complete_blocks(&self, n_tokens: usize) -> usize {
        n_tokens / self.block_size
    }

    /// Clears `local` and `sequence` and fills them with one entry per complete block.
    /// Reusing the two vectors makes the call allocation-free.
    pub fn hash_tokens(
        &self,
        tokens: &[u32],
        local: &mut Vec<LocalHash>,
        sequence: &mut Vec<SequenceHash>,
    ) {
        local.clear();
        sequence.clear();
        let n = self.complete_blocks(tokens.len());
        local.reserve(n);
        sequence.reserve(n);
        let mut prev: Option<SequenceHash> = None;
        for block in tokens.chunks_exact(self.block_size) {
            let l = local_block_hash(block, self.salt);
            let s = next_sequence_hash(prev, l);
            local.push(l);
            sequence.push(s);
            prev = Some(s);
        }
    }

    /// Local hashes only (what a Stored event or a selection request carries).
    pub fn local_hashes(&self, tokens: &[u32], local: &mut Vec<LocalHash>) {
        local.clear();
        local.extend(
            tokens
                .chunks_exact(self.block_size)
                .map(|b| local_block_hash(b, self.salt)),
        );
    }
}

#[cfg(target_endian = "little")]
#[inline(always)]
fn tokens_as_le_bytes(tokens: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and every byte pattern is a valid u8; u8 needs alignment 1;
    // the byte length is exactly the slice's size in memory, inside one allocation; on a
    // little-endian target these bytes are the tokens' LE encoding.
    unsafe {
        core::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), core::mem::size_of_val(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_raw_vector() {
        assert_eq!(xxh3_64_with_seed(b"test data", 1337), 13226331709069118873);
    }

    #[test]
    fn pinned_token_vector() {
        let h = BlockHasher::new(4, HashSalt::NONE).unwrap();
        let (mut l, mut s) = (Vec::new(), Vec::new());
        h.hash_tokens(&[0, 1, 2, 3, 4, 5, 6, 7, 8], &mut l, &mut s);
        assert_eq!(l, vec![9143094415614847814, 12124091508212882195]);
        assert_eq!(s, vec![9143094415614847814, 9510318385840434533]);
        assert_eq!(sequence_hashes(&l), s);
    }

    #[test]
    fn salt_changes_local_hash_and_empty_salt_is_none() {
        assert_eq!(HashSalt::new(Some(""), Some("")), HashSalt::NONE);
        let a = local_block_hash(&[1, 2, 3, 4], HashSalt::NONE);
        let b = local_block_hash(&[1, 2, 3, 4], HashSalt::new(Some("adapter"), None));
        let c = local_block_hash(&[1, 2, 3, 4], HashSalt::new(None, Some("adapter")));
        assert_ne!(a, b);
        assert_ne!(b, c);
        let expect = BASE_SEED
            .wrapping_add(xxh3_64_with_seed(b"l", 0))
            .wrapping_add(xxh3_64_with_seed(b"n", 1));
        assert_eq!(HashSalt::new(Some("l"), Some("n")).seed(), expect);
    }

    #[test]
    fn multimodal_hash_sorts_and_appends() {
        let toks = [5u32, 6, 7, 8];
        let mut bytes = Vec::new();
        for t in toks {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        for m in [3u64, 9] {
            bytes.extend_from_slice(&m.to_le_bytes());
        }
        let want = xxh3_64_with_seed(&bytes, 1337);
        assert_eq!(local_block_hash_mm(&toks, &[9, 3], HashSalt::NONE), want);
        assert_eq!(
            local_block_hash_mm(&toks, &[], HashSalt::NONE),
            local_block_hash(&toks, HashSalt::NONE)
        );
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(
            BlockHasher::new(0, HashSalt::NONE).unwrap_err(),
            ZeroBlockSize
        );
    }
}
