//! Per-publisher sequence tracking: in-order batches apply, a duplicate is dropped, and
//! every way of losing batches ends in a replay (when the publisher has a replay ROUTER)
//! or in a clear of the stream's ranks — never in silently stale state.
//!
//! vLLM numbers its batches from 0 per publisher instance (REFERENCE.md §2). A batch
//! lost on the way (slow joiner, high-water mark) is a gap; a restarted engine starts
//! from 0 again with an empty cache, and the frames cannot tell instances apart. The
//! rules (README's ingress section lists them too):
//!
//! - **join**: the first batch seen has `seq > 0` → replay from 0 (what came before was
//!   never in the index; the replay brings what the publisher still buffers).
//! - **gap**: `seq > last + 1` → replay from `last`, not `last + 1`: the publisher must send
//!   back the batch kvr applied last, unchanged (compared by a digest of its payload),
//!   which proves the replayed range continues what the index holds. Without replay: clear.
//! - **restart**: `seq < last`, or `seq == last` with a different payload → clear, then
//!   replay from 0 (the new instance's first batches may have been missed too).
//!   A replay whose verification fails (the batch at `last` differs, or the publisher's
//!   newest batch is older than `last`) is a restart found through replay: clear, replay
//!   from 0; so is a replayed batch that differs from the batch of its number applied or
//!   held while the replay ran (the old instance answered, then restarted, and its
//!   replay arrives behind the new instance's live batches).
//! - **idle probe** ([`SequenceTracker::on_idle`], called by the transport after a
//!   silence and once right after subscribing): replay from `last` (verified as above) or
//!   from 0 before anything was applied. It finds a gap at the end of a burst, a
//!   restart of an engine that went idle, and everything a late subscriber missed.
//! - a replay that cannot cover the loss (the range is no longer buffered, or it failed or
//!   timed out) clears the stream's ranks and counts the batches lost; the index is then
//!   rebuilt from new events.
//!
//! The tracker is a pure state machine over sequence numbers and payloads; the caller
//! performs the [`Action`]s it returns, in order (apply a batch, clear the stream's ranks,
//! ask the transport for a replay, which supersedes any replay of this stream in flight).
//! While a replay fills a known gap, live batches newer than the gap wait in a buffer and
//! apply after the replayed range; during a probe (no gap known) contiguous live batches
//! apply at once, so a dead replay endpoint never delays the live stream of a stream that
//! has applied anything. A join's live batches (nothing applied yet) wait for the join's
//! replay to end (at most its timeout): nothing could tell them from an old instance's. A live batch
//! past the next expected one during a probe makes the loss known: the probe becomes a
//! gap recovery (counted in `gaps`; if it fails, the stream's ranks are cleared).

use std::collections::BTreeMap;

use xxhash_rust::xxh3::xxh3_64;

/// Why a stream's ranks were cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ClearCause {
    /// Batches were lost and no replay endpoint is configured.
    GapWithoutReplay,
    /// The replay ended (failed, timed out, or the range was no longer buffered) without
    /// filling the gap.
    ReplayIncomplete,
    /// The publisher restarted (its sequence went back, or a batch came back changed).
    Restart,
}

/// What the caller must do, in order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Decode and apply this batch.
    Apply {
        seq: u64,
        payload: Vec<u8>,
        /// The payload's digest (what a resumed stream verifies).
        digest: u64,
    },
    /// Clear the ranks this stream feeds (the index's state for them may be stale).
    Clear(ClearCause),
    /// Ask the publisher to resend from `from_seq` (only returned with replay enabled);
    /// supersedes the stream's replay in flight, if any.
    RequestReplay { from_seq: u64 },
}

/// How a replay ended, as the transport reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayResult {
    /// The end marker arrived.
    Completed,
    /// No end marker in time, or the request failed.
    Failed,
}

/// Counters the tracker keeps (the ingress stats read them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SequenceStats {
    /// Losses found: by a live batch past the next expected one, or by an idle probe that
    /// brought batches the live stream never delivered.
    pub gaps: u64,
    /// New publisher instances found (sequence back, a changed batch, or through replay).
    pub restarts: u64,
    /// Batches received again (already applied) and dropped.
    pub duplicates: u64,
    /// Replays asked of the transport (each is then filled, partial or failed, or
    /// superseded by the next one of the stream).
    pub replays_requested: u64,
    /// Replays that brought everything needed.
    pub replays_filled: u64,
    /// Replays that completed but could not cover the loss (the range was no longer
    /// buffered): the stream's ranks were cleared.
    pub replays_partial: u64,
    /// Replays that failed or timed out before covering the loss (a probe's failure clears
    /// nothing: no loss was known).
    pub replays_failed: u64,
    /// Idle probes started.
    pub idle_probes: u64,
    /// Times the stream's ranks were cleared (a loss that could not be filled, a restart).
    pub clears: u64,
    /// Batches lost for good (their range could not be replayed).
    pub batches_lost: u64,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// A replay is in flight (the stream is recovering, or being probed).
    pub recovering: bool,
}

impl SequenceStats {
    /// Replays that ended without bringing everything needed (partial + failed).
    pub fn replays_incomplete(&self) -> u64 {
        self.replays_partial.saturating_add(self.replays_failed)
    }
}

/// Live batches held back while a replay is in flight, at most this many (beyond, the
/// replay is abandoned: clear and go on live).
const MAX_HELD: usize = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Why {
    /// Nothing applied yet (first batch past 0, or the probe right after subscribing).
    Join,
    /// A live batch past the next expected one.
    Gap,
    /// A new publisher instance, after the clear.
    Restart,
    /// An idle probe: no loss known.
    Probe,
}

struct Replay {
    why: Why,
    /// The batch applied last (seq, payload digest): the publisher must send it back
    /// unchanged before anything newer counts.
    verify: Option<(u64, u64)>,
    /// Verification became impossible (the publisher no longer holds that batch).
    unverified: bool,
    /// The next sequence number the index needs.
    next: u64,
    /// Live batches newer than the loss, waiting for the replay to end; the first of
    /// them is the replay's target (it must reach it).
    held: BTreeMap<u64, Vec<u8>>,
    /// Batches of the needed range were found missing.
    partial: bool,
    /// The replay applied at least one batch.
    applied: bool,
    /// The newest live batch heard (seq, payload digest), from the batch applied last
    /// when the replay began: the live stream never goes back, so a live batch before it
    /// (or at it, changed) is a new publisher instance, as outside a replay.
    live_high: Option<(u64, u64)>,
    /// Digests of the batches applied while this replay ran, replayed or live (at most
    /// `MAX_HELD`): another batch of the same number, from either side, means the
    /// publisher restarted.
    applied_digests: std::collections::HashMap<u64, u64>,
}

impl Replay {
    fn new(
        why: Why,
        verify: Option<(u64, u64)>,
        next: u64,
        held: BTreeMap<u64, Vec<u8>>,
        live_high: Option<(u64, u64)>,
    ) -> Self {
        Replay {
            why,
            verify,
            unverified: false,
            next,
            held,
            partial: false,
            applied: false,
            live_high,
            applied_digests: std::collections::HashMap::new(),
        }
    }

    /// Remembers the digest of a batch applied while the replay runs (bounded).
    fn note_applied(&mut self, seq: u64, d: u64) {
        if self.applied_digests.len() < MAX_HELD {
            self.applied_digests.insert(seq, d);
        }
    }

    /// The first live sequence number held: the replay must reach it.
    fn target(&self) -> Option<u64> {
        self.held.keys().next().copied()
    }
}

/// The sequence state of one publisher (one worker's PUB endpoint or topic).
pub(crate) struct SequenceTracker {
    replay_enabled: bool,
    /// The last applied batch: its seq and the digest of its payload.
    last: Option<(u64, u64)>,
    replay: Option<Replay>,
    stats: SequenceStats,
    /// Losses for good, counted once each (wrapping): `batches_lost` saturates, so a
    /// loss after it is full must still be seen (`loss_events`).
    losses: u64,
    /// Resumed from a previous run ([`SequenceTracker::resumed`]) and not yet confirmed:
    /// what the index holds may be older than the publisher (batches sent while kvr was
    /// down), so the stream is stale until its replay covers that (or it is cleared).
    resumed: bool,
}

impl std::fmt::Debug for SequenceTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceTracker")
            .field("replay_enabled", &self.replay_enabled)
            .field("last", &self.last)
            .field("replaying", &self.replay.as_ref().map(|r| r.why))
            .field("stats", &self.stats)
            .finish()
    }
}

fn digest(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

impl SequenceTracker {
    /// A tracker for a publisher whose lost batches can (`replay_enabled`) or cannot be
    /// requested again.
    pub(crate) fn new(replay_enabled: bool) -> Self {
        SequenceTracker {
            replay_enabled,
            last: None,
            replay: None,
            stats: SequenceStats::default(),
            losses: 0,
            resumed: false,
        }
    }

    /// A tracker for a publisher whose batch `last.0` (payload digest `last.1`) a previous
    /// run applied last (a warm restart; `None`: its ranks hold a peer's dump, no batch
    /// known: it joins, and stays stale until its join replay ends, as the replay brings
    /// history older than the dump): it goes on as a stream that applied that batch
    /// and went silent — the probe after subscribing asks for a replay from it, which the
    /// publisher must send back unchanged (else a restart: clear, replay from 0); without
    /// replay, only the very next batch continues it (anything else clears). Until then
    /// it is stale (`stale`): the publisher may have gone on while kvr was down, so the
    /// probe's replay must cover what followed, as a gap's must, or the ranks are cleared.
    pub(crate) fn resumed(replay_enabled: bool, last: Option<(u64, u64)>) -> Self {
        SequenceTracker {
            last,
            resumed: true,
            ..Self::new(replay_enabled)
        }
    }

    /// How many losses for good the tracker has seen (wrapping): a change between two
    /// reads means state went missing in between.
    pub(crate) fn loss_events(&self) -> u64 {
        self.losses
    }

    pub(crate) fn stats(&self) -> SequenceStats {
        SequenceStats {
            last_seq: self.last.map(|l| l.0),
            recovering: self.replay.is_some(),
            ..self.stats
        }
    }

    /// Whether what the index holds from this stream may be stale: a loss is known (live
    /// batches past it wait for the replay) and batches applied before it stay counted,
    /// though the lost ones may have evicted some of their blocks. Ends when the replay
    /// fills the loss or the stream's ranks are cleared (`crate::freshness`).
    pub(crate) fn stale(&self) -> bool {
        self.resumed
            || (self.last.is_some() && self.replay.as_ref().is_some_and(|r| !r.held.is_empty()))
    }

    /// Whether a replay is in flight (its batches are expected through
    /// [`SequenceTracker::on_replayed`]).
    pub(crate) fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    fn clear(&mut self, cause: ClearCause, out: &mut Vec<Action>) {
        self.resumed = false;
        self.stats.clears += 1;
        out.push(Action::Clear(cause));
    }

    fn apply(&mut self, seq: u64, payload: Vec<u8>, out: &mut Vec<Action>) {
        let d = digest(&payload);
        self.apply_digested(seq, payload, d, out);
    }

    /// [`Self::apply`] of a batch whose digest is known.
    fn apply_digested(&mut self, seq: u64, payload: Vec<u8>, d: u64, out: &mut Vec<Action>) {
        self.last = Some((seq, d));
        out.push(Action::Apply {
            seq,
            payload,
            digest: d,
        });
    }

    fn lose(&mut self, n: u64) {
        self.stats.batches_lost = self.stats.batches_lost.saturating_add(n);
        if n > 0 {
            self.losses = self.losses.wrapping_add(1);
        }
    }

    /// Starts a replay from `from` (superseding the transport's replay in flight).
    fn start_replay(
        &mut self,
        why: Why,
        from: u64,
        held: Option<(u64, &[u8])>,
        out: &mut Vec<Action>,
    ) {
        let verify = match why {
            Why::Gap | Why::Probe => self.last,
            Why::Join | Why::Restart => None,
        };
        let next = verify.map_or(from, |v| v.0.wrapping_add(1));
        let live_high = held.map(|(seq, p)| (seq, digest(p))).or(self.last);
        let held = held.map(|(seq, p)| (seq, p.to_vec())).into_iter().collect();
        self.replay = Some(Replay::new(why, verify, next, held, live_high));
        self.stats.replays_requested += 1;
        out.push(Action::RequestReplay { from_seq: from });
    }

    /// A new publisher instance: clear, then apply `seq` or replay from 0 first.
    fn restart(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        // A replay of the old instance in flight is abandoned (the transport's next
        // request supersedes it; its late batches find no replay and are ignored).
        self.replay = None;
        self.stats.restarts += 1;
        self.clear(ClearCause::Restart, out);
        self.last = None;
        if self.replay_enabled && seq > 0 {
            self.start_replay(Why::Restart, 0, Some((seq, payload)), out);
        } else {
            self.apply(seq, payload.to_vec(), out);
        }
    }

    /// A restart found through the replay in flight: clear, and replay from 0 instead
    /// (the held live batches stay held).
    fn restart_found(&mut self, out: &mut Vec<Action>) {
        self.stats.restarts += 1;
        self.clear(ClearCause::Restart, out);
        self.last = None;
        let Some(old) = self.replay.take() else {
            return;
        };
        self.replay = Some(Replay::new(Why::Restart, None, 0, old.held, old.live_high));
        self.stats.replays_requested += 1;
        out.push(Action::RequestReplay { from_seq: 0 });
    }

    /// A live batch whose first event clears the publisher's whole cache
    /// (`AllBlocksCleared`): a **fence**. Nothing the publisher sent before it matters to
    /// the index any more, so a loss or a restart it ends is not replayed: the stream's
    /// ranks are cleared (a lost batch may have fed a rank this one does not clear) and the
    /// batch applies, its number the last applied. vLLM sends this first when an engine
    /// resets its prefix cache and when one is restored from a checkpoint, whose numbers go
    /// on from the checkpoint's (so "the sequence went back" no longer tells every new
    /// instance). In sequence, or a duplicate, it is an ordinary live batch.
    pub(crate) fn on_fence(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        let ordinary = self.replay.is_none()
            && match self.last {
                None => seq == 0 || !self.replay_enabled,
                Some((last, d)) => {
                    seq == last.wrapping_add(1) || (seq == last && digest(payload) == d)
                }
            };
        if ordinary {
            return self.on_live(seq, payload, out);
        }
        out.clear();
        match self.last {
            Some((last, _)) if seq <= last => self.stats.restarts += 1,
            Some(_) => self.stats.gaps += 1,
            None => {}
        }
        // A replay in flight is abandoned (its late batches find none and are ignored;
        // the clear tells the transport to drop it); its held live batches are older than
        // this one (the live stream never goes back but for a restart, which this is then).
        self.replay = None;
        self.clear(ClearCause::Restart, out);
        self.apply(seq, payload.to_vec(), out);
    }

    /// A live batch. Returns the actions to perform in `out` (cleared first).
    pub(crate) fn on_live(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        out.clear();
        if !self.replay_enabled {
            // Without replay the first live batch is all the evidence there will be: it
            // continues the resumed stream, or it clears it.
            self.resumed = false;
        }
        if let Some(r) = &mut self.replay {
            // One digest of the batch serves every comparison below and its apply.
            let d = digest(payload);
            match r.live_high {
                Some((high, hd)) if seq < high || (seq == high && d != hd) => {
                    // Back before the newest live batch: a new instance (found by the
                    // fuzz target `recovery`: taken for a duplicate, it went unnoticed).
                    return self.restart(seq, payload, out);
                }
                Some((high, _)) if seq == high => {
                    self.stats.duplicates += 1;
                    return;
                }
                _ => r.live_high = Some((seq, d)),
            }
            if r.applied_digests.get(&seq).is_some_and(|&b| b != d) {
                // Another batch than the one the replay brought under this number.
                return self.restart(seq, payload, out);
            }
            if seq < r.next && !r.applied_digests.contains_key(&seq) {
                // Below what the replay applied, and not a batch it brought (one it found
                // missing): the live stream never goes back, so a new publisher instance
                // (found by the fuzz target `recovery`: the old instance's replay went on
                // applying after the new instance's batch 0 was taken for a duplicate).
                return self.restart(seq, payload, out);
            }
            if seq < r.next {
                // The replay brought it already.
                self.stats.duplicates += 1;
            } else if r.held.is_empty() && seq == r.next && r.why != Why::Join {
                // No gap is known (a probe): contiguous live batches apply at once; a
                // failed verification later clears them anyway. Not during a join: with
                // nothing applied there is nothing to verify a live batch against, and a
                // join replay answered by an old publisher instance that then restarted
                // could not be told from the new instance's first batches (found by the
                // fuzz target `recovery`: the new batch 0 applied, the old 1 and 2
                // replayed after it). The join's live batches wait for its replay to end.
                r.next = seq.wrapping_add(1);
                r.note_applied(seq, d);
                self.apply_digested(seq, payload.to_vec(), d, out);
            } else if r.held.len() >= MAX_HELD {
                // The replay is not keeping up: give it up (clear, apply what was held),
                // then take this batch as live.
                let mut ended = Vec::new();
                self.on_replay_end(ReplayResult::Failed, &mut ended);
                out.append(&mut ended);
                let mut more = Vec::new();
                self.on_live(seq, payload, &mut more);
                out.append(&mut more);
            } else {
                if r.held.is_empty() && r.why == Why::Probe {
                    // A live batch past the next expected one during a probe: a loss is
                    // now known, so the probe is a gap recovery (a failure clears).
                    r.why = Why::Gap;
                    self.stats.gaps += 1;
                }
                r.held.entry(seq).or_insert_with(|| payload.to_vec());
            }
            return;
        }
        match self.last {
            None if seq > 0 && self.replay_enabled => {
                // First batch seen. What came before was never in the index (nothing is
                // stale); a publisher with a replay buffer is asked for what it holds.
                self.start_replay(Why::Join, 0, Some((seq, payload)), out);
            }
            None => self.apply(seq, payload.to_vec(), out),
            Some((last, _)) if seq == last.wrapping_add(1) => {
                self.apply(seq, payload.to_vec(), out)
            }
            Some((last, d)) if seq == last => {
                if digest(payload) == d {
                    self.stats.duplicates += 1;
                } else {
                    // Same number, other content: a new instance that got this far.
                    self.restart(seq, payload, out);
                }
            }
            Some((last, _)) if seq < last => self.restart(seq, payload, out),
            Some((last, _)) => {
                self.stats.gaps += 1;
                if self.replay_enabled {
                    self.start_replay(Why::Gap, last, Some((seq, payload)), out);
                } else {
                    self.lose(seq - last - 1);
                    self.clear(ClearCause::GapWithoutReplay, out);
                    self.apply(seq, payload.to_vec(), out);
                }
            }
        }
    }

    /// No live batch for a while (or the subscription just started): with replay
    /// enabled and no replay in flight, probe the publisher (replay from the last applied
    /// batch, verified, or from 0 before any).
    pub(crate) fn on_idle(&mut self, out: &mut Vec<Action>) {
        out.clear();
        if !self.replay_enabled || self.replay.is_some() {
            return;
        }
        self.stats.idle_probes += 1;
        match self.last {
            None => self.start_replay(Why::Join, 0, None, out),
            Some((last, _)) => self.start_replay(Why::Probe, last, None, out),
        }
    }

    /// A batch of the replay in flight (ignored if none is, or if it is not needed).
    pub(crate) fn on_replayed(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        out.clear();
        let Some(r) = &mut self.replay else {
            return;
        };
        if let Some((vseq, vdigest)) = r.verify {
            if seq < vseq {
                return;
            }
            r.verify = None;
            if seq == vseq {
                if digest(payload) != vdigest {
                    self.restart_found(out);
                }
                return;
            }
            // The publisher no longer holds the batch to verify: whether it restarted
            // cannot be told, so what the index holds is not trusted.
            r.unverified = true;
        }
        if seq < r.next {
            // Already applied: the same batch, or the publisher restarted after answering
            // (its old instance's replay arrives behind the new instance's live batches;
            // found by the fuzz target `recovery`: taken for what was applied, the old
            // batches after it overcounted).
            if r.applied_digests
                .get(&seq)
                .is_some_and(|&b| b != digest(payload))
            {
                self.restart_found(out);
            }
            return;
        }
        if r.target().is_some_and(|t| seq >= t) {
            // At or past the first held live batch: a live batch will (or did) bring it.
            // If one is held under this number, it must be the same batch (else the
            // publisher restarted, as above). One the live stream lost between held
            // batches is not taken from the replay: nothing ties the replay to the live
            // batches' instance there (the old instance's would fill the hole).
            if r.held
                .get(&seq)
                .is_some_and(|p| digest(p) != digest(payload))
            {
                self.restart_found(out);
            }
            return;
        }
        let missing = seq - r.next;
        let unverified = std::mem::take(&mut r.unverified);
        let why = r.why;
        let first = !r.applied;
        r.applied = true;
        r.next = seq.wrapping_add(1);
        if missing > 0 || unverified {
            // [next, seq) is no longer buffered: lost for good. Clear now (before applying
            // anything newer) unless nothing was applied since the join or the restart.
            r.partial = true;
            self.lose(missing);
            if self.last.is_some() {
                self.clear(ClearCause::ReplayIncomplete, out);
            }
        }
        if why == Why::Probe && first {
            // The live stream lost these batches (a gap at the end of a burst).
            self.stats.gaps += 1;
        }
        let d = digest(payload);
        if let Some(r) = &mut self.replay {
            r.note_applied(seq, d);
        }
        self.apply_digested(seq, payload.to_vec(), d, out);
    }

    /// The replay in flight ended: verify, count, then apply the held live batches in
    /// order (clearing first if the loss was not covered).
    pub(crate) fn on_replay_end(&mut self, result: ReplayResult, out: &mut Vec<Action>) {
        out.clear();
        if result == ReplayResult::Completed
            && self.replay.as_ref().is_some_and(|r| r.verify.is_some())
        {
            // The end marker before the batch to verify: the publisher's newest batch is
            // older than the one applied last. It restarted.
            self.restart_found(out);
            return;
        }
        let Some(r) = self.replay.take() else {
            return;
        };
        let target = r.target();
        let covered = target.is_none_or(|t| r.next >= t) && r.verify.is_none();
        let mut partial = r.partial;
        // A probe knows of no loss, unless the live stream skipped ahead meanwhile (a held
        // batch): then the hole before it must be covered like a gap's.
        // A resumed stream's probe must cover what the publisher sent while kvr was down.
        if !covered && (r.why != Why::Probe || self.resumed) {
            partial = true;
            self.lose(target.map_or(0, |t| t.wrapping_sub(r.next)));
            if self.last.is_some() {
                self.clear(ClearCause::ReplayIncomplete, out);
            }
        }
        // Filled: completed, or failed after covering a known loss; a failed replay with
        // nothing to cover (a join or probe that heard nothing back) brought nothing.
        let filled = covered && !partial && (result == ReplayResult::Completed || target.is_some());
        self.resumed = false;
        match result {
            _ if filled => self.stats.replays_filled += 1,
            ReplayResult::Completed => self.stats.replays_partial += 1,
            ReplayResult::Failed => self.stats.replays_failed += 1,
        }
        let mut expect = target;
        for (seq, payload) in r.held {
            if let Some(e) = expect.filter(|&e| e != seq) {
                // A gap among the held live batches: the replay covered only the first.
                self.stats.gaps += 1;
                self.lose(seq - e);
                self.clear(ClearCause::GapWithoutReplay, out);
            }
            // Wrapping: a held batch may carry seq u64::MAX (the next expected is 0).
            expect = Some(seq.wrapping_add(1));
            self.apply(seq, payload, out);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
