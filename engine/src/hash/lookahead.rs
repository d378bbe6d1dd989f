//! Lookahead hashing: with speculative decoding's lookahead (vLLM's
//! `num_hash_lookahead_tokens`, L > 0) an engine's hash of block i covers the L tokens
//! after the block too, since the drafter's state at the block's last position depends on
//! them; the engine publishes those tokens per block (`lookahead_token_ids`). Such a block
//! is reusable only by a prompt that continues with the same L tokens, and a block with
//! fewer than L tokens after it has no hash at all.
//!
//! kvr's rule (the same on both sides): the L tokens become one more key value of the block
//! ([`lookahead_key`]), folded into its local hash with its other extra keys
//! ([`local_block_hash_mm`]). A request is hashed once per lookahead length its partition
//! has seen ([`lookahead_local_hashes`]), and each rank matches only the hashes of its own
//! length, so no block is counted where only its own tokens match.

use xxhash_rust::xxh3::Xxh3;

use super::{local_block_hash_mm, BlockExtras, HashSalt, LocalHash};

/// The seed of lookahead key values (its own kind: never equal to another key by design).
const LOOKAHEAD_SEED: u64 = 0x6b76_725f_6c61; // "kvr_la"

/// The key value of a block's lookahead tokens: xxh3 of the tokens as LE u32, seeded with
/// a seed of its own.
pub fn lookahead_key(tokens: &[u32]) -> u64 {
    // Streamed: no buffer per block (it runs once per stored block and prompt block).
    let mut h = Xxh3::with_seed(LOOKAHEAD_SEED);
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest()
}

/// The local hashes a rank hashing with `lookahead` tokens of lookahead gives `tokens`'
/// blocks (with `extras`' keys, under `salt`), into `out` (cleared first): one per
/// complete block followed by at least `lookahead` tokens.
pub fn lookahead_local_hashes(
    tokens: &[u32],
    block_size: usize,
    lookahead: usize,
    extras: Option<&BlockExtras>,
    salt: HashSalt,
    out: &mut Vec<LocalHash>,
) {
    out.clear();
    let bs = block_size.max(1);
    let n = tokens.len().saturating_sub(lookahead) / bs;
    let mut values = Vec::new();
    for i in 0..n {
        values.clear();
        if let Some(e) = extras {
            e.block_values(i, bs, &mut values);
        }
        let end = (i + 1) * bs;
        values.push(lookahead_key(&tokens[end..end + lookahead]));
        out.push(local_block_hash_mm(&tokens[end - bs..end], &values, salt));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_xxh3_of_the_tokens_le_bytes() {
        let bytes: Vec<u8> = [4u32, 5].iter().flat_map(|t| t.to_le_bytes()).collect();
        let want = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, LOOKAHEAD_SEED);
        assert_eq!(lookahead_key(&[4, 5]), want);
    }

    #[test]
    fn a_block_is_hashed_only_with_its_lookahead_tokens_present() {
        let toks: Vec<u32> = (0..10).collect();
        let mut out = Vec::new();
        lookahead_local_hashes(&toks, 4, 2, None, HashSalt::NONE, &mut out);
        // Blocks 0 and 1 (tokens 4..6 and 8..10 follow them); no third block.
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0],
            local_block_hash_mm(&toks[..4], &[lookahead_key(&[4, 5])], HashSalt::NONE)
        );
        let mut short = Vec::new();
        lookahead_local_hashes(&toks[..9], 4, 2, None, HashSalt::NONE, &mut short);
        assert_eq!(short, out[..1], "block 1 lacks one lookahead token");
        // Another continuation: block 0 differs, though its own tokens are the same.
        let mut other = toks.clone();
        other[5] = 99;
        lookahead_local_hashes(&other, 4, 2, None, HashSalt::NONE, &mut short);
        assert_ne!(short[0], out[0]);
    }
}
