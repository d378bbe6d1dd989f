//! One stream: a publisher's sequence of batches (one engine process: one DP rank's PUB
//! socket in vLLM, which numbers each socket's batches from 0) into a sink. Its sequence
//! tracker decides what to apply, clear or replay (`sequence`); each batch it applies goes
//! through the door: decoded and counted here, then translated and applied event by event.
//!
//! A batch's events apply to rank `(worker, data_parallel_rank)`, or `(worker, stream)`
//! when the batch names no rank; a batch naming a rank the worker does not have is refused
//! whole and counted. A batch that fails to decode applies nothing and is counted by cause,
//! and the ranks the stream fed are cleared: whatever it held (a removal, a clear) is
//! unknown, and an index that kept blocks the engine dropped would overcount.

use smallvec::SmallVec;

use crate::ids::{RankId, WorkerId};
use crate::index::{KvEvent, StoredBlock};

use super::counters::{now_unix_ms, StreamCounters};
use super::decode::{decode_batch, starts_with_clear, DecodedBatch};
use super::door::{Door, EventSink, EventsOutcome, IngestOutcome};
use super::groups::GroupRouting;
use super::health::{HealthFlags, HealthReason};
use super::sequence::{Action, ReplayResult, SequenceStats, SequenceTracker};
use super::translate::{translate, translate_state, SinkShape, Skips};

/// The state of one stream: its sequence tracker, reusable decode buffers, its counters.
pub(crate) struct IngressStream {
    worker_id: WorkerId,
    stream: u32,
    tracker: SequenceTracker,
    batch: DecodedBatch,
    blocks: Vec<StoredBlock>,
    actions: Vec<Action>,
    /// DP ranks this stream's batches named (a clear clears these).
    ranks_seen: Vec<u32>,
    groups: GroupRouting,
    stats: StreamCounters,
    /// Since when this stream is stale, and how many of `ranks_seen` were listed then.
    stale: Option<(u64, usize)>,
    /// What its health depends on beyond the tracker (`health`).
    health: HealthFlags,
}

impl std::fmt::Debug for IngressStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngressStream")
            .field("worker_id", &self.worker_id)
            .field("stream", &self.stream)
            .field("ranks_seen", &self.ranks_seen)
            .finish_non_exhaustive()
    }
}

impl IngressStream {
    /// A stream of `worker_id`'s batches into `sink` (registered for its stats), which
    /// can (`replay`) or cannot ask its publisher to resend lost batches.
    pub(crate) fn new(
        sink: &(impl EventSink + ?Sized),
        worker_id: WorkerId,
        stream: u32,
        replay: bool,
    ) -> Self {
        let resume = sink.resume_point(worker_id, stream);
        let mut s = IngressStream {
            worker_id,
            stream,
            tracker: match &resume {
                Some(r) => SequenceTracker::resumed(replay, r.last),
                None => SequenceTracker::new(replay),
            },
            batch: DecodedBatch::default(),
            blocks: Vec::new(),
            actions: Vec::new(),
            ranks_seen: resume.map(|r| r.dp_ranks).unwrap_or_default(),
            groups: GroupRouting::default(),
            stats: sink.register_stream(worker_id, stream),
            stale: None,
            health: HealthFlags::default(),
        };
        // A resumed stream's ranks are stale from the start, until its replay covers what
        // the publisher sent while kvr was down; its health says so from the start too (a
        // reader between creation and the first probe would otherwise see it exact).
        s.note_freshness(sink);
        s.note_health();
        s
    }

    /// A live message.
    pub(crate) fn on_live<S: EventSink + ?Sized>(
        &mut self,
        door: &Door<'_, S>,
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        self.note_message(payload.len());
        if starts_with_clear(payload) {
            return self.track(door, |t, out| t.on_fence(seq, payload, out));
        }
        self.track(door, |t, out| t.on_live(seq, payload, out))
    }

    /// A replayed message (of the replay requested last).
    pub(crate) fn on_replayed<S: EventSink + ?Sized>(
        &mut self,
        door: &Door<'_, S>,
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        self.note_message(payload.len());
        self.track(door, |t, out| t.on_replayed(seq, payload, out))
    }

    /// The stream has been silent for a while (or was just subscribed): probe the
    /// publisher through replay (nothing without replay or while a replay runs).
    /// `replay_from` says what to ask for.
    pub(crate) fn on_idle<S: EventSink + ?Sized>(&mut self, door: &Door<'_, S>) -> IngestOutcome {
        self.track(door, |t, out| t.on_idle(out))
    }

    /// The replay ended.
    pub(crate) fn on_replay_end<S: EventSink + ?Sized>(
        &mut self,
        door: &Door<'_, S>,
        result: ReplayResult,
    ) -> IngestOutcome {
        self.track(door, |t, out| t.on_replay_end(result, out))
    }

    /// The stream's number (its counters' `stream`).
    pub(crate) fn stream(&self) -> u32 {
        self.stream
    }

    /// Whether a replay is in flight for this stream.
    pub(crate) fn replaying(&self) -> bool {
        self.tracker.replaying()
    }

    /// A message the transport could not parse into frames.
    pub(crate) fn on_bad_frame(&mut self) {
        self.stats.0.lock().bad_frames += 1;
    }

    /// Runs one step of the sequence tracker and performs the actions it returns (in a
    /// buffer kept across calls) through the sink's door.
    fn track<S: EventSink + ?Sized>(
        &mut self,
        door: &Door<'_, S>,
        step: impl FnOnce(&mut SequenceTracker, &mut Vec<Action>),
    ) -> IngestOutcome {
        let mut actions = std::mem::take(&mut self.actions);
        // Before the step: what it counts (batches lost for good) decides the health.
        let before = self.tracker.stats();
        let losses = self.tracker.loss_events();
        step(&mut self.tracker, &mut actions);
        #[cfg(loom)]
        if crate::sync::faults::get().unlist_before_repair {
            self.note_freshness(door.sink());
        }
        let out = self.perform(door, &mut actions, before, losses);
        self.actions = actions;
        out
    }

    fn note_message(&self, bytes: usize) {
        let mut s = self.stats.0.lock();
        s.messages += 1;
        s.bytes += bytes as u64;
    }

    fn perform<S: EventSink + ?Sized>(
        &mut self,
        door: &Door<'_, S>,
        actions: &mut Vec<Action>,
        sequence: SequenceStats,
        losses: u64,
    ) -> IngestOutcome {
        let mut out = IngestOutcome::default();
        for a in actions.drain(..) {
            match a {
                Action::Apply {
                    payload,
                    seq,
                    digest,
                } => {
                    let door = door.for_batch(self.worker_id, self.stream, seq, digest);
                    let applied = self.apply_batch(&door, &payload);
                    door.sink().batch_end(door.origin());
                    if applied {
                        out.batches_applied += 1;
                    } else {
                        out.decode_errors += 1;
                        clear_fed_ranks(door.sink(), self.worker_id, &self.ranks_seen);
                        out.clears += 1;
                    }
                    // A batch that applies repairs a clear and a reconnection; one that
                    // does not decode is lost.
                    self.health.decode_failed = !applied;
                    self.health.cleared &= !applied;
                    self.health.relinked &= !applied;
                }
                Action::Clear(_) => {
                    clear_fed_ranks(door.sink(), self.worker_id, &self.ranks_seen);
                    out.clears += 1;
                }
                Action::RequestReplay { from_seq } => out.replay_from = Some(from_seq),
            }
        }
        let after = self.tracker.stats();
        // Batches lost without a replay to bring them back: the clear left state missing.
        // (Counted by events: the batch count saturates, and a publisher can fill it.)
        self.health.cleared |= self.tracker.loss_events() != losses;
        if after.replays_filled > sequence.replays_filled {
            self.health.relinked = false;
        }
        self.note_freshness(door.sink());
        self.note_health();
        self.stats.0.lock().sequence = after;
        out
    }

    /// The transport reached the publisher (`None`) or could not (`Some`, a dead reason).
    /// After a reconnection the stream stays degraded until a batch applies or a replay
    /// fills: messages sent meanwhile were lost.
    pub(crate) fn on_link(&mut self, sink: &(impl EventSink + ?Sized), down: Option<HealthReason>) {
        match (self.health.link_down, down) {
            (_, Some(r)) => {
                self.stats.0.lock().link_failures += 1;
                self.health.link_down = Some(r);
            }
            (Some(_), None) => {
                self.health.link_down = None;
                self.health.relinked = !self.ranks_seen.is_empty();
            }
            (None, None) => return,
        }
        self.note_freshness(sink);
        self.note_health();
    }

    /// Whether nothing was heard for longer than the source's silence bound.
    pub(crate) fn on_silence(&mut self, sink: &(impl EventSink + ?Sized), silent: bool) {
        if self.health.silent != silent {
            self.health.silent = silent;
            self.note_freshness(sink);
            self.note_health();
        }
    }

    /// Whether the stream is marked silent.
    pub(crate) fn silent(&self) -> bool {
        self.health.silent
    }

    /// The stream's health now (`health`).
    fn reason(&self) -> HealthReason {
        self.health
            .reason(self.tracker.stale(), self.tracker.replaying())
    }

    /// Publishes the health to the stats, with the time it changed.
    fn note_health(&self) {
        let reason = self.reason();
        let mut s = self.stats.0.lock();
        if s.health_reason != reason {
            s.health = reason.health();
            s.health_reason = reason;
            s.health_since_unix_ms = now_unix_ms();
        }
    }

    /// Lists or unlists the stream's ranks as stale (after the actions: an unlisting
    /// follows the repair it waited for, `crate::freshness`).
    fn note_freshness(&mut self, sink: &(impl EventSink + ?Sized)) {
        let n = self.ranks_seen.len();
        // A known loss, and any degraded or dead state: the ranks' state may be missing.
        let stale = self.tracker.stale() || self.reason().may_overcount();
        match (stale, self.stale) {
            (true, Some((_, listed))) if listed == n => {}
            (true, since) => {
                let t = since.map_or_else(now_unix_ms, |s| s.0);
                sink.mark_stale(self.worker_id, &self.ranks_seen, Some(t));
                self.stale = Some((t, n));
                self.stats.0.lock().stale_since_unix_ms = t;
            }
            (false, Some(_)) => {
                sink.mark_stale(self.worker_id, &self.ranks_seen, None);
                self.stale = None;
                self.stats.0.lock().stale_since_unix_ms = 0;
            }
            (false, None) => {}
        }
    }

    /// The door's first step, decode and count: `false` if the payload did not decode
    /// (nothing applied, the cause counted).
    fn decode_counted(&mut self, payload: &[u8]) -> bool {
        let Err(e) = decode_batch(payload, &mut self.batch) else {
            return true;
        };
        let mut s = self.stats.0.lock();
        if let Some(c) = s.decode_errors.iter_mut().find(|c| c.0 == e.kind.name()) {
            c.1 += 1;
        }
        false
    }

    /// The rank the decoded batch applies to, or `None` when the sink refuses its DP rank
    /// (the whole batch counted as rejected).
    fn batch_rank(&mut self, sink: &(impl EventSink + ?Sized)) -> Option<RankId> {
        let dp = self.batch.data_parallel_rank.unwrap_or(self.stream);
        if !sink.accepts_dp_rank(self.worker_id, dp) {
            let n = self.batch.events.len() as u64;
            let mut s = self.stats.0.lock();
            s.batches += 1;
            s.events += n;
            s.events_rejected += n;
            s.dp_rank_refused += 1;
            s.last_batch_unix_ms = now_unix_ms();
            return None;
        }
        if !self.ranks_seen.contains(&dp) {
            self.ranks_seen.push(dp);
        }
        Some(RankId::new(self.worker_id, dp))
    }

    /// One batch through the door: decoded and counted, then each event translated and
    /// applied; `false` if it did not decode.
    fn apply_batch<S: EventSink + ?Sized>(&mut self, door: &Door<'_, S>, payload: &[u8]) -> bool {
        if !self.decode_counted(payload) {
            return false;
        }
        let Some(rank) = self.batch_rank(door.sink()) else {
            return true;
        };
        let sink = door.sink();
        let accepts_lookahead = |len| sink.accepts_lookahead(len);
        let shape = SinkShape {
            block_size: sink.block_size(),
            namespace: sink.cache_namespace(),
            accepts_lookahead: &accepts_lookahead,
        };
        let (mut applied, mut skips) = (EventsOutcome::default(), Skips::default());
        // Blocks of tokenless stores the rank held on no tier (left out).
        let mut tokenless_unknown = 0;
        // Recurrent groups' events, applied after the rest (`translate_state`).
        let mut states: SmallVec<[u32; 8]> = SmallVec::new();
        for (i, ev) in self.batch.events.iter().enumerate() {
            let t = translate(
                ev,
                &self.batch,
                shape,
                &mut self.groups,
                &mut self.blocks,
                &mut skips,
            );
            if t.clear_first {
                clear_fed_ranks(door.sink(), self.worker_id, &self.ranks_seen);
            }
            if t.state {
                states.push(i as u32);
            }
            if let Some(event) = t.event {
                let unknown = applied.blocks_not_found;
                door.apply(rank, &event, &mut applied);
                if let KvEvent::StoredKnown { .. } = event {
                    tokenless_unknown += applied.blocks_not_found - unknown;
                    applied.blocks_not_found = unknown;
                }
            }
        }
        for &i in &states {
            let ev = &self.batch.events[i as usize];
            let Some(event) = translate_state(ev, &self.batch) else {
                // A store of a group known as recurrent that still reads as blocks (it
                // changed its kind): neither blocks nor a state, skipped as its group's.
                skips.group += 1;
                continue;
            };
            // States are not blocks: only what was left out is counted, as for a tokenless
            // store (names of blocks the rank does not hold).
            let before = applied;
            door.apply(rank, &event, &mut applied);
            if let KvEvent::StatesStored { .. } = event {
                tokenless_unknown += applied.blocks_not_found - before.blocks_not_found;
            }
            applied.blocks_stored = before.blocks_stored;
            applied.blocks_removed = before.blocks_removed;
            applied.blocks_not_found = before.blocks_not_found;
        }
        let mut s = self.stats.0.lock();
        s.batches += 1;
        s.events += self.batch.events.len() as u64;
        s.blocks_stored += applied.blocks_stored;
        s.blocks_removed += applied.blocks_removed;
        s.events_rejected += applied.rejected;
        s.block_size_mismatches += skips.block_size;
        s.events_skipped_group += skips.group;
        s.events_skipped_medium += skips.medium;
        s.events_skipped_malformed += skips.malformed;
        s.tokenless_blocks_unknown += tokenless_unknown;
        s.group_switches += skips.group_switches;
        s.last_batch_unix_ms = now_unix_ms();
        true
    }
}

/// Clears the ranks a stream fed (`fed`, the DP ranks its batches named), and only those:
/// another stream of the worker (its other DP ranks) keeps its state. A stream that
/// applied nothing holds nothing.
fn clear_fed_ranks(sink: &(impl EventSink + ?Sized), worker: WorkerId, fed: &[u32]) {
    if !fed.is_empty() {
        sink.clear_ranks(worker, fed);
    }
}
