//! The deterministic workload every backend is fed: prompt trees over 128 workers.
//!
//! Workers are grouped into *holder groups* (one worker each in the `single` profile, eight
//! in `shared8`); every block is held by exactly the workers of its group, so the profile
//! sets the holders per block. Each group has a few system prompts (`SYS_LEN` blocks of
//! random content, its own). A request continues one of its group's system prompts:
//! - a plain request with `REQ_LEN - SYS_LEN` fresh blocks;
//! - every `TEMPLATE_EVERY`-th request is a *template variant*: the system prompt, a fresh
//!   `VARIANT_LEN`-block segment (the part of a template that varies, e.g. a user name), the
//!   template's body (`TEMPLATE_LEN` blocks, the same content at the same positions in every
//!   variant), then fresh blocks. Equal content at equal positions behind different
//!   prefixes is what a positional index can confuse (see the `splice` queries).
//!
//! Events, as an engine sends them: the first request on a system prompt stores it
//! (`parent = None`) on each holder, then every request stores its own blocks with the
//! system prompt's last block as parent. Engine hashes are a function of the block's chained
//! hash (as SGLang's, and vLLM's with `PYTHONHASHSEED` set), the same on every holder.
//!
//! Churn evicts whole requests, oldest first (their own blocks; system prompts stay, as an
//! engine's prefix cache keeps blocks that live requests share).

use kvr::hash::sequence_hashes;

/// Workers in every profile.
pub(crate) const WORKERS: usize = 128;
/// System prompts per holder group.
pub(crate) const SYS_PER_GROUP: usize = 4;
/// Blocks of a system prompt.
pub(crate) const SYS_LEN: usize = 16;
/// Blocks of a whole request chain (system prompt included).
pub(crate) const REQ_LEN: usize = 128;
/// Every n-th request is a template variant.
pub(crate) const TEMPLATE_EVERY: usize = 8;
/// Blocks of a template's varying segment.
pub(crate) const VARIANT_LEN: usize = 8;
/// Blocks of a template's shared body.
pub(crate) const TEMPLATE_LEN: usize = 32;
/// Requests in the cache-hot query set.
pub(crate) const HOT_SET: usize = 64;

/// splitmix64: small, fast, deterministic.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        // The state advances by the golden ratio; the output is its SplitMix64 mix.
        let z = kvr::hash::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }

    #[inline]
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// Holders per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Profile {
    Single,
    Shared8,
}

impl Profile {
    pub(crate) const ALL: [Profile; 2] = [Profile::Single, Profile::Shared8];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Profile::Single => "single",
            Profile::Shared8 => "shared8",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.label() == s)
    }

    pub(crate) fn holders(self) -> usize {
        match self {
            Profile::Single => 1,
            Profile::Shared8 => 8,
        }
    }

    pub(crate) fn groups(self) -> usize {
        WORKERS / self.holders()
    }
}

/// The engine's hash of a block: a function of its chained hash, so every holder names a
/// block alike (and two blocks with equal content behind different prefixes differently).
#[inline]
pub(crate) fn engine_hash(seq: u64) -> u64 {
    let mut r = Rng::new(seq ^ 0x656e_6769_6e65_2121);
    r.next_u64()
}

/// One block of a `Stored` event: (engine hash, local hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub ext: u64,
    pub local: u64,
}

/// One request: its group, and its chain's local hashes (system prompt first).
#[derive(Clone, Debug)]
pub(crate) struct Request {
    pub group: u32,
    pub sys: u32,
    /// Template id (`sys` of the group) for a template variant.
    pub template: Option<u32>,
    pub local: Vec<u64>,
}

/// A `Stored` event: on `worker`, `blocks` after `parent` (an engine hash).
#[derive(Clone, Debug)]
pub(crate) struct Store {
    pub worker: u32,
    pub parent: Option<u64>,
    pub blocks: Vec<Block>,
}

/// Generates requests and their events, deterministically.
#[derive(Debug)]
pub(crate) struct Generator {
    pub profile: Profile,
    rng: Rng,
    /// `[group][sys]` local hashes.
    sys_prompts: Vec<Vec<Vec<u64>>>,
    /// `[group][sys]` template bodies.
    templates: Vec<Vec<Vec<u64>>>,
    /// `[group][sys]` whether the group's holders have stored the system prompt.
    sys_stored: Vec<Vec<bool>>,
    next_request: usize,
}

impl Generator {
    pub(crate) fn new(profile: Profile, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let groups = profile.groups();
        let mut draw = |n: usize| -> Vec<u64> { (0..n).map(|_| rng.next_u64()).collect() };
        let sys_prompts = (0..groups)
            .map(|_| (0..SYS_PER_GROUP).map(|_| draw(SYS_LEN)).collect())
            .collect();
        let templates = (0..groups)
            .map(|_| (0..SYS_PER_GROUP).map(|_| draw(TEMPLATE_LEN)).collect())
            .collect();
        Generator {
            profile,
            rng,
            sys_prompts,
            templates,
            sys_stored: vec![vec![false; SYS_PER_GROUP]; groups],
            next_request: 0,
        }
    }

    /// Workers of group `g`.
    pub(crate) fn holders(&self, g: u32) -> std::ops::Range<u32> {
        let h = self.profile.holders() as u32;
        g * h..(g + 1) * h
    }

    /// The next request (groups round-robin, a random system prompt of the group).
    pub(crate) fn next_request(&mut self) -> Request {
        let r = self.next_request;
        self.next_request += 1;
        let groups = self.profile.groups();
        let group = (r % groups) as u32;
        let sys = self.rng.below(SYS_PER_GROUP) as u32;
        let mut local = Vec::with_capacity(REQ_LEN);
        local.extend_from_slice(&self.sys_prompts[group as usize][sys as usize]);
        let template = (r % TEMPLATE_EVERY == TEMPLATE_EVERY - 1).then_some(sys);
        if template.is_some() {
            local.extend((0..VARIANT_LEN).map(|_| self.rng.next_u64()));
            local.extend_from_slice(&self.templates[group as usize][sys as usize]);
        }
        while local.len() < REQ_LEN {
            local.push(self.rng.next_u64());
        }
        Request {
            group,
            sys,
            template,
            local,
        }
    }

    /// The events that put `req` on its holders (its system prompt first, once).
    pub(crate) fn stores(&mut self, req: &Request, out: &mut Vec<Store>) {
        let seq = sequence_hashes(&req.local);
        let first_time = !std::mem::replace(
            &mut self.sys_stored[req.group as usize][req.sys as usize],
            true,
        );
        let blocks = |range: std::ops::Range<usize>| -> Vec<Block> {
            range
                .map(|i| Block {
                    ext: engine_hash(seq[i]),
                    local: req.local[i],
                })
                .collect()
        };
        for worker in self.holders(req.group) {
            if first_time {
                out.push(Store {
                    worker,
                    parent: None,
                    blocks: blocks(0..SYS_LEN),
                });
            }
            out.push(Store {
                worker,
                parent: Some(engine_hash(seq[SYS_LEN - 1])),
                blocks: blocks(SYS_LEN..req.local.len()),
            });
        }
    }

    /// Engine hashes of the blocks `req` stored itself (what evicting it removes).
    pub(crate) fn own_engine_hashes(req: &Request) -> Vec<u64> {
        sequence_hashes(&req.local)[SYS_LEN..]
            .iter()
            .map(|&s| engine_hash(s))
            .collect()
    }

    /// Fresh random local hashes (a prompt nobody holds).
    pub(crate) fn miss(&mut self, n: usize) -> Vec<u64> {
        (0..n).map(|_| self.rng.next_u64()).collect()
    }

    pub(crate) fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }
}

/// A built workload: the requests stored to reach the target size, and their events.
#[derive(Debug)]
pub(crate) struct Built {
    pub requests: Vec<Request>,
    pub stores: Vec<Store>,
    /// (worker, block) pairs the stores hold.
    pub holder_blocks: usize,
}

/// Requests and stores until at least `holder_blocks` (worker, block) pairs are held.
pub(crate) fn build(gen: &mut Generator, holder_blocks: usize) -> Built {
    let mut requests = Vec::new();
    let mut stores = Vec::new();
    let mut held = 0;
    while held < holder_blocks {
        let req = gen.next_request();
        let before = stores.len();
        gen.stores(&req, &mut stores);
        held += stores[before..]
            .iter()
            .map(|s| s.blocks.len())
            .sum::<usize>();
        requests.push(req);
    }
    Built {
        requests,
        stores,
        holder_blocks: held,
    }
}

/// A query and the answer an exact index gives: `(worker, blocks)` sorted by worker.
#[derive(Clone, Debug)]
pub(crate) struct Query {
    pub local: Vec<u64>,
    pub expect: Vec<(u32, u32)>,
}

impl Query {
    fn new(local: Vec<u64>, expect: Vec<(u32, u32)>) -> Self {
        Query { local, expect }
    }
}

/// Query sets over a built workload (every request in `requests` is live).
pub(crate) struct Queries;

impl Queries {
    /// `count` stored requests drawn uniformly (the whole index is the working set), cut
    /// to `len` blocks.
    pub(crate) fn cold(
        gen: &mut Generator,
        reqs: &[Request],
        len: usize,
        count: usize,
    ) -> Vec<Query> {
        (0..count)
            .map(|_| {
                let r = &reqs[gen.rng().below(reqs.len())];
                Self::stored(gen, r, len)
            })
            .collect()
    }

    /// `count` queries over the first `HOT_SET` requests only (they stay in cache).
    pub(crate) fn hot(
        gen: &mut Generator,
        reqs: &[Request],
        len: usize,
        count: usize,
    ) -> Vec<Query> {
        let hot = &reqs[..reqs.len().min(HOT_SET)];
        (0..count)
            .map(|_| {
                let r = &hot[gen.rng().below(hot.len())];
                Self::stored(gen, r, len)
            })
            .collect()
    }

    fn stored(gen: &Generator, r: &Request, len: usize) -> Query {
        let expect = gen.holders(r.group).map(|w| (w, len as u32)).collect();
        Query::new(r.local[..len].to_vec(), expect)
    }

    /// Prompts nobody holds, `len` blocks each.
    pub(crate) fn miss(gen: &mut Generator, len: usize, count: usize) -> Vec<Query> {
        (0..count)
            .map(|_| Query::new(gen.miss(len), Vec::new()))
            .collect()
    }

    /// Mid-prompt template variants: variant `a` up to the end of its template body, then
    /// the rest of variant `b` of the same template (same positions, same content as far as
    /// a positional index can tell). An exact index credits the holders up to the template's
    /// end only; a positional one also the spliced tail held in `b`.
    pub(crate) fn splice(gen: &mut Generator, reqs: &[Request], count: usize) -> Vec<Query> {
        let variants: Vec<&Request> = reqs.iter().filter(|r| r.template.is_some()).collect();
        let cut = SYS_LEN + VARIANT_LEN + TEMPLATE_LEN;
        let mut out = Vec::with_capacity(count);
        let mut tries = 0;
        while out.len() < count && tries < count * 1000 && !variants.is_empty() {
            tries += 1;
            let a = variants[gen.rng().below(variants.len())];
            let b = variants[gen.rng().below(variants.len())];
            if std::ptr::eq(a, b) || a.group != b.group || a.template != b.template {
                continue;
            }
            let mut local = a.local[..cut].to_vec();
            local.extend_from_slice(&b.local[cut..]);
            let expect = gen.holders(a.group).map(|w| (w, cut as u32)).collect();
            out.push(Query::new(local, expect));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_hold_what_they_claim() {
        for p in Profile::ALL {
            let mut g = Generator::new(p, 7);
            let b = build(&mut g, 50_000);
            assert!(b.holder_blocks >= 50_000);
            let stored: usize = b.stores.iter().map(|s| s.blocks.len()).sum();
            assert_eq!(stored, b.holder_blocks);
            for s in &b.stores {
                assert!((s.worker as usize) < WORKERS);
            }
            assert!(b.requests.iter().any(|r| r.template.is_some()));
            assert!(b.requests.iter().all(|r| r.local.len() == REQ_LEN));
        }
    }

    #[test]
    fn deterministic() {
        let a = build(&mut Generator::new(Profile::Shared8, 3), 20_000);
        let b = build(&mut Generator::new(Profile::Shared8, 3), 20_000);
        assert_eq!(a.requests[5].local, b.requests[5].local);
        assert_eq!(a.stores.len(), b.stores.len());
    }

    #[test]
    fn splices_share_positions_and_content_but_not_prefix() {
        let mut g = Generator::new(Profile::Single, 9);
        let b = build(&mut g, 200_000);
        let qs = Queries::splice(&mut g, &b.requests, 16);
        assert_eq!(qs.len(), 16);
        for q in &qs {
            assert_eq!(q.expect[0].1 as usize, SYS_LEN + VARIANT_LEN + TEMPLATE_LEN);
        }
    }
}
