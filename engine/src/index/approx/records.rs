//! One rank's records, behind that rank's mutex: (sequence hash → record) and the
//! rank's deadline-ordered expiry queue.

use std::collections::hash_map::Entry;
use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::time::Instant;

use super::Sink;
use crate::hash::mix::{HashMix, HashMixMap};
use crate::ids::RankId;
use crate::sync::Mutex;

/// When a record expires. `Never` only when `now + ttl` is past what `Instant` can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Deadline {
    At(Instant),
    Never,
}

/// One (rank, block) record.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rec {
    pub(super) deadline: Deadline,
    /// Position in its prompt chain (0 = first block): what pruning orders by.
    pub(super) depth: u32,
    /// Names the record's one live queue entry; changes whenever the deadline does.
    gen: u64,
}

/// A queue entry: live iff the record of `seq` still has generation `gen`.
#[derive(Clone, Copy, Debug)]
struct Due {
    at: Instant,
    gen: u64,
    seq: u64,
}

/// Queue entries kept beyond twice the live records before stale ones are swept.
pub(super) const COMPACT_SLACK: usize = 64;

/// A rank's records (one per rank, shared by the recorder's rank map).
pub(super) struct RankRecords {
    pub(super) rank: RankId,
    pub(super) state: Mutex<RankState>,
}

impl RankRecords {
    pub(super) fn new(rank: RankId) -> Self {
        RankRecords {
            rank,
            state: Mutex::new(RankState::default()),
        }
    }
}

/// What one recording changed of a rank's records.
#[derive(Default)]
pub(super) struct Applied {
    pub(super) stored: usize,
    pub(super) refreshed: usize,
}

#[derive(Default)]
pub(super) struct RankState {
    /// Sequence hash → record.
    pub(super) recs: HashMixMap<u64, Rec>,
    /// Deadline-ordered. Every record with a finite deadline has exactly one live entry;
    /// refreshes and prunes leave stale ones, skipped when popped and swept when they
    /// outnumber the live records.
    queue: VecDeque<Due>,
    next_gen: u64,
    /// Set (under the mutex) when the rank is forgotten: a recording that finds it set
    /// retries with the rank's new records, so none lands where nothing expires it.
    pub(super) retired: bool,
    /// Reused buffer: (depth, seq) of the records to remove from the index.
    removed: Vec<(u32, u64)>,
    remove_buf: Vec<u64>,
}

/// Queues a deadline, keeping the queue sorted: appended when time is monotonic
/// (constant TTL), inserted in place when `now` went backwards.
fn enqueue(queue: &mut VecDeque<Due>, due: Due) {
    match queue.back() {
        Some(b) if b.at > due.at => {
            let i = queue.partition_point(|d| d.at <= due.at);
            queue.insert(i, due);
        }
        _ => queue.push_back(due),
    }
}

impl RankState {
    /// Whether `seq` has a record.
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.recs.contains_key(&seq)
    }

    /// Records (or refreshes, never to an earlier deadline) every block of `seqs`, the
    /// first at depth 0. The caller stored the new ones in the index.
    pub(super) fn apply(&mut self, seqs: &[u64], deadline: Deadline) -> Applied {
        let mut out = Applied::default();
        let mut gen = self.next_gen;
        let queue = &mut self.queue;
        for (depth, &seq) in seqs.iter().enumerate() {
            match self.recs.entry(seq) {
                Entry::Occupied(mut e) => {
                    out.refreshed += 1;
                    let r = e.get_mut();
                    if deadline > r.deadline {
                        gen += 1;
                        r.deadline = deadline;
                        r.gen = gen;
                        if let Deadline::At(at) = deadline {
                            enqueue(queue, Due { at, gen, seq });
                        }
                    }
                }
                Entry::Vacant(e) => {
                    out.stored += 1;
                    gen += 1;
                    e.insert(Rec {
                        deadline,
                        depth: u32::try_from(depth).unwrap_or(u32::MAX),
                        gen,
                    });
                    if let Deadline::At(at) = deadline {
                        enqueue(queue, Due { at, gen, seq });
                    }
                }
            }
        }
        self.next_gen = gen;
        out
    }

    fn is_live(&self, d: &Due) -> bool {
        self.recs.get(&d.seq).is_some_and(|r| r.gen == d.gen)
    }

    /// Drops stale queue entries once they outnumber the live records, so the queue
    /// stays O(records) however often hot prompts are refreshed (amortized O(1)); and
    /// gives back the map's memory once most of its records are gone.
    fn maybe_compact(&mut self) {
        if self.queue.len() > 2 * self.recs.len() + COMPACT_SLACK {
            let mut q = std::mem::take(&mut self.queue);
            q.retain(|d| self.is_live(d));
            q.shrink_to(2 * q.len() + COMPACT_SLACK);
            self.queue = q;
        }
        if self.recs.capacity() > 4 * self.recs.len() + COMPACT_SLACK {
            self.recs.shrink_to(2 * self.recs.len());
        }
    }

    /// Removes the records in `self.removed` from `index`, deepest first, so a
    /// concurrent reader sees a shorter prefix rather than a hole.
    fn remove_from_index(&mut self, index: &impl Sink, rank: RankId) {
        if self.removed.is_empty() {
            return;
        }
        self.removed
            .sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        self.remove_buf.clear();
        self.remove_buf.extend(self.removed.iter().map(|e| e.1));
        index.remove(rank, &self.remove_buf);
        self.removed.clear();
    }

    /// Expires every record whose deadline is `<= now`, from the records and `index`.
    /// Returns how many. O(1) amortized per expired record while `now` is monotonic.
    pub(super) fn expire(&mut self, index: &impl Sink, rank: RankId, now: Instant) -> usize {
        let mut n = 0;
        while self.queue.front().is_some_and(|d| d.at <= now) {
            let Some(d) = self.queue.pop_front() else {
                break;
            };
            if let Entry::Occupied(e) = self.recs.entry(d.seq) {
                if e.get().gen == d.gen {
                    let r = e.remove();
                    self.removed.push((r.depth, d.seq));
                    n += 1;
                }
            }
        }
        self.remove_from_index(index, rank);
        self.maybe_compact();
        n
    }

    /// Makes room by evicting this rank's least recently booked records: whole groups of
    /// records sharing the earliest deadline (one booking's blocks; a record's deadline
    /// is its last booking plus the TTL, so earliest = least recent), deepest first, until
    /// at least `want` are gone or only `keep`'s are left. `keep` (the blocks of the
    /// prompt being recorded) is prefix-closed and a parent's deadline is never earlier
    /// than its child's, so no record is left without its parent. From the records and
    /// `index`; returns how many. O(evicted + kept) per call.
    pub(super) fn evict_oldest(
        &mut self,
        index: &impl Sink,
        rank: RankId,
        want: usize,
        keep: &HashSet<u64, BuildHasherDefault<HashMix>>,
    ) -> usize {
        let mut n = 0;
        let mut kept: Vec<Due> = Vec::new();
        while n < want {
            let Some(at) = self.queue.front().map(|d| d.at) else {
                break;
            };
            while let Some(d) = self.queue.front().copied() {
                if d.at != at {
                    break;
                }
                self.queue.pop_front();
                if !self.is_live(&d) {
                    continue;
                }
                if keep.contains(&d.seq) {
                    kept.push(d);
                    continue;
                }
                if let Some(r) = self.recs.remove(&d.seq) {
                    self.removed.push((r.depth, d.seq));
                    n += 1;
                }
            }
        }
        // Their deadlines are the earliest left: back at the front, still sorted.
        for d in kept.into_iter().rev() {
            self.queue.push_front(d);
        }
        self.remove_from_index(index, rank);
        self.maybe_compact();
        n
    }

    /// Adds each record's depth to `hist`.
    pub(super) fn depth_histogram(&self, hist: &mut Vec<usize>) {
        for r in self.recs.values() {
            let d = r.depth as usize;
            if d >= hist.len() {
                hist.resize(d + 1, 0);
            }
            hist[d] += 1;
        }
    }

    /// Pushes `(depth, deadline, rank, seq)` of every record at depth `cut` or deeper.
    pub(super) fn candidates(
        &self,
        rank: RankId,
        cut: u32,
        out: &mut Vec<(u32, Deadline, RankId, u64)>,
    ) {
        for (&seq, r) in &self.recs {
            if r.depth >= cut {
                out.push((r.depth, r.deadline, rank, seq));
            }
        }
    }

    /// Prunes this rank's records: those in `chosen` still present, and every record
    /// deeper than `cut` (a record added since the candidates were taken: never keep a
    /// block whose parent goes). From the records and `index`; returns how many.
    pub(super) fn prune(
        &mut self,
        index: &impl Sink,
        rank: RankId,
        cut: u32,
        chosen: &[u64],
    ) -> usize {
        for &seq in chosen {
            if let Some(r) = self.recs.remove(&seq) {
                self.removed.push((r.depth, seq));
            }
        }
        let removed = &mut self.removed;
        self.recs.retain(|&seq, r| {
            if r.depth > cut {
                removed.push((r.depth, seq));
                false
            } else {
                true
            }
        });
        let n = self.removed.len();
        self.remove_from_index(index, rank);
        self.maybe_compact();
        n
    }

    /// Drops every record (the rank was forgotten), without touching the index.
    pub(super) fn retire(&mut self) -> usize {
        self.retired = true;
        let n = self.recs.len();
        self.recs = HashMixMap::default();
        self.queue = VecDeque::new();
        n
    }

    #[cfg(test)]
    pub(super) fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Sorted queue, and exactly one live entry per record with a finite deadline.
    #[cfg(test)]
    pub(super) fn check_queue(&self) -> Result<(), String> {
        let sorted = self
            .queue
            .iter()
            .zip(self.queue.iter().skip(1))
            .all(|(a, b)| a.at <= b.at);
        let live = self.queue.iter().filter(|d| self.is_live(d)).count();
        let finite = self
            .recs
            .values()
            .filter(|r| matches!(r.deadline, Deadline::At(_)))
            .count();
        if !sorted || live != finite {
            return Err(format!(
                "sorted {sorted}, live entries {live}, records {finite}"
            ));
        }
        Ok(())
    }
}
