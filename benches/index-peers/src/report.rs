//! The tables: medians over runs of every figure, per size and profile, one row per
//! backend, and kvr's ratio to SMG's chain index.

use std::fmt::Write;

use crate::measure::{Latency, Record};
use crate::workload::Profile;

pub(crate) fn size_label(n: usize) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 && n.is_multiple_of(1_000) {
        format!("{}K", n / 1_000)
    } else {
        n.to_string()
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The records of one cell (backend, profile, requested size).
fn cell<'a>(
    records: &'a [Record],
    backend: &str,
    profile: Profile,
    size: usize,
) -> Vec<&'a Record> {
    records
        .iter()
        .filter(|r| r.backend == backend && r.profile == profile.label())
        .filter(|r| r.holder_blocks >= size && r.holder_blocks < size + size / 50 + 1_024)
        .collect()
}

fn med(rs: &[&Record], f: impl Fn(&Record) -> f64) -> f64 {
    median(rs.iter().map(|r| f(r)).collect())
}

fn lat(rs: &[&Record], set: &str, f: impl Fn(&Latency) -> f64) -> f64 {
    med(rs, |r| {
        r.latency
            .iter()
            .find(|(n, _)| n == set)
            .map_or(f64::NAN, |(_, l)| f(l))
    })
}

fn ns(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v >= 10_000.0 {
        format!("{:.1} µs", v / 1_000.0)
    } else if v >= 1_000.0 {
        format!("{:.2} µs", v / 1_000.0)
    } else {
        format!("{v:.0} ns")
    }
}

fn rate(v: f64) -> String {
    if v.is_nan() || v == 0.0 {
        "–".into()
    } else {
        format!("{:.2} M", v / 1e6)
    }
}

/// The whole report: per (size, profile) a writes/memory table, a lookups table and a
/// concurrency/exactness table; then kvr / smg-chain ratios.
pub(crate) fn tables(
    records: &[Record],
    sizes: &[usize],
    profiles: &[Profile],
    backends: &[String],
    runs: usize,
) -> String {
    let mut s = String::new();
    let timer = median(records.iter().map(|r| r.timer_overhead_ns).collect());
    let _ = writeln!(
        s,
        "Medians of {runs} run(s) per cell, one process per run, backends interleaved. \
         Latencies are per call (`Instant` around each lookup; timer overhead {timer:.0} ns, \
         not subtracted). Rates are holder-blocks per second (stored, or stored + removed)."
    );
    for &size in sizes {
        for &profile in profiles {
            let _ = writeln!(
                s,
                "\n#### {} holder-blocks, `{}`\n",
                size_label(size),
                profile.label()
            );
            let _ = writeln!(
                s,
                "| backend | store blocks/s | churn blocks/s | churn ns/block store / evict | heap B/holder-block | RSS B/holder-block | \
                 cold q32 p50 / p99 | cold q128 p50 / p99 | dependent load at heap size, ns (cold q128 p50 in loads) | hot q32 p50 | hot q128 p50 / p99 | \
                 splice p50 | miss 1 / 32 / 128 / 512 p50 | 2 readers q/s | reader + writer q/s | writer blocks/s | overcounted / undercounted / checked |"
            );
            let _ = writeln!(s, "|{}", "---|".repeat(17));
            for b in backends {
                let rs = cell(records, b, profile, size);
                if rs.is_empty() {
                    continue;
                }
                let p50 = |set: &str| ns(lat(&rs, set, |l| l.p50));
                let p99 = |set: &str| ns(lat(&rs, set, |l| l.p99));
                let _ = writeln!(
                    s,
                    "| {b} | {} | {} | {:.1} / {:.1} | {:.1} | {:.1} | {} / {} | {} / {} | {:.0} ({:.1}) | {} | {} / {} | {} | {} / {} / {} / {} | {} | {} | {} | {:.0} / {:.0} / {:.0} |",
                    rate(med(&rs, |r| r.store_blocks_per_s)),
                    rate(med(&rs, |r| r.churn_blocks_per_s)),
                    med(&rs, |r| r.churn_store_ns),
                    med(&rs, |r| r.churn_evict_ns),
                    med(&rs, |r| r.heap_bytes_per_holder_block),
                    med(&rs, |r| r.rss_bytes_per_holder_block),
                    p50("cold32"),
                    p99("cold32"),
                    p50("cold128"),
                    p99("cold128"),
                    med(&rs, |r| r.dependent_load_ns),
                    lat(&rs, "cold128", |l| l.p50) / med(&rs, |r| r.dependent_load_ns),
                    p50("hot32"),
                    p50("hot128"),
                    p99("hot128"),
                    p50("splice"),
                    p50("miss1"),
                    p50("miss32"),
                    p50("miss128"),
                    p50("miss512"),
                    rate(med(&rs, |r| r.readers2_qps)),
                    rate(med(&rs, |r| r.reader_with_writer_qps)),
                    rate(med(&rs, |r| r.writer_blocks_per_s)),
                    med(&rs, |r| r.overcounts as f64),
                    med(&rs, |r| r.undercounts as f64),
                    med(&rs, |r| r.checked as f64),
                );
            }
        }
    }
    ratios(&mut s, records, sizes, profiles);
    s
}

/// kvr (both ways of sizing its maps) over smg-chain, per cell: > 1 means kvr is better.
fn ratios(s: &mut String, records: &[Record], sizes: &[usize], profiles: &[Profile]) {
    let _ = writeln!(
        s,
        "\n#### kvr ÷ smg-chain (> 1: kvr better; lookups and bytes as smg ÷ kvr)\n"
    );
    let _ = writeln!(
        s,
        "| kvr | size | profile | store | churn | churn store / evict per block | heap bytes | cold q32 p50 | cold q128 p50 | cold q128 p99 | hot q128 p50 | miss 128 p50 |"
    );
    let _ = writeln!(s, "|{}", "---|".repeat(12));
    for name in ["kvr", "kvr-reserved"] {
        for &size in sizes {
            for &profile in profiles {
                let k = cell(records, name, profile, size);
                let c = cell(records, "smg-chain", profile, size);
                if k.is_empty() || c.is_empty() {
                    continue;
                }
                let up = |f: &dyn Fn(&Record) -> f64| med(&k, f) / med(&c, f);
                let down = |a: &[&Record], set: &str, p: fn(&Latency) -> f64| {
                    lat(&c, set, p) / lat(a, set, p)
                };
                let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2}× | {:.2}× | {:.2}× / {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× |",
                name,
                size_label(size),
                profile.label(),
                up(&|r| r.store_blocks_per_s),
                up(&|r| r.churn_blocks_per_s),
                med(&c, |r| r.churn_store_ns) / med(&k, |r| r.churn_store_ns),
                med(&c, |r| r.churn_evict_ns) / med(&k, |r| r.churn_evict_ns),
                med(&c, |r| r.heap_bytes_per_holder_block) / med(&k, |r| r.heap_bytes_per_holder_block),
                down(&k, "cold32", |l| l.p50),
                down(&k, "cold128", |l| l.p50),
                down(&k, "cold128", |l| l.p99),
                down(&k, "hot128", |l| l.p50),
                down(&k, "miss128", |l| l.p50),
            );
            }
        }
    }
}
