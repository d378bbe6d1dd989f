//! An SVG of cold q128 lookup latency (p50 solid, p99 dashed) against index size, one
//! colour per backend, one panel per profile; log-log axes.

use std::fmt::Write;

use crate::measure::Record;
use crate::report::{median, size_label};
use crate::workload::Profile;

const W: f64 = 460.0;
const H: f64 = 320.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 44.0;
const COLOURS: [&str; 6] = [
    "#1b6ac9", "#7a3fb0", "#d1495b", "#e09f3e", "#2e8540", "#555555",
];

fn series(
    records: &[Record],
    backend: &str,
    profile: Profile,
    sizes: &[usize],
    q: f64,
) -> Vec<(f64, f64)> {
    sizes
        .iter()
        .filter_map(|&size| {
            let v: Vec<f64> = records
                .iter()
                .filter(|r| r.backend == backend && r.profile == profile.label())
                .filter(|r| r.holder_blocks >= size && r.holder_blocks < size + size / 50 + 1_024)
                .filter_map(|r| r.latency.iter().find(|(n, _)| n == "cold128"))
                .map(|(_, l)| if q == 0.5 { l.p50 } else { l.p99 })
                .collect();
            (!v.is_empty()).then(|| (size as f64, median(v)))
        })
        .collect()
}

pub(crate) fn lookup_vs_size(records: &[Record], sizes: &[usize], backends: &[String]) -> String {
    let panels = Profile::ALL;
    let width = W * panels.len() as f64;
    let legend_h = 22.0 * backends.len().div_ceil(3) as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{}" font-family="sans-serif" font-size="12">"#,
        H + legend_h
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let (xmin, xmax) = (
        sizes.iter().copied().min().unwrap_or(1) as f64,
        sizes.iter().copied().max().unwrap_or(2) as f64,
    );
    // The range of what is drawn: the medians.
    let all: Vec<f64> = backends
        .iter()
        .flat_map(|b| {
            Profile::ALL.into_iter().flat_map(move |p| {
                [0.5, 0.99]
                    .into_iter()
                    .flat_map(move |q| series(records, b, p, sizes, q))
            })
        })
        .map(|(_, y)| y)
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let ymin = all.iter().copied().fold(f64::INFINITY, f64::min).max(1.0) / 1.3;
    let ymax = all.iter().copied().fold(0.0, f64::max).max(ymin * 10.0) * 1.3;
    for (p, profile) in panels.iter().enumerate() {
        let x0 = p as f64 * W;
        let px = |x: f64| {
            let span = (xmax.ln() - xmin.ln()).max(1e-9);
            x0 + LEFT + (x.ln() - xmin.ln()) / span * (W - LEFT - RIGHT)
        };
        let py = |y: f64| TOP + (ymax.ln() - y.ln()) / (ymax.ln() - ymin.ln()) * (H - TOP - BOTTOM);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="20" text-anchor="middle" font-weight="bold">cold q128 lookup, `{}` (p50 solid, p99 dashed)</text>"#,
            x0 + W / 2.0,
            profile.label()
        );
        // Axes, grid and labels.
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
            x0 + LEFT,
            H - BOTTOM,
            x0 + W - RIGHT,
            H - BOTTOM,
            x0 + LEFT,
            TOP,
            x0 + LEFT,
            H - BOTTOM
        );
        let mut tick = 10f64.powf(ymin.log10().floor());
        while tick <= ymax {
            for m in [1.0, 2.0, 5.0] {
                let v = tick * m;
                if v < ymin || v > ymax {
                    continue;
                }
                let label = if v >= 1_000.0 {
                    format!("{} µs", v / 1_000.0)
                } else {
                    format!("{v} ns")
                };
                let _ = writeln!(
                    s,
                    r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{label}</text>"##,
                    x0 + LEFT,
                    x0 + W - RIGHT,
                    x0 + LEFT - 4.0,
                    py(v) + 4.0,
                    y = py(v)
                );
            }
            tick *= 10.0;
        }
        for &size in sizes {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                px(size as f64),
                H - BOTTOM + 16.0,
                size_label(size)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">index size (holder-blocks)</text>"#,
            x0 + W / 2.0,
            H - 8.0
        );
        for (i, b) in backends.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            for (q, dash) in [(0.5, ""), (0.99, r#" stroke-dasharray="6 4""#)] {
                let pts = series(records, b, *profile, sizes, q);
                let path: Vec<String> = pts
                    .iter()
                    .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
                    path.join(" ")
                );
                for &(x, y) in &pts {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                        px(x),
                        py(y)
                    );
                }
            }
        }
    }
    for (i, b) in backends.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        let (col, row) = (i % 3, i / 3);
        let x = LEFT + col as f64 * 200.0;
        let y = H + 8.0 + row as f64 * 22.0;
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{b}</text>"#,
            x + 24.0,
            x + 30.0,
            y + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}
