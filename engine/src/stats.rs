//! Every counter snapshot a partition reports, in one place: what its index holds
//! ([`IndexStats`], per rank [`RankStats`]), what selection decided
//! ([`SelectionStats`]), the booking table ([`ReservationStats`]), the session table
//! ([`SessionStats`]), the indexer policy and its approximate and remote indexes
//! ([`IndexerStats`], [`ApproxStats`], [`RemoteStats`]), and each event stream
//! ([`StreamStats`] with its [`SequenceStats`]). Each is a plain copy, taken without
//! stopping the engine; hosts mirror every field (C, C++, Go, Python, `/metrics`).

pub use crate::index::{ApproxStats, IndexStats, RankStats, RemoteStats};
pub use crate::indexer::IndexerStats;
pub use crate::ingress::counters::{StreamFreshness, StreamStats};
pub use crate::ingress::health::{HealthReason, SourceHealth};
pub use crate::ingress::sequence::SequenceStats;
pub use crate::reservation::ReservationStats;
pub use crate::select::SelectionStats;
pub use crate::session::SessionStats;
