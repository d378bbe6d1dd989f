//! The simulated cluster: a discrete-event model of inference ranks behind the router
//! under test.
//!
//! Per rank: a paged KV cache with prefix caching ([`KvCache`]), a waiting queue, one
//! prefill pipeline and a decode batch. Time is simulated (ms); only the router's calls
//! and the ingest of events run for real, and their wall time is what is measured.
//!
//! * **Arrival**: the router routes and books the request; it joins the rank's queue.
//! * **Admission** (FIFO, head of line): when the rank runs fewer than `max_running`
//!   requests and its cache can hold the request's blocks (prompt and output), evicting
//!   unheld cached blocks least recently used first. Evictions are reported to the
//!   router as `BlockRemoved` events. The leading prompt blocks found in the cache are the
//!   request's cached tokens.
//! * **Prefill**: one request at a time per rank, `overhead + uncached tokens / rate`.
//!   When it ends, the computed blocks are cached and reported (`BlockStored`, with
//!   the engine's own block hashes and the blocks' tokens, as vLLM publishes them), the
//!   router is told `mark_prefill_complete`, and the first token is out (TTFT).
//! * **Decode**: `output tokens × tpot × (1 + slowdown × (decoding requests − 1))`,
//!   fixed when decode starts; each completed output block is reported to the router
//!   (`add_output_blocks`); at the end the blocks are released and the router frees the
//!   booking.
//!
//! Events reach the router through kvr's real ingress path ([`Partition::ingest`]: the
//! msgpack batch is sequence-checked, decoded, hashed and applied), `event_delay` after
//! the rank emitted them, one stream per rank in order.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvr::index::IndexStats;
use kvr::ingress::decode::Medium;
use kvr::ingress::encode::BatchEncoder;
use kvr::partition::Partition;
use kvr::RankId;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::kv_cache::{Admission, KvCache};
use super::policy::Router;
use super::workload::Workload;

/// The cluster's shape and speed.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: u32,
    pub dp_size: u32,
    /// KV blocks per rank.
    pub kv_blocks: u32,
    pub block_size: u32,
    /// Prefill throughput of one rank, tokens per second.
    pub prefill_rate: f64,
    /// Fixed cost of one prefill, ms.
    pub prefill_overhead_ms: f64,
    /// Time per output token of a lone request, ms.
    pub tpot_ms: f64,
    /// Extra time per output token for each other decoding request on the rank.
    pub batch_slowdown: f64,
    pub max_running: u32,
    /// Delay from a rank emitting an event batch to the router applying it, ms.
    pub event_delay_ms: f64,
    /// Arrival times are divided by this.
    pub speed: f64,
    pub seed: u64,
    /// The cost knobs of kvr's own selection (policies `kvr`, `kvr-approx`, `kvr-predict`).
    pub cost: kvr::cost::CostConfig,
    /// How long `kvr-predict`'s side index believes a booking, ms.
    pub prediction_ttl_ms: f64,
    /// Session affinity for the kvr-family policies (`None` = off).
    pub affinity: Option<kvr::session::AffinityMode>,
}

impl SimConfig {
    pub fn ranks(&self) -> Vec<RankId> {
        (0..self.workers)
            .flat_map(|w| (0..self.dp_size).map(move |d| RankId::new(u64::from(w), d)))
            .collect()
    }

    fn rank_index(&self, r: RankId) -> usize {
        r.worker_id as usize * self.dp_size as usize + r.dp_rank as usize
    }

    /// Blocks a request occupies at most (prompt and output).
    pub fn blocks_needed(&self, input: u32, output: u32) -> u32 {
        (u64::from(input) + u64::from(output)).div_ceil(u64::from(self.block_size)) as u32
    }
}

/// What one policy's run measured.
#[derive(Clone, Debug, Default)]
pub struct RunResult {
    pub policy: &'static str,
    pub requests: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens the ranks found cached at admission.
    pub cached_tokens: u64,
    /// Every request's TTFT, ms, sorted.
    pub ttft_ms: Vec<f64>,
    /// Prefill tokens computed per rank.
    pub prefill_tokens_per_rank: Vec<u64>,
    /// Wall time of each routing call, ns, sorted.
    pub select_ns: Vec<u64>,
    pub events_applied: u64,
    pub blocks_applied: u64,
    /// Wall time spent in `Partition::ingest`.
    pub ingest_secs: f64,
    pub index: IndexStats,
    /// Blocks evicted by the ranks.
    pub evictions: u64,
    /// Simulated time from the first arrival to the last completion, ms.
    pub makespan_ms: f64,
    /// Wall time of the whole run, s.
    pub wall_secs: f64,
    /// Broken invariants (empty when the run was clean).
    pub problems: Vec<String>,
}

enum Ev {
    Arrive(u32),
    PrefillDone(u32),
    OutputBlock(u32),
    Complete(u32),
    Deliver {
        rank: u32,
        seq: u64,
        payload: Vec<u8>,
    },
}

struct Item {
    t: f64,
    n: u64,
    ev: Ev,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == CmpOrdering::Equal
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    /// Earliest first (reversed for the max-heap); equal times in scheduling order.
    fn cmp(&self, o: &Self) -> CmpOrdering {
        o.t.total_cmp(&self.t).then(o.n.cmp(&self.n))
    }
}

struct InFlight {
    arrival_ms: f64,
    rank: usize,
    id: u64,
    tokens: Vec<u32>,
    /// The rank's engine hashes of the prompt's complete blocks.
    hashes: Vec<u64>,
    output_tokens: u32,
    admission: Option<Admission>,
    /// Output blocks still to report, and the time one takes.
    out_blocks_left: u32,
    block_ms: f64,
}

struct Rank {
    id: RankId,
    cache: KvCache,
    waiting: VecDeque<u32>,
    prefill_free_at: f64,
    running: u32,
    decoding: u32,
    next_seq: u64,
    prefill_tokens: u64,
}

/// The engine's block hash, as a vLLM-like engine computes it: its own function of the
/// parent's hash and the block's tokens (not kvr's; kvr learns the mapping from events).
fn engine_hashes(tokens: &[u32], block_size: usize, bytes: &mut Vec<u8>, out: &mut Vec<u64>) {
    out.clear();
    let mut parent = 0x766c_6c6d_5f72_6f6f_u64;
    for block in tokens.chunks_exact(block_size) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        parent = xxh3_64_with_seed(bytes, parent);
        out.push(parent);
    }
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    router: &'a mut Router,
    heap: BinaryHeap<Item>,
    n: u64,
    ranks: Vec<Rank>,
    flights: HashMap<u32, InFlight>,
    base: Instant,
    res: RunResult,
    evicted: Vec<u64>,
    bytes: Vec<u8>,
    enc: BatchEncoder,
    /// The router reads the ranks' KV events.
    events: bool,
    completed: u64,
}

impl Sim<'_> {
    fn at(&mut self, t: f64, ev: Ev) {
        self.n += 1;
        self.heap.push(Item { t, n: self.n, ev });
    }

    fn fail(&mut self, msg: String) {
        if self.res.problems.len() < 20 {
            self.res.problems.push(msg);
        }
    }

    /// Sends the batch in `self.enc` from `rank`; it reaches the router `event_delay`
    /// later. (Without events, no batch is built at all.)
    fn emit(&mut self, rank: usize, now: f64) {
        let r = &mut self.ranks[rank];
        let payload = self.enc.finish(now / 1e3, Some(r.id.dp_rank));
        let seq = r.next_seq;
        r.next_seq += 1;
        let t = now + self.cfg.event_delay_ms;
        self.at(
            t,
            Ev::Deliver {
                rank: rank as u32,
                seq,
                payload,
            },
        );
    }

    fn try_admit(&mut self, rank: usize, now: f64) {
        let b = self.cfg.block_size;
        while let Some(&i) = self.ranks[rank].waiting.front() {
            let r = &mut self.ranks[rank];
            if r.running >= self.cfg.max_running {
                return;
            }
            let f = self
                .flights
                .get_mut(&i)
                .expect("queued requests are in flight");
            let total = self
                .cfg
                .blocks_needed(f.tokens.len() as u32, f.output_tokens);
            self.evicted.clear();
            let Some(adm) = r.cache.admit(&f.hashes, total, &mut self.evicted) else {
                return;
            };
            r.waiting.pop_front();
            r.running += 1;
            // As vLLM: the last prompt token is always computed (its logits start decode),
            // so a fully cached prompt still recomputes its last block.
            let usable = (f.tokens.len() as u32).saturating_sub(1) / b;
            let cached = u64::from(adm.hit_blocks.min(usable)) * u64::from(b);
            let prefill = f.tokens.len() as u64 - cached;
            r.prefill_tokens += prefill;
            let start = r.prefill_free_at.max(now);
            let done =
                start + self.cfg.prefill_overhead_ms + prefill as f64 * 1e3 / self.cfg.prefill_rate;
            r.prefill_free_at = done;
            f.admission = Some(adm);
            self.res.cached_tokens += cached;
            self.at(done, Ev::PrefillDone(i));
            if !self.evicted.is_empty() {
                self.res.evictions += self.evicted.len() as u64;
                if self.events {
                    self.enc.removed(&self.evicted, Medium::Gpu);
                    self.emit(rank, now);
                }
            }
        }
    }

    fn step(&mut self, now: f64, ev: Ev, workload: &Workload, tokens: &mut Vec<u32>) {
        let b = self.cfg.block_size as usize;
        match ev {
            Ev::Arrive(i) => {
                let req = &workload.requests[i as usize];
                req.tokens_into(tokens);
                let sim_now = self.base + Duration::from_secs_f64(now.max(0.0) / 1e3);
                let t0 = Instant::now();
                let routed = self
                    .router
                    .route(tokens, req.output_tokens, req.session, sim_now);
                self.res.select_ns.push(t0.elapsed().as_nanos() as u64);
                let routed = match routed {
                    Ok(r) => r,
                    Err(e) => return self.fail(format!("request {i} not routed: {e}")),
                };
                let rank = self.cfg.rank_index(routed.rank);
                let mut hashes = Vec::new();
                engine_hashes(tokens, b, &mut self.bytes, &mut hashes);
                self.flights.insert(
                    i,
                    InFlight {
                        arrival_ms: now,
                        rank,
                        id: routed.selection_id,
                        tokens: tokens.clone(),
                        hashes,
                        output_tokens: req.output_tokens,
                        admission: None,
                        out_blocks_left: 0,
                        block_ms: 0.0,
                    },
                );
                self.ranks[rank].waiting.push_back(i);
                self.try_admit(rank, now);
            }
            Ev::PrefillDone(i) => {
                let f = self.flights.get_mut(&i).expect("in flight");
                let rank = f.rank;
                let r = &mut self.ranks[rank];
                let adm = f.admission.as_ref().expect("admitted");
                let runs = r.cache.commit(&f.hashes, adm);
                for run in runs.iter().filter(|_| self.events) {
                    let parent = run.start.checked_sub(1).map(|p| f.hashes[p]);
                    self.enc.stored(
                        &f.hashes[run.start..run.end],
                        parent,
                        &f.tokens[run.start * b..run.end * b],
                        b as u32,
                        Medium::Gpu,
                        None,
                    );
                }
                r.decoding += 1;
                let tpot =
                    self.cfg.tpot_ms * (1.0 + self.cfg.batch_slowdown * f64::from(r.decoding - 1));
                self.res.ttft_ms.push(now - f.arrival_ms);
                let (id, out) = (f.id, f.output_tokens);
                // Output blocks completed strictly before the request ends.
                f.out_blocks_left = out.saturating_sub(1) / b as u32;
                f.block_ms = tpot * b as f64;
                let has_blocks = f.out_blocks_left > 0;
                let block_ms = f.block_ms;
                if self.events && !runs.is_empty() {
                    self.emit(rank, now);
                }
                if let Err(e) = self.router.prefill_done(id) {
                    self.fail(format!("mark_prefill_complete({id}): {e}"));
                }
                if has_blocks {
                    self.at(now + block_ms, Ev::OutputBlock(i));
                }
                self.at(now + f64::from(out) * tpot, Ev::Complete(i));
            }
            Ev::OutputBlock(i) => {
                let f = self.flights.get_mut(&i).expect("in flight");
                f.out_blocks_left -= 1;
                let (id, more, block_ms) = (f.id, f.out_blocks_left > 0, f.block_ms);
                if let Err(e) = self.router.output_block(id) {
                    self.fail(format!("add_output_blocks({id}): {e}"));
                }
                if more {
                    self.at(now + block_ms, Ev::OutputBlock(i));
                }
            }
            Ev::Complete(i) => {
                let f = self.flights.remove(&i).expect("in flight");
                let r = &mut self.ranks[f.rank];
                r.cache
                    .release(&f.hashes, f.admission.as_ref().expect("admitted"));
                r.running -= 1;
                r.decoding -= 1;
                self.completed += 1;
                self.res.makespan_ms = now;
                if let Err(e) = self.router.free(f.id) {
                    self.fail(format!("free({}): {e}", f.id));
                }
                self.try_admit(f.rank, now);
            }
            Ev::Deliver { rank, seq, payload } => {
                let id = self.ranks[rank as usize].id;
                let p: &Partition = self.router.partition();
                let t0 = Instant::now();
                let out = p.ingest(id.worker_id, id.dp_rank, b"kv-events", seq, &payload);
                self.res.ingest_secs += t0.elapsed().as_secs_f64();
                if out.decode_errors > 0 || out.clears > 0 || out.batches_applied != 1 {
                    self.fail(format!("event batch {seq} of {id:?}: {out:?}"));
                }
            }
        }
    }
}

/// Runs `workload` through a cluster of `cfg` routed by `router`. `progress` is called
/// after every request arrival.
pub fn run(
    cfg: &SimConfig,
    workload: &Workload,
    router: &mut Router,
    progress: impl FnMut(),
) -> RunResult {
    run_keeping_caches(cfg, workload, router, progress).0
}

/// [`run`], also returning each rank's cache as the run left it.
pub fn run_keeping_caches(
    cfg: &SimConfig,
    workload: &Workload,
    router: &mut Router,
    mut progress: impl FnMut(),
) -> (RunResult, Vec<(RankId, KvCache)>) {
    let wall = Instant::now();
    let ranks = cfg
        .ranks()
        .into_iter()
        .map(|id| Rank {
            id,
            cache: KvCache::new(cfg.kv_blocks),
            waiting: VecDeque::new(),
            prefill_free_at: 0.0,
            running: 0,
            decoding: 0,
            next_seq: 0,
            prefill_tokens: 0,
        })
        .collect();
    let events = router.kind().uses_events();
    let mut sim = Sim {
        cfg,
        router,
        heap: BinaryHeap::new(),
        n: 0,
        ranks,
        flights: HashMap::new(),
        base: Instant::now(),
        res: RunResult {
            policy: "",
            requests: workload.requests.len() as u64,
            prompt_tokens: workload.prompt_tokens(),
            ..RunResult::default()
        },
        evicted: Vec::new(),
        bytes: Vec::new(),
        enc: BatchEncoder::new(),
        events,
        completed: 0,
    };
    sim.res.policy = sim.router.kind().name();
    let t0 = workload.requests.first().map_or(0.0, |r| r.arrival_ms);
    for (i, r) in workload.requests.iter().enumerate() {
        sim.at((r.arrival_ms - t0) / cfg.speed, Ev::Arrive(i as u32));
    }
    let mut tokens = Vec::new();
    while let Some(Item { t, ev, .. }) = sim.heap.pop() {
        let arrival = matches!(ev, Ev::Arrive(_));
        sim.step(t, ev, workload, &mut tokens);
        if arrival {
            progress();
        }
    }
    sim.finish(wall)
}

impl Sim<'_> {
    fn finish(mut self, wall: Instant) -> (RunResult, Vec<(RankId, KvCache)>) {
        let mut problems = Vec::new();
        if self.completed != self.res.requests {
            problems.push(format!(
                "{} of {} requests completed",
                self.completed, self.res.requests
            ));
        }
        let caches: Vec<(RankId, &KvCache)> = self.ranks.iter().map(|r| (r.id, &r.cache)).collect();
        problems.extend(router_problems(self.router, &caches));
        let p = self.router.partition();
        for s in p.ingress_stats() {
            self.res.events_applied += s.events;
            self.res.blocks_applied += s.blocks_stored + s.blocks_removed;
        }
        self.res.index = p.index().stats();
        self.res.prefill_tokens_per_rank = self.ranks.iter().map(|r| r.prefill_tokens).collect();
        self.res.ttft_ms.sort_by(f64::total_cmp);
        self.res.select_ns.sort_unstable();
        self.res.problems.extend(problems);
        self.res.wall_secs = wall.elapsed().as_secs_f64();
        let caches = self.ranks.into_iter().map(|r| (r.id, r.cache)).collect();
        (self.res, caches)
    }
}

/// The end-of-run invariants of a router whose requests have all ended: kvr holds no
/// booking and every rank's booking counters are back to zero; no event was refused,
/// failed to decode or went missing; and (with events) the index holds exactly what each
/// rank's cache holds.
pub fn router_problems(router: &Router, caches: &[(RankId, &KvCache)]) -> Vec<String> {
    let mut problems = Vec::new();
    let p = router.partition();
    if router.booked != router.freed || router.prefilled != router.booked {
        problems.push(format!(
            "{} booked, {} marked prefill-complete, {} freed",
            router.booked, router.prefilled, router.freed
        ));
    }
    if let Some(s) = p.session_stats() {
        if s.leases > 0 || s.unknown_lease_releases > 0 {
            problems.push(format!("session leases outlived their bookings: {s:?}"));
        }
    }
    let indexer = p.indexer_stats();
    if indexer.record_failures > 0 {
        problems.push(format!("recording bookings failed: {indexer:?}"));
    }
    let bookings = p.bookings();
    let stats = bookings.stats();
    if stats.expired_total + stats.counter_underflows > 0 {
        problems.push(format!(
            "bookings expired or counters underflowed: {stats:?}"
        ));
    }
    if !bookings.is_empty() {
        problems.push(format!("{} bookings left", bookings.len()));
    }
    let loads = bookings.loads();
    for (id, cache) in caches {
        let l = loads.get(*id);
        if !l.is_zero() {
            problems.push(format!("rank {id:?} still has load {l:?}"));
        }
        if let Err(e) = cache.check() {
            problems.push(format!("rank {id:?} cache: {e}"));
        }
    }
    if let Err(e) = bookings.audit() {
        problems.push(format!("booking audit: {e}"));
    }
    for s in p.ingress_stats() {
        let decode_errors: u64 = s.decode_errors.iter().map(|e| e.1).sum();
        if s.events_rejected + s.block_size_mismatches + decode_errors + s.sequence.gaps > 0 {
            problems.push(format!("stream {}/{}: {s:?}", s.worker_id, s.stream));
        }
    }
    if router.kind().uses_events() {
        let index = p.index().stats();
        if index.parent_not_found + index.block_not_found > 0 {
            problems.push(format!("index refused events: {index:?}"));
        }
        for (id, cache) in caches {
            let held = p.index().rank_stats(*id).map_or(0, |s| s.holder_blocks);
            if held != cache.cached() as u64 {
                problems.push(format!(
                    "rank {id:?}: index holds {held} blocks, its cache {}",
                    cache.cached()
                ));
            }
        }
    }
    problems
}
