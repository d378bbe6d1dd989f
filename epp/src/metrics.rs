//! The picker's own metrics, in the same `/metrics` as the selection service's.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use kvr_tokenize::{ReuseStats, Tokenizers};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Phase {
    pub phase: &'static str,
}

/// Counters and histograms of the ext_proc side.
#[derive(Clone, Debug)]
pub struct EppMetrics {
    /// Requests by outcome: `routed`, or why not (the error kinds of `prompt` and
    /// `picker`).
    pub picks: Family<Outcome, Counter>,
    /// Pick latency by phase: `parse`, `tokenize`, `select`, `total`.
    pub pick_seconds: Family<Phase, Histogram>,
    pub bookings_active: Gauge,
    /// Streams that ended (broken, reset, cancelled) with their booking still live: freed
    /// at once.
    pub broken_streams: Counter,
    /// Requests a fallback endpoint served (the booking moved there).
    pub fallback_served: Counter,
    /// Prompt tokens the chosen rank held, as predicted at the pick, and as the engine
    /// reported (`usage.prompt_tokens_details.cached_tokens`), over requests that
    /// reported it.
    pub predicted_cached_tokens: Counter,
    pub observed_cached_tokens: Counter,
    pub observed_prompt_tokens: Counter,
    /// Requests sent to a rank holding less of the prompt than another eligible rank
    /// (load outweighed the cache), and the device tokens given up so.
    pub cache_given_up_for_load: Counter,
    pub cached_tokens_given_up: Counter,
    /// Membership files refused, and pods not registered.
    pub pool_errors: Counter,
    /// ext_proc messages out of order or of a kind the picker does not take.
    pub protocol_errors: Counter,
}

fn seconds_histogram() -> Histogram {
    // 1 µs .. ~1 s.
    Histogram::new(exponential_buckets(1e-6, 2.0, 21))
}

impl EppMetrics {
    /// New metrics, registered in `r`, with token reuse read from `tokenizers` (a clone
    /// shares the tokenizers' tables).
    pub fn register(r: &mut Registry, tokenizers: Option<Tokenizers>) -> Self {
        r.register_collector(Box::new(TokenReuseCollector(tokenizers)));
        let m = EppMetrics {
            picks: Family::default(),
            pick_seconds: Family::new_with_constructor(seconds_histogram as fn() -> _),
            bookings_active: Gauge::default(),
            broken_streams: Counter::default(),
            fallback_served: Counter::default(),
            predicted_cached_tokens: Counter::default(),
            observed_cached_tokens: Counter::default(),
            observed_prompt_tokens: Counter::default(),
            cache_given_up_for_load: Counter::default(),
            cached_tokens_given_up: Counter::default(),
            pool_errors: Counter::default(),
            protocol_errors: Counter::default(),
        };
        r.register("kvr_epp_picks", "Requests by pick outcome", m.picks.clone());
        r.register(
            "kvr_epp_pick_duration_seconds",
            "Time to pick, by phase (parse, tokenize, select, total)",
            m.pick_seconds.clone(),
        );
        r.register(
            "kvr_epp_bookings_active",
            "Requests booked and not yet ended",
            m.bookings_active.clone(),
        );
        r.register(
            "kvr_epp_broken_streams",
            "Streams that ended with their booking live (freed at once)",
            m.broken_streams.clone(),
        );
        r.register(
            "kvr_epp_fallback_served",
            "Requests a fallback endpoint served",
            m.fallback_served.clone(),
        );
        r.register(
            "kvr_epp_predicted_cached_tokens",
            "Prompt tokens the chosen rank held, as predicted at the pick",
            m.predicted_cached_tokens.clone(),
        );
        r.register(
            "kvr_epp_observed_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details)",
            m.observed_cached_tokens.clone(),
        );
        r.register(
            "kvr_epp_observed_prompt_tokens",
            "Prompt tokens of the requests that reported cached tokens",
            m.observed_prompt_tokens.clone(),
        );
        r.register(
            "kvr_epp_cache_given_up_for_load",
            "Requests sent to a rank holding less of the prompt than another eligible rank",
            m.cache_given_up_for_load.clone(),
        );
        r.register(
            "kvr_epp_cached_tokens_given_up",
            "Device tokens an eligible rank held beyond the chosen one's",
            m.cached_tokens_given_up.clone(),
        );
        r.register(
            "kvr_epp_pool_errors",
            "Membership files refused and pods not registered",
            m.pool_errors.clone(),
        );
        r.register(
            "kvr_epp_protocol_errors",
            "ext_proc messages out of order or not taken",
            m.protocol_errors.clone(),
        );
        m
    }

    pub fn outcome(&self, outcome: &'static str) {
        self.picks.get_or_create(&Outcome { outcome }).inc();
    }

    pub fn phase(&self, phase: &'static str, secs: f64) {
        self.pick_seconds
            .get_or_create(&Phase { phase })
            .observe(secs);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

/// Token reuse of each local tokenizer (labelled by the first model name using it),
/// read at scrape time.
#[derive(Debug)]
pub struct TokenReuseCollector(pub Option<Tokenizers>);

impl TokenReuseCollector {
    /// Each distinct tokenizer with reuse on, once.
    fn rows(&self) -> Vec<(ModelLabel, ReuseStats)> {
        let Some(t) = self.0.as_ref() else {
            return Vec::new();
        };
        let mut names: Vec<&str> = t.models().collect();
        names.sort_unstable();
        let mut seen = Vec::new();
        let mut rows = Vec::new();
        for name in names {
            let Some(tok) = t.get(name) else { continue };
            let ptr = Arc::as_ptr(tok);
            if seen.contains(&ptr) {
                continue;
            }
            seen.push(ptr);
            if let Some(s) = tok.reuse_stats() {
                rows.push((
                    ModelLabel {
                        model: name.to_owned(),
                    },
                    s,
                ));
            }
        }
        rows
    }
}

impl Collector for TokenReuseCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rows = self.rows();
        if rows.is_empty() {
            return Ok(());
        }
        type Get = fn(&ReuseStats) -> u64;
        let counters: [(&str, &str, Get); 7] = [
            (
                "kvr_epp_token_reuse_lookups",
                "Prompts looked up for a head seen before",
                |s| s.lookups,
            ),
            (
                "kvr_epp_token_reuse_hits",
                "Prompts whose head's token ids were reused",
                |s| s.hits,
            ),
            (
                "kvr_epp_token_reuse_reused_tokens",
                "Token ids taken from prompts seen before",
                |s| s.reused_tokens,
            ),
            (
                "kvr_epp_token_reuse_encoded_tokens",
                "Token ids the tokenizer produced for looked-up prompts",
                |s| s.encoded_tokens,
            ),
            (
                "kvr_epp_token_reuse_checks",
                "Reuses checked against a full encoding",
                |s| s.checks,
            ),
            (
                "kvr_epp_token_reuse_mismatches",
                "Checks that differed (reuse then off)",
                |s| s.mismatches,
            ),
            (
                "kvr_epp_token_reuse_evictions",
                "Prompts dropped to stay within the capacity",
                |s| s.evictions,
            ),
        ];
        for (name, help, get) in counters {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (l, s) in &rows {
                ConstCounter::new(get(s)).encode(m.encode_family(l)?)?;
            }
        }
        let gauges: [(&str, &str, Get); 3] = [
            (
                "kvr_epp_token_reuse_bytes",
                "Bytes of prompts and token ids kept for reuse",
                |s| s.bytes,
            ),
            (
                "kvr_epp_token_reuse_prompts",
                "Prompts kept for reuse",
                |s| s.texts,
            ),
            (
                "kvr_epp_token_reuse_disabled",
                "1 when reuse was turned off by a mismatch",
                |s| u64::from(s.disabled),
            ),
        ];
        for (name, help, get) in gauges {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (l, s) in &rows {
                ConstGauge::new(get(s) as i64).encode(m.encode_family(l)?)?;
            }
        }
        Ok(())
    }
}
