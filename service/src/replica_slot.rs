//! `--replica-ordinal` / `--replica-count`: how this replica splits ties between equally
//! good workers. Replicas that see the same loads and choose at the same instant (a burst
//! of requests spread over them) would otherwise each take a random one of the tied
//! workers and often the same one; with distinct ordinals each starts its round of the
//! workers at its own share of the way round, so simultaneous choices spread out. Nothing
//! is exchanged on the selection path: the ordinal is fixed at start.

use std::sync::Arc;

use kvr::{RankId, TieBreak};

/// Checks the flags: both or neither, the ordinal below the count.
pub fn check_args(ordinal: Option<u32>, count: Option<u32>) -> Result<(), String> {
    match (ordinal, count) {
        (None, None) => Ok(()),
        (Some(o), Some(n)) if n > 0 && o < n => Ok(()),
        (Some(o), Some(n)) => Err(format!(
            "--replica-ordinal {o} must be below --replica-count {n}"
        )),
        _ => Err("--replica-ordinal and --replica-count go together".to_string()),
    }
}

/// The tie-break of replica `ordinal` of `count`: the first tied rank, in rank order,
/// from position `ordinal * candidates / count` on, wrapping round.
pub fn tie_break(ordinal: u32, count: u32) -> Arc<TieBreak> {
    Arc::new(move |ranks: &[RankId], tied: &[usize]| {
        let n = ranks.len();
        if n == 0 || count == 0 {
            return None;
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by_key(|&k| ranks[k]);
        let start = (ordinal as usize * n) / count as usize;
        (0..n)
            .map(|j| order[(start + j) % n])
            .find(|k| tied.binary_search(k).is_ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(n: u64) -> Vec<RankId> {
        // Out of rank order on purpose: the rotation follows rank ids, not positions.
        (0..n).rev().map(|w| RankId::new(w, 0)).collect()
    }

    #[test]
    fn four_replicas_choosing_at_once_take_four_different_ranks() {
        let r = ranks(4);
        let all = [0, 1, 2, 3];
        let picks: Vec<u64> = (0..4)
            .map(|o| r[tie_break(o, 4)(&r, &all).unwrap()].worker_id)
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_burst_of_three_each_on_four_replicas_fills_four_ranks_evenly() {
        // Each replica sees only its own bookings (the burst outruns the sync): its next
        // choice is among the ranks it has not booked yet.
        let r = ranks(4);
        let mut load = [0u32; 4];
        for o in 0..4 {
            let f = tie_break(o, 4);
            let mut mine = [0u32; 4];
            for _ in 0..3 {
                let low = *mine.iter().min().unwrap();
                let tied: Vec<usize> = (0..4)
                    .filter(|&k| mine[r[k].worker_id as usize] == low)
                    .collect();
                let w = r[f(&r, &tied).unwrap()].worker_id as usize;
                mine[w] += 1;
                load[w] += 1;
            }
        }
        assert_eq!(load, [3, 3, 3, 3]);
    }

    #[test]
    fn the_answer_is_always_a_tied_position() {
        let r = ranks(5);
        for o in 0..3 {
            for tied in [vec![1, 3], vec![4], vec![0, 2, 4]] {
                let k = tie_break(o, 3)(&r, &tied).unwrap();
                assert!(tied.contains(&k));
            }
        }
        assert_eq!(tie_break(0, 1)(&[], &[]), None);
    }

    #[test]
    fn the_flags_go_together() {
        assert!(check_args(None, None).is_ok());
        assert!(check_args(Some(3), Some(4)).is_ok());
        assert!(check_args(Some(4), Some(4)).is_err());
        assert!(check_args(Some(0), Some(0)).is_err());
        assert!(check_args(Some(0), None).is_err());
        assert!(check_args(None, Some(2)).is_err());
    }
}
