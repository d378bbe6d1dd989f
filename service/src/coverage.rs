//! Readiness that says how much of the index is exact: every KV-event stream is counted
//! by its state (exact, recovering, degraded, dead), and with `--ready-min-exact-share`
//! `/ready` waits until that share of the streams is exact, or `--ready-wait-secs` has
//! passed since start (then it is ready with what it has, and says so). After a warm
//! restart the restored streams are degraded until their replay covers what the engines
//! sent while kvr was down; after a cold start, until they caught up.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::figures::{family, Labels};
use crate::registry::Registry;

use crate::wire::worker::Coverage;

/// When the service started, and when its streams first reached the share.
#[derive(Debug)]
pub struct ReadyGate {
    started: Instant,
    reached: OnceLock<Duration>,
    gave_up: OnceLock<()>,
}

impl Default for ReadyGate {
    fn default() -> Self {
        ReadyGate {
            started: Instant::now(),
            reached: OnceLock::new(),
            gave_up: OnceLock::new(),
        }
    }
}

impl ReadyGate {
    /// Whether `c` lets `/ready` answer ready: the share is reached, or `wait_secs` have
    /// passed since start (logged once).
    pub fn ready(&self, c: &Coverage, wait_secs: u64) -> bool {
        if c.exact_share >= c.min_exact_share {
            return true;
        }
        if self.started.elapsed() >= Duration::from_secs(wait_secs) {
            if self.gave_up.set(()).is_ok() {
                tracing::warn!(
                    exact_share = c.exact_share,
                    min_exact_share = c.min_exact_share,
                    wait_secs,
                    "ready without the exact share of KV-event streams: the wait bound passed"
                );
            }
            return true;
        }
        false
    }

    /// The streams of `registry` by state; notes the first time `min` is reached.
    pub fn coverage(&self, registry: &Registry, min: f64) -> Coverage {
        let mut c = Coverage {
            min_exact_share: min,
            ..Coverage::default()
        };
        for entry in registry.partitions() {
            for s in entry.partition.ingress_stats() {
                match s.health.name() {
                    "exact" => c.exact += 1,
                    "recovering" => c.recovering += 1,
                    "degraded" => c.degraded += 1,
                    _ => c.dead += 1,
                }
            }
        }
        let total = c.exact + c.recovering + c.degraded + c.dead;
        c.exact_share = if total == 0 {
            1.0
        } else {
            c.exact as f64 / total as f64
        };
        if c.exact_share >= c.min_exact_share && total > 0 {
            let _ = self.reached.set(self.started.elapsed());
        }
        c.reached_after_secs = self.reached.get().map(Duration::as_secs_f64);
        c.wait_bound_passed = self.gave_up.get().is_some();
        c
    }
}

/// `kvr_kv_streams{state}`, `kvr_ready_exact_share` and `kvr_ready_reached_seconds`, read
/// at scrape time.
#[derive(Debug)]
pub struct CoverageMetrics {
    pub registry: Arc<Registry>,
    pub gate: Arc<ReadyGate>,
    pub min_exact_share: f64,
}

impl Collector for CoverageMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = self.gate.coverage(&self.registry, self.min_exact_share);
        let by_state: Vec<(Labels, ConstGauge<i64>)> = [
            ("exact", c.exact),
            ("recovering", c.recovering),
            ("degraded", c.degraded),
            ("dead", c.dead),
        ]
        .into_iter()
        .map(|(s, n)| (vec![("state", s.to_string())], ConstGauge::new(n as i64)))
        .collect();
        family(
            &mut enc,
            "kvr_kv_streams",
            "KV-event streams by state",
            MetricType::Gauge,
            &by_state,
        )?;
        let g = |v: f64| [(Labels::new(), ConstGauge::new(v))];
        family(
            &mut enc,
            "kvr_ready_exact_share",
            "Share of the KV-event streams that are exact (1 with none)",
            MetricType::Gauge,
            &g(c.exact_share),
        )?;
        family(
            &mut enc,
            "kvr_ready_reached_seconds",
            "Seconds from start until the streams first reached the exact share /ready waits for (0: not yet)",
            MetricType::Gauge,
            &g(c.reached_after_secs.unwrap_or(0.0)),
        )
    }
}
