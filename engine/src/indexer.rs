//! Indexer policy (DESIGN.md §5, seed 000): which index answers a selection's overlap
//! query, and which bookings write into one.
//!
//! | configuration | primary | side index |
//! |---|---|---|
//! | events on | event-driven | — |
//! | events on + prediction TTL | event-driven | approximate, short TTL; a query takes the per-rank max |
//! | events off | approximate, fed by bookings | — |
//! | remote URL (events on) | remote `POST /query_tiered_by_hash`; no local subscription | — |
//! | remote URL + events off | **rejected**: the remote service has no write API | |
//!
//! A booking (`select_and_reserve`, a replica booking installed from a peer, an explicit
//! reservation that carries tokens or hashes) records its decision into the approximate
//! index — the primary when events are off, the side index when a prediction TTL is set —
//! *after* the booking: a recording failure is logged and counted, never a failed
//! booking. Advisory selection records nothing.
//!
//! # A remote primary: who builds the client
//!
//! The engine speaks no HTTP: it calls the remote primary through the [`RemoteIndex`]
//! trait, and the host supplies the implementation in [`IndexerConfig::remote_client`]
//! (the `kvr-remote` crate's `HttpRemoteIndex` for `POST /query_tiered_by_hash`, built from
//! the URL and the timeouts by `kvr_remote::with_http_client`; libkvr does this for C, C++
//! and Go hosts; a test double or another transport works the same way). `remote_url`
//! still chooses the policy ([`IndexerPolicy::RemotePrimary`]): a URL with no client is
//! refused by [`IndexerConfig::check`] and when the partition is built, with a reason that
//! says what to supply. [`IndexerConfig::resolve`] stays the policy table alone, so a host
//! can learn the policy before it builds a client.
//!
//! # No engine lock across the remote call
//!
//! A remote query blocks its thread for up to the client's request timeout. The selection's
//! decision (`Selector::decide`, select/decide.rs) makes it first, through
//! `IndexState::query_remote`, before it reads the worker set, the hooks, the booking table
//! or the load, and with no guard alive: what it holds is its own thread-local scratch
//! (taken out of its slot, not borrowed) and `&self`. No engine `Mutex` is held by the
//! selection path above it either (`Engine::select` / `select_and_reserve` through a handle
//! hold the partition by `Arc` and release the id claim's map entry before deciding). So a
//! slow remote delays only its own selection: `engine/tests/remote_no_lock.rs` runs the
//! other partition and engine operations (membership, hooks, ingest, statistics, selections
//! of the same session, bookings, frees, partitions created and removed) from another
//! thread while a remote query is in progress, and fails naming the first that waits for
//! it.

use std::time::Duration;

use crate::ids::RankId;
use crate::ids::{PartitionKey, WorkerId};
use crate::index::remote::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT};
use crate::index::{
    ApproxConfig, ApproxRecorder, ApproxStats, Index, IndexConfig, RemoteIndex, TieredOverlap,
    TieredScores,
};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::StdArc as Arc;

/// How the approximate index forgets what bookings recorded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Retention {
    /// Records expire `ApproxConfig::ttl` after their last booking (Dynamo's default).
    #[default]
    Ttl,
    /// At most a worker's KV capacity per rank, least recently used first. Accepted as
    /// configuration; until request leases are shared (seed 000 defers it the same way)
    /// it falls back to [`Retention::Ttl`] with a logged notice.
    CapacityBounded,
}

/// A partition's indexing configuration, as a Dynamo router is configured.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    /// The engines' KV events feed the index (Dynamo's `use_kv_events`, default on).
    pub use_kv_events: bool,
    /// With events on: also record bookings into a side index kept this long, so a
    /// prefix just routed counts before its engine's events arrive. `None` = no side
    /// index.
    pub prediction_ttl: Option<Duration>,
    /// A remote index service answers overlap queries (`POST {url}/query_tiered_by_hash`,
    /// protocol in the `kvr-remote` crate), through [`IndexerConfig::remote_client`].
    pub remote_url: Option<String>,
    /// Bounds on one remote query (connect, whole request), for the host building the
    /// client (`kvr_remote::with_http_client` uses them). An unreachable or slow remote
    /// gives that selection no overlap: counted and logged, never a failed selection.
    pub remote_connect_timeout: Duration,
    /// The whole-request bound (see `remote_connect_timeout`).
    pub remote_request_timeout: Duration,
    /// The remote primary's client, required with `remote_url` (the engine has no HTTP
    /// client of its own: see the module documentation). `kvr_remote::with_http_client`
    /// fills it with the HTTP client of `remote_url` and the timeouts above; a host may
    /// pass any [`RemoteIndex`] (its own transport, a test double). Ignored without a URL.
    pub remote_client: Option<RemoteClient>,
    /// Retention of the approximate index (primary with events off; the side index takes
    /// its size bound, with `prediction_ttl` as TTL).
    pub approx: ApproxConfig,
    /// How the approximate index forgets; `CapacityBounded` falls back to `Ttl` for now.
    pub retention: Retention,
}

impl Default for IndexerConfig {
    fn default() -> Self {
        IndexerConfig {
            use_kv_events: true,
            prediction_ttl: None,
            remote_url: None,
            remote_connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            remote_request_timeout: DEFAULT_REQUEST_TIMEOUT,
            remote_client: None,
            approx: ApproxConfig::default(),
            retention: Retention::Ttl,
        }
    }
}

/// A remote index the host supplies (compared by identity).
#[derive(Clone)]
pub struct RemoteClient(pub Arc<dyn RemoteIndex>);

impl std::fmt::Debug for RemoteClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RemoteClient(..)")
    }
}

impl PartialEq for RemoteClient {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The indexing a configuration resolves to.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum IndexerPolicy {
    /// Events feed the primary; bookings record nothing.
    EventDriven,
    /// Events feed the primary; bookings are recorded into a side index with this TTL.
    EventDrivenWithPrediction {
        /// How long a recorded booking counts (`prediction_ttl`).
        ttl: Duration,
    },
    /// No events: the primary holds what bookings recorded.
    ApproximatePrimary,
    /// A remote service is the primary; nothing is indexed locally.
    RemotePrimary {
        /// The service's base URL (`remote_url`).
        url: String,
    },
}

impl IndexerPolicy {
    /// Whether engine events are applied to the local index.
    pub fn applies_events(&self) -> bool {
        matches!(
            self,
            IndexerPolicy::EventDriven | IndexerPolicy::EventDrivenWithPrediction { .. }
        )
    }
}

/// A resolved configuration: the policy, the approximate retention actually used, and
/// notices for what was accepted but changed (logged when the partition is built).
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedIndexer {
    /// The policy the configuration selects.
    pub policy: IndexerPolicy,
    /// Retention of the approximate index the policy records into, if any.
    pub approx: Option<ApproxConfig>,
    /// What was accepted but changed, in words.
    pub notices: Vec<String>,
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexerConfigError(pub String);

impl std::fmt::Display for IndexerConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for IndexerConfigError {}

impl IndexerConfig {
    /// Whether a partition can be built with this configuration, checked as building it
    /// would (the table, then that a remote primary has its client), without building one
    /// and without logging: hosts validate configuration up front and show the reason
    /// (the C ABI's `kvr_partition_options_check`, which first gives a remote URL its HTTP
    /// client, so that a URL the client cannot use is reported too).
    pub fn check(&self) -> Result<ResolvedIndexer, IndexerConfigError> {
        let resolved = self.resolve()?;
        IndexState::remote_primary(&resolved, self)?;
        Ok(resolved)
    }

    /// DESIGN.md §5's table, row by row.
    pub fn resolve(&self) -> Result<ResolvedIndexer, IndexerConfigError> {
        let mut notices = Vec::new();
        let bad = |m: String| Err(IndexerConfigError(m));
        if self.approx.max_blocks == 0 {
            return bad(
                "the approximate index's size bound (max_blocks) must be at least 1".into(),
            );
        }
        let mut approx = self.approx;
        if self.retention == Retention::CapacityBounded {
            notices.push(format!(
                "capacity-bounded approximate retention is not supported yet; records expire \
                 after the TTL ({} s) instead",
                approx.ttl.as_secs_f64()
            ));
        }
        if let Some(url) = &self.remote_url {
            if !self.use_kv_events {
                return bad(
                    "a remote index primary cannot run with KV events off: the remote index \
                     service has no write API for routing decisions, so nothing would ever \
                     fill it (turn events on, or drop the remote URL to use the approximate \
                     index)"
                        .into(),
                );
            }
            if url.trim().is_empty() {
                return bad("the remote index URL is empty".into());
            }
            if self.prediction_ttl.is_some() {
                notices.push(
                    "the prediction TTL is ignored with a remote primary (no local index to \
                     pair it with)"
                        .into(),
                );
            }
            return Ok(ResolvedIndexer {
                policy: IndexerPolicy::RemotePrimary { url: url.clone() },
                approx: None,
                notices,
            });
        }
        if !self.use_kv_events {
            if self.prediction_ttl.is_some() {
                notices.push(
                    "the prediction TTL is ignored with events off (the primary is already \
                     fed by bookings)"
                        .into(),
                );
            }
            return Ok(ResolvedIndexer {
                policy: IndexerPolicy::ApproximatePrimary,
                approx: Some(approx),
                notices,
            });
        }
        match self.prediction_ttl {
            Some(ttl) if ttl.is_zero() => bad("the prediction TTL must be longer than 0".into()),
            Some(ttl) => {
                approx.ttl = ttl;
                Ok(ResolvedIndexer {
                    policy: IndexerPolicy::EventDrivenWithPrediction { ttl },
                    approx: Some(approx),
                    notices,
                })
            }
            None => Ok(ResolvedIndexer {
                policy: IndexerPolicy::EventDriven,
                approx: None,
                notices,
            }),
        }
    }
}

/// A partition's live indexing state: the policy and what it needs.
pub(crate) struct IndexState {
    pub(crate) policy: IndexerPolicy,
    /// Records bookings into the primary (events off) or into `side` (prediction).
    pub(crate) recorder: Option<Arc<ApproxRecorder>>,
    /// The prediction side index.
    pub(crate) side: Option<Arc<Index>>,
    /// The remote primary.
    pub(crate) remote: Option<Arc<dyn RemoteIndex>>,
    counters: IndexerCounters,
}

#[derive(Default)]
struct IndexerCounters {
    recorded: AtomicU64,
    record_failures: AtomicU64,
    remote_queries: AtomicU64,
    remote_failures: AtomicU64,
    events_ignored: AtomicU64,
    /// Recordings still to fail on purpose ([`IndexState::fail_next_records`]).
    injected_failures: AtomicU64,
}

/// A partition's indexing, as read at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerStats {
    /// The policy the configuration resolved to.
    pub policy: IndexerPolicy,
    /// Bookings recorded into the approximate index.
    pub bookings_recorded: u64,
    /// Recordings that failed (logged; the bookings stood).
    pub record_failures: u64,
    /// The approximate index's own counters, if the policy keeps one.
    pub approx: Option<ApproxStats>,
    /// Overlap queries sent to the remote primary, and those that failed (the selection
    /// went on without overlap).
    pub remote_queries: u64,
    /// Of `remote_queries`, those that failed.
    pub remote_failures: u64,
    /// Engine event messages handed to a partition whose policy applies none (events
    /// off, or a remote primary): not applied.
    pub events_ignored: u64,
    /// Engine messages, batches and topics refused because they would create ingress
    /// state past a bound: a bind subscription's route-less topic past its cap, a stream
    /// past the partition's stream cap, a rank of a worker not registered past the
    /// pending-rank budget, or a typed batch for a DP rank its worker does not have.
    pub ingress_refused: u64,
}

impl IndexState {
    pub(crate) fn new(
        resolved: &ResolvedIndexer,
        cfg: &IndexerConfig,
    ) -> Result<Self, IndexerConfigError> {
        for n in &resolved.notices {
            log::warn!("kvr indexer: {n}");
        }
        let remote = Self::remote_primary(resolved, cfg)?;
        let side = match resolved.policy {
            IndexerPolicy::EventDrivenWithPrediction { .. } => Some(Arc::new(if cfg!(loom) {
                Index::with_config(IndexConfig {
                    shards: 1,
                    min_shard_capacity: 8,
                })
            } else {
                Index::new()
            })),
            _ => None,
        };
        Ok(IndexState {
            policy: resolved.policy.clone(),
            recorder: resolved.approx.map(|c| Arc::new(ApproxRecorder::new(c))),
            side,
            remote,
            counters: IndexerCounters::default(),
        })
    }

    /// The remote primary the policy names: the client the host supplied. A remote URL
    /// without one is refused (the engine cannot reach a URL by itself).
    fn remote_primary(
        resolved: &ResolvedIndexer,
        cfg: &IndexerConfig,
    ) -> Result<Option<Arc<dyn RemoteIndex>>, IndexerConfigError> {
        let IndexerPolicy::RemotePrimary { url } = &resolved.policy else {
            return Ok(None);
        };
        match &cfg.remote_client {
            Some(c) => Ok(Some(c.0.clone())),
            None => Err(IndexerConfigError(format!(
                "remote index {url:?}: no client to reach it (IndexerConfig::remote_client is \
                 unset; the kvr engine has no HTTP client of its own: build one with the \
                 kvr-remote crate, kvr_remote::with_http_client or HttpRemoteIndex, or supply \
                 any RemoteIndex)"
            ))),
        }
    }

    /// The remote primary's overlap for a prompt's local hashes into `out`; on failure
    /// (refused, timed out, garbage) no overlap, counted and logged — the selection goes on.
    pub(crate) fn query_remote(
        &self,
        remote: &dyn RemoteIndex,
        key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) {
        if local_hashes.is_empty() {
            let _ = out.fill_from(std::iter::empty());
            return;
        }
        self.counters.remote_queries.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = remote.query_tiered(key, block_size, local_hashes, out) {
            let n = self
                .counters
                .remote_failures
                .fetch_add(1, Ordering::Relaxed)
                + 1;
            // Logged at the 1st, 2nd, 4th, 8th... failure: visible, never a flood.
            if n.is_power_of_two() {
                log::warn!("kvr indexer: remote index query failed ({n} so far): {e}");
            }
            let _ = out.fill_from(std::iter::empty());
        }
    }

    /// Records a booking of the prompt `seqs` (sequence hashes, first block first) on
    /// `rank` into the approximate index (`primary` when it is the approximate one), if
    /// the policy keeps one. Called after the booking; a failure is logged and counted.
    pub(crate) fn record_booking(
        &self,
        primary: &Index,
        rank: RankId,
        seqs: &[u64],
        now: std::time::Instant,
    ) {
        let Some(rec) = &self.recorder else { return };
        if seqs.is_empty() {
            return;
        }
        let index = self.side.as_deref().unwrap_or(primary);
        let injected = self.counters.injected_failures.load(Ordering::Relaxed) != 0
            && self
                .counters
                .injected_failures
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok();
        let result = if injected {
            Err(crate::index::IndexError::TooManyRanks)
        } else {
            rec.record_sequence(index, rank, seqs, now).map(|_| ())
        };
        match result {
            Ok(_) => {
                self.counters.recorded.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.counters
                    .record_failures
                    .fetch_add(1, Ordering::Relaxed);
                log::warn!("kvr indexer: recording a booking on {rank} failed: {e}");
            }
        }
    }

    /// Forgets a removed worker: the approximate recorder's records of its ranks, then
    /// its entries in the prediction side index (the caller removes it from the primary
    /// afterwards: records first, see `ApproxRecorder::forget_rank`).
    pub(crate) fn forget_worker(&self, worker: WorkerId, ranks: impl Iterator<Item = RankId>) {
        if let Some(rec) = &self.recorder {
            for rank in ranks {
                rec.forget_rank(rank);
            }
        }
        if let Some(side) = &self.side {
            side.remove_worker(worker);
        }
    }

    /// The keys the local primary is looked up by (`crate::index`'s "Keys"): a prompt's
    /// local hashes when engine events feed it, its sequence hashes when bookings do.
    pub(crate) fn primary_keys<'a>(&self, local: &'a [u64], seq: &'a [u64]) -> &'a [u64] {
        match self.policy {
            IndexerPolicy::ApproximatePrimary => seq,
            _ => local,
        }
    }

    /// Raises `tiered` to the side index's device prefixes, per rank (prediction).
    /// `predicted` and `merged` are the caller's reused buffers (no allocation once warm).
    pub(crate) fn merge_prediction(
        &self,
        seqs: &[u64],
        tiered: &mut TieredScores,
        predicted: &mut TieredScores,
        merged: &mut Vec<TieredOverlap>,
    ) {
        let Some(side) = &self.side else { return };
        // The side index is fed by bookings: keyed by sequence hashes.
        side.find_matches_tiered_into(seqs, predicted);
        if predicted.is_empty() {
            return;
        }
        merge_device_max(tiered.as_slice(), predicted.as_slice(), merged);
        tiered
            .fill_from(merged.drain(..))
            .expect("a merge lists each rank once");
    }

    /// The booking-table sweep interval this policy needs: `default`, or with an
    /// approximate index at most half its TTL (at least 100 ms).
    pub(crate) fn sweep_interval(&self, default: Option<Duration>) -> Option<Duration> {
        let Some(rec) = &self.recorder else {
            return default;
        };
        let half = (rec.config().ttl / 2).max(Duration::from_millis(100));
        Some(default.map_or(half, |d| d.min(half)))
    }

    /// Makes the next `n` recordings fail as a full index would (`TooManyRanks`): the only
    /// other way to reach that path is 2^18 ranks. For tests of what a failure does.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn fail_next_records(&self, n: u64) {
        self.counters.injected_failures.store(n, Ordering::Relaxed);
    }

    /// Whether engine events reach the local index; if not, counts one ignored message.
    pub(crate) fn accepts_events(&self) -> bool {
        let yes = self.policy.applies_events();
        if !yes {
            self.counters.events_ignored.fetch_add(1, Ordering::Relaxed);
        }
        yes
    }

    pub(crate) fn stats(&self) -> IndexerStats {
        IndexerStats {
            policy: self.policy.clone(),
            bookings_recorded: self.counters.recorded.load(Ordering::Relaxed),
            record_failures: self.counters.record_failures.load(Ordering::Relaxed),
            approx: self.recorder.as_ref().map(|r| r.stats()),
            remote_queries: self.counters.remote_queries.load(Ordering::Relaxed),
            remote_failures: self.counters.remote_failures.load(Ordering::Relaxed),
            events_ignored: self.counters.events_ignored.load(Ordering::Relaxed),
            // The partition's ingress keeps this count (`Partition::indexer_stats`).
            ingress_refused: 0,
        }
    }
}

/// Per rank, the larger device prefix of the two; the primary's blocks beyond it stay on
/// their slower tiers. Both inputs sorted by rank; so is the result.
pub(crate) fn merge_device_max(
    primary: &[TieredOverlap],
    side: &[TieredOverlap],
    out: &mut Vec<TieredOverlap>,
) {
    out.clear();
    let (mut i, mut j) = (0, 0);
    while i < primary.len() || j < side.len() {
        let take_p = j >= side.len() || (i < primary.len() && primary[i].rank <= side[j].rank);
        let take_s = i >= primary.len() || (j < side.len() && side[j].rank <= primary[i].rank);
        match (take_p, take_s) {
            (true, true) => {
                let (p, s) = (primary[i], side[j]);
                let device = p.device.max(s.device);
                // What the primary covers beyond the new device prefix keeps its tiers.
                let host = (p.device + p.host).saturating_sub(device);
                let end = p.device + p.host + p.disk;
                let disk = end.saturating_sub(device + host);
                out.push(TieredOverlap {
                    rank: p.rank,
                    device,
                    host,
                    disk,
                });
                i += 1;
                j += 1;
            }
            (true, false) => {
                out.push(primary[i]);
                i += 1;
            }
            _ => {
                out.push(TieredOverlap {
                    host: 0,
                    disk: 0,
                    ..side[j]
                });
                j += 1;
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn merge_device_max(p: &[TieredOverlap], s: &[TieredOverlap]) -> Vec<TieredOverlap> {
        let mut out = vec![o(9, 9, 9, 9)]; // stale contents are cleared
        super::merge_device_max(p, s, &mut out);
        out
    }

    fn o(w: u64, device: u32, host: u32, disk: u32) -> TieredOverlap {
        TieredOverlap {
            rank: RankId::new(w, 0),
            device,
            host,
            disk,
        }
    }

    #[test]
    fn merge_takes_the_larger_device_prefix_per_rank_and_keeps_slower_tiers_beyond_it() {
        let primary = [o(1, 2, 3, 1), o(3, 5, 0, 0), o(4, 1, 0, 0)];
        let side = [o(0, 4, 0, 0), o(1, 4, 0, 0), o(3, 2, 0, 0), o(4, 9, 0, 0)];
        assert_eq!(
            merge_device_max(&primary, &side),
            vec![
                o(0, 4, 0, 0),
                // device 2 → 4: host blocks 3..5 (two of three) become device; 1 host + disk.
                o(1, 4, 1, 1),
                o(3, 5, 0, 0),
                o(4, 9, 0, 0),
            ]
        );
        // A side prefix past the primary's host and disk blocks covers them all.
        assert_eq!(
            merge_device_max(&[o(1, 1, 1, 1)], &[o(1, 6, 0, 0)]),
            vec![o(1, 6, 0, 0)]
        );
        assert_eq!(merge_device_max(&[], &[]), vec![]);
        assert_eq!(merge_device_max(&primary, &[]), primary.to_vec());
    }
}
