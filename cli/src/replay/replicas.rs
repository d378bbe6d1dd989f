//! `kvr replay --routers N,… --sync MODE,…`: every policy with several router replicas
//! sharing bookings or not ([`super::routers`]), one row per (policy, replicas, sync),
//! medians over `--seeds` seeds, in one table.
//!
//! Per row: prefix hit rate; TTFT p50/p90; **load CoV** — the coefficient of variation
//! (population standard deviation / mean) across ranks of the true number of requests
//! on each rank (queued or running, from the simulated engines), sampled every 100 ms of
//! simulated time while any request is in flight and averaged over the samples;
//! **max/mean** — the busiest rank's requests over the mean, averaged the same way, and
//! the most requests any rank held; **seen** — requests replica 0's bookings count
//! (local, peers', phantoms) over the requests truly in flight, averaged (1 = an exact
//! view; about 1/N without sync); **race** — share of requests routed to a rank that
//! another replica picked within the race window (`--race-window-ms`), i.e. before
//! either could see the other's booking; **race|exposed** — the same among the requests
//! routed while another replica routed anything within the window (1/ranks if the
//! picks were independent and uniform); **blind** — share of requests routed to a rank
//! holding a live request of another replica that the routing replica cannot see.

use clap::Args;
use indicatif::ProgressBar;

use super::policy::PolicyKind;
use super::report::{percentile, secs_cell, PolicyReport};
use super::routers::{FleetStats, ReplicaConfig, Spread, SyncMode};
use super::sim::{self, RunResult, SimConfig};
use super::workload::Workload;

/// The replica flags of `kvr replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplicaArgs {
    /// Router replicas in front of the cluster, comma-separated for a table over several
    /// (e.g. 1,2,4,8). Without it, one router (the usual report).
    #[arg(long, value_name = "N,…")]
    pub routers: Option<String>,
    /// How replicas share bookings, comma-separated: none, dynamo (best effort, lossy,
    /// no output blocks, peers' bookings expire 300 s after receipt), jetstream
    /// (sequenced, nothing lost).
    #[arg(long, default_value = "none", value_name = "MODE,…")]
    pub sync: String,
    /// Delay of a sync event between replicas, ms (default: 1 for dynamo, 3 for
    /// jetstream).
    #[arg(long, value_name = "MS")]
    pub sync_latency_ms: Option<f64>,
    /// `dynamo` sync: probability that one event is lost for one peer.
    #[arg(long, default_value_t = 0.0)]
    pub sync_loss: f64,
    /// How requests are spread over the replicas: round-robin or random.
    #[arg(long, default_value = "round-robin", value_name = "round-robin|random")]
    pub router_spread: String,
    /// Two replicas picking the same rank within this window is a selection race, ms.
    #[arg(long, default_value_t = RACE_WINDOW_MS)]
    pub race_window_ms: f64,
    /// Replica-specific near-tie break for least-loaded and dynamo-classic: among ranks
    /// within this fraction of the best key, each replica takes its own favourite (a hash
    /// of replica and rank). 0 = off (a random rank among exact ties).
    #[arg(long, default_value_t = 0.0)]
    pub replica_tie_band: f64,
    /// kvr's policies: each replica splits exact ties in its own way, as `kvr serve
    /// --replica-ordinal K --replica-count N` does (replica K starts its round of the
    /// ranks K/N of the way round). Off: a random rank among exact ties.
    #[arg(long)]
    pub replica_split: bool,
    /// With --routers: replay seeds --seed, --seed+1, … and report medians.
    #[arg(long, default_value_t = 1)]
    pub seeds: u32,
}

/// The default race window, ms.
const RACE_WINDOW_MS: f64 = 10.0;

/// The parsed replica settings.
pub(crate) struct ReplicaPlan {
    pub routers: Vec<u32>,
    pub syncs: Vec<SyncMode>,
    pub latency_ms: Option<f64>,
    pub loss: f64,
    pub spread: Spread,
    pub race_window_ms: f64,
    pub tie_band: f64,
    pub split: bool,
    pub seeds: u32,
}

/// Replicas a replay may simulate.
pub(crate) const MAX_ROUTERS: u32 = 64;

impl ReplicaArgs {
    pub(crate) fn plan(&self) -> Result<Option<ReplicaPlan>, String> {
        let Some(list) = &self.routers else {
            let set = self.sync != "none"
                || self.sync_latency_ms.is_some()
                || self.sync_loss != 0.0
                || self.router_spread != "round-robin"
                || self.race_window_ms != RACE_WINDOW_MS
                || self.replica_tie_band != 0.0
                || self.replica_split
                || self.seeds != 1;
            if set {
                return Err(
                    "the replica flags (--sync, --sync-latency-ms, --sync-loss, \
                            --router-spread, --race-window-ms, --replica-tie-band, --replica-split, \
                            --seeds) \
                            apply only with --routers"
                        .into(),
                );
            }
            return Ok(None);
        };
        let routers = list
            .split(',')
            .map(|v| match v.trim().parse::<u32>() {
                Ok(n) if (1..=MAX_ROUTERS).contains(&n) => Ok(n),
                _ => Err(format!(
                    "--routers takes replica counts from 1 to {MAX_ROUTERS} (got {v:?})"
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let syncs = self
            .sync
            .split(',')
            .map(|s| SyncMode::parse(s.trim()))
            .collect::<Result<Vec<_>, _>>()?;
        let finite = |v: f64| v.is_finite() && v >= 0.0;
        if !self.sync_latency_ms.is_none_or(finite) {
            return Err("--sync-latency-ms must be zero or more".into());
        }
        if !(finite(self.sync_loss) && self.sync_loss <= 1.0) {
            return Err("--sync-loss must be a probability in [0, 1]".into());
        }
        if !finite(self.race_window_ms) || !finite(self.replica_tie_band) {
            return Err("--race-window-ms and --replica-tie-band must be zero or more".into());
        }
        if !(1..=16).contains(&self.seeds) {
            return Err("--seeds must be between 1 and 16".into());
        }
        let spread = match self.router_spread.as_str() {
            "round-robin" => Spread::RoundRobin,
            "random" => Spread::Random,
            s => {
                return Err(format!(
                    "--router-spread must be round-robin or random (got {s:?})"
                ))
            }
        };
        Ok(Some(ReplicaPlan {
            routers,
            syncs,
            latency_ms: self.sync_latency_ms,
            loss: self.sync_loss,
            spread,
            race_window_ms: self.race_window_ms,
            tie_band: self.replica_tie_band,
            split: self.replica_split,
            seeds: self.seeds,
        }))
    }
}

impl ReplicaPlan {
    /// The replica configuration of `n` replicas syncing by `sync` with seed `seed`.
    pub(crate) fn config(&self, n: u32, sync: SyncMode, seed: u64) -> ReplicaConfig {
        ReplicaConfig {
            routers: n,
            sync,
            latency_ms: self.latency_ms.unwrap_or(sync.default_latency_ms()),
            loss: self.loss,
            spread: self.spread,
            race_window_ms: self.race_window_ms,
            seed,
        }
    }

    /// The (replicas, sync) pairs to run: one replica runs once (sync changes nothing).
    fn cells(&self) -> Vec<(u32, SyncMode)> {
        let mut out = Vec::new();
        for &n in &self.routers {
            if n == 1 {
                out.push((1, SyncMode::None));
            } else {
                out.extend(self.syncs.iter().map(|&s| (n, s)));
            }
        }
        out.dedup();
        out
    }
}

/// Runs `kind` with the replicas of `rc` on `w`.
pub(crate) fn run_one(
    kind: PolicyKind,
    cfg: &SimConfig,
    rc: ReplicaConfig,
    tie_band: f64,
    split: bool,
    w: &Workload,
    bar: &ProgressBar,
) -> (RunResult, FleetStats) {
    let n = rc.routers;
    let mut routers: Vec<_> = (0..n)
        .map(|k| {
            let r = super::replica_router_for(kind, cfg, k, tie_band);
            if split && n > 1 {
                r.partition().set_hooks(kvr::HostHooks {
                    tie_break: Some(kvr_service::replica_slot::tie_break(k, n)),
                    ..kvr::HostHooks::default()
                });
            }
            r
        })
        .collect();
    let (res, _, stats) = sim::run_replicas(cfg, w, &mut routers, rc, || bar.inc(1));
    (res, stats)
}

/// One seed's figures of a row.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub(crate) struct RowFigures {
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub load_cov: f64,
    pub max_over_mean: f64,
    pub peak_active: f64,
    pub seen: f64,
    pub race: f64,
    pub race_given_exposed: f64,
    pub blind: f64,
    pub sync_lost: f64,
    pub peer_expired: f64,
}

impl RowFigures {
    pub(crate) fn new(r: &RunResult, s: &FleetStats, oracle: f64) -> Self {
        let p = PolicyReport::new(r, oracle);
        let per = |x: f64, n: f64| if n > 0.0 { x / n } else { 0.0 };
        let samples = s.samples as f64;
        let requests = r.requests as f64;
        RowFigures {
            hit_rate: p.hit_rate,
            ttft_p50_ms: p.ttft_ms.p50,
            ttft_p90_ms: p.ttft_ms.p90,
            load_cov: per(s.cov_sum, samples),
            max_over_mean: per(s.peak_ratio_sum, samples),
            peak_active: f64::from(s.max_active),
            seen: per(s.visible_sum, samples),
            race: per(s.races as f64, requests),
            race_given_exposed: per(s.races as f64, s.exposed as f64),
            blind: per(s.blind as f64, requests),
            sync_lost: s.lost as f64,
            peer_expired: s.peer_expired.iter().sum::<u64>() as f64,
        }
    }
}

/// A row: its per-seed figures.
#[derive(serde::Serialize)]
pub(crate) struct Row {
    pub policy: &'static str,
    pub routers: u32,
    pub sync: &'static str,
    pub seeds: Vec<RowFigures>,
}

/// Median and (min, max) of one figure over a row's seeds.
fn stat(row: &Row, f: impl Fn(&RowFigures) -> f64) -> (f64, f64, f64) {
    let mut v: Vec<f64> = row.seeds.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    let lo = v.first().copied().unwrap_or(0.0);
    let hi = v.last().copied().unwrap_or(0.0);
    // The lower median for an even count (nearest rank), as the report's percentiles.
    (percentile(&v, 50.0), lo, hi)
}

/// Every policy at every (replicas, sync) over the seeds. `workload(seed)` gives the
/// workload and its oracle hit rate for a seed.
pub(crate) fn run(
    plan: &ReplicaPlan,
    cfg: &SimConfig,
    policies: &[PolicyKind],
    mut workload: impl FnMut(u64) -> Result<(Workload, f64), String>,
    bar: &ProgressBar,
) -> Result<(Vec<Row>, Vec<String>), String> {
    let cells = plan.cells();
    let mut rows: Vec<Row> = Vec::new();
    for &kind in policies {
        for &(n, sync) in &cells {
            rows.push(Row {
                policy: kind.name(),
                routers: n,
                sync: sync.name(),
                seeds: Vec::new(),
            });
        }
    }
    let mut problems = Vec::new();
    for k in 0..u64::from(plan.seeds) {
        let seed = cfg.seed.wrapping_add(k);
        let (w, oracle) = workload(seed)?;
        let at = SimConfig {
            seed,
            ..cfg.clone()
        };
        let mut row = rows.iter_mut();
        for &kind in policies {
            for &(n, sync) in &cells {
                bar.reset();
                bar.set_length(w.requests.len() as u64);
                bar.set_message(format!("{} × {n} {} seed {seed}", kind.name(), sync.name()));
                let rc = plan.config(n, sync, seed);
                let (r, s) = run_one(kind, &at, rc, plan.tie_band, plan.split, &w, bar);
                problems.extend(
                    r.problems
                        .iter()
                        .map(|p| format!("{} × {n} {} seed {seed}: {p}", kind.name(), sync.name())),
                );
                let row = row.next().expect("a row per cell");
                row.seeds.push(RowFigures::new(&r, &s, oracle));
            }
        }
    }
    bar.finish_and_clear();
    Ok((rows, problems))
}

/// The rows as a text table: medians over the seeds, with the range of CoV and hit rate
/// when there are several.
pub(crate) fn table(rows: &[Row]) -> String {
    let header = [
        "policy",
        "routers",
        "sync",
        "hit rate",
        "TTFT p50 s",
        "p90 s",
        "load CoV",
        "max/mean",
        "peak",
        "seen",
        "race",
        "race|exp",
        "blind",
        "lost",
        "expired",
    ];
    let several = rows.first().is_some_and(|r| r.seeds.len() > 1);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let ranged = |f: &dyn Fn(&RowFigures) -> f64, scale: f64, digits: usize| {
                let (m, lo, hi) = stat(r, f);
                if several {
                    format!(
                        "{:.digits$} ({:.digits$}–{:.digits$})",
                        m * scale,
                        lo * scale,
                        hi * scale
                    )
                } else {
                    format!("{:.digits$}", m * scale)
                }
            };
            let med = |f: &dyn Fn(&RowFigures) -> f64| stat(r, f).0;
            vec![
                r.policy.to_string(),
                r.routers.to_string(),
                if r.routers == 1 {
                    "-".into()
                } else {
                    r.sync.to_string()
                },
                ranged(&|x| x.hit_rate, 100.0, 1) + " %",
                secs_cell(med(&|x| x.ttft_p50_ms)),
                secs_cell(med(&|x| x.ttft_p90_ms)),
                ranged(&|x| x.load_cov, 1.0, 3),
                format!("{:.2}", med(&|x| x.max_over_mean)),
                format!("{:.0}", med(&|x| x.peak_active)),
                format!("{:.2}", med(&|x| x.seen)),
                format!("{:.1} %", med(&|x| x.race) * 100.0),
                format!("{:.3}", med(&|x| x.race_given_exposed)),
                format!("{:.1} %", med(&|x| x.blind) * 100.0),
                format!("{:.0}", med(&|x| x.sync_lost)),
                format!("{:.0}", med(&|x| x.peer_expired)),
            ]
        })
        .collect();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let all =
        std::iter::once(header.iter().map(|h| h.to_string()).collect::<Vec<_>>()).chain(cells);
    for row in all {
        for (i, (c, w)) in row.iter().zip(&width).enumerate() {
            let pad = " ".repeat(w - c.chars().count());
            if i == 0 {
                out.push_str(&format!("{c}{pad}"));
            } else {
                out.push_str(&format!("  {pad}{c}"));
            }
        }
        out.push('\n');
    }
    out
}
