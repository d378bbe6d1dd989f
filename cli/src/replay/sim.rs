//! The simulated cluster: a discrete-event model of inference ranks behind the router
//! under test, each scheduled as vLLM's engine schedules a step.
//!
//! Per rank: a paged KV cache with prefix caching ([`KvCache`]), a waiting queue and the
//! running requests. The rank runs **steps** back to back while it has work; each step
//! batches one token for every decoding request and, in the token budget left
//! (`max_batched_tokens`), chunks of prefill — the running prefills first, then waiting
//! requests admitted in arrival order (vLLM's chunked prefill). Time is simulated (ms);
//! only the router's calls and the ingest of events run for real, and their wall time is
//! what is measured.
//!
//! * **Arrival**: the router routes and books the request; it joins the rank's queue. A
//!   conversation's later turn arrives its think time after the previous turn's answer
//!   ended ([`Request::follows`]); other requests at their arrival time ÷ `speed`.
//! * **Scheduling** (when a step is planned, FIFO, head of line): a waiting request is
//!   admitted when the rank runs fewer than `max_running` requests, budget is left and
//!   its cache can hold the request's blocks (prompt and output), evicting unheld cached
//!   blocks least recently used first (reported as `BlockRemoved`). The cache is looked up
//!   *then*, not at arrival, as vLLM and Dynamo's mocker do: a request queued behind one
//!   with the same prefix finds the blocks that one computed. The leading prompt blocks
//!   found are its cached tokens; the last prompt token is always computed.
//! * **A step** takes `tpot × (1 + batch_slowdown × (decoding − 1))` if it decodes, plus
//!   `prefill_overhead + prefill tokens / prefill_rate` if it prefills: a decode step that
//!   carries a prefill chunk is slower, so per-token latency pays for co-scheduled
//!   prefill.
//! * **Prefill end** (the step that computed a request's last prompt chunk): its computed
//!   blocks are cached and reported (`BlockStored`, with the engine's own block hashes
//!   and the blocks' tokens, as vLLM publishes them), the router is told
//!   `mark_prefill_complete` (at the simulated time: kvr learns its prefill rate from
//!   it), and the first token is out (TTFT).
//! * **Decode**: one token a step; each completed output block is reported to the router
//!   (`add_output_blocks`). At the end the output's complete blocks are cached and
//!   reported too (the answer's tokens are the request's `output_content`, so the next
//!   turn, whose prompt carries the answer, reuses them), the blocks are released, and
//!   the router frees the booking. TPOT is (end − first token) / (output − 1).
//!
//! Events reach the router through kvr's real ingress path ([`Partition::ingest`]: the
//! msgpack batch is sequence-checked, decoded, hashed and applied), one batch per step
//! that changed the cache, `event_delay` after the step, one stream per rank in order.
//!
//! What is not modelled: preemption (a request reserves its output's blocks when it is
//! admitted, so KV memory pressure shows as queueing), speculative decoding, and
//! prefill/decode disaggregation.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvr::ingress::Medium;
use kvr::stats::IndexStats;
use kvr::Partition;
use kvr::RankId;
use kvr_emulator::BatchEncoder;

use super::checks::fleet_problems;
#[cfg(test)]
pub(crate) use super::checks::router_problems;
use super::kv_cache::{encode_stored, engine_hashes, Admission, KvCache};
use super::policy::Router;
use super::routers::{Fleet, FleetStats, ReplicaConfig, SyncMsg};
use super::workload::{token_at, Workload};

/// The cluster's shape and speed.
#[derive(Clone, Debug)]
pub(crate) struct SimConfig {
    pub workers: u32,
    pub dp_size: u32,
    /// KV blocks per rank.
    pub kv_blocks: u32,
    pub block_size: u32,
    /// Prefill throughput of one rank, tokens per second.
    pub prefill_rate: f64,
    /// Fixed cost of a step that prefills, ms.
    pub prefill_overhead_ms: f64,
    /// Time per output token of a lone request, ms.
    pub tpot_ms: f64,
    /// Extra time per output token for each other decoding request on the rank.
    pub batch_slowdown: f64,
    pub max_running: u32,
    /// Tokens one step may process (vLLM's `max_num_batched_tokens`).
    pub max_batched_tokens: u32,
    /// Delay from a rank emitting an event batch to the router applying it, ms.
    pub event_delay_ms: f64,
    /// Open-loop arrival times are divided by this (a trace's timestamps, the built-in
    /// workload's session starts); a later turn still waits for its predecessor.
    pub speed: f64,
    pub seed: u64,
    /// The cost knobs of kvr's own selection (policies `kvr`, `kvr-approx`, `kvr-predict`;
    /// `kvr-dynamo` uses them with Dynamo's model).
    pub cost: kvr::config::CostConfig,
    /// How long `kvr-predict`'s side index believes a booking, ms.
    pub prediction_ttl_ms: f64,
    /// Session affinity for the kvr-family policies (`None` = off).
    pub affinity: Option<kvr::config::AffinityMode>,
    /// Workers slower than the rest (`None`: every worker alike).
    pub slow: Option<super::slow::SlowWorkers>,
}

impl SimConfig {
    pub(crate) fn ranks(&self) -> Vec<RankId> {
        (0..self.workers)
            .flat_map(|w| (0..self.dp_size).map(move |d| RankId::new(u64::from(w), d)))
            .collect()
    }

    pub(crate) fn rank_index(&self, r: RankId) -> usize {
        r.worker_id as usize * self.dp_size as usize + r.dp_rank as usize
    }

    /// Blocks a request occupies at most (prompt and output).
    pub(crate) fn blocks_needed(&self, input: u32, output: u32) -> u32 {
        (u64::from(input) + u64::from(output)).div_ceil(u64::from(self.block_size)) as u32
    }
}

/// What one policy's run measured.
#[derive(Clone, Debug, Default)]
pub(crate) struct RunResult {
    pub policy: &'static str,
    pub requests: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens the ranks found cached when they scheduled the request.
    pub cached_tokens: u64,
    /// Every request's TTFT, ms, sorted.
    pub ttft_ms: Vec<f64>,
    /// Every request's mean time per output token after the first, ms, sorted (requests
    /// with at least two output tokens).
    pub tpot_ms: Vec<f64>,
    /// Every request's arrival to last token, ms, sorted.
    pub e2e_ms: Vec<f64>,
    /// Prefill tokens computed per rank.
    pub prefill_tokens_per_rank: Vec<u64>,
    /// Requests each rank served.
    pub requests_per_rank: Vec<u64>,
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
    /// The prefill rate kvr learned (tokens/s), if the policy books through it.
    pub learned_prefill_rate: Option<f64>,
    /// Broken invariants (empty when the run was clean).
    pub problems: Vec<String>,
}

enum Ev {
    Arrive(u32),
    StepEnd(u32),
    Deliver {
        rank: u32,
        seq: u64,
        payload: Vec<u8>,
    },
    /// A replica's booking event reaching a peer.
    Sync(SyncMsg),
}

/// Simulated time between two load samples, ms.
pub(crate) const SAMPLE_MS: f64 = 100.0;

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
    /// The replica that booked it, and its booking.
    router: u32,
    id: u64,
    tokens: Vec<u32>,
    /// The rank's engine hashes of the prompt's complete blocks (then of the output's,
    /// once cached at the end).
    hashes: Vec<u64>,
    output_tokens: u32,
    output_content: u64,
    admission: Option<Admission>,
    /// Prompt tokens still to compute (set when scheduled).
    prefill_left: u32,
    /// Output tokens produced so far.
    generated: u32,
    first_token_ms: f64,
}

struct Rank {
    id: RankId,
    cache: KvCache,
    waiting: VecDeque<u32>,
    /// Admitted requests, in admission order (prefilling or decoding).
    running: Vec<u32>,
    /// The step in flight: (request, prefill tokens in it; 0 = one decode token).
    step: Vec<(u32, u32)>,
    busy: bool,
    next_seq: u64,
    prefill_tokens: u64,
    /// Requests admitted.
    admitted: u64,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    fleet: Fleet<'a>,
    workload: &'a Workload,
    heap: BinaryHeap<Item>,
    n: u64,
    ranks: Vec<Rank>,
    flights: HashMap<u32, InFlight>,
    /// The turn that follows each request (its conversation's next), if any.
    next_turn: Vec<Option<u32>>,
    base: Instant,
    res: RunResult,
    evicted: Vec<u64>,
    bytes: Vec<u8>,
    enc: BatchEncoder,
    /// Events encoded since the rank's last batch went out.
    pending_events: bool,
    /// The router reads the ranks' KV events.
    events: bool,
    completed: u64,
}

impl Sim<'_> {
    fn at(&mut self, t: f64, ev: Ev) {
        self.n += 1;
        self.heap.push(Item { t, n: self.n, ev });
    }

    fn instant(&self, now: f64) -> Instant {
        self.base + Duration::from_secs_f64(now.max(0.0) / 1e3)
    }

    fn fail(&mut self, msg: String) {
        if self.res.problems.len() < 20 {
            self.res.problems.push(msg);
        }
    }

    /// Schedules the sync events the replicas sent.
    fn flush_sync(&mut self) {
        let mut out = std::mem::take(&mut self.fleet.outbox);
        for (t, msg) in out.drain(..) {
            self.at(t, Ev::Sync(msg));
        }
        self.fleet.outbox = out;
    }

    /// Sends the events encoded for `rank` as one batch; it reaches the router
    /// `event_delay` later.
    fn emit(&mut self, rank: usize, now: f64) {
        if !std::mem::take(&mut self.pending_events) {
            return;
        }
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

    fn arrive(&mut self, i: u32, now: f64, tokens: &mut Vec<u32>) {
        let b = self.cfg.block_size as usize;
        let req = &self.workload.requests[i as usize];
        req.tokens_into(tokens);
        let t0 = Instant::now();
        let at = self.instant(now);
        let routed = self
            .fleet
            .route(tokens, req.output_tokens, req.session, now, at);
        self.res.select_ns.push(t0.elapsed().as_nanos() as u64);
        self.flush_sync();
        let (router, routed) = match routed {
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
                router,
                id: routed.selection_id,
                tokens: tokens.clone(),
                hashes,
                output_tokens: req.output_tokens.max(1),
                output_content: req.output_content,
                admission: None,
                prefill_left: 0,
                generated: 0,
                first_token_ms: 0.0,
            },
        );
        self.ranks[rank].waiting.push_back(i);
        if !self.ranks[rank].busy {
            self.plan_step(rank, now);
        }
    }

    /// Plans the rank's next step at `now` (decodes, running prefills, then admissions in
    /// the budget left) and schedules its end; the rank goes idle if there is no work.
    fn plan_step(&mut self, rank: usize, now: f64) {
        let b = self.cfg.block_size;
        let mut budget = self.cfg.max_batched_tokens;
        let mut step = std::mem::take(&mut self.ranks[rank].step);
        step.clear();
        let (mut decoding, mut prefill) = (0u32, 0u64);
        for &i in &self.ranks[rank].running {
            let f = &self.flights[&i];
            if f.prefill_left == 0 {
                step.push((i, 0));
                decoding += 1;
                budget = budget.saturating_sub(1);
            }
        }
        for &i in &self.ranks[rank].running {
            let left = self.flights[&i].prefill_left;
            if left > 0 && budget > 0 {
                let take = left.min(budget);
                step.push((i, take));
                budget -= take;
                prefill += u64::from(take);
            }
        }
        while budget > 0 {
            let r = &mut self.ranks[rank];
            let Some(&i) = r.waiting.front() else { break };
            if r.running.len() as u32 >= self.cfg.max_running {
                break;
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
                break;
            };
            r.waiting.pop_front();
            r.running.push(i);
            // As vLLM: the last prompt token is always computed (its logits start decode),
            // so a fully cached prompt still recomputes its last block.
            let usable = (f.tokens.len() as u32).saturating_sub(1) / b;
            let cached = adm.hit_blocks.min(usable) * b;
            f.prefill_left = f.tokens.len() as u32 - cached;
            f.admission = Some(adm);
            r.prefill_tokens += u64::from(f.prefill_left);
            r.admitted += 1;
            self.res.cached_tokens += u64::from(cached);
            let take = f.prefill_left.min(budget);
            step.push((i, take));
            budget -= take;
            prefill += u64::from(take);
            if !self.evicted.is_empty() {
                self.res.evictions += self.evicted.len() as u64;
                if self.events {
                    self.enc.removed(&self.evicted, Medium::Gpu);
                    self.pending_events = true;
                }
            }
        }
        self.emit(rank, now);
        let r = &mut self.ranks[rank];
        if step.is_empty() {
            r.busy = false;
            r.step = step;
            return;
        }
        let mut ms = 0.0;
        if decoding > 0 {
            ms += self.cfg.tpot_ms * (1.0 + self.cfg.batch_slowdown * f64::from(decoding - 1));
        }
        if prefill > 0 {
            ms += self.cfg.prefill_overhead_ms + prefill as f64 * 1e3 / self.cfg.prefill_rate;
        }
        if let Some(slow) = &self.cfg.slow {
            ms *= slow.factor(rank as u32 / self.cfg.dp_size.max(1), now);
        }
        r.step = step;
        r.busy = true;
        self.at(now + ms, Ev::StepEnd(rank as u32));
    }

    /// The step ended: prefills that finished store their blocks and emit their first
    /// token, decodes advance, finished requests end; then the next step is planned.
    fn step_end(&mut self, rank: usize, now: f64, tokens: &mut Vec<u32>) {
        let step = std::mem::take(&mut self.ranks[rank].step);
        for &(i, take) in &step {
            if take > 0 {
                let f = self.flights.get_mut(&i).expect("in flight");
                f.prefill_left -= take;
                if f.prefill_left == 0 {
                    self.prefill_done(i, rank, now, tokens);
                }
            } else {
                self.decode_token(i, rank, now, tokens);
            }
        }
        self.ranks[rank].step = step;
        self.plan_step(rank, now);
    }

    fn prefill_done(&mut self, i: u32, rank: usize, now: f64, tokens: &mut Vec<u32>) {
        let b = self.cfg.block_size as usize;
        let f = self.flights.get_mut(&i).expect("in flight");
        let r = &mut self.ranks[rank];
        let adm = f.admission.as_ref().expect("admitted");
        let runs = r.cache.commit(&f.hashes, adm);
        if self.events {
            self.pending_events |= encode_stored(&mut self.enc, &runs, &f.hashes, &f.tokens, b);
        }
        f.generated = 1;
        f.first_token_ms = now;
        self.res.ttft_ms.push(now - f.arrival_ms);
        let (router, id, done) = (f.router, f.id, f.output_tokens <= 1);
        let at = self.instant(now);
        if let Err(e) = self.fleet.prefill_done(router, id, now, at) {
            self.fail(format!("mark_prefill_complete({id}): {e}"));
        }
        self.flush_sync();
        if done {
            self.complete(i, rank, now, tokens);
        }
    }

    fn decode_token(&mut self, i: u32, rank: usize, now: f64, tokens: &mut Vec<u32>) {
        let b = self.cfg.block_size;
        let f = self.flights.get_mut(&i).expect("in flight");
        f.generated += 1;
        let (router, id, generated, out) = (f.router, f.id, f.generated, f.output_tokens);
        // Output blocks completed strictly before the request ends.
        if generated < out && generated % b == 0 {
            if let Err(e) = self.fleet.output_block(router, id, now) {
                self.fail(format!("add_output_blocks({id}): {e}"));
            }
            self.flush_sync();
        }
        if generated == out {
            self.complete(i, rank, now, tokens);
        }
    }

    /// The request's last token is out: its answer's complete blocks are cached and
    /// reported, its blocks released, its booking freed, and its conversation's next
    /// turn (if any) arrives after the user's think time.
    fn complete(&mut self, i: u32, rank: usize, now: f64, tokens: &mut Vec<u32>) {
        let b = self.cfg.block_size as usize;
        let mut f = self.flights.remove(&i).expect("in flight");
        let r = &mut self.ranks[rank];
        r.running.retain(|&x| x != i);
        let mut adm = f.admission.take().expect("admitted");
        // The last generated token has no KV yet: the cached sequence ends before it.
        tokens.clear();
        tokens.extend_from_slice(&f.tokens);
        tokens.extend((0..f.output_tokens - 1).map(|j| token_at(f.output_content, j)));
        let prompt_blocks = f.hashes.len();
        engine_hashes(tokens, b, &mut self.bytes, &mut f.hashes);
        let runs = r.cache.commit_output(&f.hashes, prompt_blocks, &mut adm);
        f.hashes
            .truncate(prompt_blocks + adm.output_blocks as usize);
        if self.events {
            self.pending_events |= encode_stored(&mut self.enc, &runs, &f.hashes, tokens, b);
        }
        r.cache.release(&f.hashes, &adm);
        self.completed += 1;
        self.res.makespan_ms = now;
        if f.output_tokens > 1 {
            let tpot = (now - f.first_token_ms) / f64::from(f.output_tokens - 1);
            self.res.tpot_ms.push(tpot);
        }
        self.res.e2e_ms.push(now - f.arrival_ms);
        if let Err(e) = self.fleet.free(f.router, f.id, rank, now) {
            self.fail(format!("free({}): {e}", f.id));
        }
        self.flush_sync();
        if let Some(next) = self.next_turn[i as usize] {
            let think = self.workload.requests[next as usize]
                .follows
                .map_or(0.0, |(_, t)| t);
            self.at(now + think, Ev::Arrive(next));
        }
    }

    /// An event batch reaches every replica's index (replica 0's ingest is timed).
    fn deliver(&mut self, rank: u32, seq: u64, payload: &[u8]) {
        let id = self.ranks[rank as usize].id;
        for k in 0..self.fleet.routers().len() {
            let p: &Partition = self.fleet.routers()[k].partition();
            let t0 = Instant::now();
            let out = p.ingest(id.worker_id, id.dp_rank, b"kv-events", seq, payload);
            if k == 0 {
                self.res.ingest_secs += t0.elapsed().as_secs_f64();
            }
            if out.decode_errors > 0 || out.clears > 0 || out.batches_applied != 1 {
                self.fail(format!("event batch {seq} of {id:?}: {out:?}"));
            }
        }
    }

    /// One load sample: requests queued or running on each rank.
    fn sample(&mut self, active: &mut Vec<u32>) {
        active.clear();
        active.extend(
            self.ranks
                .iter()
                .map(|r| (r.waiting.len() + r.running.len()) as u32),
        );
        self.fleet.sample(active);
    }
}

fn ranks_len(cfg: &SimConfig) -> usize {
    cfg.workers as usize * cfg.dp_size as usize
}

/// Runs `workload` through a cluster of `cfg` routed by `router`. `progress` is called
/// after every request arrival.
pub(crate) fn run(
    cfg: &SimConfig,
    workload: &Workload,
    router: &mut Router,
    progress: impl FnMut(),
) -> RunResult {
    run_keeping_caches(cfg, workload, router, progress).0
}

/// [`run`], also returning each rank's cache as the run left it.
pub(crate) fn run_keeping_caches(
    cfg: &SimConfig,
    workload: &Workload,
    router: &mut Router,
    progress: impl FnMut(),
) -> (RunResult, Vec<(RankId, KvCache)>) {
    let replicas = ReplicaConfig::single(cfg.seed);
    let (res, caches, _) = run_replicas(
        cfg,
        workload,
        std::slice::from_mut(router),
        replicas,
        progress,
    );
    (res, caches)
}

/// Runs `workload` through a cluster of `cfg` routed by the replicas `routers` (built
/// with [`Router::set_replica`]) sharing bookings as `replicas` says. Also returns each
/// rank's cache and what the replicas did.
pub(crate) fn run_replicas(
    cfg: &SimConfig,
    workload: &Workload,
    routers: &mut [Router],
    replicas: ReplicaConfig,
    mut progress: impl FnMut(),
) -> (RunResult, Vec<(RankId, KvCache)>, FleetStats) {
    let wall = Instant::now();
    let ranks = cfg
        .ranks()
        .into_iter()
        .map(|id| Rank {
            id,
            cache: KvCache::new(cfg.kv_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            step: Vec::new(),
            busy: false,
            next_seq: 0,
            prefill_tokens: 0,
            admitted: 0,
        })
        .collect();
    let events = routers[0].kind().uses_events();
    let fleet = Fleet::new(routers, replicas, cfg.dp_size, ranks_len(cfg));
    let mut next_turn = vec![None; workload.requests.len()];
    for (i, r) in workload.requests.iter().enumerate() {
        if let Some((prev, _)) = r.follows {
            next_turn[prev as usize] = Some(i as u32);
        }
    }
    let mut sim = Sim {
        cfg,
        fleet,
        workload,
        heap: BinaryHeap::new(),
        n: 0,
        ranks,
        flights: HashMap::new(),
        next_turn,
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
        pending_events: false,
        events,
        completed: 0,
    };
    sim.res.policy = sim.fleet.kind().name();
    let t0 = workload.requests.first().map_or(0.0, |r| r.arrival_ms);
    for (i, r) in workload.requests.iter().enumerate() {
        if r.follows.is_none() {
            sim.at((r.arrival_ms - t0) / cfg.speed, Ev::Arrive(i as u32));
        }
    }
    let mut tokens = Vec::new();
    let (mut next_sample, mut active) = (0.0, Vec::new());
    while let Some(Item { t, ev, .. }) = sim.heap.pop() {
        // The cluster's state holds between events: sample it at every sample time passed.
        while next_sample <= t {
            sim.sample(&mut active);
            next_sample += SAMPLE_MS;
        }
        match ev {
            Ev::Arrive(i) => {
                sim.arrive(i, t, &mut tokens);
                progress();
            }
            Ev::StepEnd(rank) => sim.step_end(rank as usize, t, &mut tokens),
            Ev::Deliver { rank, seq, payload } => sim.deliver(rank, seq, &payload),
            Ev::Sync(msg) => {
                let at = sim.instant(t);
                sim.fleet.apply(msg, t, at);
                sim.flush_sync();
            }
        }
    }
    sim.finish(wall)
}

impl Sim<'_> {
    fn finish(mut self, wall: Instant) -> (RunResult, Vec<(RankId, KvCache)>, FleetStats) {
        let mut problems = Vec::new();
        if self.completed != self.res.requests {
            problems.push(format!(
                "{} of {} requests completed",
                self.completed, self.res.requests
            ));
        }
        let caches: Vec<(RankId, &KvCache)> = self.ranks.iter().map(|r| (r.id, &r.cache)).collect();
        problems.extend(fleet_problems(&self.fleet, &caches));
        // Replica 0 speaks for the ingest and the learned rate (every replica applies the
        // same events).
        let p = self.fleet.routers()[0].partition();
        for s in p.ingress_stats() {
            self.res.events_applied += s.events;
            self.res.blocks_applied += s.blocks_stored + s.blocks_removed;
        }
        self.res.index = p.index().stats();
        self.res.learned_prefill_rate = p.bookings().prefill_rate();
        self.res.prefill_tokens_per_rank = self.ranks.iter().map(|r| r.prefill_tokens).collect();
        self.res.requests_per_rank = self.ranks.iter().map(|r| r.admitted).collect();
        for v in [
            &mut self.res.ttft_ms,
            &mut self.res.tpot_ms,
            &mut self.res.e2e_ms,
        ] {
            v.sort_by(f64::total_cmp);
        }
        self.res.select_ns.sort_unstable();
        self.res.problems.extend(problems);
        self.res.wall_secs = wall.elapsed().as_secs_f64();
        let caches = self.ranks.into_iter().map(|r| (r.id, r.cache)).collect();
        (self.res, caches, self.fleet.stats)
    }
}
