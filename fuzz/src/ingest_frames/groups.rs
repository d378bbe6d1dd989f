//! The model of `kvr::ingress::groups` (its rules, written again from its documentation):
//! per stream, the KV-cache groups seen in stores and what each is, and the group whose
//! blocks route.
//!
//! - A store names its group's role: full attention or no kind routes; another kind
//!   (sliding window, ...) routes only while no routing kind is known; a recurrent
//!   (Mamba) group never routes, and its stores and removals are recurrent state.
//! - A group that changes its kind keeps the most trusting reading, except that a group
//!   once recurrent stays recurrent.
//! - The routing group is the smallest routing group, else the smallest other group
//!   (recurrent ones never count); when it changes, the stream's ranks are cleared.
//! - At most [`MAX_GROUPS`] groups are remembered; a store of another group is skipped
//!   (a recurrent one still applies as state, unremembered).
//! - A removal of a recurrent group is state; of a group seen but not routing, skipped;
//!   any other (no group, unknown group, the routing one) applies.

use kvr::ingress::SpecKind;

/// Groups remembered per stream.
const MAX_GROUPS: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Routes,
    Other,
    Recurrent,
}

impl Role {
    fn of(spec: SpecKind) -> Role {
        match spec {
            SpecKind::Recurrent => Role::Recurrent,
            SpecKind::Other => Role::Other,
            SpecKind::FullAttention | SpecKind::Unspecified => Role::Routes,
        }
    }

    /// How far a group of this role is trusted to hold whole prefixes (recurrent:
    /// sticky, whatever it says later).
    fn trust(self) -> u8 {
        match self {
            Role::Other => 0,
            Role::Routes => 1,
            Role::Recurrent => 2,
        }
    }
}

/// What to do with one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Verdict {
    /// Clear the stream's ranks before it (the routing group changed).
    pub clear_first: bool,
    /// Apply it (else skipped, counted).
    pub apply: bool,
    /// Apply it as recurrent state, after the batch's other events.
    pub state: bool,
}

/// An event of no group rule (a clear): applied.
pub(super) const APPLY: Verdict = verdict(true, false);

const fn verdict(apply: bool, state: bool) -> Verdict {
    Verdict {
        clear_first: false,
        apply,
        state,
    }
}

#[derive(Default)]
pub(super) struct GroupModel {
    seen: Vec<(u32, Role)>,
    routing: Option<u32>,
}

impl GroupModel {
    pub(super) fn store(&mut self, g: Option<u32>, spec: SpecKind) -> Verdict {
        let role = Role::of(spec);
        let recurrent = role == Role::Recurrent;
        let Some(g) = g else {
            return verdict(true, recurrent);
        };
        match self.seen.iter().position(|e| e.0 == g) {
            Some(i) if role.trust() > self.seen[i].1.trust() => self.seen[i].1 = role,
            Some(_) => {}
            None if self.seen.len() < MAX_GROUPS => self.seen.push((g, role)),
            None => return verdict(recurrent, recurrent),
        }
        let smallest =
            |want: &dyn Fn(Role) -> bool| self.seen.iter().filter(|e| want(e.1)).map(|e| e.0).min();
        let routing = smallest(&|r| r == Role::Routes).or_else(|| smallest(&|r| r == Role::Other));
        let switched = self.routing.is_some() && self.routing != routing;
        self.routing = routing;
        let state = self.is_recurrent(g);
        Verdict {
            clear_first: switched,
            apply: state || routing == Some(g),
            state,
        }
    }

    pub(super) fn remove(&self, g: Option<u32>) -> Verdict {
        match g {
            Some(g) if self.is_recurrent(g) => verdict(true, true),
            Some(g) if self.routing != Some(g) && self.seen.iter().any(|e| e.0 == g) => {
                verdict(false, false)
            }
            _ => verdict(true, false),
        }
    }

    fn is_recurrent(&self, g: u32) -> bool {
        self.seen.iter().any(|e| e.0 == g && e.1 == Role::Recurrent)
    }
}
