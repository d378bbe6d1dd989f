//! Which KV-cache group's events a stream routes on.
//!
//! vLLM's hybrid KV-cache manager (full attention plus sliding window, or Mamba groups)
//! publishes one `BlockStored` / `BlockRemoved` per group, with the same block hashes
//! (REFERENCE.md §9). A sliding-window group evicts blocks that fell out of its window
//! while the full-attention group still holds them; a prefix hit needs the full-attention
//! blocks, so routing follows them, as Dynamo does. Removals carry only `group_idx`, so
//! each group's kind is learned from its stores.
//!
//! The rule, per stream:
//! - an event without `group_idx` applies (an engine without hybrid groups);
//! - the routing group is the lowest-numbered group whose stores said `full_attention`
//!   (or gave no kind); while none has, the lowest-numbered group seen (a model whose only
//!   groups are sliding-window still routes on them);
//! - a store applies iff its group is the routing group; a removal applies iff its group
//!   is the routing group or one never seen in a store (never keeping a block the engine
//!   may have dropped: an unknown group's removal can only undercount);
//! - when the routing group changes (a full-attention group shows up after another was
//!   followed), the stream's ranks are cleared: their blocks came from the other group.
//!
//! Skipped events are counted (`StreamStats::events_skipped_group`).

use super::decode::SpecKind;

/// Groups a stream remembers; later new groups' stores are skipped and their removals
/// applied (a bound on what one publisher can make kvr keep).
const MAX_GROUPS: usize = 16;

/// What to do with one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Clear the stream's ranks first (the routing group changed).
    pub(crate) clear_first: bool,
    pub(crate) apply: bool,
}

pub(crate) const APPLY: Verdict = Verdict {
    clear_first: false,
    apply: true,
};

const SKIP: Verdict = Verdict {
    clear_first: false,
    apply: false,
};

/// One stream's groups.
#[derive(Debug, Default)]
pub(crate) struct GroupRouting {
    /// (group, routes: full attention or unspecified kind), by group.
    seen: Vec<(u32, bool)>,
    routing: Option<u32>,
}

impl GroupRouting {
    pub(crate) fn on_store(&mut self, group: Option<u32>, spec: SpecKind) -> Verdict {
        let Some(g) = group else {
            return APPLY;
        };
        let full = spec != SpecKind::Other;
        match self.seen.iter().position(|e| e.0 == g) {
            // A group that changes its kind keeps the most trusting reading.
            Some(i) => self.seen[i].1 |= full,
            None if self.seen.len() < MAX_GROUPS => self.seen.push((g, full)),
            None => return SKIP,
        }
        let routing = self
            .seen
            .iter()
            .filter(|e| e.1)
            .map(|e| e.0)
            .min()
            .or_else(|| self.seen.iter().map(|e| e.0).min());
        let clear_first = self.routing.is_some() && routing != self.routing;
        self.routing = routing;
        Verdict {
            clear_first,
            apply: routing == Some(g),
        }
    }

    pub(crate) fn on_remove(&self, group: Option<u32>) -> Verdict {
        match group {
            Some(g) if self.routing != Some(g) && self.seen.iter().any(|e| e.0 == g) => SKIP,
            _ => APPLY,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_like_full_plus_sliding_routes_on_the_full_group() {
        let mut g = GroupRouting::default();
        assert_eq!(g.on_store(Some(0), SpecKind::FullAttention), APPLY);
        assert_eq!(g.on_store(Some(1), SpecKind::Other), SKIP);
        assert_eq!(g.on_remove(Some(1)), SKIP, "the window's eviction");
        assert_eq!(g.on_remove(Some(0)), APPLY);
        assert_eq!(
            g.on_remove(Some(7)),
            APPLY,
            "an unknown group: never overcount"
        );
        assert_eq!(g.on_remove(None), APPLY);
    }

    #[test]
    fn a_full_group_seen_after_another_takes_over_and_clears() {
        // Mamba-like: the state group's store may come first.
        let mut g = GroupRouting::default();
        assert_eq!(
            g.on_store(Some(1), SpecKind::Other),
            APPLY,
            "the only group so far"
        );
        assert_eq!(
            g.on_store(Some(0), SpecKind::FullAttention),
            Verdict {
                clear_first: true,
                apply: true
            }
        );
        assert_eq!(g.on_store(Some(1), SpecKind::Other), SKIP);
        assert_eq!(g.on_remove(Some(1)), SKIP);
        // Two full-attention groups: the lower one routes.
        let mut g = GroupRouting::default();
        assert_eq!(g.on_store(Some(2), SpecKind::FullAttention), APPLY);
        assert_eq!(g.on_store(Some(3), SpecKind::FullAttention), SKIP);
        assert_eq!(g.on_store(None, SpecKind::Other), APPLY);
    }

    #[test]
    fn groups_beyond_the_bound_are_not_remembered() {
        let mut g = GroupRouting::default();
        for i in 0..MAX_GROUPS as u32 {
            g.on_store(Some(100 + i), SpecKind::Other);
        }
        assert_eq!(g.on_store(Some(5), SpecKind::FullAttention), SKIP);
        assert_eq!(g.on_remove(Some(5)), APPLY);
        assert_eq!(g.seen.len(), MAX_GROUPS);
    }
}
