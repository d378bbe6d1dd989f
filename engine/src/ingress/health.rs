//! A stream's health: whether the index follows its publisher, and if not, why — so that a
//! wrong or dead KV-event source is never silent (hosts log each change, `kvr serve` lists
//! it in `/ready` and `/metrics`).
//!
//! Four states, worst first (the first that applies wins):
//! - **dead**: the transport cannot reach the publisher (connect or bind failed, the
//!   connection dropped), or nothing came for longer than the source's silence bound;
//! - **degraded**: the stream's ranks may be missing state or hold stale state: a loss is
//!   being replayed, a loss could not be repaired (the ranks were cleared), or batches
//!   failed to decode (their events were dropped);
//! - **recovering**: a replay is in flight (a join, a probe, a restart) and nothing is
//!   known lost;
//! - **exact**: the stream is in sequence.
//!
//! A dead or degraded stream's ranks are listed stale (`crate::freshness`), so selection
//! does not credit their overlap unless `PartitionConfig::trust_stale_overlap` says to.

/// A stream's health (module docs). The numbers are the C ABI's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum SourceHealth {
    /// In sequence: the index follows the publisher.
    #[default]
    Exact = 0,
    /// A replay is in flight, nothing known lost.
    Recovering = 1,
    /// State may be missing or stale (the reason says which).
    Degraded = 2,
    /// Unreachable, or silent beyond the bound.
    Dead = 3,
}

impl SourceHealth {
    /// Every state, by number.
    pub const ALL: [SourceHealth; 4] = [
        SourceHealth::Exact,
        SourceHealth::Recovering,
        SourceHealth::Degraded,
        SourceHealth::Dead,
    ];

    /// The state's name: `exact`, `recovering`, `degraded`, `dead`.
    pub const fn name(self) -> &'static str {
        match self {
            SourceHealth::Exact => "exact",
            SourceHealth::Recovering => "recovering",
            SourceHealth::Degraded => "degraded",
            SourceHealth::Dead => "dead",
        }
    }
}

/// Why a stream is in its state. The numbers are the C ABI's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum HealthReason {
    /// Exact: every batch applied in order.
    #[default]
    InSequence = 0,
    /// Recovering: a replay is in flight.
    ReplayInFlight = 1,
    /// Degraded: a loss is known and its replay has not filled it yet.
    LossNotRepaired = 2,
    /// Degraded: a loss could not be replayed, so the stream's ranks were cleared; until
    /// the next batch applies, the engine holds blocks kvr does not know of.
    StateCleared = 3,
    /// Degraded: the last batch failed to decode (its events were dropped).
    DecodeErrors = 4,
    /// Dead: the publisher cannot be reached (connection refused or timed out).
    Unreachable = 5,
    /// Dead: the peer does not speak ZMQ (the handshake failed).
    HandshakeFailed = 6,
    /// Dead: the connection to the publisher dropped.
    Disconnected = 7,
    /// Dead: the endpoint could not be bound.
    BindFailed = 8,
    /// Dead: no message for longer than the source's silence bound.
    Silent = 9,
    /// Degraded: the connection came back after it was lost; what the publisher sent
    /// meanwhile is unknown until a batch applies or a replay fills.
    Reconnected = 10,
}

impl HealthReason {
    /// Every reason, by number.
    pub const ALL: [HealthReason; 11] = [
        HealthReason::InSequence,
        HealthReason::ReplayInFlight,
        HealthReason::LossNotRepaired,
        HealthReason::StateCleared,
        HealthReason::DecodeErrors,
        HealthReason::Unreachable,
        HealthReason::HandshakeFailed,
        HealthReason::Disconnected,
        HealthReason::BindFailed,
        HealthReason::Silent,
        HealthReason::Reconnected,
    ];

    /// A short text for logs and `/ready`.
    pub const fn text(self) -> &'static str {
        match self {
            HealthReason::InSequence => "in sequence",
            HealthReason::ReplayInFlight => "replay in flight",
            HealthReason::LossNotRepaired => "loss not repaired yet",
            HealthReason::StateCleared => "replay failed, state cleared",
            HealthReason::DecodeErrors => "decode errors",
            HealthReason::Unreachable => "cannot connect (refused or timed out)",
            HealthReason::HandshakeFailed => "not a ZMQ publisher (handshake failed)",
            HealthReason::Disconnected => "connection lost",
            HealthReason::BindFailed => "cannot bind the endpoint",
            HealthReason::Silent => "no message within the silence bound",
            HealthReason::Reconnected => "reconnected, nothing applied since",
        }
    }

    /// The state this reason belongs to.
    pub const fn health(self) -> SourceHealth {
        match self {
            HealthReason::InSequence => SourceHealth::Exact,
            HealthReason::ReplayInFlight => SourceHealth::Recovering,
            HealthReason::LossNotRepaired
            | HealthReason::StateCleared
            | HealthReason::DecodeErrors
            | HealthReason::Reconnected => SourceHealth::Degraded,
            HealthReason::Unreachable
            | HealthReason::HandshakeFailed
            | HealthReason::Disconnected
            | HealthReason::BindFailed
            | HealthReason::Silent => SourceHealth::Dead,
        }
    }

    /// Whether the index may hold blocks the engine dropped in this state, so the stream's
    /// ranks are listed stale: a loss not repaired, a lost or dead link, silence. A clear
    /// (after a loss, or of a batch that did not decode) leaves only an undercount, so
    /// those ranks stay credited for what kvr does know.
    pub const fn may_overcount(self) -> bool {
        !matches!(
            self,
            HealthReason::InSequence
                | HealthReason::ReplayInFlight
                | HealthReason::StateCleared
                | HealthReason::DecodeErrors
        )
    }
}

/// What a stream knows about its health beyond its sequence tracker.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HealthFlags {
    /// The transport reported the publisher unreachable (a dead reason), not yet back.
    pub(crate) link_down: Option<HealthReason>,
    /// Nothing heard for longer than the silence bound.
    pub(crate) silent: bool,
    /// The ranks were cleared without a batch applied since.
    pub(crate) cleared: bool,
    /// The last batch failed to decode.
    pub(crate) decode_failed: bool,
    /// The link came back after it was down, and the stream held state: what was sent
    /// meanwhile is unknown until a batch applies or a replay fills.
    pub(crate) relinked: bool,
}

impl HealthFlags {
    /// The reason of the worst state that applies (module docs), given the tracker's
    /// `stale` and `replaying`.
    pub(crate) fn reason(&self, stale: bool, replaying: bool) -> HealthReason {
        if let Some(r) = self.link_down {
            r
        } else if self.silent {
            HealthReason::Silent
        } else if stale {
            HealthReason::LossNotRepaired
        } else if self.cleared {
            HealthReason::StateCleared
        } else if self.relinked {
            HealthReason::Reconnected
        } else if self.decode_failed {
            HealthReason::DecodeErrors
        } else if replaying {
            HealthReason::ReplayInFlight
        } else {
            HealthReason::InSequence
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_worst_state_wins_and_every_reason_has_its_state() {
        let mut f = HealthFlags::default();
        assert_eq!(f.reason(false, false), HealthReason::InSequence);
        assert_eq!(f.reason(false, true), HealthReason::ReplayInFlight);
        f.decode_failed = true;
        assert_eq!(f.reason(false, true), HealthReason::DecodeErrors);
        assert_eq!(f.reason(true, true), HealthReason::LossNotRepaired);
        f.link_down = Some(HealthReason::Unreachable);
        assert_eq!(f.reason(true, true).health(), SourceHealth::Dead);
        for (i, r) in HealthReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        for (i, h) in SourceHealth::ALL.iter().enumerate() {
            assert_eq!(*h as usize, i);
        }
    }
}
