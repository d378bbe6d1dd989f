//! The JetStream sync's own counters, beside the booking outcomes it shares with the
//! Dynamo-compatible sync.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Counters of the JetStream sync (monotonic, except `queued`, `waiting` and `peers`).
        #[derive(Debug, Default)]
        pub(crate) struct JsCounters {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// A moment's copy of the JetStream sync's counters.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct JetStreamStats {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl JsCounters {
            pub(crate) fn snapshot(&self) -> JetStreamStats {
                JetStreamStats { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }

        impl JetStreamStats {
            /// Every counter with its name (the service's metrics read it).
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters! {
    /// Events the stream acknowledged.
    acked,
    /// Acknowledged publishes the stream had stored already (a retry of a publish whose
    /// acknowledgement was lost).
    deduplicated,
    /// Publish attempts that failed and were retried (the server down or slow).
    publish_retries,
    /// Events dropped because the publish queue was full (the sequence number is used, so
    /// peers see the gap).
    dropped,
    /// Events waiting to be published now (a gauge).
    queued,
    /// Stream messages received (this replica's own included).
    received,
    /// Events skipped: already applied (a replay's overlap).
    repeated,
    /// Events skipped: from an incarnation older than one already heard.
    stale,
    /// Adds older than the peer-booking lifetime when they were read (a replay): not applied.
    too_old,
    /// Per-sender sequence gaps found (each answered by a replay from the last applied
    /// stream message).
    gaps,
    /// Events still missing after that replay: lost at their publisher (a full queue).
    lost,
    /// Times the consumer was (re)created: at start, after an error, after a gap.
    consumer_starts,
    /// Times the stream no longer held the next message to apply (this replica fell behind
    /// the stream's retention, or the stream was recreated).
    fell_behind,
    /// Adds whose partition or rank was not registered here yet: kept to be tried again.
    parked,
    /// Kept adds applied later (their worker was registered meanwhile).
    unparked,
    /// Kept adds waiting now (a gauge).
    waiting,
    /// Heartbeats received from peers.
    heartbeats,
    /// Peers heard from now (a gauge).
    peers,
}
