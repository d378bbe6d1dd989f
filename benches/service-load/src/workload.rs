//! The prompt stream: shared system-prompt prefixes, a unique suffix, and some
//! multi-turn reuse, as token ids, with the block hashes an engine would report.
//!
//! The k-th prompt drawn is a function of the seed and k alone (sessions advance when a
//! prompt is drawn, not when it is served), so every service sees the same stream in
//! the same order whatever the timing.

use std::sync::Arc;

/// Token ids are drawn below this (a typical vocabulary size).
const VOCAB: u64 = 32_000;

/// splitmix64: small, fast, and reproducible across platforms (no dependency needed).
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        // The state advances by the golden ratio; the output is its SplitMix64 mix.
        let z = kvr::hash::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi] (inclusive).
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    fn tokens(&mut self, n: usize, out: &mut Vec<u32>) {
        out.extend((0..n).map(|_| (self.next_u64() % VOCAB) as u32));
    }
}

/// How prompt lengths are drawn between `min_len` and `max_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LenDist {
    Uniform,
    /// Log-uniform: as many prompts of 1k-2k as of 4k-8k tokens (real traffic is skewed
    /// to short prompts).
    Log,
}

#[derive(Debug, Clone)]
pub(crate) struct WorkloadConfig {
    pub seed: u64,
    pub block_size: usize,
    pub min_len: usize,
    pub max_len: usize,
    pub len_dist: LenDist,
    /// Number of shared system prompts; each prompt starts with one of them.
    pub groups: usize,
    pub group_min: usize,
    pub group_max: usize,
    /// Probability that a prompt is the next turn of an earlier conversation.
    pub multi_turn: f64,
    /// Conversations kept for multi-turn reuse.
    pub sessions: usize,
    /// Every prompt exactly this long (the per-op CPU mode): system prompts are drawn no
    /// longer than half of it, and a next turn keeps the conversation's leading tokens,
    /// cut to leave room for its new message.
    pub fixed_len: Option<usize>,
}

/// One prompt: its tokens and the sequence hashes of its complete blocks.
#[derive(Debug, Clone)]
pub(crate) struct Prompt {
    /// Its place in the stream (0, 1, …).
    pub index: u64,
    pub tokens: Arc<Vec<u32>>,
    /// Dynamo's chained sequence hash of each complete block (REFERENCE §1). Also used as
    /// the engine's block hash in the events (a chained hash, as vLLM's is).
    pub hashes: Arc<Vec<u64>>,
}

#[derive(Debug)]
pub(crate) struct Workload {
    cfg: WorkloadConfig,
    rng: Rng,
    groups: Vec<Vec<u32>>,
    sessions: Vec<Option<Prompt>>,
    pub drawn: u64,
}

impl Workload {
    pub(crate) fn new(cfg: WorkloadConfig) -> Self {
        let mut rng = Rng::new(cfg.seed);
        // A fixed length L keeps system prompts within [L/4, L/2] at most, so that at 1k
        // tokens a prompt is not all shared prefix.
        let (gmin, gmax) = match cfg.fixed_len {
            Some(l) => {
                let hi = cfg.group_max.min(l / 2).max(1);
                (cfg.group_min.min(l / 4).clamp(1, hi), hi)
            }
            None => (cfg.group_min, cfg.group_max),
        };
        let groups = (0..cfg.groups)
            .map(|_| {
                let n = rng.range(gmin, gmax);
                let mut t = Vec::with_capacity(n);
                rng.tokens(n, &mut t);
                t
            })
            .collect();
        let sessions = vec![None; cfg.sessions];
        Workload {
            cfg,
            rng,
            groups,
            sessions,
            drawn: 0,
        }
    }

    fn length(&mut self) -> usize {
        if let Some(l) = self.cfg.fixed_len {
            return l;
        }
        let (lo, hi) = (self.cfg.min_len as f64, self.cfg.max_len as f64);
        let u = self.rng.unit();
        let len = match self.cfg.len_dist {
            LenDist::Uniform => lo + u * (hi - lo),
            LenDist::Log => (lo.ln() + u * (hi.ln() - lo.ln())).exp(),
        };
        (len as usize).clamp(self.cfg.min_len, self.cfg.max_len)
    }

    /// A fresh conversation: a system prompt, then unique tokens up to a drawn length.
    fn fresh(&mut self) -> Vec<u32> {
        let len = self.length();
        let g = self.rng.range(0, self.groups.len() - 1);
        let mut t = Vec::with_capacity(len);
        let prefix = &self.groups[g];
        t.extend_from_slice(&prefix[..prefix.len().min(len)]);
        let rest = len - t.len();
        self.rng.tokens(rest, &mut t);
        t
    }

    /// The next prompt of the stream.
    pub(crate) fn next_prompt(&mut self) -> Prompt {
        self.drawn += 1;
        let slot = self.rng.range(0, self.sessions.len() - 1);
        let turn = self.rng.unit() < self.cfg.multi_turn;
        let tokens = match (&self.sessions[slot], turn) {
            (Some(prev), true) => {
                // The next turn: the whole previous prompt (as if its answer were part of
                // it), then a new user message; a conversation too long starts over.
                let add = self.rng.range(128, 1024);
                if let Some(l) = self.cfg.fixed_len {
                    // Fixed length: the conversation so far, cut to make room.
                    let add = add.min(l / 4);
                    let keep = prev.tokens.len().min(l - add);
                    let mut t = Vec::with_capacity(l);
                    t.extend_from_slice(&prev.tokens[..keep]);
                    self.rng.tokens(l - keep, &mut t);
                    t
                } else if prev.tokens.len() + add <= self.cfg.max_len {
                    let mut t = Vec::with_capacity(prev.tokens.len() + add);
                    t.extend_from_slice(&prev.tokens);
                    self.rng.tokens(add, &mut t);
                    t
                } else {
                    self.fresh()
                }
            }
            _ => self.fresh(),
        };
        let hashes = sequence_hashes(&tokens, self.cfg.block_size);
        let p = Prompt {
            index: self.drawn - 1,
            tokens: Arc::new(tokens),
            hashes: Arc::new(hashes),
        };
        self.sessions[slot] = Some(p.clone());
        p
    }
}

/// Dynamo's sequence hashes of the complete blocks of `tokens` (REFERENCE §1, no salt):
/// kvr's own hashing, which the engine's conformance tests pin to Dynamo's.
pub(crate) fn sequence_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let hasher = kvr::hash::BlockHasher::new(block_size, kvr::hash::HashSalt::new(None, None))
        .expect("a block size of at least 1");
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    hasher.hash_tokens(tokens, &mut local, &mut seq);
    seq
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_hash_vectors() {
        // REFERENCE §1: tokens 0..8, block size 4, no salt.
        let t: Vec<u32> = (0..8).collect();
        assert_eq!(
            sequence_hashes(&t, 4),
            vec![9143094415614847814, 9510318385840434533]
        );
    }

    fn cfg(seed: u64) -> WorkloadConfig {
        WorkloadConfig {
            seed,
            block_size: 16,
            min_len: 1024,
            max_len: 8192,
            len_dist: LenDist::Log,
            groups: 4,
            group_min: 512,
            group_max: 2048,
            multi_turn: 0.3,
            sessions: 16,
            fixed_len: None,
        }
    }

    #[test]
    fn fixed_length_prompts_share_prefixes_and_continue_conversations() {
        for l in [1024, 8192, 32768] {
            let mut w = Workload::new(WorkloadConfig {
                fixed_len: Some(l),
                ..cfg(3)
            });
            assert!(w.groups.iter().all(|g| g.len() <= l / 2 && !g.is_empty()));
            let mut prompts: Vec<Prompt> = Vec::new();
            let mut continued = 0;
            for _ in 0..200 {
                let p = w.next_prompt();
                assert_eq!(p.tokens.len(), l);
                assert!(w.groups.iter().any(|g| p.tokens.starts_with(g)));
                // A next turn shares more than any system prompt with an earlier prompt.
                if prompts
                    .iter()
                    .any(|q| q.tokens[..l / 2 + 1] == p.tokens[..l / 2 + 1])
                {
                    continued += 1;
                }
                prompts.push(p);
            }
            assert!(continued >= 20, "{l}: {continued} continued of 200");
        }
    }

    #[test]
    fn same_seed_same_stream_and_bounds() {
        let (mut a, mut b) = (Workload::new(cfg(7)), Workload::new(cfg(7)));
        for _ in 0..500 {
            let (p, q) = (a.next_prompt(), b.next_prompt());
            assert_eq!(p.tokens, q.tokens);
            assert!((1024..=8192).contains(&p.tokens.len()));
            assert_eq!(p.hashes.len(), p.tokens.len() / 16);
            // Every prompt starts with one of the system prompts.
            // Every prompt starts with a system prompt (or, when drawn shorter than it,
            // its first min_len tokens: later turns extend such a truncated one).
            assert!(a
                .groups
                .iter()
                .any(|g| p.tokens.starts_with(&g[..g.len().min(1024)])));
        }
        assert_ne!(
            Workload::new(cfg(8)).next_prompt().tokens,
            Workload::new(cfg(7)).next_prompt().tokens
        );
    }
}
