//! Small prompts on a partition of block size [`B`]: the helpers the partition-level
//! tests (indexer policy, rank lifecycle) share.

use std::time::Instant;

use kvr::cost::SelectionRng;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::{Outcome, Partition, RankId, SelectRequest};

/// The block size of these tests' partitions.
pub(crate) const B: u32 = 4;

/// An eight-block prompt, distinct per seed.
pub(crate) fn prompt(seed: u32) -> Vec<u32> {
    (0..8 * B).map(|i| seed * 1000 + i).collect()
}

/// The sequence hashes of `tokens` (no salt).
/// The local hashes of a tokens prompt (block size `B`, no salt).
pub(crate) fn locals(tokens: &[u32]) -> Vec<u64> {
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    h.hash_tokens(tokens, &mut local, &mut seq);
    local
}

pub(crate) fn seqs(tokens: &[u32]) -> Vec<u64> {
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let (mut l, mut s) = (Vec::new(), Vec::new());
    h.hash_tokens(tokens, &mut l, &mut s);
    s
}

/// Books `tokens` with selection id `id` (seeding the tie-break with it); the chosen rank.
pub(crate) fn book(p: &Partition, tokens: &[u32], id: u64, now: Instant) -> RankId {
    let mut rng = SelectionRng::from_seed(id);
    match p
        .select_and_reserve(&SelectRequest::tokens(tokens), id, now, &mut rng)
        .unwrap()
    {
        Outcome::Selected(d) => d.rank,
        o => panic!("{o:?}"),
    }
}
