//! `kvr replay --sweep KEY=V1,V2,…`: the same workload replayed at several settings of
//! one knob, every policy at each — how routing quality holds up as load rises or as the
//! KV events arrive later.
//!
//! * `rate=N,…`: load N× the run's own (`--speed` multiplied by N: a trace's arrivals, the
//!   built-in workload's session starts; a conversation's next turn still waits for its
//!   answer).
//! * `event-delay-ms=D,…`: the delay from an engine emitting KV events to the router
//!   applying them.
//!
//! The report is a table per setting (hit rate, TTFT p50/p90/p99, TPOT p50/p90, end to
//! end p90), then TTFT p90 by setting for every policy; `--plot` draws TTFT p90 against
//! the setting, a line per policy.

use std::path::Path;

use plotters::prelude::*;

use super::plot::{format_ms, line_dash, line_width, series_color, FONT};
use super::policy::PolicyKind;
use super::report::{secs_cell, PolicyReport};
use super::sim::SimConfig;
use super::workload::Workload;

/// The knob a sweep varies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum SweepKey {
    Rate,
    EventDelayMs,
}

impl SweepKey {
    pub(crate) fn name(self) -> &'static str {
        match self {
            SweepKey::Rate => "rate",
            SweepKey::EventDelayMs => "event-delay-ms",
        }
    }

    /// How a setting reads in the report.
    pub(crate) fn label(self, v: f64) -> String {
        match self {
            SweepKey::Rate => format!("{v}×"),
            SweepKey::EventDelayMs => format!("{v} ms"),
        }
    }

    /// The cluster configuration at setting `v`.
    pub(crate) fn apply(self, base: &SimConfig, v: f64) -> SimConfig {
        let mut cfg = base.clone();
        match self {
            SweepKey::Rate => cfg.speed = base.speed * v,
            SweepKey::EventDelayMs => cfg.event_delay_ms = v,
        }
        cfg
    }
}

/// Settings a sweep may have (each replays every policy).
pub(crate) const MAX_POINTS: usize = 16;

/// Parses `KEY=V1,V2,…`.
pub(crate) fn parse(s: &str) -> Result<(SweepKey, Vec<f64>), String> {
    let bad = || {
        format!(
            "--sweep must be rate=N,… (load multipliers > 0) or event-delay-ms=D,… (≥ 0), \
             at most {MAX_POINTS} values (got {s:?})"
        )
    };
    let (key, values) = s.split_once('=').ok_or_else(bad)?;
    let key = match key.trim() {
        "rate" => SweepKey::Rate,
        "event-delay-ms" => SweepKey::EventDelayMs,
        _ => return Err(bad()),
    };
    let values: Vec<f64> = values
        .split(',')
        .map(|v| v.trim().parse::<f64>().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let ok = |v: f64| match key {
        SweepKey::Rate => v.is_finite() && v > 0.0,
        SweepKey::EventDelayMs => v.is_finite() && v >= 0.0,
    };
    if values.is_empty() || values.len() > MAX_POINTS || !values.iter().all(|&v| ok(v)) {
        return Err(bad());
    }
    Ok((key, values))
}

/// One setting's results.
pub(crate) struct SweepPoint {
    pub value: f64,
    pub reports: Vec<PolicyReport>,
}

/// The sweep as text: a table per setting, then TTFT p90 (s) by setting.
pub(crate) fn table(key: SweepKey, points: &[SweepPoint]) -> String {
    let mut out = String::new();
    for p in points {
        out.push_str(&format!("{} = {}\n", key.name(), key.label(p.value)));
        out.push_str(&super::report::table(&p.reports));
        out.push('\n');
    }
    out.push_str(&format!("TTFT p90 (s) by {}\n", key.name()));
    let policies: Vec<&str> = points
        .first()
        .map(|p| p.reports.iter().map(|r| r.policy.as_str()).collect())
        .unwrap_or_default();
    let width = policies.iter().map(|p| p.len()).max().unwrap_or(6).max(6);
    out.push_str(&format!("{:<width$}", "policy"));
    for p in points {
        out.push_str(&format!("{:>10}", key.label(p.value)));
    }
    out.push('\n');
    for (k, name) in policies.iter().enumerate() {
        out.push_str(&format!("{name:<width$}"));
        for p in points {
            out.push_str(&format!("{:>10}", secs_cell(p.reports[k].ttft_ms.p90)));
        }
        out.push('\n');
    }
    out
}

/// The sweep as JSON.
pub(crate) fn json(
    key: SweepKey,
    w: &Workload,
    cfg: &serde_json::Value,
    points: &[SweepPoint],
) -> String {
    let points: Vec<serde_json::Value> = points
        .iter()
        .map(|p| serde_json::json!({ "value": p.value, "policies": p.reports }))
        .collect();
    let out = serde_json::json!({
        "workload": cfg,
        "requests": w.requests.len(),
        "sweep": { "key": key.name(), "points": points },
    });
    format!("{out}\n")
}

/// Draws TTFT p90 against the setting, a line per policy, into `path`.
pub(crate) fn write_svg(
    path: &Path,
    title: &str,
    key: SweepKey,
    points: &[SweepPoint],
    policies: &[PolicyKind],
) -> Result<(), String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 520)).into_drawing_area();
        draw(&root, title, key, points, policies)
            .map_err(|e| format!("cannot render plot: {e}"))?;
        root.present()
            .map_err(|e| format!("cannot render plot: {e}"))?;
    }
    std::fs::write(path, svg).map_err(|e| format!("cannot write plot {}: {e}", path.display()))
}

type DrawResult<T> = Result<T, DrawingAreaErrorKind<std::io::Error>>;

fn draw(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    key: SweepKey,
    points: &[SweepPoint],
    policies: &[PolicyKind],
) -> DrawResult<()> {
    root.fill(&WHITE)?;
    // Settings are drawn evenly spaced (in order), labelled with their values: loads are
    // usually geometric and delays may include 0, which a log axis cannot show.
    let n = points.len();
    let p90 = |p: &SweepPoint, k: usize| p.reports[k].ttft_ms.p90.max(0.1);
    let lo = points
        .iter()
        .flat_map(|p| (0..p.reports.len()).map(move |k| p90(p, k)))
        .fold(f64::INFINITY, f64::min);
    let hi = points
        .iter()
        .flat_map(|p| (0..p.reports.len()).map(move |k| p90(p, k)))
        .fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo / 1.25, hi * 1.25)
    } else {
        (0.1, 10.0)
    };
    let labels: Vec<String> = points.iter().map(|p| key.label(p.value)).collect();
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 18))
        .margin(14)
        .x_label_area_size(42)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.3..(n as f64 - 0.7), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc(key.name())
        .y_desc("TTFT p90 (ms, log scale)")
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| format_ms(*v))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;
    for (k, kind) in policies.iter().enumerate() {
        let line: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .map(|(i, p)| (i as f64, p90(p, k)))
            .collect();
        let color = series_color(k);
        let style = color.stroke_width(line_width(k));
        let legend = move |(x, y): (i32, i32)| vec![(x, y), (x + 24, y)];
        match line_dash(k) {
            None => chart
                .draw_series(LineSeries::new(line.clone(), style))?
                .label(kind.name())
                .legend(move |p| PathElement::new(legend(p), style)),
            Some((dash, gap)) => chart
                .draw_series(DashedLineSeries::new(line.clone(), dash, gap, style))?
                .label(kind.name())
                .legend(move |p| {
                    plotters::element::DashedPathElement::new(legend(p), dash, gap, style)
                }),
        };
        chart.draw_series(
            line.iter()
                .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font((FONT, 13))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_parse_and_refuse_nonsense() {
        assert_eq!(
            parse("rate=1,4,16").unwrap(),
            (SweepKey::Rate, vec![1.0, 4.0, 16.0])
        );
        assert_eq!(
            parse("event-delay-ms=0, 200").unwrap(),
            (SweepKey::EventDelayMs, vec![0.0, 200.0])
        );
        for bad in [
            "rate",
            "rate=",
            "rate=0",
            "rate=-1",
            "speed=2",
            "rate=x",
            "event-delay-ms=-5",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let many = format!("rate={}", vec!["1"; MAX_POINTS + 1].join(","));
        assert!(parse(&many).is_err());
    }
}
