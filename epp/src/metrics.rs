//! The picker's own metrics, in the same `/metrics` as the selection service's.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
    /// New metrics, registered in `r`.
    pub fn register(r: &mut Registry) -> Self {
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
