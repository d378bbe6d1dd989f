//! A heterogeneous fleet: some workers slower than the rest, from the start or from a
//! moment in the run (a worker that throttles, or shares its GPU with another job).

/// `--slow-workers N:F[@S]`: the first `N` workers' steps take `F` times as long, from
/// `S` seconds of simulated time (from the start without `@S`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SlowWorkers {
    pub workers: u32,
    pub factor: f64,
    pub from_ms: f64,
}

impl SlowWorkers {
    /// Parses `N:F` or `N:F@S`.
    pub(crate) fn parse(s: &str, workers: u32) -> Result<Self, String> {
        let bad = || {
            format!(
                "--slow-workers must be N:F or N:F@S (N of the {workers} workers, F > 0 times \
                 as slow, from S ≥ 0 seconds; got {s:?})"
            )
        };
        let (n, rest) = s.split_once(':').ok_or_else(bad)?;
        let (f, at) = match rest.split_once('@') {
            Some((f, at)) => (f, Some(at)),
            None => (rest, None),
        };
        let n: u32 = n.trim().parse().map_err(|_| bad())?;
        let factor: f64 = f.trim().parse().map_err(|_| bad())?;
        let from_s: f64 = match at {
            Some(a) => a.trim().parse().map_err(|_| bad())?,
            None => 0.0,
        };
        if n == 0 || n > workers || !(factor.is_finite() && factor > 0.0) {
            return Err(bad());
        }
        if !(from_s.is_finite() && from_s >= 0.0) {
            return Err(bad());
        }
        Ok(SlowWorkers {
            workers: n,
            factor,
            from_ms: from_s * 1e3,
        })
    }

    /// The factor on a step's time of `worker` at simulated time `now_ms`.
    #[inline]
    pub(crate) fn factor(&self, worker: u32, now_ms: f64) -> f64 {
        if worker < self.workers && now_ms >= self.from_ms {
            self.factor
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SlowWorkers;

    #[test]
    fn parses_counts_factors_and_start_times_and_refuses_nonsense() {
        assert_eq!(
            SlowWorkers::parse("2:3", 4),
            Ok(SlowWorkers {
                workers: 2,
                factor: 3.0,
                from_ms: 0.0
            })
        );
        let s = SlowWorkers::parse("1:2.5@30", 4).unwrap();
        assert_eq!((s.workers, s.factor, s.from_ms), (1, 2.5, 30_000.0));
        assert_eq!(s.factor(0, 29_999.0), 1.0);
        assert_eq!(s.factor(0, 30_000.0), 2.5);
        assert_eq!(s.factor(1, 40_000.0), 1.0);
        for bad in [
            "", "2", "0:2", "5:2", "2:0", "2:-1", "2:x", "2:2@-1", "2:2@", "2:inf",
        ] {
            assert!(SlowWorkers::parse(bad, 4).is_err(), "{bad:?} was accepted");
        }
    }
}
