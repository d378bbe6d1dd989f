//! Target (e): the ingress recovery state machine (`kvr::ingress::sequence` behind
//! `EventSource` with replay) under random loss, reorder, duplication, publisher
//! restarts, idle probes and replays that are answered, cut short, failed or superseded —
//! against the publishers' ground truth.
//!
//! Two simulated publishers (workers 1 and 2, one stream each, DP rank 0) emit batches
//! (stores extending chains they hold, from a 4-token vocabulary with content-addressed
//! engine hashes; removes of held names; clears; device or host) numbered from 0 per
//! instance; the truth is a naive model ([`Model`]) of what each publisher's cache holds.
//! Each publisher keeps a replay buffer of its last 1–8 batches. The input is a schedule
//! of up to [`MAX_STEPS`] steps: emit a batch (delivered, dropped, delayed or delivered
//! twice), deliver a delayed batch (reorder), restart the publisher (a new instance:
//! empty cache, numbers from 0, empty buffer; see `Run::restart` for what the frames
//! show of it), an idle probe, one batch of the replay asked last (answered from the
//! buffer as it was when asked), the replay's end (failed at any point; completed once
//! the buffer was sent), or a quiesce-and-check.
//!
//! A restart may come while a replay of the old instance is in flight: the new
//! instance's live batches then go back before the newest live batch, which the tracker
//! takes for a restart (it used to take them for duplicates, so such a restart went
//! unnoticed: found by this target). The old replay is abandoned (the transport's next
//! request supersedes it).
//!
//! Checked: the stream replays exactly when it asked for a replay (the transport's
//! replay in flight); and, once quiescent — every delayed batch delivered, then an idle
//! probe and every replay it leads to answered in full — the index never overcounts:
//! every block it holds for a publisher's rank is one the publisher holds, on that tier
//! (a per-block query for every block ever stored, and the rank's holder and tier counts
//! so that no block outside those is held). Undercounting (a loss that could not be
//! replayed clears the rank) is allowed. The check runs at every quiesce step of the
//! schedule and at its end. `KVR_FUZZ_TRACE=1` prints the schedule as it runs (to read a
//! finding: `KVR_FUZZ_TRACE=1 fuzz/target/<triple>/release/recovery <input>`).

use std::collections::VecDeque;

use arbitrary::{Result, Unstructured};
use kvr::hash::{local_block_hash, HashSalt};
use kvr::ingress::Medium;
use kvr::ingress::ReplayResult;
use kvr::ingress::{EventSource, SourceAction};
use kvr::Partition;
use kvr::{RankId, StoredBlock, Tier, WorkerId};
use kvr_emulator::BatchEncoder;
use std::time::{Duration, Instant};

use crate::check::Links;
use crate::ingest_frames::{partition_for, release_partition};
use crate::model::Model;

/// Schedule steps per input at most.
pub const MAX_STEPS: usize = 96;
const PUBLISHERS: usize = 2;
/// Chain tails a publisher remembers (parents of its next stores).
const TAILS: usize = 8;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

/// A weighted choice: index `i` with probability `w[i] / sum(w)`.
fn pick(u: &mut Unstructured<'_>, w: &[u32]) -> Result<usize> {
    let total: u32 = w.iter().sum();
    let mut r = u.int_in_range(0..=total - 1)?;
    for (i, &x) in w.iter().enumerate() {
        if r < x {
            return Ok(i);
        }
        r -= x;
    }
    Ok(w.len() - 1)
}

/// One simulated publisher and kvr's stream of it.
struct Publisher {
    rank: RankId,
    instance: u64,
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_cap: usize,
    /// Live batches on the way (delivered later, in any order).
    delayed: Vec<(u64, Vec<u8>)>,
    /// The replay asked last: what the publisher's buffer held from its `from_seq`, the
    /// batches not yet sent.
    replay: Option<VecDeque<(u64, Vec<u8>)>>,
    /// Engine hashes at the end of recent stores (parents of the next).
    tails: Vec<u64>,
    /// The publisher's source (one stream, replay id 0).
    source: EventSource<&'static Partition>,
}

/// What a run exercised (the replay test checks the committed seeds cover every path).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub batches: u64,
    pub dropped: u64,
    pub reordered: u64,
    pub restarts_emitted: u64,
    pub gaps: u64,
    pub restarts_found: u64,
    pub duplicates: u64,
    pub replays_requested: u64,
    pub replays_filled: u64,
    pub replays_partial: u64,
    pub replays_failed: u64,
    pub idle_probes: u64,
    pub clears: u64,
    pub quiesce_checks: u64,
    /// Blocks the index held at a quiescent check (summed over checks).
    pub blocks_checked: u64,
}

impl Summary {
    /// Every counter, by name.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("batches", self.batches),
            ("dropped", self.dropped),
            ("reordered", self.reordered),
            ("restarts_emitted", self.restarts_emitted),
            ("gaps", self.gaps),
            ("restarts_found", self.restarts_found),
            ("duplicates", self.duplicates),
            ("replays_requested", self.replays_requested),
            ("replays_filled", self.replays_filled),
            ("replays_partial", self.replays_partial),
            ("replays_failed", self.replays_failed),
            ("idle_probes", self.idle_probes),
            ("clears", self.clears),
            ("quiesce_checks", self.quiesce_checks),
            ("blocks_checked", self.blocks_checked),
        ]
    }

    /// Field-wise sum.
    pub fn add(&mut self, o: &Summary) {
        let mine: Vec<&mut u64> = vec![
            &mut self.batches,
            &mut self.dropped,
            &mut self.reordered,
            &mut self.restarts_emitted,
            &mut self.gaps,
            &mut self.restarts_found,
            &mut self.duplicates,
            &mut self.replays_requested,
            &mut self.replays_filled,
            &mut self.replays_partial,
            &mut self.replays_failed,
            &mut self.idle_probes,
            &mut self.clears,
            &mut self.quiesce_checks,
            &mut self.blocks_checked,
        ];
        for (m, (_, v)) in mine.into_iter().zip(o.fields()) {
            *m += v;
        }
    }
}

struct Run {
    /// A partition reused across inputs (`ingest_frames::partition_for`, checked empty).
    p: &'static Partition,
    bs: u32,
    pubs: Vec<Publisher>,
    truth: Model,
    links: Links,
    enc: BatchEncoder,
    sum: Summary,
    step: usize,
    /// `KVR_FUZZ_TRACE` set: every step is printed (to read a finding).
    trace: bool,
}

/// Runs one input; panics on a finding.
pub fn run(data: &[u8]) {
    run_summary(data);
}

/// [`run`], returning what the input exercised.
pub fn run_summary(data: &[u8]) -> Summary {
    let mut u = Unstructured::new(data);
    let Ok(mut r) = Run::new(&mut u) else {
        return Summary::default();
    };
    while r.step < MAX_STEPS && !u.is_empty() {
        if r.schedule_step(&mut u).is_err() {
            break;
        }
        r.step += 1;
    }
    // The end of the schedule: deliver what is on the way, probe, answer; then check.
    for p in 0..PUBLISHERS {
        r.quiesce(p);
    }
    for p in 0..PUBLISHERS {
        r.check_no_overcount(p);
    }
    r.finish()
}

impl Run {
    fn new(u: &mut Unstructured<'_>) -> Result<Self> {
        let bs = [1, 2][pick(u, &[1, 1])?];
        let mut caps = [0usize; PUBLISHERS];
        for c in &mut caps {
            *c = u.int_in_range(1..=8usize)?;
        }
        // Nothing below reads the input: once the partition is taken, `finish` releases it.
        let p = partition_for(bs, None, &mut Model::new());
        let mut pubs = Vec::with_capacity(PUBLISHERS);
        // Every publisher can replay; the schedule probes with a tick (any silence counts).
        let (replay, probe_on_tick) = (Some("in-process".to_string()), Some(Duration::ZERO));
        for (k, cap) in caps.into_iter().enumerate() {
            let worker = k as u64 + 1;
            pubs.push(Publisher {
                rank: RankId::new(worker, 0),
                instance: 0,
                next_seq: 0,
                buffer: VecDeque::new(),
                buffer_cap: cap,
                delayed: Vec::new(),
                replay: None,
                tails: Vec::new(),
                source: EventSource::single(p, worker, 0, replay.clone(), probe_on_tick)
                    .expect("the partition takes events"),
            });
        }
        Ok(Run {
            p,
            bs,
            pubs,
            truth: Model::new(),
            links: Links::default(),
            enc: BatchEncoder::new(),
            sum: Summary::default(),
            step: 0,
            trace: std::env::var_os("KVR_FUZZ_TRACE").is_some(),
        })
    }

    fn schedule_step(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let p = u.choose_index(PUBLISHERS)?;
        match pick(u, &[12, 3, 1, 2, 4, 2, 1])? {
            0 => {
                let (seq, payload) = self.emit(u, p)?;
                match pick(u, &[10, 3, 3, 1])? {
                    0 => self.live(p, seq, &payload),
                    1 => self.sum.dropped += 1,
                    2 => self.pubs[p].delayed.push((seq, payload)),
                    _ => {
                        self.live(p, seq, &payload);
                        self.live(p, seq, &payload);
                    }
                }
            }
            1 => {
                let n = self.pubs[p].delayed.len();
                if n > 0 {
                    let k = u.choose_index(n)?;
                    self.sum.reordered += u64::from(k + 1 < n);
                    let (seq, payload) = self.pubs[p].delayed.remove(k);
                    self.live(p, seq, &payload);
                }
            }
            2 => self.restart(u, p)?,
            3 => {
                self.probe(p);
            }
            4 => self.replay_one(p),
            5 => {
                let failed = u.ratio(1, 2)?;
                self.replay_end(p, failed);
            }
            _ => {
                self.quiesce(p);
                self.check_no_overcount(p);
            }
        }
        Ok(())
    }

    /// The publisher produces its next batch: the truth applies it, the buffer keeps it.
    fn emit(&mut self, u: &mut Unstructured<'_>, p: usize) -> Result<(u64, Vec<u8>)> {
        let bs = self.bs;
        let rank = self.pubs[p].rank;
        let n = 1 + pick(u, &[4, 2, 1])?;
        let mut blocks: Vec<StoredBlock> = Vec::new();
        for _ in 0..n {
            let medium = if u.ratio(1, 5)? {
                Medium::Cpu
            } else {
                Medium::Gpu
            };
            let tier = if medium == Medium::Cpu {
                Tier::Host
            } else {
                Tier::Device
            };
            match pick(u, &[6, 3, 1])? {
                0 => {
                    // A store: from the root or extending a chain the publisher holds.
                    let held_tails: Vec<u64> = self.pubs[p]
                        .tails
                        .iter()
                        .copied()
                        .filter(|t| {
                            self.truth
                                .rank(rank)
                                .is_some_and(|rm| rm.resolve(*t).is_some())
                        })
                        .collect();
                    let parent = if !held_tails.is_empty() && u.ratio(3, 4)? {
                        Some(held_tails[u.choose_index(held_tails.len())?])
                    } else {
                        None
                    };
                    let len = 1 + pick(u, &[3, 2, 1, 1])?;
                    let mut hashes = Vec::with_capacity(len);
                    let mut tokens = Vec::with_capacity(len * bs as usize);
                    let mut prev = parent.unwrap_or(0x1337);
                    blocks.clear();
                    for _ in 0..len {
                        let start = tokens.len();
                        for _ in 0..bs {
                            tokens.push(u32::from(u.int_in_range(0..=3u8)?));
                        }
                        let t = &tokens[start..];
                        let content = t.iter().fold(prev, |h, &x| mix(h ^ u64::from(x)));
                        hashes.push(content);
                        blocks.push(StoredBlock {
                            external_hash: content,
                            local_hash: local_block_hash(t, HashSalt::new(None, None)),
                        });
                        prev = content;
                    }
                    let mut touched = Vec::new();
                    self.links
                        .record(&self.truth, rank, parent, &blocks, &mut touched);
                    self.truth
                        .store(rank, tier, parent, &blocks)
                        .expect("the publisher stores after blocks it holds");
                    let tails = &mut self.pubs[p].tails;
                    if tails.len() == TAILS {
                        tails.remove(0);
                    }
                    tails.push(prev);
                    self.enc.stored(&hashes, parent, &tokens, bs, medium, None);
                }
                1 => {
                    // A remove of names the publisher holds on that tier (or none).
                    let held: Vec<u64> = self.truth.rank(rank).map_or(Vec::new(), |rm| {
                        let mut v: Vec<u64> = rm.names[tier as usize].keys().copied().collect();
                        v.sort_unstable();
                        v
                    });
                    let mut hashes = Vec::new();
                    if !held.is_empty() {
                        for _ in 0..1 + pick(u, &[3, 1])? {
                            hashes.push(held[u.choose_index(held.len())?]);
                        }
                    }
                    self.truth.remove(rank, tier, &hashes);
                    self.enc.removed(&hashes, medium);
                }
                _ => {
                    self.truth.clear(rank);
                    self.enc.cleared();
                }
            }
        }
        let pb = &mut self.pubs[p];
        let seq = pb.next_seq;
        pb.next_seq += 1;
        // The timestamp tells instances apart (as wall-clock time does).
        let payload = self
            .enc
            .finish(pb.instance as f64 * 1e6 + seq as f64, Some(0));
        pb.buffer.push_back((seq, payload.clone()));
        if pb.buffer.len() > pb.buffer_cap {
            pb.buffer.pop_front();
        }
        self.sum.batches += 1;
        if self.trace {
            eprintln!(
                "step {}: publisher {p} emits seq {seq}; truth {:?}",
                self.step,
                self.truth.rank(pb.rank).map(|rm| rm.tier_blocks())
            );
        }
        Ok((seq, payload))
    }

    /// A new publisher instance: an empty cache, numbers from 0, an empty buffer.
    ///
    /// What the frames can tell: the old instance's connection ends first (what it still
    /// had on the way arrives before anything of the new one); its replay in flight, if
    /// any, stays in flight (answered from the old buffer, or failed later); and the new
    /// instance's first batch arrives. Without that batch a restart can be
    /// invisible (the new instance's next batch may continue the old numbering exactly),
    /// which no tracker can tell.
    fn restart(&mut self, u: &mut Unstructured<'_>, p: usize) -> Result<()> {
        for (seq, payload) in std::mem::take(&mut self.pubs[p].delayed) {
            self.live(p, seq, &payload);
        }
        let pb = &mut self.pubs[p];
        pb.instance += 1;
        pb.next_seq = 0;
        pb.buffer.clear();
        pb.tails.clear();
        self.truth.clear(pb.rank);
        self.sum.restarts_emitted += 1;
        if self.trace {
            eprintln!(
                "step {}: publisher {p} restarts (instance {})",
                self.step, pb.instance
            );
        }
        let (seq, payload) = self.emit(u, p)?;
        self.live(p, seq, &payload);
        Ok(())
    }

    fn live(&mut self, p: usize, seq: u64, payload: &[u8]) {
        if self.trace {
            eprintln!("step {}: publisher {p} live seq {seq}", self.step);
        }
        let clears = self.clears(p);
        let out = self.pubs[p]
            .source
            .on_message(b"", seq, payload, Instant::now());
        self.after(p, out, clears, "live");
    }

    /// The clears publisher `p`'s stream has counted so far.
    fn clears(&self, p: usize) -> u64 {
        let worker = self.pubs[p].rank.worker_id;
        self.p
            .ingress_stats()
            .iter()
            .find(|s| s.worker_id == worker)
            .map_or(0, |s| s.sequence.clears)
    }

    /// An idle probe of publisher `p`'s stream.
    fn probe(&mut self, p: usize) {
        let clears = self.clears(p);
        let mut out = Vec::new();
        self.pubs[p].source.on_tick(Instant::now(), &mut out);
        assert!(out.len() <= 1, "one stream, at most one probe: {out:?}");
        let out = out.pop().unwrap_or(SourceAction::Continue);
        self.after(p, out, clears, "idle");
    }

    /// Serves the stream's replay request, if any (superseding the one in flight), and
    /// checks the stream replays exactly when it asked to. `clears_before`: the stream's
    /// clears before the step.
    fn after(&mut self, p: usize, out: SourceAction, clears_before: u64, what: &str) {
        if self.trace {
            eprintln!("step {}: publisher {p} {what} -> {out:?}", self.step);
        }
        let cleared = self.clears(p) > clears_before;
        let pb = &mut self.pubs[p];
        let replay_from = match out {
            SourceAction::Replay { from_seq, .. } => Some(from_seq),
            SourceAction::Continue => None,
        };
        if cleared && replay_from.is_none() && !pb.source.replaying(0) {
            // A restart found while a replay of the old instance was in flight abandons
            // it (its late batches would find no replay); the transport drops it.
            pb.replay = None;
        }
        if let Some(from) = replay_from {
            pb.replay = Some(
                pb.buffer
                    .iter()
                    .filter(|(s, _)| *s >= from)
                    .cloned()
                    .collect(),
            );
        }
        assert_eq!(
            pb.source.replaying(0),
            pb.replay.is_some(),
            "publisher {p}: the stream replays iff it asked (after {what}: {out:?}); step {}",
            self.step
        );
    }

    fn replay_one(&mut self, p: usize) {
        let clears = self.clears(p);
        let pb = &mut self.pubs[p];
        let Some(next) = pb.replay.as_mut().and_then(|q| q.pop_front()) else {
            return;
        };
        if self.trace {
            eprintln!("step {}: publisher {p} replayed seq {}", self.step, next.0);
        }
        let out = pb.source.on_replayed(0, next.0, &next.1, Instant::now());
        self.after(p, out, clears, "replayed");
    }

    /// Ends the replay in flight: failed, or completed once everything was sent.
    fn replay_end(&mut self, p: usize, failed: bool) {
        let clears = self.clears(p);
        let pb = &mut self.pubs[p];
        let Some(q) = &pb.replay else { return };
        let result = if failed {
            ReplayResult::Failed
        } else if q.is_empty() {
            ReplayResult::Completed
        } else {
            return;
        };
        pb.replay = None;
        if self.trace {
            eprintln!("step {}: publisher {p} replay end {result:?}", self.step);
        }
        let out = pb.source.on_replay_end(0, result, Instant::now());
        self.after(p, out, clears, "replay end");
    }

    /// Delivers the delayed batches, then probes and answers every replay in full.
    fn quiesce(&mut self, p: usize) {
        for (seq, payload) in std::mem::take(&mut self.pubs[p].delayed) {
            self.live(p, seq, &payload);
        }
        let mut probed = false;
        for _ in 0..16 {
            if self.pubs[p].replay.is_some() {
                while self.pubs[p].replay.as_ref().is_some_and(|q| !q.is_empty()) {
                    self.replay_one(p);
                }
                self.replay_end(p, false);
            } else if !probed {
                probed = true;
                self.probe(p);
            } else {
                break;
            }
        }
        assert!(
            !self.pubs[p].source.replaying(0),
            "publisher {p}: still replaying after quiescing; step {}",
            self.step
        );
    }

    /// Every block the index holds for publisher `p`'s rank (quiesced), the publisher
    /// holds (on the tier the index says).
    fn check_no_overcount(&mut self, p: usize) {
        self.sum.quiesce_checks += 1;
        let index = self.p.index();
        {
            let rank = self.pubs[p].rank;
            let truth = self.truth.rank(rank);
            let mut held = 0u64;
            for k in 0..self.links.len() {
                let seq = self.links.nth(k).unwrap();
                let Some(locals) = self.links.locals_to(seq) else {
                    continue;
                };
                let tiers = index.block_tiers(rank, &locals);
                if tiers == 0 {
                    continue;
                }
                held += 1;
                for tier in Tier::ALL {
                    if tiers & (1 << tier as u8) == 0 {
                        continue;
                    }
                    assert!(
                        truth.is_some_and(|rm| rm.holds(tier, seq)),
                        "overcount: the index holds block {seq:#x} for {rank} on {tier:?} once \
                         quiescent, the publisher does not; step {}",
                        self.step
                    );
                }
            }
            let rs = index.rank_stats(rank).unwrap_or_default();
            assert_eq!(
                rs.holder_blocks, held,
                "the index holds blocks for {rank} that no publisher ever stored; step {}",
                self.step
            );
            let want = truth.map_or([0; 3], |rm| rm.tier_blocks());
            for (t, (got, want)) in rs.tier_blocks.iter().zip(want).enumerate() {
                assert!(
                    *got <= want,
                    "overcount: {rank} tier {t}: index {got} > publisher {want}; step {}",
                    self.step
                );
            }
            self.sum.blocks_checked += held;
        }
    }

    fn finish(mut self) -> Summary {
        let stats = self.p.ingress_stats();
        assert_eq!(stats.len(), PUBLISHERS, "one ingress stream per publisher");
        for st in &stats {
            let s = st.sequence;
            self.sum.gaps += s.gaps;
            self.sum.restarts_found += s.restarts;
            self.sum.duplicates += s.duplicates;
            self.sum.replays_requested += s.replays_requested;
            self.sum.replays_filled += s.replays_filled;
            self.sum.replays_partial += s.replays_partial;
            self.sum.replays_failed += s.replays_failed;
            self.sum.idle_probes += s.idle_probes;
            self.sum.clears += s.clears;
        }
        drop(self.pubs);
        release_partition(self.p, (1..=PUBLISHERS as u64).map(|w| w as WorkerId));
        crate::check::collect_garbage();
        self.sum
    }
}
