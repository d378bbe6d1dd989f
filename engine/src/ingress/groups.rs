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
//! - a recurrent (Mamba) group never routes: its stores and removals are recurrent state
//!   (`index::KvEvent::StatesStored` / `StatesRemoved`), which cut a hybrid rank's score
//!   back to the last block with a state.
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
    /// Apply it as recurrent state (`index::KvEvent::StatesStored` / `StatesRemoved`),
    /// not as blocks: the event is of a recurrent group.
    pub(crate) state: bool,
}

pub(crate) const APPLY: Verdict = Verdict {
    clear_first: false,
    apply: true,
    state: false,
};

const SKIP: Verdict = Verdict {
    clear_first: false,
    apply: false,
    state: false,
};

const STATE: Verdict = Verdict {
    clear_first: false,
    apply: true,
    state: true,
};

/// What a group's stores said it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Full attention, or no kind given: may route.
    Routes,
    /// Sliding window and the like: routes only while nothing better is seen.
    Other,
    /// Recurrent state (Mamba): never routes; its events are states.
    Recurrent,
}

/// One stream's groups.
#[derive(Debug, Default)]
pub(crate) struct GroupRouting {
    /// (group, role), by group.
    seen: Vec<(u32, Role)>,
    routing: Option<u32>,
}

impl GroupRouting {
    pub(crate) fn on_store(&mut self, group: Option<u32>, spec: SpecKind) -> Verdict {
        let role = match spec {
            SpecKind::Recurrent => Role::Recurrent,
            SpecKind::Other => Role::Other,
            SpecKind::FullAttention | SpecKind::Unspecified => Role::Routes,
        };
        let Some(g) = group else {
            return if role == Role::Recurrent {
                STATE
            } else {
                APPLY
            };
        };
        match self.seen.iter().position(|e| e.0 == g) {
            // A group that changes its kind keeps the most trusting reading; a recurrent
            // group stays one (its stores name states, not blocks).
            Some(i) => {
                let e = &mut self.seen[i].1;
                *e = match (*e, role) {
                    (Role::Recurrent, _) | (_, Role::Recurrent) => Role::Recurrent,
                    (Role::Routes, _) | (_, Role::Routes) => Role::Routes,
                    _ => Role::Other,
                };
            }
            None if self.seen.len() < MAX_GROUPS => self.seen.push((g, role)),
            None if role == Role::Recurrent => return STATE,
            None => return SKIP,
        }
        let candidates = || self.seen.iter().filter(|e| e.1 != Role::Recurrent);
        let routing = candidates()
            .filter(|e| e.1 == Role::Routes)
            .map(|e| e.0)
            .min()
            .or_else(|| candidates().map(|e| e.0).min());
        let clear_first = self.routing.is_some() && routing != self.routing;
        self.routing = routing;
        let state = self.is_recurrent(g);
        Verdict {
            clear_first,
            apply: state || routing == Some(g),
            state,
        }
    }

    pub(crate) fn on_remove(&self, group: Option<u32>) -> Verdict {
        match group {
            Some(g) if self.is_recurrent(g) => STATE,
            Some(g) if self.routing != Some(g) && self.seen.iter().any(|e| e.0 == g) => SKIP,
            _ => APPLY,
        }
    }

    fn is_recurrent(&self, g: u32) -> bool {
        self.seen.iter().any(|e| e.0 == g && e.1 == Role::Recurrent)
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
                apply: true,
                state: false,
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
    fn a_recurrent_group_never_routes_and_its_events_are_states() {
        // Qwen3-Next / Nemotron-H like: the Mamba group may come first.
        let mut g = GroupRouting::default();
        assert_eq!(g.on_store(Some(0), SpecKind::Recurrent), STATE);
        assert_eq!(g.on_store(Some(1), SpecKind::FullAttention), APPLY);
        assert_eq!(g.on_remove(Some(0)), STATE);
        assert_eq!(g.on_remove(Some(1)), APPLY);
        assert_eq!(g.on_store(Some(0), SpecKind::Recurrent), STATE);
        // Only recurrent groups (a pure Mamba model): nothing routes, states still apply.
        let mut g = GroupRouting::default();
        assert_eq!(g.on_store(Some(0), SpecKind::Recurrent), STATE);
        assert_eq!(g.routing, None);
        assert_eq!(g.on_store(None, SpecKind::Recurrent), STATE);
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
