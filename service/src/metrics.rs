//! `GET /metrics`: Prometheus text exposition (prometheus-client). Names, all `kvr_`
//! prefixed, plus the Dynamo names users' dashboards already query:
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `kvr_http_requests_total` | counter | `route`, `status` | requests answered |
//! | `kvr_http_request_duration_seconds` | histogram | `route` | time to answer |
//! | `kvr_http_bad_bodies_total` | counter | | bodies refused as malformed (4xx) |
//! | `kvr_selections_total` | counter | `outcome` (`selected`, `booked`, `busy`, `no_worker`, `error`) | selection requests |
//! | `kvr_selection_prompt_tokens_total`, `kvr_selection_cached_tokens_total` | counter | | prompt tokens selected, and of them cached on the chosen rank's device |
//! | `kvr_router_kv_hit_rate`, `dynamo_component_router_kv_hit_rate` | gauge | | cached / prompt tokens since start |
//! | `kvr_kv_events_applied_total` | counter | `model`, `event_type` (`stored_blocks`, `removed_blocks`), `status` (`ok`) | blocks the index applied |
//! | `kvr_kv_events_rejected_total` | counter | `model`, `reason` | events or frames refused |
//! | `kvr_kv_stream_*` | gauge/counter | `model`, `worker_id`, `stream` (+ `outcome`, `state`, `reason`) | per stream: `last_batch_age_seconds`, `gaps_total`, `replays_total` (requested), `replay_outcomes_total` (`outcome`: `filled`, `partial`, `failed`), `restarts_total`, `idle_probes_total`, `clears_total`, `batches_lost_total`, `recovering` (1 while a replay is in flight), `stale_seconds` (how long the ranks have been stale; 0 = fresh), `health` (`state`: `exact`, `recovering`, `degraded`, `dead`, 1 for the current one; `reason`), `health_seconds` (time in that state), `link_failures_total` |
//! | `kvr_index_blocks`, `kvr_index_nodes`, `kvr_index_bytes`, `kvr_index_bytes_per_holder_block` | gauge | `model` | index size |
//! | `kvr_index_*`, `kvr_selection_*`, `kvr_session_*`, `kvr_indexer_*`, `kvr_approx_index_*`, `kvr_booking_*` | counter/gauge | `model` | the engine's figures, one family per stats field (figures.rs; e.g. `kvr_index_stored_events_total`, `kvr_index_tier_blocks{tier}`, `kvr_session_leases`) |
//! | `kvr_kv_stream_*` (more) | counter | `model`, `worker_id`, `stream` | per stream: `messages_total`, `bytes_total`, `batches_total`, `events_total`, `duplicates_total`, `dp_rank_refused_total`, `events_skipped_group_total`, `group_switches_total`, `events_skipped_medium_total`, `events_skipped_malformed_total`, `tokenless_blocks_unknown_total` |
//! | `kvr_rank_active_requests` | gauge | `worker_id`, `dp_rank` | booked requests per rank |
//! | `kvr_bookings_active` | gauge | `model` | live bookings |
//! | `kvr_prefill_rate_tokens_per_second` | gauge | `model` | the latency cost's learned prefill rate of one rank (0 until a prefill completion is timed; the prior is used meanwhile) |
//! | `kvr_prefill_rate_observations_total` | counter | `model` | prefill completions folded into that rate |
//! | `kvr_decode_drag_ms_per_block` | gauge | `model` | the latency cost's learned decode drag: ms of time to first token per decode block a rank holds (0 until learned) |
//! | `kvr_decode_drag_observations_total` | counter | `model` | prefill completions folded into that drag |
//! | `kvr_workers` | gauge | `model`, `lifecycle` | registered workers |
//! | `kvr_pending_selections` | gauge | | pending-selection cache entries |
//! | `kvr_recovery_*` | counter | | peer `/dump` recovery: `attempts_total`, `failures_total`, `events_total` |
//! | `kvr_state_*` | counter/gauge | `model`, `backend` | `--state-dir`: the journal's writer and the restore at start (`crate::state`) |
//! | `kvr_kv_streams`, `kvr_ready_exact_share`, `kvr_ready_reached_seconds` | gauge | `state` (the first) | streams by state, the exact share, when `/ready`'s share was first reached (`crate::coverage`) |
//! | `dynamo_frontend_worker_active_decode_blocks`, `dynamo_frontend_worker_active_prefill_tokens` | gauge | `worker_id`, `dp_rank` | booked load per rank |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry as PromRegistry;

use kvr::stats::SourceHealth;

use crate::figures::{self, family, Labels, Rows};
use crate::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteStatus {
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// Selection outcomes counted by `kvr_selections_total`.
#[derive(Clone, Copy, Debug)]
pub enum SelectionOutcome {
    Selected,
    Booked,
    Busy,
    NoWorker,
    Error,
}

impl SelectionOutcome {
    fn label(self) -> &'static str {
        match self {
            SelectionOutcome::Selected => "selected",
            SelectionOutcome::Booked => "booked",
            SelectionOutcome::Busy => "busy",
            SelectionOutcome::NoWorker => "no_worker",
            SelectionOutcome::Error => "error",
        }
    }
}

/// Counters of the recovery from peers.
#[derive(Debug, Default)]
pub struct RecoveryCounters {
    pub attempts: AtomicU64,
    pub failures: AtomicU64,
    pub events: AtomicU64,
}

/// The service's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: PromRegistry,
    requests: Family<RouteStatus, Counter>,
    latency: Family<RouteLabel, Histogram>,
    selections: Family<OutcomeLabel, Counter>,
    pub prompt_tokens: Counter,
    pub cached_tokens: Counter,
    pub recovery: Arc<RecoveryCounters>,
    /// Refused requests and connections by reason (`kvr_http_refused_total`).
    pub refusals: Arc<crate::refusals::Refusals>,
}

fn latency_histogram() -> Histogram {
    // 1 µs .. ~1 s.
    Histogram::new(exponential_buckets(1e-6, 2.0, 21))
}

impl Metrics {
    pub fn new(workers: Arc<Registry>, pending: Arc<crate::pending::PendingCache>) -> Self {
        Self::with_extra(workers, pending, |_| {})
    }

    /// As [`Metrics::new`], with a host's own metrics registered by `extra` (the endpoint
    /// picker's), so one `/metrics` carries both.
    pub fn with_extra(
        workers: Arc<Registry>,
        pending: Arc<crate::pending::PendingCache>,
        extra: impl FnOnce(&mut PromRegistry),
    ) -> Self {
        let mut registry = PromRegistry::default();
        extra(&mut registry);
        let requests = Family::<RouteStatus, Counter>::default();
        let latency =
            Family::<RouteLabel, Histogram>::new_with_constructor(latency_histogram as fn() -> _);
        let selections = Family::<OutcomeLabel, Counter>::default();
        let prompt_tokens = Counter::default();
        let cached_tokens = Counter::default();
        registry.register(
            "kvr_http_requests",
            "HTTP requests answered",
            requests.clone(),
        );
        registry.register(
            "kvr_http_request_duration_seconds",
            "Time to answer an HTTP request",
            latency.clone(),
        );
        registry.register(
            "kvr_selections",
            "Selection requests by outcome",
            selections.clone(),
        );
        registry.register(
            "kvr_selection_prompt_tokens",
            "Prompt tokens of selected requests",
            prompt_tokens.clone(),
        );
        registry.register(
            "kvr_selection_cached_tokens",
            "Prompt tokens cached on the chosen rank's device",
            cached_tokens.clone(),
        );
        let recovery = Arc::new(RecoveryCounters::default());
        let refusals = Arc::new(crate::refusals::Refusals::register(&mut registry));
        registry.register_collector(Box::new(EngineCollector {
            workers,
            pending,
            prompt_tokens: prompt_tokens.clone(),
            cached_tokens: cached_tokens.clone(),
            recovery: recovery.clone(),
        }));
        Self {
            registry,
            requests,
            latency,
            selections,
            prompt_tokens,
            cached_tokens,
            recovery,
            refusals,
        }
    }

    pub fn selection(&self, outcome: SelectionOutcome) {
        self.selections
            .get_or_create(&OutcomeLabel {
                outcome: outcome.label(),
            })
            .inc();
    }

    /// Counts and times one answered request by its route template.
    pub fn request(&self, route: String, status: u16, elapsed: Duration) {
        self.latency
            .get_or_create(&RouteLabel {
                route: route.clone(),
            })
            .observe(elapsed.as_secs_f64());
        self.requests
            .get_or_create(&RouteStatus { route, status })
            .inc();
    }

    /// The Prometheus text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Engine state, read at scrape time.
#[derive(Debug)]
struct EngineCollector {
    workers: Arc<Registry>,
    pending: Arc<crate::pending::PendingCache>,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    recovery: Arc<RecoveryCounters>,
}

fn one<M: EncodeMetric>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    v: M,
) -> Result<(), std::fmt::Error> {
    v.encode(enc.encode_descriptor(name, help, None, kind)?)
}

impl Collector for EngineCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let (mut applied, mut rejected) = (Vec::new(), Vec::new());
        let (mut age, mut replays, mut outcomes, mut stale) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut tiers, mut per_block, mut bookings) = (Vec::new(), Vec::new(), Vec::new());
        let (mut drag_gauge, mut drag_obs) = (Vec::new(), Vec::new());
        let (mut rate_gauge, mut rate_obs) = (Vec::new(), Vec::new());
        let (mut health, mut health_age) = (Vec::new(), Vec::new());
        let mut index = Rows::new(figures::INDEX);
        let mut selection = Rows::new(figures::SELECTION);
        let mut session = Rows::new(figures::SESSION);
        let mut indexer = Rows::new(figures::INDEXER);
        let mut approx = Rows::new(figures::APPROX);
        let mut booking = Rows::new(figures::BOOKING);
        let mut stream = Rows::new(figures::STREAM);
        let mut sequence = Rows::new(figures::SEQUENCE);
        let mut rank = Rows::new(figures::RANK);
        for entry in self.workers.partitions() {
            let p = &entry.partition;
            let model = format!("{}:{}", p.key().model, p.key().routing_group);
            let streams = p.ingress_stats();
            let (mut stored, mut removed, mut ev_rej, mut bad) = (0, 0, 0, 0);
            for s in &streams {
                stored += s.blocks_stored;
                removed += s.blocks_removed;
                ev_rej += s.events_rejected + s.block_size_mismatches;
                bad += s.bad_frames + s.decode_errors.iter().map(|(_, n)| n).sum::<u64>();
                let l: Labels = vec![
                    ("model", model.clone()),
                    ("worker_id", s.worker_id.to_string()),
                    ("stream", s.stream.to_string()),
                ];
                stream.push(&l, s);
                let q = &s.sequence;
                sequence.push(&l, q);
                let a = if s.last_batch_unix_ms == 0 {
                    -1.0
                } else {
                    now_ms.saturating_sub(s.last_batch_unix_ms) as f64 / 1e3
                };
                age.push((l.clone(), ConstGauge::new(a)));
                replays.push((l.clone(), ConstCounter::new(q.replays_requested)));
                for (outcome, n) in [
                    ("filled", q.replays_filled),
                    ("partial", q.replays_partial),
                    ("failed", q.replays_failed),
                ] {
                    let mut labels = l.clone();
                    labels.push(("outcome", outcome.to_string()));
                    outcomes.push((labels, ConstCounter::new(n)));
                }
                let st = match s.stale_since_unix_ms {
                    0 => 0.0,
                    t => now_ms.saturating_sub(t) as f64 / 1e3,
                };
                stale.push((l.clone(), ConstGauge::new(st)));
                let reason = s.health_reason.text().to_string();
                for state in SourceHealth::ALL {
                    let mut labels = l.clone();
                    labels.push(("state", state.name().to_string()));
                    labels.push(("reason", reason.clone()));
                    health.push((labels, ConstGauge::new(i64::from(state == s.health))));
                }
                let since = match s.health_since_unix_ms {
                    0 => 0.0,
                    t => now_ms.saturating_sub(t) as f64 / 1e3,
                };
                health_age.push((l, ConstGauge::new(since)));
            }
            let ml = |extra: &[(&'static str, &str)]| -> Labels {
                let mut v = vec![("model", model.clone())];
                v.extend(extra.iter().map(|(k, x)| (*k, x.to_string())));
                v
            };
            applied.push((
                ml(&[("event_type", "stored_blocks"), ("status", "ok")]),
                ConstCounter::new(stored),
            ));
            applied.push((
                ml(&[("event_type", "removed_blocks"), ("status", "ok")]),
                ConstCounter::new(removed),
            ));
            rejected.push((ml(&[("reason", "event")]), ConstCounter::new(ev_rej)));
            rejected.push((ml(&[("reason", "frame")]), ConstCounter::new(bad)));
            let ix = p.index().stats();
            index.push(&ml(&[]), &ix);
            for (tier, n) in figures::TIERS.iter().zip(ix.tier_blocks) {
                tiers.push((ml(&[("tier", tier)]), ConstGauge::new(n as i64)));
            }
            let pb = if ix.holder_blocks == 0 {
                0.0
            } else {
                ix.bytes as f64 / ix.holder_blocks as f64
            };
            per_block.push((ml(&[]), ConstGauge::new(pb)));
            selection.push(&ml(&[]), &p.selection_stats());
            if let Some(s) = p.session_stats() {
                session.push(&ml(&[]), &s);
            }
            let ixr = p.indexer_stats();
            indexer.push(&ml(&[]), &ixr);
            if let Some(a) = &ixr.approx {
                approx.push(&ml(&[]), a);
            }
            let b = p.bookings();
            bookings.push((ml(&[]), ConstGauge::new(b.len() as i64)));
            booking.push(&ml(&[]), &b.stats());
            rate_gauge.push((ml(&[]), ConstGauge::new(b.prefill_rate().unwrap_or(0.0))));
            rate_obs.push((ml(&[]), ConstCounter::new(b.prefill_rate_observations())));
            drag_gauge.push((
                ml(&[]),
                ConstGauge::new(b.decode_drag().map_or(0.0, |s| s * 1e3)),
            ));
            drag_obs.push((ml(&[]), ConstCounter::new(b.decode_drag_observations())));
            for (r, load) in b.loads().ranks() {
                let l: Labels = vec![
                    ("worker_id", r.worker_id.to_string()),
                    ("dp_rank", r.dp_rank.to_string()),
                ];
                rank.push(&l, &load);
            }
        }
        let g = MetricType::Gauge;
        let c = MetricType::Counter;
        family(
            &mut enc,
            "kvr_kv_events_applied",
            "Blocks the index applied from KV events",
            c,
            &applied,
        )?;
        family(
            &mut enc,
            "kvr_kv_events_rejected",
            "KV events or frames refused",
            c,
            &rejected,
        )?;
        family(
            &mut enc,
            "kvr_kv_stream_last_batch_age_seconds",
            "Seconds since the stream's last batch (-1: none yet)",
            g,
            &age,
        )?;
        family(
            &mut enc,
            "kvr_kv_stream_replays",
            "Replays requested for the stream",
            c,
            &replays,
        )?;
        family(
            &mut enc,
            "kvr_kv_stream_replay_outcomes",
            "Replays ended, by outcome (filled, partial: range no longer buffered, failed)",
            c,
            &outcomes,
        )?;
        family(
            &mut enc,
            "kvr_kv_stream_stale_seconds",
            "How long the stream's ranks have been stale (a known loss being replayed, or the stream degraded or dead; their overlap is not credited), 0 when fresh",
            g,
            &stale,
        )?;
        family(
            &mut enc,
            "kvr_kv_stream_health",
            "The stream's state, 1 for the current one (exact, recovering, degraded, dead), with why",
            g,
            &health,
        )?;
        family(
            &mut enc,
            "kvr_kv_stream_health_seconds",
            "Seconds the stream has been in its state (0: since its subscription started)",
            g,
            &health_age,
        )?;
        stream.encode(&mut enc)?;
        sequence.encode(&mut enc)?;
        index.encode(&mut enc)?;
        let (name, help) = figures::TIER_BLOCKS;
        family(&mut enc, name, help, g, &tiers)?;
        family(
            &mut enc,
            "kvr_index_bytes_per_holder_block",
            "Index bytes per holder-block",
            g,
            &per_block,
        )?;
        selection.encode(&mut enc)?;
        session.encode(&mut enc)?;
        indexer.encode(&mut enc)?;
        approx.encode(&mut enc)?;
        family(
            &mut enc,
            "kvr_bookings_active",
            "Live bookings",
            g,
            &bookings,
        )?;
        booking.encode(&mut enc)?;
        family(
            &mut enc,
            "kvr_prefill_rate_tokens_per_second",
            "Learned prefill rate of one rank (0: none measured yet)",
            g,
            &rate_gauge,
        )?;
        family(
            &mut enc,
            "kvr_prefill_rate_observations",
            "Prefill completions folded into the learned rate",
            c,
            &rate_obs,
        )?;
        family(
            &mut enc,
            "kvr_decode_drag_ms_per_block",
            "Learned decode drag: ms of time to first token per decode block a rank holds (0: none learned)",
            g,
            &drag_gauge,
        )?;
        family(
            &mut enc,
            "kvr_decode_drag_observations",
            "Prefill completions folded into the learned decode drag",
            c,
            &drag_obs,
        )?;
        rank.encode(&mut enc)?;
        let mut by_state: std::collections::BTreeMap<(String, &'static str), i64> =
            Default::default();
        for r in self.workers.records() {
            let state = match r.lifecycle {
                crate::wire::worker::Lifecycle::Incomplete => "incomplete",
                crate::wire::worker::Lifecycle::Schedulable => "schedulable",
                crate::wire::worker::Lifecycle::Draining => "draining",
                crate::wire::worker::Lifecycle::Unschedulable => "unschedulable",
            };
            *by_state
                .entry((format!("{}:{}", r.model_name, r.routing_group), state))
                .or_default() += 1;
        }
        let workers: Vec<(Labels, ConstGauge)> = by_state
            .into_iter()
            .map(|((m, s), n)| {
                (
                    vec![("model", m), ("lifecycle", s.to_string())],
                    ConstGauge::new(n),
                )
            })
            .collect();
        family(
            &mut enc,
            "kvr_workers",
            "Registered workers by lifecycle",
            g,
            &workers,
        )?;
        let prompt = self.prompt_tokens.get();
        let rate = if prompt == 0 {
            0.0
        } else {
            self.cached_tokens.get() as f64 / prompt as f64
        };
        one(
            &mut enc,
            "kvr_router_kv_hit_rate",
            "Cached / prompt tokens of selections since start",
            g,
            ConstGauge::new(rate),
        )?;
        one(
            &mut enc,
            "dynamo_component_router_kv_hit_rate",
            "Cached / prompt tokens of selections since start (Dynamo's name)",
            g,
            ConstGauge::new(rate),
        )?;
        one(
            &mut enc,
            "kvr_http_bad_bodies",
            "Request bodies refused as malformed",
            c,
            ConstCounter::new(crate::error::bad_bodies()),
        )?;
        one(
            &mut enc,
            "kvr_pending_selections",
            "Pending selections awaiting their claim",
            g,
            ConstGauge::new(self.pending.len() as i64),
        )?;
        let r = &self.recovery;
        one(
            &mut enc,
            "kvr_recovery_attempts",
            "Peer dump recoveries attempted",
            c,
            ConstCounter::new(r.attempts.load(Ordering::Relaxed)),
        )?;
        one(
            &mut enc,
            "kvr_recovery_failures",
            "Peer dump recoveries that failed (unreachable, truncated, garbage)",
            c,
            ConstCounter::new(r.failures.load(Ordering::Relaxed)),
        )?;
        one(
            &mut enc,
            "kvr_recovery_events",
            "Events applied from peer dumps",
            c,
            ConstCounter::new(r.events.load(Ordering::Relaxed)),
        )?;
        Ok(())
    }
}
