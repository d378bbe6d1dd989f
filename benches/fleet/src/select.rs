//! Selection at fleet scale: one partition of `workers` workers of `dp` data-parallel ranks
//! (1,024 × 8 = 8,192 candidates by default), the selection workload of the criterion
//! bench (`kvr_benches::selection`) at that size, and beside it in the same process the
//! same workload at 64 ranks (8 × 8), so the scale costs read as a ratio.
//!
//! Per case, `reps` rounds of `calls` calls each, the cases interleaved round by round;
//! each call timed alone (`Instant` around it, the timer's cost printed, not subtracted).
//! A round gives a p50 and a p99; the report is the median round with the spread.
//! Cases: booked (`select_and_reserve`, then `free` timed on its own) and advisory
//! (`select`) over every rank; booked with an allow-set of one worker in 16; booked with a
//! LoRA adapter that one worker in 16 serves; booked on the same fleet idle (nothing stored
//! or booked: every rank ties). Then worker churn: workers added (an
//! empty 8-rank worker, as a new pod registers) and removed (built workers, with their
//! index entries, bookings and loads), each call timed. Memory: the process's RSS growth
//! over the build and the index's own byte count, per holder-block.

use std::hint::black_box;
use std::time::Instant;

use kvr::{Outcome, SelectRequest, WorkerId, WorkerInfo};
use kvr_benches::{build_selection, rss_bytes, SelectionConfig, SelectionWorkload, DEFAULT_SEED};

use crate::report::{Figure, Report, Spread};

/// What the `select` part runs.
#[derive(Clone, Debug)]
pub(crate) struct SelectPlan {
    pub workers: usize,
    pub dp: u32,
    pub tokens: usize,
    pub calls: usize,
    pub reps: usize,
    pub private_blocks_per_rank: usize,
    pub churn_workers: usize,
    /// Only the cases whose name contains this.
    pub only: String,
}

impl SelectPlan {
    pub(crate) fn full() -> Self {
        SelectPlan {
            workers: 1_024,
            dp: 8,
            tokens: 256,
            calls: 20_000,
            reps: 5,
            private_blocks_per_rank: 1_024,
            churn_workers: 32,
            only: String::new(),
        }
    }

    /// Seconds, for CI: the figures mean nothing, the paths all run.
    pub(crate) fn quick() -> Self {
        SelectPlan {
            workers: 64,
            dp: 8,
            tokens: 256,
            calls: 300,
            reps: 2,
            private_blocks_per_rank: 32,
            churn_workers: 4,
            only: String::new(),
        }
    }
}

/// One in this many workers is in the allow-set, and serves the LoRA adapter.
const NARROW: usize = 16;
/// Pre-built queries per workload (cycled).
const QUERIES: usize = 512;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Filter {
    None,
    Subset,
    Lora,
}

struct Case<'a> {
    name: String,
    w: &'a SelectionWorkload,
    queries: &'a [Vec<u32>],
    filter: Filter,
    booked: bool,
    reserve: Vec<(u64, u64)>,
    free: Vec<(u64, u64)>,
}

fn workload(plan: &SelectPlan, ranks: usize) -> (SelectionWorkload, f64, u64) {
    build(SelectionConfig {
        dp_size: plan.dp,
        lora_every: NARROW,
        private_blocks_per_rank: plan.private_blocks_per_rank,
        ..SelectionConfig::new(ranks)
    })
}

/// The same fleet with nothing stored and nothing booked (a new or quiet partition): no
/// rank holds any prompt, and with every load zero every rank ties.
fn idle_workload(plan: &SelectPlan, ranks: usize) -> SelectionWorkload {
    build(SelectionConfig {
        dp_size: plan.dp,
        prefixes_per_rank: 0,
        private_blocks_per_rank: 0,
        bookings_per_rank: 0,
        ..SelectionConfig::new(ranks)
    })
    .0
}

fn build(cfg: SelectionConfig) -> (SelectionWorkload, f64, u64) {
    let before = rss_bytes().unwrap_or(0);
    let t0 = Instant::now();
    let w = build_selection(cfg);
    let built = t0.elapsed().as_secs_f64();
    let grown = rss_bytes().unwrap_or(0).saturating_sub(before);
    (w, built, grown)
}

/// Runs the plan and adds its figures to `report`.
pub(crate) fn run(plan: &SelectPlan, report: &mut Report) {
    let ranks = plan.workers * plan.dp as usize;
    let (big, big_built, big_rss) = workload(plan, ranks);
    let (small, _, _) = workload(plan, 64);
    let idle = idle_workload(plan, ranks);
    let stats = big
        .engine
        .partition(&big.key)
        .expect("the workload's partition")
        .index()
        .stats();
    report.note(format!(
        "fleet: {} workers × {} ranks = {ranks} ranks, {} holder-blocks, {} live bookings, built in {big_built:.2} s",
        plan.workers, plan.dp, big.holder_blocks, big.live_bookings
    ));
    report.push(Figure::single(
        "memory/rss_bytes_per_holder_block",
        big_rss as f64 / big.holder_blocks.max(1) as f64,
        "B",
    ));
    report.push(Figure::single(
        "memory/index_bytes_per_holder_block",
        stats.bytes as f64 / stats.holder_blocks.max(1) as f64,
        "B",
    ));

    let subset: Vec<WorkerId> = (0..plan.workers)
        .step_by(NARROW)
        .map(|w| w as u64)
        .collect();
    let big_qs = big.queries(plan.tokens, QUERIES, DEFAULT_SEED ^ 0xf1ee7);
    let small_qs = small.queries(plan.tokens, QUERIES, DEFAULT_SEED ^ 0xf1ee7);
    let idle_qs = idle.queries(plan.tokens, QUERIES, DEFAULT_SEED ^ 0x1d1e);
    let on_big = |name: String, filter, booked| Case::new(name, &big, &big_qs, filter, booked);
    let mut cases = vec![
        on_big(format!("{ranks}r/all"), Filter::None, true),
        on_big(format!("{ranks}r/all/advisory"), Filter::None, false),
        on_big(format!("{ranks}r/subset1in{NARROW}"), Filter::Subset, true),
        on_big(format!("{ranks}r/lora1in{NARROW}"), Filter::Lora, true),
        Case::new("64r/all".to_string(), &small, &small_qs, Filter::None, true),
        Case::new(
            format!("{ranks}r/idle"),
            &idle,
            &idle_qs,
            Filter::None,
            true,
        ),
    ];
    cases.retain(|c| c.name.contains(plan.only.as_str()));
    // A warm-up round of every case, not kept.
    for c in &mut cases {
        c.round(0, &subset, plan.calls / 4 + 1);
        c.reserve.clear();
        c.free.clear();
    }
    for rep in 0..plan.reps {
        for c in &mut cases {
            c.round(rep * 7, &subset, plan.calls);
        }
    }
    for c in &cases {
        let what = if c.booked {
            "select_and_reserve"
        } else {
            "select"
        };
        report.push(Figure::percentiles(
            &format!("{what}/{}", c.name),
            &c.reserve,
        ));
        if c.booked && c.filter == Filter::None {
            report.push(Figure::percentiles(&format!("free/{}", c.name), &c.free));
        }
    }
    churn(plan, &big, report);
}

impl<'a> Case<'a> {
    fn new(
        name: String,
        w: &'a SelectionWorkload,
        queries: &'a [Vec<u32>],
        filter: Filter,
        booked: bool,
    ) -> Self {
        Case {
            name,
            w,
            queries,
            filter,
            booked,
            reserve: Vec::new(),
            free: Vec::new(),
        }
    }

    /// `calls` calls from query `first` on (cycled); pushes this round's (p50, p99).
    fn round(&mut self, first: usize, subset: &[WorkerId], calls: usize) {
        let qs = self.queries;
        let (engine, key) = (&*self.w.engine, &self.w.key);
        let mut r_ns = Vec::with_capacity(calls);
        let mut f_ns = Vec::with_capacity(calls);
        for k in 0..calls {
            let mut req = SelectRequest::tokens(&qs[(first + k) % qs.len()]);
            match self.filter {
                Filter::None => {}
                Filter::Subset => req.allowed_workers = Some(subset),
                Filter::Lora => req.lora_name = Some(kvr_benches::selection::LORA),
            }
            if self.booked {
                let t0 = Instant::now();
                let out = engine.select_and_reserve(key, black_box(&req));
                let t1 = Instant::now();
                let Ok(Outcome::Selected(d)) = out else {
                    panic!("select_and_reserve on {}: {out:?}", self.name);
                };
                let id = d.selection_id.expect("a booked decision has an id");
                black_box(engine.free(id).expect("freeing a live booking"));
                let t2 = Instant::now();
                r_ns.push((t1 - t0).as_nanos() as u64);
                f_ns.push((t2 - t1).as_nanos() as u64);
                // Both filters narrow to every NARROW-th worker.
                assert!(
                    self.filter == Filter::None || d.rank.worker_id % NARROW as u64 == 0,
                    "{} chose {:?}, outside its filter",
                    self.name,
                    d.rank
                );
            } else {
                let t0 = Instant::now();
                let out = engine.select(key, black_box(&req));
                r_ns.push(t0.elapsed().as_nanos() as u64);
                assert!(matches!(out, Ok(Outcome::Selected(_))), "select: {out:?}");
            }
        }
        self.reserve.push(p50_p99(r_ns));
        if self.booked {
            self.free.push(p50_p99(f_ns));
        }
    }
}

fn p50_p99(mut ns: Vec<u64>) -> (u64, u64) {
    ns.sort_unstable();
    let at = |p: f64| ns[((ns.len() as f64 * p).ceil() as usize).clamp(1, ns.len()) - 1];
    (at(0.50), at(0.99))
}

/// Adds `plan.churn_workers` new workers, then removes as many built ones (with their
/// blocks, bookings and loads), each call timed.
fn churn(plan: &SelectPlan, w: &SelectionWorkload, report: &mut Report) {
    let p = w
        .engine
        .partition(&w.key)
        .expect("the workload's partition");
    let first_new = plan.workers as u64 + 1_000;
    let mut add_ns = Vec::new();
    for i in 0..plan.churn_workers as u64 {
        let mut info = WorkerInfo::new(first_new + i, plan.dp);
        info.total_kv_blocks = 65_536;
        let t0 = Instant::now();
        let new = p.upsert_worker(info).expect("valid worker metadata");
        add_ns.push(t0.elapsed().as_nanos() as u64);
        assert!(new, "worker {} existed", first_new + i);
    }
    // The first booking on each new worker (its ranks' booking state is made then).
    let q = w.queries(plan.tokens, 1, 2);
    let mut first_ns = Vec::new();
    for i in 0..plan.churn_workers as u64 {
        let mut req = SelectRequest::tokens(&q[0]);
        req.pinned_worker = Some(first_new + i);
        let t0 = Instant::now();
        let out = w.engine.select_and_reserve(&w.key, &req);
        first_ns.push(t0.elapsed().as_nanos() as u64);
        let Ok(Outcome::Selected(d)) = out else {
            panic!("first booking on worker {}: {out:?}", first_new + i);
        };
        w.engine
            .free(d.selection_id.expect("a booked decision has an id"))
            .expect("freeing a live booking");
    }
    report.push(Figure::calls("first_booking_on_a_new_worker", first_ns));
    let held_before = p.index().stats().holder_blocks;
    let mut remove_ns = Vec::new();
    // Built workers from the top of the id range, each with its blocks and bookings.
    for k in 0..plan.churn_workers as u64 {
        let id = plan.workers as u64 - 1 - k;
        let t0 = Instant::now();
        let gone = p.remove_worker(id);
        remove_ns.push(t0.elapsed().as_nanos() as u64);
        assert!(gone, "worker {id} was not there");
    }
    let held_after = p.index().stats().holder_blocks;
    assert!(
        held_after < held_before,
        "removed workers left their blocks"
    );
    report.push(Figure::calls("add_worker", add_ns));
    report.push(Figure::calls("remove_worker", remove_ns));
    report.note(format!(
        "remove_worker dropped {} holder-blocks over {} workers",
        held_before - held_after,
        plan.churn_workers
    ));
    // Selection still serves after the churn.
    let q = w.queries(plan.tokens, 1, 1);
    let out = w.engine.select(&w.key, &SelectRequest::tokens(&q[0]));
    assert!(
        matches!(out, Ok(Outcome::Selected(_))),
        "select after churn: {out:?}"
    );
}

impl Figure {
    /// The median round's p50 and p99 with their spreads over the rounds.
    fn percentiles(name: &str, rounds: &[(u64, u64)]) -> Self {
        Figure {
            name: name.to_string(),
            unit: "ns",
            p50: Spread::of(rounds.iter().map(|r| r.0 as f64).collect()),
            p99: Some(Spread::of(rounds.iter().map(|r| r.1 as f64).collect())),
        }
    }

    /// One call each: the p50 and the largest.
    fn calls(name: &str, mut ns: Vec<u64>) -> Self {
        ns.sort_unstable();
        let p50 = ns[ns.len() / 2] as f64;
        let max = *ns.last().expect("at least one call") as f64;
        Figure {
            name: name.to_string(),
            unit: "ns",
            p50: Spread {
                median: p50,
                min: ns[0] as f64,
                max,
            },
            p99: None,
        }
    }
}
