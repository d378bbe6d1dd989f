//! Per-call latency summaries shared by the harness benches (`latency`, `selection`):
//! percentiles over raw `Instant` timings, the timer's own cost, and the table and JSON
//! forms that `summary.sh` reads.

use std::hint::black_box;
use std::time::Instant;

/// Percentiles of one variant's per-call times, in nanoseconds.
#[derive(Debug)]
pub struct Lat {
    pub name: String,
    pub calls: usize,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
    pub mean: f64,
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Summarizes raw per-call times (nanoseconds); `ns` must not be empty.
pub fn summarize(name: String, mut ns: Vec<u64>) -> Lat {
    ns.sort_unstable();
    let mean = ns.iter().sum::<u64>() as f64 / ns.len().max(1) as f64;
    Lat {
        name,
        calls: ns.len(),
        p50: percentile(&ns, 0.50),
        p90: percentile(&ns, 0.90),
        p99: percentile(&ns, 0.99),
        p999: percentile(&ns, 0.999),
        max: *ns.last().unwrap_or(&0),
        mean,
    }
}

/// The cost of the timing itself (`Instant::now` + `elapsed`), per call.
pub fn timer_overhead(calls: usize) -> Vec<u64> {
    (0..calls)
        .map(|_| {
            let t = Instant::now();
            black_box(());
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

/// Prints a table of summaries under `title`, the name column `width` wide.
pub fn print_table(title: &str, width: usize, lats: &[Lat]) {
    println!(
        "{:<width$} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
        title, "calls", "p50", "p90", "p99", "p99.9", "max", "mean"
    );
    for l in lats {
        println!(
            "{:<width$} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9.1}",
            l.name, l.calls, l.p50, l.p90, l.p99, l.p999, l.max, l.mean
        );
    }
}

impl Lat {
    /// One JSON object (as `summary.sh` reads it), indented for a list.
    pub fn json_entry(&self) -> String {
        format!(
            "    {{\"name\": \"{}\", \"calls\": {}, \"p50_ns\": {}, \"p90_ns\": {}, \
             \"p99_ns\": {}, \"p999_ns\": {}, \"max_ns\": {}, \"mean_ns\": {:.2}}}",
            self.name, self.calls, self.p50, self.p90, self.p99, self.p999, self.max, self.mean
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_one_to_a_thousand() {
        let l = summarize("x".into(), (1..=1000).rev().collect());
        assert_eq!(
            (l.p50, l.p90, l.p99, l.p999, l.max),
            (500, 900, 990, 999, 1000)
        );
        assert!((l.mean - 500.5).abs() < 1e-9);
    }
}
