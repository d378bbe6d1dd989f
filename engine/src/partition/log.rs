//! A journal of what a partition's index applied: a warm restart replays it on top of a
//! snapshot (the `kvr-state` crate keeps both on disk; the engine only hands events out).
//!
//! Every event the index applied, whatever its way in (a stream's batch, a host's typed
//! events, a peer's dump, a restore), goes through ingress's one door, which reports it
//! with its [`Origin`]; every clear of ranks is reported too. The log is called on the
//! ingesting thread, after the index changed: it must not block (a journal hands the
//! event to a writer thread).

use super::Partition;
use crate::ids::{RankId, WorkerId};
use crate::index::KvEvent;
use crate::ingress::door::{Origin, StreamResume};
use crate::sync::StdArc;

/// Receives what a partition's index applied ([`Partition::attach_applied_log`]).
pub trait AppliedLog: Send + Sync {
    /// `event` of `rank` was applied; `origin` says from where (a stream's batch `seq`).
    fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>);
    /// The stream batch `origin` names is over: every event of it that applied was
    /// handed to [`Self::applied`] (a journal keeps a batch whole or not at all).
    fn batch_end(&self, origin: Origin);
    /// `worker`'s DP ranks `dp_ranks` were cleared (all of its ranks when empty).
    fn cleared(&self, worker: WorkerId, dp_ranks: &[u32]);
    /// `worker` was removed: its ranks' blocks are gone and its streams start afresh if it
    /// comes back.
    fn worker_removed(&self, worker: WorkerId);
}

impl Partition {
    /// Hands every applied event and clear to `log` from now on. A partition has one
    /// log: `false` (and `log` unused) when one is attached already.
    pub fn attach_applied_log(&self, log: StdArc<dyn AppliedLog>) -> bool {
        self.applied_log.set(log).is_ok()
    }

    /// Makes stream `at.stream` of `at.worker_id`, when it is next created (its worker
    /// registered with a KV-event source), go on from the batch `at` names instead of
    /// starting afresh: it asks its publisher (through replay) for that batch, unchanged,
    /// and what followed; a publisher that restarted since shows it, and the stream's ranks
    /// are cleared and re-read (with no batch named, it joins). Its ranks are stale from
    /// this call until the stream has caught up. False when the partition keeps no more
    /// such points (65,536, or the stream bound if higher: a restore runs before the
    /// workers are registered again).
    pub fn resume_stream(&self, at: StreamResume) -> bool {
        self.ingress.set_resume_point(at)
    }

    pub(super) fn log(&self) -> Option<&dyn AppliedLog> {
        self.applied_log.get().map(|l| &**l)
    }
}
