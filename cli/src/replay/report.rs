//! What a replay reports: one [`PolicyReport`] per policy, as a table or one JSON object.

use serde::Serialize;

use super::sim::RunResult;

#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub(crate) struct Ttft {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// Percentiles of a per-token or end-to-end latency, ms.
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub(crate) struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Latency {
    fn of(sorted: &[f64]) -> Self {
        Latency {
            p50: percentile(sorted, 50.0),
            p90: percentile(sorted, 90.0),
            p99: percentile(sorted, 99.0),
        }
    }
}

#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub(crate) struct SelectNs {
    pub p50: f64,
    pub p99: f64,
}

/// One policy's line of the report (the `--json` schema, field for field).
#[derive(Serialize, Clone, Debug, PartialEq)]
pub(crate) struct PolicyReport {
    pub policy: String,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Cached / prompt tokens.
    pub hit_rate: f64,
    /// The reuse one infinite cache would get on the same arrivals.
    pub oracle_hit_rate: f64,
    pub ttft_ms: Ttft,
    /// Mean time per output token after the first, per request (ms).
    pub tpot_ms: Latency,
    /// Arrival to last token, per request (ms).
    pub e2e_ms: Latency,
    /// The prefill rate kvr learned from `mark_prefill_complete` timings, tokens/s.
    pub learned_prefill_rate: Option<f64>,
    /// Max / mean prefill tokens computed per rank.
    pub load_imbalance: f64,
    /// Requests each rank served, in rank order (worker-major).
    pub requests_per_rank: Vec<u64>,
    /// Wall time of the routing call.
    pub select_ns: SelectNs,
    pub events_applied: u64,
    /// Blocks stored + removed by ingest, per second of ingest wall time.
    pub block_ops_per_s: f64,
    /// Index bytes per (rank, block) pair at the end of the run.
    pub bytes_per_holder_block: f64,
}

/// Nearest-rank percentile of sorted values (0 for none).
pub(crate) fn percentile<T: Copy + Into<f64>>(sorted: &[T], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].into()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

impl PolicyReport {
    pub(crate) fn new(r: &RunResult, oracle_hit_rate: f64) -> Self {
        let ranks = r.prefill_tokens_per_rank.len().max(1) as f64;
        let total: u64 = r.prefill_tokens_per_rank.iter().sum();
        let max = r.prefill_tokens_per_rank.iter().copied().max().unwrap_or(0);
        let select: Vec<f64> = r.select_ns.iter().map(|&n| n as f64).collect();
        PolicyReport {
            policy: r.policy.to_string(),
            requests: r.requests,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            hit_rate: ratio(r.cached_tokens as f64, r.prompt_tokens as f64),
            oracle_hit_rate,
            ttft_ms: Ttft {
                p50: percentile(&r.ttft_ms, 50.0),
                p90: percentile(&r.ttft_ms, 90.0),
                p99: percentile(&r.ttft_ms, 99.0),
            },
            tpot_ms: Latency::of(&r.tpot_ms),
            e2e_ms: Latency::of(&r.e2e_ms),
            learned_prefill_rate: r.learned_prefill_rate,
            load_imbalance: ratio(max as f64, total as f64 / ranks),
            requests_per_rank: r.requests_per_rank.clone(),
            select_ns: SelectNs {
                p50: percentile(&select, 50.0),
                p99: percentile(&select, 99.0),
            },
            events_applied: r.events_applied,
            block_ops_per_s: ratio(r.blocks_applied as f64, r.ingest_secs),
            bytes_per_holder_block: ratio(r.index.bytes as f64, r.index.holder_blocks as f64),
        }
    }
}

pub(super) fn secs_cell(ms: f64) -> String {
    if ms >= 10_000.0 {
        format!("{:.1}", ms / 1e3)
    } else {
        format!("{:.2}", ms / 1e3)
    }
}

pub(super) fn si(x: f64) -> String {
    match x {
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.1} k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// The report as a text table.
pub(crate) fn table(reports: &[PolicyReport]) -> String {
    let header = [
        "policy",
        "hit rate",
        "TTFT p50 s",
        "p90 s",
        "p99 s",
        "TPOT p50 ms",
        "p90 ms",
        "e2e p90 s",
        "imbalance",
        "select p50 µs",
        "p99 µs",
        "events",
        "B/holder-block",
    ];
    let rows: Vec<[String; 13]> = reports
        .iter()
        .map(|r| {
            let events = r.events_applied > 0;
            [
                r.policy.clone(),
                format!("{:.1} %", r.hit_rate * 100.0),
                secs_cell(r.ttft_ms.p50),
                secs_cell(r.ttft_ms.p90),
                secs_cell(r.ttft_ms.p99),
                format!("{:.1}", r.tpot_ms.p50),
                format!("{:.1}", r.tpot_ms.p90),
                secs_cell(r.e2e_ms.p90),
                format!("{:.2}", r.load_imbalance),
                format!("{:.2}", r.select_ns.p50 / 1e3),
                format!("{:.2}", r.select_ns.p99 / 1e3),
                if events {
                    si(r.events_applied as f64)
                } else {
                    "off".into()
                },
                if r.bytes_per_holder_block > 0.0 {
                    format!("{:.1}", r.bytes_per_holder_block)
                } else {
                    "-".into()
                },
            ]
        })
        .collect();
    let mut width = header.map(|h| h.chars().count());
    for row in &rows {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(width).enumerate() {
            let pad = w - c.chars().count();
            if i == 0 {
                s.push_str(c);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str("  ");
                s.push_str(&" ".repeat(pad));
                s.push_str(c);
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&header.map(String::from));
    for row in &rows {
        out.push_str(&line(row));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 90.0), 90.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v[..1], 99.0), 1.0);
        assert_eq!(percentile::<f64>(&[], 50.0), 0.0);
    }

    #[test]
    fn report_derives_rates_and_imbalance() {
        let r = RunResult {
            policy: "x",
            requests: 2,
            prompt_tokens: 1000,
            cached_tokens: 250,
            ttft_ms: vec![1.0, 3.0],
            prefill_tokens_per_rank: vec![300, 100, 200],
            select_ns: vec![10, 20],
            blocks_applied: 50,
            ingest_secs: 0.5,
            ..RunResult::default()
        };
        let p = PolicyReport::new(&r, 0.4);
        assert_eq!(p.hit_rate, 0.25);
        assert_eq!(p.load_imbalance, 1.5);
        assert_eq!(p.block_ops_per_s, 100.0);
        assert_eq!(p.ttft_ms.p99, 3.0);
        assert_eq!(p.bytes_per_holder_block, 0.0);
        let t = table(&[p]);
        assert!(t.contains("25.0 %"), "{t}");
    }
}
