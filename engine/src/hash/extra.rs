//! Extra keys: what an engine mixes into a block's identity besides its tokens
//! (REFERENCE.md §9) — multimodal inputs, the request's cache salt, prompt embeddings.
//! Two blocks with equal tokens and different extra keys are different blocks, so a
//! request must hash with the same keys to match them.
//!
//! kvr's rule (the same on both sides, so an event and a request agree):
//! 1. each extra key becomes one u64 *key value* ([`mm_key`], [`cache_salt_key`],
//!    [`prompt_embeds_key`]);
//! 2. a block's local hash is the multimodal local hash of its tokens and its key values
//!    ([`local_block_hash_mm`](super::local_block_hash_mm): tokens, then the values sorted
//!    ascending, each LE u64, seeded with the partition's salt), so a block without extra
//!    keys hashes exactly as before and Dynamo's `block_mm_infos` hashes (already u64) are
//!    key values as they are.
//!
//! Event side (vLLM 0.33's `extra_keys`, one entry per block, untagged): a string equal
//! to the event's `lora_name` is dropped (LoRA already salts the seed, as in Dynamo); any
//! other string is a cache salt; an `[identifier, offset]` pair is a multimodal input
//! starting `offset` tokens after the block's first token (negative when it began in an
//! earlier block); bytes are a prompt-embeddings digest; any other value folds as
//! [`opaque_key`] of its msgpack bytes, which no request can produce (such a block
//! is counted for no request: an undercount, never an overcount).
//!
//! Request side: [`BlockExtras`] — a cache salt (on block 0, as vLLM puts it), multimodal
//! spans over the prompt's tokens (each block the span touches gets the input's key, with
//! its offset relative to that block, as vLLM computes it), and raw per-block key values.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{local_block_hash_mm, HashSalt, LocalHash};

/// Seeds of the key-value hashes, one per kind so that kinds never collide by design.
const MM_SEED: u64 = 0x6b76_725f_6d6d; // "kvr_mm"
const TEXT_SEED: u64 = 0x6b76_725f_7478; // "kvr_tx"
const BYTES_SEED: u64 = 0x6b76_725f_6279; // "kvr_by"
const OPAQUE_SEED: u64 = 0x6b76_725f_6f70; // "kvr_op"

/// The key value of a multimodal input `identifier` (vLLM's `mm_feature.identifier`)
/// starting `offset` tokens after the block's first token:
/// `xxh3(LE64(xxh3(identifier, MM)) ‖ LE64(offset), MM)`.
pub fn mm_key(identifier: &[u8], offset: i64) -> u64 {
    mm_key_of(mm_identifier_hash(identifier), offset)
}

fn mm_identifier_hash(identifier: &[u8]) -> u64 {
    xxh3_64_with_seed(identifier, MM_SEED)
}

fn mm_key_of(identifier_hash: u64, offset: i64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&identifier_hash.to_le_bytes());
    buf[8..].copy_from_slice(&offset.to_le_bytes());
    xxh3_64_with_seed(&buf, MM_SEED)
}

/// The key value of a cache salt (vLLM's `cache_salt`, on block 0): `xxh3(salt, TEXT)`.
/// An event's bare string other than its LoRA name is read with this.
pub fn cache_salt_key(salt: &[u8]) -> u64 {
    xxh3_64_with_seed(salt, TEXT_SEED)
}

/// The key value of a block's prompt-embeddings digest (vLLM: sha256 of the block's
/// embeddings, sent as bytes): `xxh3(digest, BYTES)`.
pub fn prompt_embeds_key(digest: &[u8]) -> u64 {
    xxh3_64_with_seed(digest, BYTES_SEED)
}

/// The key value of an extra key of a shape kvr does not know, from its msgpack bytes.
pub fn opaque_key(msgpack: &[u8]) -> u64 {
    xxh3_64_with_seed(msgpack, OPAQUE_SEED)
}

/// Most multimodal inputs a request may name ([`BlockExtras::multimodal`] refuses more):
/// a bound on what one caller's request makes kvr store.
pub const MAX_MM_SPANS: usize = 4096;
/// Most raw per-block key values a request may carry ([`BlockExtras::block_key`]).
pub const MAX_BLOCK_KEYS: usize = 1 << 16;

/// A request's extra keys, folded into its blocks' local hashes as engines fold them
/// (multimodal spans, cache salt, prompt-embeddings digests). Empty by default;
/// [`BlockExtras::local_hashes`] applies them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtras {
    /// The cache salt's key value (block 0).
    salt: Option<u64>,
    /// Multimodal inputs: (identifier hash, first token, length in tokens).
    spans: Vec<(u64, u64, u64)>,
    /// Raw key values: (block index, value).
    keys: Vec<(usize, u64)>,
}

/// A request's extra keys exceed [`MAX_MM_SPANS`] or [`MAX_BLOCK_KEYS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooManyExtraKeys;

impl std::fmt::Display for TooManyExtraKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "too many extra keys (at most {MAX_MM_SPANS} multimodal inputs and \
             {MAX_BLOCK_KEYS} block keys per request)"
        )
    }
}

impl std::error::Error for TooManyExtraKeys {}

impl BlockExtras {
    /// No extra keys (the same as `default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// No key at all: hashing is the plain token hash.
    pub fn is_empty(&self) -> bool {
        self.salt.is_none() && self.spans.is_empty() && self.keys.is_empty()
    }

    /// Empties it for reuse (keeps the allocations).
    pub fn clear(&mut self) {
        self.salt = None;
        self.spans.clear();
        self.keys.clear();
    }

    /// The request's cache salt (`None` or empty: none), folded into block 0 as vLLM does.
    pub fn set_cache_salt(&mut self, salt: Option<&str>) -> &mut Self {
        self.salt = salt
            .filter(|s| !s.is_empty())
            .map(|s| cache_salt_key(s.as_bytes()));
        self
    }

    /// A multimodal input `identifier` occupying prompt tokens `offset..offset + length`
    /// (vLLM's `mm_position`): every block it touches gets its key, with the input's
    /// offset relative to that block. A zero length touches nothing.
    pub fn multimodal(
        &mut self,
        identifier: &[u8],
        offset: u64,
        length: u64,
    ) -> Result<&mut Self, TooManyExtraKeys> {
        if self.spans.len() >= MAX_MM_SPANS {
            return Err(TooManyExtraKeys);
        }
        self.spans
            .push((mm_identifier_hash(identifier), offset, length));
        Ok(self)
    }

    /// A raw key value for block `block` (0-based): e.g. Dynamo's `block_mm_infos`
    /// `mm_hash`, or [`prompt_embeds_key`] of the block's digest.
    pub fn block_key(&mut self, block: usize, value: u64) -> Result<&mut Self, TooManyExtraKeys> {
        if self.keys.len() >= MAX_BLOCK_KEYS {
            return Err(TooManyExtraKeys);
        }
        self.keys.push((block, value));
        Ok(self)
    }

    /// Appends block `index`'s key values (`block_size` tokens per block) to `out`.
    pub(crate) fn block_values(&self, index: usize, block_size: usize, out: &mut Vec<u64>) {
        if index == 0 {
            out.extend(self.salt);
        }
        let bs = block_size as u64;
        let start = (index as u64).saturating_mul(bs);
        let end = start.saturating_add(bs);
        for &(id, offset, length) in &self.spans {
            // vLLM: the block holds part of the input when end > offset and
            // start < offset + length.
            if length > 0 && end > offset && start < offset.saturating_add(length) {
                // Both below 2^64 and the difference of two token positions: as i64 it is
                // exact for any real prompt (i128 keeps it exact for every input).
                let rel = (i128::from(offset) - i128::from(start)) as i64;
                out.push(mm_key_of(id, rel));
            }
        }
        out.extend(
            self.keys
                .iter()
                .filter(|&&(b, _)| b == index)
                .map(|&(_, v)| v),
        );
    }

    /// The local hashes of `tokens`' complete blocks with these keys, into `out`
    /// (cleared first).
    pub fn local_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        salt: HashSalt,
        out: &mut Vec<LocalHash>,
    ) {
        out.clear();
        let bs = block_size.max(1);
        let mut values = Vec::new();
        out.extend(tokens.chunks_exact(bs).enumerate().map(|(i, block)| {
            values.clear();
            self.block_values(i, bs, &mut values);
            local_block_hash_mm(block, &values, salt)
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::local_block_hash;

    #[test]
    fn no_keys_is_the_plain_hash() {
        let toks: Vec<u32> = (0..8).collect();
        let mut out = Vec::new();
        BlockExtras::new().local_hashes(&toks, 4, HashSalt::NONE, &mut out);
        assert_eq!(
            out,
            vec![
                local_block_hash(&toks[..4], HashSalt::NONE),
                local_block_hash(&toks[4..], HashSalt::NONE)
            ]
        );
    }

    #[test]
    fn cache_salt_changes_block_zero_only() {
        let toks: Vec<u32> = (0..8).collect();
        let (mut plain, mut salted) = (Vec::new(), Vec::new());
        BlockExtras::new().local_hashes(&toks, 4, HashSalt::NONE, &mut plain);
        BlockExtras::new().set_cache_salt(Some("s")).local_hashes(
            &toks,
            4,
            HashSalt::NONE,
            &mut salted,
        );
        assert_ne!(plain[0], salted[0]);
        assert_eq!(plain[1], salted[1]);
        let mut empty = Vec::new();
        BlockExtras::new().set_cache_salt(Some("")).local_hashes(
            &toks,
            4,
            HashSalt::NONE,
            &mut empty,
        );
        assert_eq!(plain, empty, "an empty salt is no salt");
    }

    #[test]
    fn a_span_keys_every_block_it_touches_with_its_relative_offset() {
        let mut e = BlockExtras::new();
        // Tokens 2..7 with block size 4: blocks 0 (offset 2) and 1 (offset -2), not 2.
        e.multimodal(b"img", 2, 5).unwrap();
        let mut v = Vec::new();
        e.block_values(0, 4, &mut v);
        assert_eq!(v, vec![mm_key(b"img", 2)]);
        v.clear();
        e.block_values(1, 4, &mut v);
        assert_eq!(v, vec![mm_key(b"img", -2)]);
        v.clear();
        e.block_values(2, 4, &mut v);
        assert!(v.is_empty());
        // Different images, equal tokens: different blocks.
        let toks = [7u32; 8];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        e.local_hashes(&toks, 4, HashSalt::NONE, &mut a);
        let mut f = BlockExtras::new();
        f.multimodal(b"other", 2, 5).unwrap();
        f.local_hashes(&toks, 4, HashSalt::NONE, &mut b);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn absurd_spans_are_bounded_and_harmless() {
        let mut e = BlockExtras::new();
        e.multimodal(b"x", u64::MAX, u64::MAX).unwrap();
        e.multimodal(b"y", 0, u64::MAX).unwrap();
        let mut v = Vec::new();
        e.block_values(usize::MAX / 8, 4, &mut v);
        for _ in 2..MAX_MM_SPANS {
            e.multimodal(b"z", 0, 0).unwrap();
        }
        assert_eq!(e.multimodal(b"z", 0, 1).unwrap_err(), TooManyExtraKeys);
    }

    #[test]
    fn kinds_do_not_collide() {
        assert_ne!(cache_salt_key(b"a"), prompt_embeds_key(b"a"));
        assert_ne!(cache_salt_key(b"a"), opaque_key(b"a"));
        assert_ne!(mm_key(b"a", 0), mm_key(b"a", 1));
    }
}
