//! CPU accounting around each phase, from /proc: how much of a core the generator and
//! the server used, and how much *other* processes took on each pinned core. The
//! machine is shared: a server that got only part of its core measured less than itself,
//! and the output should say so.

use std::time::Instant;

use crate::load::PhaseResult;

/// Linux reports these in USER_HZ ticks, 100 a second on every common build.
const TICKS: f64 = 100.0;

/// User + system CPU seconds of a process, all threads (/proc/PID/stat).
fn process_secs(pid: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / TICKS)
}

/// Busy seconds of one core (/proc/stat: everything but idle and iowait).
fn core_busy_secs(core: usize) -> Option<f64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&format!("cpu{core}")))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy: f64 = v.iter().take(8).sum::<f64>() - v.get(3)? - v.get(4)?;
    Some(busy / TICKS)
}

/// Where the two processes run (run.sh pins them with taskset).
#[derive(Debug, Clone)]
pub(crate) struct Cores {
    pub server_pid: Option<String>,
    pub server_core: Option<usize>,
    pub loadgen_core: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    t: Instant,
    loadgen: Option<f64>,
    server: Option<f64>,
    server_core: Option<f64>,
    loadgen_core: Option<f64>,
}

impl Cores {
    pub(crate) fn sample(&self) -> Sample {
        Sample {
            t: Instant::now(),
            loadgen: process_secs("self"),
            server: self.server_pid.as_deref().and_then(process_secs),
            server_core: self.server_core.and_then(core_busy_secs),
            loadgen_core: self.loadgen_core.and_then(core_busy_secs),
        }
    }

    /// Fills the phase's CPU figures (in cores) from the samples around it.
    pub(crate) fn fill(&self, before: Sample, r: &mut PhaseResult) {
        let after = self.sample();
        let secs = after.t.duration_since(before.t).as_secs_f64();
        let d = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| (a - b) / secs);
        r.loadgen_cpu = d(after.loadgen, before.loadgen);
        r.server_cpu = d(after.server, before.server);
        let other =
            |busy: Option<f64>, own: Option<f64>| busy.zip(own).map(|(b, o)| (b - o).max(0.0));
        r.server_core_others = other(d(after.server_core, before.server_core), r.server_cpu);
        r.loadgen_core_others = other(d(after.loadgen_core, before.loadgen_core), r.loadgen_cpu);
        // Per operation: CPU seconds over the phase / operations (ticks are 10 ms, so a
        // phase needs hundreds of operations for this to mean much; run.sh's are seconds).
        let ops = r.ops;
        let per_op = |a: Option<f64>, b: Option<f64>| {
            a.zip(b)
                .filter(|_| ops > 0)
                .map(|(a, b)| (a - b) / ops as f64 * 1e6)
        };
        r.server_cpu_us_per_op = per_op(after.server, before.server);
        r.loadgen_cpu_us_per_op = per_op(after.loadgen, before.loadgen);
    }
}
