//! The exact audit: recomputes every rank's counters and prompt-block refcounts from the
//! live bookings and compares (point 5 of the module docs), and checks the prefill sum and
//! that every group's floors stay at or below its members' counters and its count of
//! live bookings is its members'. For tests and
//! diagnostics on a quiescent table.

use super::inner::Inner;
use super::rank::{MixMap, RankState};
use super::types::ActiveLoad;
use crate::sync::atomic::Ordering;
use crate::sync::Arc;

impl Inner {
    pub(super) fn audit(&self) -> Result<(), String> {
        struct Expect {
            state: Arc<RankState>,
            load: ActiveLoad,
            refs: MixMap<u64, u64>,
        }
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let registry = self.ranks.load();
        let mut expect: Vec<Expect> = registry
            .values()
            .map(|s| Expect {
                state: s.clone(),
                load: ActiveLoad::default(),
                refs: MixMap::default(),
            })
            .collect();
        for g in &guards {
            for b in g.live.values() {
                let i = match expect.iter().position(|e| Arc::ptr_eq(&e.state, &b.rank)) {
                    Some(i) => i,
                    None => {
                        expect.push(Expect {
                            state: b.rank.clone(),
                            load: ActiveLoad::default(),
                            refs: MixMap::default(),
                        });
                        expect.len() - 1
                    }
                };
                let e = &mut expect[i];
                e.load.active_requests += 1;
                if !b.prefill_done {
                    e.load.active_prefill_tokens += b.prefill_tokens;
                }
                e.load.active_decode_blocks += b.output_blocks;
                for &h in &b.prompt_blocks {
                    *e.refs.entry(h).or_insert(0) += 1;
                }
            }
        }
        for e in &mut expect {
            e.load.active_decode_blocks += e.refs.len() as u64;
            let blocks = e.state.blocks.lock();
            if blocks.refs != e.refs {
                return Err(format!(
                    "rank {}: prompt-block refcounts differ from the live bookings' ({} vs {} blocks)",
                    e.state.rank,
                    blocks.refs.len(),
                    e.refs.len()
                ));
            }
            let prompt = e.state.counters.prompt_blocks.load(Ordering::Relaxed);
            if prompt != e.refs.len() as u64 {
                return Err(format!(
                    "rank {}: distinct prompt blocks counter {prompt} != {}",
                    e.state.rank,
                    e.refs.len()
                ));
            }
            let have = e.state.load();
            if have != e.load {
                return Err(format!(
                    "rank {}: counters {have:?} != recomputed {:?}",
                    e.state.rank, e.load
                ));
            }
        }
        // The running sum a pruned selection reads, and each group's floors (bounds).
        let sum: u64 = expect.iter().map(|e| e.load.active_prefill_tokens).sum();
        let kept = self.prefill_sum.load(Ordering::Relaxed);
        if kept != sum {
            return Err(format!("prefill token sum {kept} != recomputed {sum}"));
        }
        for e in &expect {
            let f = e.state.floor.read();
            let have = e.state.load();
            let figures = self.floor_mix.figures(have);
            if f.bounds()
                .iter()
                .zip(figures)
                .any(|(&bound, figure)| bound > figure)
            {
                return Err(format!(
                    "rank {}: its group's floor {f:?} is above its counters {have:?}",
                    e.state.rank
                ));
            }
        }
        // Each group's count of its members' live bookings (`idle.rs`).
        for e in &expect {
            let floor = &e.state.floor;
            let live: u64 = expect
                .iter()
                .filter(|o| Arc::ptr_eq(&o.state.floor, floor))
                .map(|o| o.load.active_requests)
                .sum();
            let counted = floor.bookings();
            if counted != live {
                return Err(format!(
                    "rank {}: its group counts {counted} live bookings, its members hold {live}",
                    e.state.rank
                ));
            }
        }
        let under = self.underflows.load(Ordering::Relaxed);
        if under != 0 {
            return Err(format!("{under} counter underflows"));
        }
        Ok(())
    }
}
