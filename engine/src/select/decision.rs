//! What a selection answers: the decision, its overlap, session route and transfer hint.

use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::reservation::ReservationError;
use crate::session::{SessionContext, Steer};

/// Cached prefix of the chosen rank, per source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Leading prompt blocks the rank holds on its device.
    pub device_blocks: u32,
    /// Further contiguous blocks it holds in host memory.
    pub host_blocks: u32,
    /// Further contiguous blocks it holds on disk.
    pub disk_blocks: u32,
    /// Blocks the host's shared cache holds beyond the device prefix.
    pub shared_blocks: u32,
}

/// The decision for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The chosen rank.
    pub rank: RankId,
    /// The booking's id (booked mode); `None` for advisory selection.
    pub selection_id: Option<SelectionId>,
    /// How much of the prompt the chosen rank has cached.
    pub overlap: Overlap,
    /// Prompt tokens the chosen rank has cached on its device.
    pub cached_tokens: u64,
    /// Prefill tokens this request adds to the rank (host estimator, else prompt − cached).
    pub projected_prefill_tokens: u64,
    /// The rank's decode blocks once this request is booked on it.
    pub projected_decode_blocks: u64,
    /// The chosen rank's cost in the partition's model: predicted TTFT plus charges, ms
    /// (`CostModel::Latency`, the default), or block equivalents (`CostModel::Dynamo`).
    pub cost: f64,
    /// The request's session context, carried through
    /// ([`SelectRequest::effective_session`](super::SelectRequest::effective_session)).
    pub session: Option<SessionContext>,
    /// How session affinity steered this decision: `None` without a session table or a
    /// session context (and for explicit reservations, which are not steered).
    pub session_route: Option<SessionRoute>,
    /// Booked responses only: a peer rank that holds more of the prompt and can send it.
    pub kv_hint: Option<KvHint>,
}

/// How session affinity took part in a selection (DESIGN.md §9), reported so a gateway
/// can log or count it per request as Dynamo's router does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionRoute {
    /// The session had no binding: chosen by cost (booking binds it).
    Unbound,
    /// Hard mode: sent to the session's bound rank.
    Pinned,
    /// Soft mode: chosen by cost with the bound rank preferred (it may or may not win).
    Preferred,
    /// The bound rank could not take the turn (left, unavailable, overloaded, not
    /// allowed): chosen by cost; booking rebinds the session (a forced rebind).
    Rebound,
}

impl SessionRoute {
    pub(super) fn of(steer: &Steer) -> Self {
        match steer {
            Steer::Free => SessionRoute::Unbound,
            Steer::Pin(_) => SessionRoute::Pinned,
            Steer::Prefer { .. } => SessionRoute::Preferred,
            Steer::Rebind { .. } => SessionRoute::Rebound,
        }
    }
}

/// A transfer hint (DESIGN.md §7): the chosen rank may pull blocks `block_range` of the
/// prompt from `source` through its control endpoint instead of computing them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvHint {
    /// The rank that holds the blocks.
    pub source: RankId,
    /// The source rank's control endpoint, as its worker registered it.
    pub control_endpoint: String,
    /// `[start, end)` in prompt blocks: from the chosen rank's device prefix to the
    /// source's, at most `max_transfer_blocks` long.
    pub block_range: (u32, u32),
    /// The source engine's own hashes of those blocks, in order (Dynamo's
    /// `router_hint.block_hashes`: engines with different hash seeds name blocks
    /// differently). The range ends where the names kvr knows end.
    pub block_hashes: Vec<u64>,
}

/// What a selection answers.
// `Selected` is the common case and is returned by value: boxing the decision would put
// an allocation on every selection (the routing path allocates nothing once warm).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// A rank was chosen (in booked mode, and booked).
    Selected(Decision),
    /// Candidates exist, but every one is busy or overloaded: try again later.
    Busy,
    /// No rank can serve the request at all (no workers, nothing allowed or available).
    NoWorker,
}

/// Why a booked selection or an explicit reservation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SelectError {
    /// The booking table refused the booking.
    Reservation(ReservationError),
    /// An explicit reservation named a rank that is not a member of the partition.
    UnknownRank(RankId),
}

impl std::fmt::Display for SelectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SelectError::Reservation(e) => write!(f, "{e}"),
            SelectError::UnknownRank(r) => write!(f, "rank {r} is not in this partition"),
        }
    }
}

impl std::error::Error for SelectError {}

impl From<ReservationError> for SelectError {
    fn from(e: ReservationError) -> Self {
        SelectError::Reservation(e)
    }
}
