//! Per-publisher sequence tracking: in-order batches apply, a gap asks for a replay (or
//! clears the worker), a restart clears the worker, a duplicate is dropped.
//!
//! vLLM numbers its batches from 0 per publisher instance (REFERENCE.md §2). A batch
//! lost on the way (slow joiner, high-water mark) is a gap; a restarted engine starts
//! from 0 again with an empty cache. kvr never keeps state it knows may be stale: a gap
//! it cannot fill means the worker's ranks are cleared and rebuilt from new events.
//!
//! The tracker is a pure state machine over sequence numbers and payloads; the caller
//! performs the [`Action`]s it returns, in order (apply a batch, clear the worker, ask
//! the transport for a replay). Replayed batches and live batches that arrive while a
//! replay runs are ordered here: live ones newer than the gap wait in a buffer and apply
//! after the replayed range.

use std::collections::BTreeMap;

/// Why a worker's ranks were cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClearCause {
    /// Batches were lost and no replay endpoint is configured.
    GapWithoutReplay,
    /// The replay ended (failed, timed out, or the range was no longer buffered) without
    /// filling the gap.
    ReplayIncomplete,
    /// The publisher restarted (its sequence went back).
    Restart,
}

/// What the caller must do, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Decode and apply this batch.
    Apply { seq: u64, payload: Vec<u8> },
    /// Clear every rank of the worker (the index's state for it may be stale).
    Clear(ClearCause),
    /// Ask the publisher to resend from `from_seq` (only returned with replay enabled).
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
    pub gaps: u64,
    pub restarts: u64,
    pub duplicates: u64,
    pub replays_requested: u64,
    pub replays_filled: u64,
    pub replays_incomplete: u64,
    pub clears: u64,
    /// Batches lost for good (their range could not be replayed).
    pub batches_lost: u64,
    pub last_seq: Option<u64>,
}

/// Live batches held back while a replay is in flight, at most this many (beyond, the
/// replay is abandoned: clear and go on live).
const MAX_HELD: usize = 100_000;

struct Replay {
    /// The next sequence number the index needs.
    next: u64,
    /// The first live sequence number seen after the gap (replay must reach it).
    target: u64,
    /// Live batches with seq >= target, waiting for the replay to end.
    held: BTreeMap<u64, Vec<u8>>,
}

/// The sequence state of one publisher (one worker's PUB endpoint or topic).
pub struct SequenceTracker {
    replay_enabled: bool,
    last: Option<u64>,
    replay: Option<Replay>,
    stats: SequenceStats,
}

impl std::fmt::Debug for SequenceTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceTracker")
            .field("replay_enabled", &self.replay_enabled)
            .field("last", &self.last)
            .field("replaying", &self.replay.is_some())
            .field("stats", &self.stats)
            .finish()
    }
}

impl SequenceTracker {
    /// A tracker for a publisher whose lost batches can (`replay_enabled`) or cannot be
    /// requested again.
    pub fn new(replay_enabled: bool) -> Self {
        SequenceTracker {
            replay_enabled,
            last: None,
            replay: None,
            stats: SequenceStats::default(),
        }
    }

    pub fn stats(&self) -> SequenceStats {
        SequenceStats {
            last_seq: self.last,
            ..self.stats
        }
    }

    /// Whether a replay is in flight (its batches are expected through
    /// [`SequenceTracker::on_replayed`]).
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    fn clear(&mut self, cause: ClearCause, out: &mut Vec<Action>) {
        self.stats.clears += 1;
        out.push(Action::Clear(cause));
    }

    /// A live batch. Returns the actions to perform in `out` (cleared first).
    pub fn on_live(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        out.clear();
        if let Some(r) = &mut self.replay {
            if seq < r.next {
                self.stats.duplicates += 1;
            } else if r.held.len() >= MAX_HELD {
                // The replay is not keeping up: give it up (clear, apply what was held),
                // then take this batch as live.
                let mut ended = Vec::new();
                self.on_replay_end(ReplayResult::Failed, &mut ended);
                out.append(&mut ended);
                self.on_live_after_replay(seq, payload, out);
            } else {
                r.target = r.target.min(seq);
                r.held.entry(seq).or_insert_with(|| payload.to_vec());
            }
            return;
        }
        match self.last {
            None => {
                // First batch seen. What came before we subscribed is unknowable (and was
                // never in our index, so nothing is stale); a publisher with a replay
                // buffer is asked for what it still holds.
                self.last = Some(seq);
                if seq > 0 && self.replay_enabled {
                    self.start_replay(0, seq, payload, out);
                    return;
                }
                out.push(Action::Apply {
                    seq,
                    payload: payload.to_vec(),
                });
            }
            Some(last) if seq == last.wrapping_add(1) => {
                self.last = Some(seq);
                out.push(Action::Apply {
                    seq,
                    payload: payload.to_vec(),
                });
            }
            Some(last) if seq == last => {
                self.stats.duplicates += 1;
            }
            Some(last) if seq < last => {
                // Sequence went back: a new publisher instance with an empty cache.
                self.stats.restarts += 1;
                self.clear(ClearCause::Restart, out);
                self.last = Some(seq);
                out.push(Action::Apply {
                    seq,
                    payload: payload.to_vec(),
                });
            }
            Some(last) => {
                self.stats.gaps += 1;
                self.last = Some(seq);
                if self.replay_enabled {
                    self.start_replay(last + 1, seq, payload, out);
                } else {
                    self.stats.batches_lost =
                        self.stats.batches_lost.saturating_add(seq - last - 1);
                    self.clear(ClearCause::GapWithoutReplay, out);
                    out.push(Action::Apply {
                        seq,
                        payload: payload.to_vec(),
                    });
                }
            }
        }
    }

    /// [`SequenceTracker::on_live`] without clearing `out` (appends).
    fn on_live_after_replay(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        let mut more = Vec::new();
        self.on_live(seq, payload, &mut more);
        out.append(&mut more);
    }

    fn start_replay(&mut self, from: u64, seen: u64, payload: &[u8], out: &mut Vec<Action>) {
        let mut held = BTreeMap::new();
        held.insert(seen, payload.to_vec());
        self.replay = Some(Replay {
            next: from,
            target: seen,
            held,
        });
        self.stats.replays_requested += 1;
        out.push(Action::RequestReplay { from_seq: from });
    }

    /// A batch of the replay in flight (ignored if none is, or if it is not needed).
    pub fn on_replayed(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        out.clear();
        let Some(r) = &mut self.replay else {
            return;
        };
        if seq < r.next || seq >= r.target {
            // Already applied, or a live batch will (or did) bring it.
            return;
        }
        if seq > r.next {
            // The publisher no longer holds [next, seq): lost for good. Clear now (before
            // applying anything newer), then continue from here.
            self.stats.batches_lost = self.stats.batches_lost.saturating_add(seq - r.next);
            r.next = seq;
            self.stats.clears += 1;
            out.push(Action::Clear(ClearCause::ReplayIncomplete));
        }
        out.push(Action::Apply {
            seq,
            payload: payload.to_vec(),
        });
        if let Some(r) = &mut self.replay {
            r.next = seq + 1;
        }
    }

    /// The replay in flight ended: apply the held live batches in order (clearing first
    /// if the gap was not filled).
    pub fn on_replay_end(&mut self, result: ReplayResult, out: &mut Vec<Action>) {
        out.clear();
        let Some(r) = self.replay.take() else {
            return;
        };
        let filled = r.next >= r.target;
        if filled && result == ReplayResult::Completed {
            self.stats.replays_filled += 1;
        } else if !filled {
            self.stats.replays_incomplete += 1;
            self.stats.batches_lost = self.stats.batches_lost.saturating_add(r.target - r.next);
            self.stats.clears += 1;
            out.push(Action::Clear(ClearCause::ReplayIncomplete));
        } else {
            // Filled, though the end marker never came: the batches are all here.
            self.stats.replays_filled += 1;
        }
        let mut expect = r.target;
        for (seq, payload) in r.held {
            if seq != expect {
                // A gap among the held live batches: the replay covered only the first.
                self.stats.gaps += 1;
                self.stats.batches_lost = self.stats.batches_lost.saturating_add(seq - expect);
                self.stats.clears += 1;
                out.push(Action::Clear(ClearCause::GapWithoutReplay));
            }
            // Wrapping: a held batch may carry seq u64::MAX (the next expected is 0).
            expect = seq.wrapping_add(1);
            out.push(Action::Apply { seq, payload });
        }
        self.last = Some(expect.wrapping_sub(1));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn applied(out: &[Action]) -> Vec<u64> {
        out.iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    fn live(t: &mut SequenceTracker, seq: u64) -> Vec<Action> {
        let mut out = Vec::new();
        t.on_live(seq, &[seq as u8], &mut out);
        out
    }

    #[test]
    fn in_order_batches_apply_and_duplicates_drop() {
        let mut t = SequenceTracker::new(false);
        assert_eq!(applied(&live(&mut t, 0)), vec![0]);
        assert_eq!(applied(&live(&mut t, 1)), vec![1]);
        assert!(live(&mut t, 1).is_empty());
        assert_eq!(t.stats().duplicates, 1);
        assert_eq!(t.stats().last_seq, Some(1));
    }

    #[test]
    fn a_gap_without_replay_clears_then_applies() {
        let mut t = SequenceTracker::new(false);
        live(&mut t, 0);
        let out = live(&mut t, 4);
        assert_eq!(out[0], Action::Clear(ClearCause::GapWithoutReplay));
        assert_eq!(applied(&out), vec![4]);
        let s = t.stats();
        assert_eq!((s.gaps, s.clears, s.batches_lost), (1, 1, 3));
    }

    #[test]
    fn a_restart_clears_then_applies() {
        let mut t = SequenceTracker::new(true);
        live(&mut t, 0);
        live(&mut t, 1);
        let out = live(&mut t, 0);
        assert_eq!(out[0], Action::Clear(ClearCause::Restart));
        assert_eq!(applied(&out), vec![0]);
        assert_eq!(t.stats().restarts, 1);
    }

    #[test]
    fn a_gap_with_replay_applies_the_range_then_the_held_live_batches_in_order() {
        let mut t = SequenceTracker::new(true);
        live(&mut t, 0);
        let out = live(&mut t, 3);
        assert_eq!(out, vec![Action::RequestReplay { from_seq: 1 }]);
        assert!(live(&mut t, 4).is_empty(), "held while replaying");
        let mut out = Vec::new();
        t.on_replayed(1, b"r1", &mut out);
        assert_eq!(applied(&out), vec![1]);
        t.on_replayed(2, b"r2", &mut out);
        assert_eq!(applied(&out), vec![2]);
        t.on_replayed(3, b"dup of live", &mut out);
        assert!(out.is_empty(), "the live copy of 3 is held");
        t.on_replay_end(ReplayResult::Completed, &mut out);
        assert_eq!(applied(&out), vec![3, 4]);
        assert!(!out.iter().any(|a| matches!(a, Action::Clear(_))));
        assert_eq!(applied(&live(&mut t, 5)), vec![5]);
        let s = t.stats();
        assert_eq!(
            (s.gaps, s.replays_requested, s.replays_filled, s.clears),
            (1, 1, 1, 0)
        );
    }

    #[test]
    fn a_replay_that_cannot_fill_the_gap_clears_before_newer_batches() {
        let mut t = SequenceTracker::new(true);
        live(&mut t, 0);
        live(&mut t, 10);
        let mut out = Vec::new();
        // The publisher kept only from 7 on.
        t.on_replayed(7, b"r7", &mut out);
        assert_eq!(out[0], Action::Clear(ClearCause::ReplayIncomplete));
        assert_eq!(applied(&out), vec![7]);
        t.on_replay_end(ReplayResult::Completed, &mut out);
        assert_eq!(out[0], Action::Clear(ClearCause::ReplayIncomplete));
        assert_eq!(applied(&out), vec![10]);
        assert_eq!(t.stats().replays_incomplete, 1);
    }

    #[test]
    fn a_failed_replay_clears_and_applies_what_was_held() {
        let mut t = SequenceTracker::new(true);
        live(&mut t, 0);
        live(&mut t, 2);
        live(&mut t, 3);
        let mut out = Vec::new();
        t.on_replay_end(ReplayResult::Failed, &mut out);
        assert_eq!(out[0], Action::Clear(ClearCause::ReplayIncomplete));
        assert_eq!(applied(&out), vec![2, 3]);
        assert_eq!(applied(&live(&mut t, 4)), vec![4]);
    }

    #[test]
    fn huge_sequence_jumps_saturate_the_lost_counter_instead_of_overflowing() {
        // Found by fuzz target ingest_frames (fuzz/regressions/ingest_frames/).
        let mut t = SequenceTracker::new(false);
        live(&mut t, 0);
        live(&mut t, u64::MAX);
        live(&mut t, 0);
        live(&mut t, 3);
        assert_eq!(t.stats().batches_lost, u64::MAX);
        // And a held batch at u64::MAX ends a replay without overflowing.
        let mut t = SequenceTracker::new(true);
        live(&mut t, 0);
        live(&mut t, 5);
        live(&mut t, u64::MAX);
        let mut out = Vec::new();
        t.on_replay_end(ReplayResult::Failed, &mut out);
        assert_eq!(applied(&out), vec![5, u64::MAX]);
        assert_eq!(t.stats().last_seq, Some(u64::MAX));
    }

    #[test]
    fn joining_late_with_replay_asks_for_what_the_publisher_still_holds() {
        let mut t = SequenceTracker::new(true);
        assert_eq!(live(&mut t, 5), vec![Action::RequestReplay { from_seq: 0 }]);
        let mut out = Vec::new();
        for s in 0..5 {
            t.on_replayed(s, b"r", &mut out);
            assert_eq!(applied(&out), vec![s]);
        }
        t.on_replay_end(ReplayResult::Completed, &mut out);
        assert_eq!(applied(&out), vec![5]);
        assert_eq!(t.stats().clears, 0);
    }
}
