//! Cost → choice (DESIGN.md §7 step 5): [`choose`] picks one index from a slice of costs,
//! argmin with a uniform random tie-break at temperature 0, range-normalised softmax
//! above it, total for any input (NaN and infinite costs, odd temperatures).

use super::rng::RandomSource;

/// The ordering key of a cost: NaN counts as +inf (the worst cost), so a NaN can never
/// win and never poisons a comparison.
#[inline]
fn key(c: f64) -> f64 {
    if c.is_nan() {
        f64::INFINITY
    } else {
        c
    }
}

/// The index of the `r`-th (0-based) cost whose key equals `target`.
#[inline]
fn nth_with_key(costs: &[f64], target: f64, r: u64) -> Option<usize> {
    costs
        .iter()
        .enumerate()
        .filter(|&(_, &c)| key(c) == target)
        .nth(usize::try_from(r).ok()?)
        .map(|(i, _)| i)
}

/// Whether [`choose`] takes the argmin at `temperature` (any temperature not above 0,
/// NaN included) rather than sampling.
pub(crate) fn takes_argmin(temperature: f64) -> bool {
    !matches!(
        temperature.partial_cmp(&0.0),
        Some(std::cmp::Ordering::Greater)
    )
}

/// The positions of the costs tied at the minimum (NaN counting as +inf), into `out`.
pub(crate) fn ties_at_min(costs: &[f64], out: &mut Vec<usize>) {
    out.clear();
    let best = costs.iter().map(|&c| key(c)).fold(f64::INFINITY, f64::min);
    out.extend((0..costs.len()).filter(|&i| key(costs[i]) == best));
}

/// Argmin with a random choice among exact ties weighted by `weight(i)` (how many ranks
/// candidate `i` stands for, at least 1): the chosen index and a uniform draw below its
/// weight, which picks one of the ranks it stands for. With every weight 1 this is the
/// uniform tie-break of [`choose`], one draw per choice among several ties.
pub(crate) fn choose_argmin_weighted<R: RandomSource + ?Sized>(
    costs: &[f64],
    weight: impl Fn(usize) -> u64,
    rng: &mut R,
) -> Option<(usize, u64)> {
    let best = costs.iter().map(|&c| key(c)).fold(f64::INFINITY, f64::min);
    let tied = || (0..costs.len()).filter(move |&i| key(costs[i]) == best);
    let total = tied()
        .map(|i| weight(i).max(1))
        .fold(0u64, u64::saturating_add);
    let mut r = rng.below(total);
    for i in tied() {
        let w = weight(i).max(1);
        if r < w {
            return Some((i, r));
        }
        r -= w;
    }
    None
}

/// Argmin with a uniform random choice among exact ties (`temperature == 0`).
fn choose_argmin<R: RandomSource + ?Sized>(costs: &[f64], rng: &mut R) -> Option<usize> {
    let mut best = f64::INFINITY;
    let mut ties: u64 = 0;
    let mut first = 0;
    for (i, &c) in costs.iter().enumerate() {
        let k = key(c);
        if ties == 0 || k < best {
            best = k;
            ties = 1;
            first = i;
        } else if k == best {
            ties += 1;
        }
    }
    match ties {
        0 => None,
        1 => Some(first),
        n => nth_with_key(costs, best, rng.below(n)),
    }
}

/// Softmax over range-normalised costs (`temperature > 0`); see [`choose`].
fn choose_softmax<R: RandomSource + ?Sized>(
    costs: &[f64],
    temperature: f64,
    rng: &mut R,
) -> Option<usize> {
    // Pass 1: the minimum key, and the maximum among finite keys.
    let mut lo = f64::INFINITY;
    let mut hi_finite = f64::NEG_INFINITY;
    for &c in costs {
        let k = key(c);
        lo = lo.min(k);
        if k.is_finite() {
            hi_finite = hi_finite.max(k);
        }
    }
    if !lo.is_finite() {
        // lo = +inf: every cost is +inf/NaN; lo = -inf: the -inf ones dominate any
        // finite range. Either way: uniform among the entries at `lo`.
        return choose_argmin(costs, rng);
    }
    // Work in halves: `0.5 * a - 0.5 * b` is exactly half of `a - b` for normal floats but
    // cannot overflow, so costs spanning more than f64::MAX still normalise correctly.
    let half_range = 0.5 * hi_finite - 0.5 * lo;
    if half_range <= 0.0 {
        // All finite costs equal: uniform among them (+inf/NaN excluded).
        return choose_argmin(costs, rng);
    }
    // weight = exp(-((k - lo) / (max - min)) / T) in (0, 1]; the minimum has weight 1, so
    // the sum is >= 1 and never underflows to 0. +inf/NaN costs get weight 0.
    let weight = |c: f64| {
        let k = key(c);
        if k.is_finite() {
            (-((0.5 * k - 0.5 * lo) / half_range) / temperature).exp()
        } else {
            0.0
        }
    };
    // Pass 2: the normaliser. Pass 3: invert the CDF. Recomputing exp beats allocating.
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let u = rng.next_f64() * total;
    let mut cumulative = 0.0;
    let mut last_positive = None;
    for (i, &c) in costs.iter().enumerate() {
        let w = weight(c);
        if w > 0.0 {
            cumulative += w;
            last_positive = Some(i);
            if u < cumulative {
                return Some(i);
            }
        }
    }
    // Rounding can leave u just above the accumulated sum: give it to the last candidate
    // with positive weight (never to a +inf/NaN one).
    last_positive
}

/// Chooses one index from `costs` (lower is better), per DESIGN.md §7 step 5 and
/// REFERENCE.md §3.
///
/// * `temperature == 0`: the minimum cost; exact ties are broken **uniformly at random**
///   (not first-wins, which would bias load towards low rank ids whenever several ranks
///   look identical, e.g. an idle cluster). Consumes one draw only when there is a tie.
/// * `temperature > 0`: samples `i` with `p_i ∝ exp(-(cost_i - min) / ((max - min) * T))`.
///   Normalising by the range makes `T` scale-free: `T` is "how much of the spread between
///   best and worst to ignore", whatever the absolute size of the costs. All costs equal →
///   uniform. `T = +inf` → uniform.
/// * Empty `costs` → `None`; otherwise always `Some`.
///
/// Non-finite inputs never panic:
/// * a NaN cost is treated as `+inf` (the worst), so it is chosen only when every cost is
///   `+inf`/NaN (then uniformly among all);
/// * under softmax, `+inf`/NaN costs get probability 0 and the range is taken over the
///   finite costs; if any cost is `-inf`, the choice is uniform among the `-inf` ones (the
///   limit of the formula);
/// * a negative or NaN temperature is treated as 0 (argmin).
pub fn choose<R: RandomSource + ?Sized>(
    costs: &[f64],
    temperature: f64,
    rng: &mut R,
) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    if takes_argmin(temperature) {
        choose_argmin(costs, rng)
    } else {
        choose_softmax(costs, temperature, rng)
    }
}
