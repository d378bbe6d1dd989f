//! The figures of a run: printed as a table, written as JSON, checked against the goals.

use std::fmt::Write as _;

use serde_json::json;

/// A median over rounds, with the smallest and largest round.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub(crate) fn of(mut v: Vec<f64>) -> Self {
        assert!(!v.is_empty(), "a spread of nothing");
        v.sort_by(f64::total_cmp);
        Spread {
            median: v[v.len() / 2],
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    fn show(&self, unit: &str) -> String {
        format!(
            "{} ({}–{})",
            human(self.median, unit),
            human(self.min, unit),
            human(self.max, unit)
        )
    }
}

/// One measured quantity: a per-call latency (p50 and p99, each over rounds) or a
/// single value (`p99` none).
#[derive(Clone, Debug)]
pub(crate) struct Figure {
    pub name: String,
    pub unit: &'static str,
    pub p50: Spread,
    pub p99: Option<Spread>,
}

impl Figure {
    pub(crate) fn single(name: &str, value: f64, unit: &'static str) -> Self {
        Figure {
            name: name.to_string(),
            unit,
            p50: Spread {
                median: value,
                min: value,
                max: value,
            },
            p99: None,
        }
    }
}

/// Everything a run measured, in order.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub notes: Vec<String>,
    pub figures: Vec<Figure>,
}

impl Report {
    pub(crate) fn note(&mut self, s: String) {
        println!("{s}");
        self.notes.push(s);
    }

    pub(crate) fn push(&mut self, f: Figure) {
        self.figures.push(f);
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Figure> {
        self.figures.iter().find(|f| f.name == name)
    }

    pub(crate) fn table(&self) -> String {
        let mut s = String::from(
            "| figure | p50 or value (min–max over rounds) | p99 (min–max over rounds) |\n|---|---|---|\n",
        );
        for f in &self.figures {
            let p99 = f.p99.map_or_else(String::new, |p| p.show(f.unit));
            let _ = writeln!(s, "| {} | {} | {p99} |", f.name, f.p50.show(f.unit));
        }
        s
    }

    pub(crate) fn json(&self) -> String {
        let spread = |s: &Spread| json!({"median": s.median, "min": s.min, "max": s.max});
        let figures: Vec<_> = self
            .figures
            .iter()
            .map(|f| {
                json!({
                    "name": f.name,
                    "unit": f.unit,
                    "p50": spread(&f.p50),
                    "p99": f.p99.as_ref().map(spread),
                })
            })
            .collect();
        let doc = json!({"notes": self.notes, "figures": figures});
        // Serializing a `Value` to a string cannot fail.
        serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
    }
}

/// `ns` as ns, µs or ms; other units as they are.
fn human(v: f64, unit: &str) -> String {
    match unit {
        "ns" if v >= 1e6 => format!("{:.2} ms", v / 1e6),
        "ns" if v >= 1e3 => format!("{:.2} µs", v / 1e3),
        "ns" => format!("{v:.0} ns"),
        u => format!("{v:.1} {u}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_median_min_max() {
        let s = Spread::of(vec![5.0, 1.0, 3.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 5.0));
    }

    #[test]
    fn json_carries_every_figure() {
        let mut r = Report::default();
        r.push(Figure::single("a", 1.0, "B"));
        r.push(Figure::single("b", 2.0, "B"));
        r.note("x \"y\"".into());
        let j = r.json();
        assert!(j.contains("\"name\": \"a\"") && j.contains("\"name\": \"b\""));
        assert!(j.contains("x \\\"y\\\""));
    }
}
