//! Raw engine messages into a partition's index: sequence tracking, decoding, local
//! hashes from the tokens, counters per worker.
//!
//! A *stream* is one publisher's sequence of batches: one engine process (one DP rank's
//! PUB socket in vLLM, which numbers each socket's batches from 0). Hosts that read the
//! sockets themselves hand kvr each message with [`Partition::ingest`](crate::partition::Partition::ingest), naming the
//! worker and the stream (e.g. the DP rank the socket belongs to); kvr's own subscriber
//! does the same through [`IngressStream`], with replay.
//!
//! Decisions (where REFERENCE.md is silent): a batch's events apply to rank
//! `(worker, data_parallel_rank)`, or `(worker, stream)` when the batch names no rank;
//! a block's `extra_keys` (multimodal inputs, cache salt, prompt-embeddings digests) are
//! folded into its local hash by `crate::hash::extra`'s rule, the one requests hash with
//! ([`BlockExtras`](crate::hash::BlockExtras)), so equal tokens with different images or
//! salts are different blocks; a store whose `block_size`
//! differs from the partition's is refused and counted, the rest of the batch applies; a
//! batch that fails to decode applies nothing and is counted by cause.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::hash::{local_block_hash_mm, HashSalt};
use crate::ids::{RankId, Tier, WorkerId};
use crate::index::{ApplyOutcome, IndexError, KvEvent, StoredBlock};
use crate::sync::{Arc, Mutex, ShardedMap, StdArc};

use super::decode::{decode_batch, DecodeErrorKind, DecodedBatch, DecodedEvent, Medium};
use super::groups::{GroupRouting, APPLY};
use super::sequence::{Action, ReplayResult, SequenceStats, SequenceTracker};
use crate::freshness::Freshness;

/// One stream's counters (readable through [`Partition::ingress_stats`](crate::partition::Partition::ingress_stats)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    pub worker_id: WorkerId,
    pub stream: u32,
    /// Messages received (live and replayed).
    pub messages: u64,
    pub bytes: u64,
    /// Batches decoded and applied.
    pub batches: u64,
    pub events: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Events the index refused (unknown parent, rank limit), and the events of batches
    /// refused for their DP rank.
    pub events_rejected: u64,
    /// Batches refused because they name a DP rank the worker does not have (outside its
    /// `dp_start..dp_start + dp_size`, or at least [`MAX_DP_SIZE`] for a worker not yet
    /// registered): the wire never picks which ranks exist.
    ///
    /// [`MAX_DP_SIZE`]: crate::workers::MAX_DP_SIZE
    pub dp_rank_refused: u64,
    /// Stores refused because their block size is not the partition's.
    pub block_size_mismatches: u64,
    /// Events skipped because their KV-cache group is not the one routing follows
    /// (hybrid-attention models; `ingress::groups`).
    pub events_skipped_group: u64,
    /// Times the routing group changed (the stream's ranks were cleared).
    pub group_switches: u64,
    /// Events skipped because their `medium` is not a name kvr knows (`Medium`).
    pub events_skipped_medium: u64,
    /// Batches that failed to decode, by cause (`DecodeErrorKind::name`, count).
    pub decode_errors: Vec<(&'static str, u64)>,
    /// Messages whose frames were malformed (reported by the transport).
    pub bad_frames: u64,
    pub sequence: SequenceStats,
    /// Wall-clock time of the last applied batch, ms since the Unix epoch (0 = never).
    pub last_batch_unix_ms: u64,
    /// Since when the stream's ranks may be stale (a known loss being replayed), ms since
    /// the Unix epoch; 0 = not stale (`crate::freshness`).
    pub stale_since_unix_ms: u64,
}

impl StreamStats {
    /// The stream's freshness: live, recovering (a replay in flight), or stale.
    pub fn freshness(&self) -> StreamFreshness {
        match (self.stale_since_unix_ms, self.sequence.recovering) {
            (0, false) => StreamFreshness::Live,
            (0, true) => StreamFreshness::Recovering,
            (since, _) => StreamFreshness::Stale {
                since_unix_ms: since,
            },
        }
    }
}

/// A stream's freshness (README's ingress section; `crate::freshness`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFreshness {
    /// No replay in flight: the index follows the stream.
    Live,
    /// A replay in flight with no loss known (a join, a probe, a restart's rebuild).
    Recovering,
    /// A loss is known and being replayed: the stream's ranks' overlap is not trusted
    /// (by default) until it is filled or the ranks are cleared.
    Stale { since_unix_ms: u64 },
}

/// The counters of every stream of a partition, by (worker, stream). Opaque: a sink
/// owns one and hands it to ingress.
pub struct IngressRegistry {
    streams: Mutex<Vec<Arc<Mutex<StreamStats>>>>,
    /// Streams fed through [`Partition::ingest`](crate::partition::Partition::ingest) (no replay: kvr does not own the socket),
    /// sharded so messages of different streams never wait on one lock to find theirs.
    raw: ShardedMap<(WorkerId, u32), Arc<Mutex<IngressStream>>>,
    /// The ranks whose state may be stale, for selection (`crate::freshness`).
    pub(crate) freshness: Freshness,
}

impl std::fmt::Debug for IngressRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngressRegistry")
            .field("streams", &self.streams.lock().len())
            .finish_non_exhaustive()
    }
}

impl Default for IngressRegistry {
    fn default() -> Self {
        IngressRegistry {
            streams: Mutex::new(Vec::new()),
            raw: ShardedMap::new(),
            freshness: Freshness::default(),
        }
    }
}

impl IngressRegistry {
    fn register(&self, worker_id: WorkerId, stream: u32) -> Arc<Mutex<StreamStats>> {
        let s = Arc::new(Mutex::new(StreamStats {
            worker_id,
            stream,
            decode_errors: DecodeErrorKind::ALL.iter().map(|k| (k.name(), 0)).collect(),
            ..StreamStats::default()
        }));
        self.streams.lock().push(s.clone());
        s
    }

    /// Sequence-checks, decodes and applies one message of `worker_id`'s stream `stream`
    /// handed in by the host (no replay: kvr does not own the socket). Messages of one
    /// stream are serialized on that stream's lock; other streams proceed in parallel.
    pub(crate) fn ingest_raw(
        &self,
        sink: &impl EventSink,
        worker_id: WorkerId,
        stream: u32,
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        let s = self.raw.get_or_insert_with((worker_id, stream), || {
            Arc::new(Mutex::new(IngressStream::new(
                sink, worker_id, stream, false,
            )))
        });
        let mut s = s.lock();
        s.on_live(sink, seq, payload)
    }

    /// Drops a removed worker's streams: their sequence state (a rejoin starts fresh) and
    /// their counters.
    pub(crate) fn forget_worker(&self, worker_id: WorkerId) {
        for ((w, stream), _) in self.raw.entries() {
            if w == worker_id {
                self.raw.remove(&(w, stream));
            }
        }
        self.streams
            .lock()
            .retain(|s| s.lock().worker_id != worker_id);
        self.freshness.forget_worker(worker_id);
    }

    pub(crate) fn stats(&self) -> Vec<StreamStats> {
        self.streams
            .lock()
            .iter()
            .map(|s| s.lock().clone())
            .collect()
    }
}

/// What one message did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Batches applied (0 if held for a replay or dropped as a duplicate; several when a
    /// replay ends).
    pub batches_applied: u32,
    /// Times the stream's ranks were cleared (a gap that could not be filled, a restart).
    pub clears: u32,
    /// A replay should be requested from this sequence number (subscriber only).
    pub replay_from: Option<u64>,
    /// Batches that failed to decode.
    pub decode_errors: u32,
}

/// What ingress writes into, implemented by the partition, so that this layer never
/// names it: a sink applies one rank's events to the index its policy feeds, clears a
/// worker's ranks, and keeps the counters of the streams feeding it.
pub trait EventSink {
    /// The block size every stored block must have (others are refused and counted).
    fn block_size(&self) -> u32;
    /// The cache namespace that salts every local hash (with each event's LoRA name).
    fn cache_namespace(&self) -> Option<&str>;
    /// Applies one event of `rank`.
    fn apply_event(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError>;
    /// Drops everything `worker` holds on the DP ranks `dp_ranks` (all of its ranks when
    /// empty), as after a gap in its stream (ingress always names the ranks).
    fn clear_ranks(&self, worker: WorkerId, dp_ranks: &[u32]);
    /// The counters and sequence state of the streams feeding this sink.
    fn streams(&self) -> &IngressRegistry;
    /// Whether `worker`'s events may name DP rank `dp`. A rank the worker does not have is
    /// never a selection candidate, so its blocks could only take memory: its batches are
    /// refused and counted ([`StreamStats::dp_rank_refused`]). Every rank by default.
    fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
        let _ = (worker, dp);
        true
    }
}

/// A shared sink is a sink (a subscription holds its partition by `Arc`).
impl<S: EventSink + ?Sized> EventSink for StdArc<S> {
    fn block_size(&self) -> u32 {
        (**self).block_size()
    }
    fn cache_namespace(&self) -> Option<&str> {
        (**self).cache_namespace()
    }
    fn apply_event(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError> {
        (**self).apply_event(rank, event)
    }
    fn clear_ranks(&self, worker: WorkerId, dp_ranks: &[u32]) {
        (**self).clear_ranks(worker, dp_ranks)
    }
    fn streams(&self) -> &IngressRegistry {
        (**self).streams()
    }
    fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
        (**self).accepts_dp_rank(worker, dp)
    }
}

/// The state of one stream: its sequence tracker, reusable decode buffers, its counters.
pub struct IngressStream {
    worker_id: WorkerId,
    stream: u32,
    tracker: SequenceTracker,
    batch: DecodedBatch,
    blocks: Vec<StoredBlock>,
    actions: Vec<Action>,
    /// DP ranks this stream's batches named (a clear clears these).
    ranks_seen: Vec<u32>,
    groups: GroupRouting,
    stats: Arc<Mutex<StreamStats>>,
    /// Since when this stream is stale, and how many of `ranks_seen` were listed then.
    stale: Option<(u64, usize)>,
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
    /// A stream of `worker_id`'s batches into `partition` (registered for its stats).
    pub fn new(partition: &impl EventSink, worker_id: WorkerId, stream: u32, replay: bool) -> Self {
        IngressStream {
            worker_id,
            stream,
            tracker: SequenceTracker::new(replay),
            batch: DecodedBatch::default(),
            blocks: Vec::new(),
            actions: Vec::new(),
            ranks_seen: Vec::new(),
            groups: GroupRouting::default(),
            stats: partition.streams().register(worker_id, stream),
            stale: None,
        }
    }

    /// A live message.
    pub fn on_live(&mut self, p: &impl EventSink, seq: u64, payload: &[u8]) -> IngestOutcome {
        self.note_message(payload.len());
        self.track(p, |t, out| t.on_live(seq, payload, out))
    }

    /// A replayed message (of the replay requested last).
    pub fn on_replayed(&mut self, p: &impl EventSink, seq: u64, payload: &[u8]) -> IngestOutcome {
        self.note_message(payload.len());
        self.track(p, |t, out| t.on_replayed(seq, payload, out))
    }

    /// The stream has been silent for a while (or was just subscribed): probe the
    /// publisher through replay ([`SequenceTracker::on_idle`]; nothing without replay or
    /// while a replay runs). `replay_from` says what to ask for.
    pub fn on_idle(&mut self, p: &impl EventSink) -> IngestOutcome {
        self.track(p, |t, out| t.on_idle(out))
    }

    /// The replay ended.
    pub fn on_replay_end(&mut self, p: &impl EventSink, result: ReplayResult) -> IngestOutcome {
        self.track(p, |t, out| t.on_replay_end(result, out))
    }

    /// The stream's number (its counters' `stream`).
    pub fn stream(&self) -> u32 {
        self.stream
    }

    /// Whether a replay is in flight for this stream.
    pub fn replaying(&self) -> bool {
        self.tracker.replaying()
    }

    /// Runs one step of the sequence tracker and performs the actions it returns (in a
    /// buffer kept across calls).
    fn track(
        &mut self,
        p: &impl EventSink,
        step: impl FnOnce(&mut SequenceTracker, &mut Vec<Action>),
    ) -> IngestOutcome {
        let mut actions = std::mem::take(&mut self.actions);
        step(&mut self.tracker, &mut actions);
        #[cfg(loom)]
        if crate::sync::faults::get().unlist_before_repair {
            self.note_freshness(p);
        }
        let out = self.perform(p, &mut actions);
        self.actions = actions;
        out
    }

    /// A message the transport could not parse into frames.
    pub fn on_bad_frame(&mut self) {
        self.stats.lock().bad_frames += 1;
    }

    fn note_message(&self, bytes: usize) {
        let mut s = self.stats.lock();
        s.messages += 1;
        s.bytes += bytes as u64;
    }

    fn perform(&mut self, p: &impl EventSink, actions: &mut Vec<Action>) -> IngestOutcome {
        let mut out = IngestOutcome::default();
        for a in actions.drain(..) {
            match a {
                Action::Apply { payload, .. } => {
                    if self.apply(p, &payload) {
                        out.batches_applied += 1;
                    } else {
                        out.decode_errors += 1;
                    }
                }
                Action::Clear(_) => {
                    self.clear_fed_ranks(p);
                    out.clears += 1;
                }
                Action::RequestReplay { from_seq } => out.replay_from = Some(from_seq),
            }
        }
        self.note_freshness(p);
        self.stats.lock().sequence = self.tracker.stats();
        out
    }

    /// Lists or unlists the stream's ranks as stale (after the actions: an unlisting
    /// follows the repair it waited for, `crate::freshness`).
    fn note_freshness(&mut self, p: &impl EventSink) {
        let n = self.ranks_seen.len();
        match (self.tracker.stale(), self.stale) {
            (true, Some((_, listed))) if listed == n => {}
            (true, since) => {
                let t = since.map_or_else(now_unix_ms, |s| s.0);
                p.streams()
                    .freshness
                    .mark(self.worker_id, &self.ranks_seen, Some(t));
                self.stale = Some((t, n));
                self.stats.lock().stale_since_unix_ms = t;
            }
            (false, Some(_)) => {
                p.streams()
                    .freshness
                    .mark(self.worker_id, &self.ranks_seen, None);
                self.stale = None;
                self.stats.lock().stale_since_unix_ms = 0;
            }
            (false, None) => {}
        }
    }

    /// Clears the ranks this stream fed, and only those: another stream of the worker (its
    /// other DP ranks) keeps its state. A stream that applied nothing holds nothing.
    fn clear_fed_ranks(&self, p: &impl EventSink) {
        if !self.ranks_seen.is_empty() {
            p.clear_ranks(self.worker_id, &self.ranks_seen);
        }
    }

    /// Decodes and applies one batch; `false` if it did not decode (nothing applied).
    fn apply(&mut self, p: &impl EventSink, payload: &[u8]) -> bool {
        if let Err(e) = decode_batch(payload, &mut self.batch) {
            let mut s = self.stats.lock();
            if let Some(c) = s.decode_errors.iter_mut().find(|c| c.0 == e.kind.name()) {
                c.1 += 1;
            }
            return false;
        }
        let dp = self.batch.data_parallel_rank.unwrap_or(self.stream);
        if !p.accepts_dp_rank(self.worker_id, dp) {
            let n = self.batch.events.len() as u64;
            let mut s = self.stats.lock();
            s.batches += 1;
            s.events += n;
            s.events_rejected += n;
            s.dp_rank_refused += 1;
            s.last_batch_unix_ms = now_unix_ms();
            return true;
        }
        if !self.ranks_seen.contains(&dp) {
            self.ranks_seen.push(dp);
        }
        let rank = RankId::new(self.worker_id, dp);
        let bs = p.block_size();
        let namespace = p.cache_namespace();
        let (mut stored, mut removed, mut rejected, mut mismatched) = (0u64, 0u64, 0u64, 0u64);
        let (mut skipped_group, mut skipped_medium, mut switches) = (0u64, 0u64, 0u64);
        let b = &self.batch;
        for ev in &b.events {
            let medium = match ev {
                DecodedEvent::Stored { medium, .. } | DecodedEvent::Removed { medium, .. } => {
                    *medium
                }
                DecodedEvent::Cleared => Medium::Gpu,
            };
            let Some(tier) = tier(medium) else {
                skipped_medium += 1;
                continue;
            };
            let verdict = match ev {
                DecodedEvent::Stored { block_size, .. } if *block_size != bs => {
                    mismatched += 1;
                    continue;
                }
                DecodedEvent::Stored { group, spec, .. } => self.groups.on_store(*group, *spec),
                DecodedEvent::Removed { group, .. } => self.groups.on_remove(*group),
                DecodedEvent::Cleared => APPLY,
            };
            if verdict.clear_first {
                switches += 1;
                self.clear_fed_ranks(p);
            }
            if !verdict.apply {
                skipped_group += 1;
                continue;
            }
            let r = match ev {
                DecodedEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    lora_name,
                    extras,
                    ..
                } => {
                    let lora = lora_name.clone().map(|r| &b.text[r]);
                    let salt = HashSalt::new(lora, namespace);
                    self.blocks.clear();
                    let toks = &b.tokens[tokens.clone()];
                    for (i, (h, chunk)) in b.hashes[hashes.clone()]
                        .iter()
                        .zip(toks.chunks_exact(bs as usize))
                        .enumerate()
                    {
                        // Without extra keys this is the plain token hash.
                        let keys = b.block_extra_keys(extras, i);
                        self.blocks.push(StoredBlock {
                            external_hash: *h,
                            local_hash: local_block_hash_mm(chunk, keys, salt),
                        });
                    }
                    p.apply_event(
                        rank,
                        &KvEvent::Stored {
                            tier,
                            parent: *parent,
                            blocks: &self.blocks,
                        },
                    )
                }
                DecodedEvent::Removed { hashes, .. } => p.apply_event(
                    rank,
                    &KvEvent::Removed {
                        tier,
                        external_hashes: &b.hashes[hashes.clone()],
                    },
                ),
                DecodedEvent::Cleared => p.apply_event(rank, &KvEvent::Cleared),
            };
            match r {
                Ok(o) => {
                    stored += o.stored as u64;
                    removed += o.removed as u64;
                }
                Err(IndexError::ParentNotFound { .. }) | Err(IndexError::TooManyRanks) => {
                    rejected += 1;
                }
            }
        }
        let mut s = self.stats.lock();
        s.batches += 1;
        s.events += b.events.len() as u64;
        s.blocks_stored += stored;
        s.blocks_removed += removed;
        s.events_rejected += rejected;
        s.block_size_mismatches += mismatched;
        s.events_skipped_group += skipped_group;
        s.events_skipped_medium += skipped_medium;
        s.group_switches += switches;
        s.last_batch_unix_ms = now_unix_ms();
        true
    }
}

/// Wall-clock ms since the Unix epoch (at least 1: 0 means "never" in the stats).
fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
        .max(1)
}

/// The tier of a medium (`None`: unknown, the event is skipped).
fn tier(m: Medium) -> Option<Tier> {
    match m {
        Medium::Gpu => Some(Tier::Device),
        Medium::Cpu => Some(Tier::Host),
        Medium::Storage => Some(Tier::Disk),
        Medium::Unknown => None,
    }
}
