//! `kvr replay --plot FILE.svg`: one SVG figure comparing the routing policies
//! that a replay simulated.
//!
//! The figure has two panels, one colour per policy in both:
//!
//! * **TTFT CDF** (left): the cumulative distribution of time-to-first-token
//!   over every request, x on a log scale in milliseconds. A cache-aware router
//!   shows up as a curve shifted to the left, and the log axis keeps both the
//!   fast cache hits (sub-millisecond prefill skips) and the slow cold
//!   prefills (seconds) readable on one axis. Values below 0.1 ms, including
//!   0, are drawn at 0.1 ms since a log axis cannot show them.
//! * **prefix-cache hit rate** (right): one bar per policy, with the oracle's
//!   hit rate (the best any router could do on this workload) as a dashed
//!   horizontal line (its value in the panel's caption), so the gap between
//!   each policy and the ceiling is visible at a glance.
//!
//! Lines differ by dash pattern as well as colour, and the first policy (kvr's
//! own, listed first) is drawn wider and last, so a policy that coincides with
//! it (dynamo-classic often does) cannot hide it.
//!
//! The SVG is written with plotters' SVG backend, which emits `<text>`
//! elements directly, so no font stack (`ttf` feature, system fonts) is
//! needed. Each CDF is downsampled to at most [`MAX_CDF_POINTS`] points so the
//! file stays small whatever the trace length.

use std::path::Path;

use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One routing policy's results, as drawn in the figure.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlotSeries<'a> {
    /// Policy name, used in the legend and under its bar.
    pub policy: &'a str,
    /// Prefix-cache hit rate in `0..=1` (clamped; a non-finite value draws no bar).
    pub hit_rate: f64,
    /// The oracle's hit rate in `0..=1`, the same for every series of one workload.
    pub oracle_hit_rate: f64,
    /// Every request's TTFT in ms, sorted ascending (may contain 0.0; NaN/inf are skipped).
    pub ttft_ms: &'a [f64],
}

/// Figure size in pixels.
const WIDTH: u32 = 1200;
const HEIGHT: u32 = 500;
/// Width of the left (CDF) panel; the bar chart gets the rest.
const LEFT_PANEL_WIDTH: u32 = 720;
/// At most this many points are drawn per CDF (first and last kept).
pub(crate) const MAX_CDF_POINTS: usize = 500;
/// The log axis starts here: smaller TTFTs (including 0) are drawn at this value.
const MIN_TTFT_MS: f64 = 0.1;
/// Multiplicative padding of the CDF's x range on both sides.
const X_PAD: f64 = 1.25;
pub(super) const FONT: &str = "sans-serif";

/// Checks before a run that `path` can be written, so a bad `--plot` fails at once rather
/// than after the whole simulation: it must not be a directory, and it is opened for
/// writing (created and removed again when it did not exist).
pub(crate) fn check_writable(path: &Path) -> Result<(), String> {
    let bad = |e: String| format!("cannot write plot {}: {e}", path.display());
    if path.is_dir() {
        return Err(bad("it is a directory".into()));
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| bad(e.to_string()))?;
    if !existed {
        std::fs::remove_file(path).map_err(|e| bad(e.to_string()))?;
    }
    Ok(())
}

/// Renders the figure and writes it to `path`.
pub(crate) fn write_svg(path: &Path, title: &str, series: &[PlotSeries<'_>]) -> Result<(), String> {
    let svg = render_svg(title, series)?;
    std::fs::write(path, svg).map_err(|e| format!("cannot write plot {}: {e}", path.display()))
}

/// Renders the figure (see the module doc) into an SVG document.
pub(crate) fn render_svg(title: &str, series: &[PlotSeries<'_>]) -> Result<String, String> {
    if series.is_empty() {
        return Err("nothing to plot".to_string());
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        draw(&root, title, series).map_err(|e| format!("cannot render plot: {e}"))?;
        root.present()
            .map_err(|e| format!("cannot render plot: {e}"))?;
    }
    Ok(svg)
}

type DrawResult<T> = Result<T, DrawingAreaErrorKind<std::io::Error>>;

fn draw(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    series: &[PlotSeries<'_>],
) -> DrawResult<()> {
    root.fill(&WHITE)?;
    let body = root.titled(title, (FONT, 22))?;
    let (left, right) = body.split_horizontally(LEFT_PANEL_WIDTH);
    let colors: Vec<RGBColor> = (0..series.len()).map(series_color).collect();
    draw_cdf_panel(&left, series, &colors)?;
    draw_hit_rate_panel(root, &right, series, &colors)
}

/// Left panel: one TTFT CDF line per series, log x axis, legend.
fn draw_cdf_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    series: &[PlotSeries<'_>],
    colors: &[RGBColor],
) -> DrawResult<()> {
    let cdfs: Vec<Vec<(f64, f64)>> = series.iter().map(|s| cdf_points(s.ttft_ms)).collect();
    let (x_lo, x_hi) = x_range(&cdfs);

    let mut chart = ChartBuilder::on(area)
        .caption("TTFT CDF", (FONT, 18))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(56)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|v| format_ms(*v))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;

    let mut any_line = false;
    for (i, ((s, cdf), &color)) in series.iter().zip(&cdfs).zip(colors).enumerate() {
        if cdf.is_empty() {
            continue;
        }
        any_line = true;
        let style = color.stroke_width(line_width(i));
        let legend_line = move |(x, y): (i32, i32)| vec![(x, y), (x + 24, y)];
        match line_dash(i) {
            None => {
                chart
                    .draw_series(LineSeries::new(cdf.iter().copied(), style))?
                    .label(s.policy)
                    .legend(move |p| PathElement::new(legend_line(p), style));
            }
            Some((dash, gap)) => {
                chart
                    .draw_series(DashedLineSeries::new(cdf.iter().copied(), dash, gap, style))?
                    .label(s.policy)
                    .legend(move |p| DashedPathElement::new(legend_line(p), dash, gap, style));
            }
        }
    }
    // The first series (kvr's own policy, listed first) again on top, so no line drawn
    // after it (e.g. one that coincides with it) hides it.
    if let (Some(cdf), Some(&color)) = (cdfs.first().filter(|c| !c.is_empty()), colors.first()) {
        chart.draw_series(LineSeries::new(
            cdf.iter().copied(),
            color.stroke_width(line_width(0)),
        ))?;
    }
    if any_line {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 13))
            .draw()?;
    }
    Ok(())
}

/// Right panel: one bar per series and the oracle as a dashed line.
///
/// The policy names under the bars are drawn on `root` at absolute pixel
/// positions, since plotters' own axis labels cannot be pinned to bar centres;
/// when they would not fit side by side they are drawn vertically.
fn draw_hit_rate_panel(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    series: &[PlotSeries<'_>],
    colors: &[RGBColor],
) -> DrawResult<()> {
    const MARGIN: u32 = 12;
    const Y_LABEL_AREA: u32 = 52;
    let n = series.len() as f64;

    let name_font = (FONT, 13).into_font();
    let mut longest_name_px = 0;
    for s in series {
        longest_name_px = longest_name_px.max(
            area.estimate_text_size(s.policy, &name_font.clone().into())?
                .0,
        );
    }
    let plot_width = area
        .dim_in_pixel()
        .0
        .saturating_sub(2 * MARGIN + Y_LABEL_AREA);
    let slot_px = plot_width / series.len().max(1) as u32;
    let vertical_names = longest_name_px + 6 > slot_px;
    let x_label_area = if vertical_names {
        (longest_name_px + 14).clamp(42, 160)
    } else {
        42
    };

    // The oracle's value goes in the caption, where no bar's label can run into it (drawn
    // at the line's end, it covered the label of a bar as high as the oracle).
    let caption = match oracle_rate(series) {
        Some(o) => format!("prefix-cache hit rate (dashed: oracle {:.1}%)", o * 100.0),
        None => "prefix-cache hit rate".to_string(),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&caption, (FONT, 18))
        .margin(MARGIN)
        .x_label_area_size(x_label_area)
        .y_label_area_size(Y_LABEL_AREA)
        .build_cartesian_2d(0.0..n, 0.0..1.0)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_labels(6)
        .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;

    for (i, (s, &color)) in series.iter().zip(colors).enumerate() {
        if let Some(h) = clamp_rate(s.hit_rate) {
            let x = i as f64;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x + 0.15, 0.0), (x + 0.85, h)],
                color.filled(),
            )))?;
        }
    }

    if let Some(oracle) = oracle_rate(series) {
        chart.draw_series(DashedLineSeries::new(
            [(0.0, oracle), (n, oracle)],
            8,
            5,
            BLACK.stroke_width(2),
        ))?;
    }

    // Each bar's value above it ("n/a" at the baseline when not finite),
    // left out when the bars are too narrow for it.
    let value_font = (FONT, 12).into_font();
    if area
        .estimate_text_size("100.0%", &value_font.clone().into())?
        .0
        <= slot_px
    {
        let above = TextStyle::from(value_font.clone()).pos(Pos::new(HPos::Center, VPos::Bottom));
        // Near the top the label goes inside the bar, clear of the caption.
        let inside = TextStyle::from(value_font)
            .color(&WHITE)
            .pos(Pos::new(HPos::Center, VPos::Top));
        for (i, s) in series.iter().enumerate() {
            let (label, top) = match clamp_rate(s.hit_rate) {
                Some(h) => (format!("{:.1}%", h * 100.0), h),
                None => ("n/a".to_string(), 0.0),
            };
            let (dy, style) = if top > 0.92 {
                (3, &inside)
            } else {
                (-3, &above)
            };
            chart.draw_series(std::iter::once(
                EmptyElement::at((i as f64 + 0.5, top)) + Text::new(label, (0, dy), style.clone()),
            ))?;
        }
    }

    // Policy names under the bars.
    let name_style = if vertical_names {
        TextStyle::from(name_font)
            .transform(FontTransform::Rotate270)
            .pos(Pos::new(HPos::Right, VPos::Center))
    } else {
        TextStyle::from(name_font).pos(Pos::new(HPos::Center, VPos::Top))
    };
    for (i, s) in series.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        root.draw_text(s.policy, &name_style, (x, y + 6))?;
    }
    Ok(())
}

/// The CDF of `ttft_ms` as `(ttft, fraction ≤ ttft)` points, downsampled to at
/// most [`MAX_CDF_POINTS`]: non-finite values are skipped, values below
/// [`MIN_TTFT_MS`] are clamped to it, and the curve starts at fraction 0 at the
/// smallest value. Empty when there is no finite value.
fn cdf_points(ttft_ms: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = ttft_ms
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .map(|x| x.max(MIN_TTFT_MS))
        .collect();
    if v.is_empty() {
        return Vec::new();
    }
    // Documented as sorted already; this is cheap on sorted input and keeps a
    // caller's mistake from drawing a zig-zag.
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    // One point goes to the (first, 0) start of the curve.
    let m = n.min(MAX_CDF_POINTS - 1);
    let mut out = Vec::with_capacity(m + 1);
    out.push((v[0], 0.0));
    for j in 0..m {
        // Evenly spaced ranks, first (j = 0) and last (j = m - 1) included.
        let k = if m == 1 {
            n - 1
        } else {
            (j as u128 * (n - 1) as u128 / (m - 1) as u128) as usize
        };
        out.push((v[k], (k + 1) as f64 / n as f64));
    }
    out
}

/// The CDF panel's x range: min..max over every series, padded on a log scale.
fn x_range(cdfs: &[Vec<(f64, f64)>]) -> (f64, f64) {
    let (lo, hi) = cdfs
        .iter()
        .flatten()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(x, _)| {
            (lo.min(x), hi.max(x))
        });
    if lo.is_finite() && hi.is_finite() {
        (lo / X_PAD, hi * X_PAD)
    } else {
        (MIN_TTFT_MS, 1000.0)
    }
}

/// A hit rate clamped to `0..=1`, or `None` when it is NaN or infinite.
fn clamp_rate(r: f64) -> Option<f64> {
    r.is_finite().then(|| r.clamp(0.0, 1.0))
}

/// The oracle hit rate to draw: the largest finite one over the series (they
/// should all agree), clamped to `0..=1`.
fn oracle_rate(series: &[PlotSeries<'_>]) -> Option<f64> {
    series
        .iter()
        .filter_map(|s| clamp_rate(s.oracle_hit_rate))
        .reduce(f64::max)
}

/// A millisecond axis label with about three significant digits: "0.1", "2.5", "40", "1200".
pub(super) fn format_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        let s = if v >= 10.0 {
            format!("{v:.1}")
        } else if v >= 1.0 {
            format!("{v:.2}")
        } else {
            format!("{v:.3}")
        };
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Series `i`'s CDF stroke: `None` solid, else `(dash, gap)` in pixels. Four patterns
/// cycle, so two policies whose curves coincide still differ by pattern, not only by
/// colour; the first series is solid.
pub(super) fn line_dash(i: usize) -> Option<(u32, u32)> {
    const PATTERNS: [Option<(u32, u32)>; 4] = [None, Some((10, 5)), Some((3, 4)), Some((18, 5))];
    PATTERNS[i % PATTERNS.len()]
}

/// Series `i`'s CDF line width: the first series (kvr's policy) is drawn wider.
pub(super) fn line_width(i: usize) -> u32 {
    if i == 0 {
        3
    } else {
        2
    }
}

/// Distinct colours: Tableau 10, then golden-ratio hues for any further series.
pub(super) fn series_color(i: usize) -> RGBColor {
    const TABLEAU: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    if let Some(&c) = TABLEAU.get(i) {
        return c;
    }
    let hue = (i as f64 * 0.618_033_988_749_895).fract();
    let (r, g, b) = HSLColor(hue, 0.65, 0.45).to_backend_color().rgb;
    RGBColor(r, g, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series<'a>(policy: &'a str, ttft: &'a [f64]) -> PlotSeries<'a> {
        PlotSeries {
            policy,
            hit_rate: 0.42,
            oracle_hit_rate: 0.8,
            ttft_ms: ttft,
        }
    }

    fn ttfts(n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|i| scale * (1.0 + i as f64)).collect()
    }

    /// Whether `svg` has a `<text>` element whose content is exactly `text`
    /// (plotters' SVG backend writes it on a line of its own).
    fn has_text(svg: &str, text: &str) -> bool {
        svg.contains(&format!(">\n{text}\n</text>"))
    }

    fn count(haystack: &str, needle: &str) -> usize {
        haystack.matches(needle).count()
    }

    #[test]
    fn svg_contains_policy_names_and_oracle() {
        let a = ttfts(1000, 0.5);
        let b = ttfts(1000, 2.0);
        let svg = render_svg(
            "replay of trace.jsonl",
            &[series("round_robin", &a), series("kv_aware", &b)],
        )
        .unwrap();
        assert!(svg.trim_start().starts_with("<svg"), "{}", &svg[..100]);
        assert!(svg.contains("</svg>"));
        for text in [
            "round_robin",
            "kv_aware",
            "prefix-cache hit rate (dashed: oracle 80.0%)",
            "TTFT CDF",
            "replay of trace.jsonl",
            "42.0%",
        ] {
            assert!(has_text(&svg, text), "missing text {text:?}");
        }
        // Each policy is named in the legend and under its bar.
        assert_eq!(count(&svg, ">\nround_robin\n</text>"), 2);
        assert_eq!(count(&svg, ">\nkv_aware\n</text>"), 2);
    }

    #[test]
    fn policy_names_are_escaped() {
        let a = ttfts(10, 1.0);
        let svg = render_svg("t", &[series("a<b&c", &a)]).unwrap();
        assert!(has_text(&svg, "a&lt;b&amp;c"));
        assert!(!svg.contains("a<b&c"));
    }

    #[test]
    fn line_count_grows_with_series_count() {
        let data: Vec<Vec<f64>> = (0..4).map(|i| ttfts(300, 1.0 + i as f64)).collect();
        let names = ["p0", "p1", "p2", "p3"];
        let lines = |k: usize| {
            let s: Vec<PlotSeries<'_>> = (0..k).map(|i| series(names[i], &data[i])).collect();
            let svg = render_svg("t", &s).unwrap();
            count(&svg, "<polyline") + count(&svg, "<path")
        };
        let (one, two, four) = (lines(1), lines(2), lines(4));
        assert!(one < two && two < four, "{one} {two} {four}");
    }

    #[test]
    fn crowded_policy_names_are_drawn_vertically() {
        let v = ttfts(100, 1.0);
        let names: Vec<String> = (0..16)
            .map(|i| format!("a_rather_long_policy_{i}"))
            .collect();
        let s: Vec<PlotSeries<'_>> = names.iter().map(|n| series(n, &v)).collect();
        let svg = render_svg("t", &s).unwrap();
        // 16 names, plus the CDF panel's y axis title.
        assert_eq!(count(&svg, "rotate(270"), 17);
        for n in &names {
            assert_eq!(count(&svg, &format!(">\n{n}\n</text>")), 2, "{n}");
        }
        // Two series: side by side, only the y axis title is rotated.
        let svg = render_svg("t", &s[..2]).unwrap();
        assert_eq!(count(&svg, "rotate(270"), 1);
    }

    #[test]
    fn lines_differ_by_pattern_and_the_first_is_drawn_last() {
        let patterns: Vec<_> = (0..4).map(line_dash).collect();
        for i in 0..patterns.len() {
            for j in 0..i {
                assert_ne!(patterns[i], patterns[j], "{i} {j}");
            }
        }
        assert_eq!(line_dash(0), None);
        assert!(line_width(0) > line_width(1));
        let data: Vec<Vec<f64>> = (0..3).map(|i| ttfts(200, 1.0 + i as f64)).collect();
        let s: Vec<PlotSeries<'_>> = ["kvr", "b", "c"]
            .iter()
            .zip(&data)
            .map(|(n, d)| series(n, d))
            .collect();
        let svg = render_svg("t", &s).unwrap();
        let stroke = |i: usize| {
            let RGBColor(r, g, b) = series_color(i);
            format!("stroke=\"#{r:02X}{g:02X}{b:02X}\" stroke-width=\"")
        };
        let starts = |needle: &str| -> Vec<usize> {
            svg.match_indices("<polyline")
                .map(|(i, _)| i)
                .filter(|&i| svg[i..i + svg[i..].find("/>").unwrap()].contains(needle))
                .collect()
        };
        // kvr's line: its CDF, the same again on top, its legend entry (all 3 px wide).
        let kvr = starts(&format!("{}3\"", stroke(0)));
        assert_eq!(kvr.len(), 3, "{kvr:?}");
        // The copy on top comes after the last series' CDF (drawn before the legend).
        let last = starts(&stroke(2));
        assert!(
            kvr[1] > last[0],
            "kvr {kvr:?}, last series {:?}",
            &last[..1]
        );
        assert!(
            starts(&format!("{}3\"", stroke(1))).is_empty(),
            "only kvr's line is wide"
        );
    }

    #[test]
    fn a_plot_path_is_checked_before_the_run() {
        let dir = std::env::temp_dir();
        let err = check_writable(&dir).unwrap_err();
        assert!(err.contains("is a directory"), "{err}");
        let missing = dir.join("kvr-no-such-dir").join("p.svg");
        assert!(check_writable(&missing).is_err());
        let fresh = dir.join(format!("kvr-plot-check-{}.svg", std::process::id()));
        std::fs::remove_file(&fresh).ok();
        check_writable(&fresh).unwrap();
        assert!(!fresh.exists(), "the check left a file behind");
        std::fs::write(&fresh, "keep").unwrap();
        check_writable(&fresh).unwrap();
        assert_eq!(
            std::fs::read_to_string(&fresh).unwrap(),
            "keep",
            "the check truncated it"
        );
        std::fs::remove_file(&fresh).ok();
    }

    #[test]
    fn distinct_colours() {
        let c: Vec<RGBColor> = (0..30).map(series_color).collect();
        for i in 0..c.len() {
            for j in 0..i {
                assert_ne!(c[i], c[j], "{i} {j}");
            }
        }
    }

    #[test]
    fn downsampling_caps_points_and_keeps_ends() {
        let v = ttfts(100_000, 0.01);
        let pts = cdf_points(&v);
        assert!(pts.len() <= MAX_CDF_POINTS, "{}", pts.len());
        assert!(pts.len() >= MAX_CDF_POINTS - 10);
        assert_eq!(pts[0], (MIN_TTFT_MS, 0.0));
        assert_eq!(pts[1], (MIN_TTFT_MS, 1.0 / 100_000.0));
        assert_eq!(*pts.last().unwrap(), (1000.0, 1.0));
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));

        // Small inputs are kept whole.
        let small = cdf_points(&[1.0, 2.0, 3.0]);
        assert_eq!(
            small,
            vec![(1.0, 0.0), (1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]
        );
        assert_eq!(cdf_points(&[7.0]), vec![(7.0, 0.0), (7.0, 1.0)]);
    }

    #[test]
    fn big_series_keeps_the_file_small() {
        let v = ttfts(100_000, 0.01);
        let svg = render_svg("t", &[series("big", &v)]).unwrap();
        assert!(svg.len() < 200_000, "{} bytes", svg.len());
    }

    #[test]
    fn cdf_skips_non_finite_and_clamps_small_values() {
        let pts = cdf_points(&[0.0, f64::NAN, 0.05, 5.0, f64::INFINITY, f64::NEG_INFINITY]);
        assert_eq!(
            pts,
            vec![(0.1, 0.0), (0.1, 1.0 / 3.0), (0.1, 2.0 / 3.0), (5.0, 1.0)]
        );
        assert!(cdf_points(&[]).is_empty());
        assert!(cdf_points(&[f64::NAN]).is_empty());
    }

    #[test]
    fn empty_series_list_is_an_error() {
        assert_eq!(render_svg("t", &[]).unwrap_err(), "nothing to plot");
        let path = std::env::temp_dir().join(format!("kvr-plot-empty-{}.svg", std::process::id()));
        assert_eq!(write_svg(&path, "t", &[]).unwrap_err(), "nothing to plot");
        assert!(!path.exists());
    }

    #[test]
    fn zeros_nan_and_empty_series_render() {
        let zeros = [0.0, 0.0, f64::NAN, 0.0];
        let only_nan = [f64::NAN, f64::INFINITY];
        let normal = ttfts(50, 3.0);
        let s = [
            series("zeros", &zeros),
            PlotSeries {
                hit_rate: f64::NAN,
                oracle_hit_rate: f64::INFINITY,
                ..series("nan", &only_nan)
            },
            PlotSeries {
                hit_rate: 1.7,
                ..series("empty", &[])
            },
            PlotSeries {
                hit_rate: -0.3,
                ..series("normal", &normal)
            },
        ];
        let svg = render_svg("t", &s).unwrap();
        for text in [
            "zeros",
            "nan",
            "empty",
            "normal",
            "prefix-cache hit rate (dashed: oracle 80.0%)",
            "n/a",
            "100.0%",
            "0.0%",
        ] {
            assert!(has_text(&svg, text), "missing text {text:?}");
        }
        // Only series with finite TTFTs get a line, hence a legend entry.
        assert_eq!(count(&svg, ">\nzeros\n</text>"), 2);
        assert_eq!(count(&svg, ">\nnan\n</text>"), 1);
        assert_eq!(count(&svg, ">\nempty\n</text>"), 1);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn only_empty_series_render() {
        let svg = render_svg("t", &[series("lonely", &[])]).unwrap();
        assert!(
            has_text(&svg, "lonely")
                && has_text(&svg, "prefix-cache hit rate (dashed: oracle 80.0%)")
        );
    }

    #[test]
    fn hit_rate_clamping() {
        assert_eq!(clamp_rate(1.5), Some(1.0));
        assert_eq!(clamp_rate(-1.0), Some(0.0));
        assert_eq!(clamp_rate(0.25), Some(0.25));
        assert_eq!(clamp_rate(f64::NAN), None);
        assert_eq!(clamp_rate(f64::INFINITY), None);
    }

    #[test]
    fn ms_labels() {
        assert_eq!(format_ms(0.1), "0.1");
        assert_eq!(format_ms(0.30000000000000004), "0.3");
        assert_eq!(format_ms(2.5), "2.5");
        assert_eq!(format_ms(40.0), "40");
        assert_eq!(format_ms(1200.0), "1200");
    }

    #[test]
    fn write_svg_writes_a_file() {
        let path = std::env::temp_dir().join(format!(
            "kvr-plot-test-{}-{:?}.svg",
            std::process::id(),
            std::thread::current().id()
        ));
        let v = ttfts(100, 1.0);
        write_svg(&path, "t", &[series("written", &v)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(text.contains("<svg") && text.contains("written"));
    }

    #[test]
    fn write_svg_to_missing_directory_names_the_path() {
        let path = std::env::temp_dir()
            .join(format!("kvr-plot-no-such-dir-{}", std::process::id()))
            .join("out.svg");
        let v = ttfts(10, 1.0);
        let err = write_svg(&path, "t", &[series("p", &v)]).unwrap_err();
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
}
