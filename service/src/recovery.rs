//! `--indexer-peers`: at start, the index is recovered from the first peer whose
//! `GET /dump` (kvr's or Dynamo's shape, [`crate::wire::dump`]) answers and parses.
//! `/ready` answers 503 until recovery ends.
//!
//! Order: workers may register meanwhile, but their KV-event streams are held (no socket
//! opened, nothing applied: `App::set_recovered` opens the gate) until the dump is applied.
//! Each stream then joins as a late subscriber does: it asks its publisher's replay buffer
//! for everything from the first batch, and only then applies live batches. Replaying
//! events the dump already reflects changes nothing in the end (the last event of each
//! block decides); a live event
//! applied before the dump would not be, as the older dump would undo it (a block the
//! engine removed brought back). What the replay buffer no longer holds comes only from
//! the dump. While a stream replays, its ranks hold blocks of the replayed history until
//! the replay reaches their removal: every rank the dump filled is listed stale (no
//! overlap credit) until its stream has joined (`distrust_until_joined`).
//!
//! A peer that is unreachable, slow (`--recovery-timeout-secs`), too large
//! (`--recovery-max-bytes`), truncated or garbage is logged and counted
//! (`kvr_recovery_failures_total`) and the next is tried; when none answers, the service
//! starts empty. A dump is parsed whole before anything is applied, so a bad one leaves
//! nothing half-applied. Events a partition refuses (e.g. a parent the dump did not
//! carry) are skipped and counted, as live events are.

use std::collections::BTreeSet;
use std::io::Read;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::ingress::EventSink;
use kvr::stats::StreamStats;
use kvr::DumpedStore;
use kvr::{KvEvent, Partition, PartitionKey, RankId};

use crate::wire::dump::{parse_partition_name, stores_of, Dump};
use crate::App;

/// How long a rank the dump filled stays out of overlap credit, at most, waiting for its
/// stream to join (a worker that never registers must not keep it out for ever).
const DISTRUST_AT_MOST: Duration = Duration::from_secs(600);

/// How often the ranks the dump filled are checked for their stream having joined.
const JOIN_POLL: Duration = Duration::from_millis(20);

/// Starts recovery from the peers (if any) on a blocking thread.
pub fn start(app: Arc<App>) {
    if app.args.indexer_peers.is_empty() || app.state.as_ref().is_some_and(|s| s.restored_any()) {
        app.set_recovered();
        return;
    }
    std::thread::spawn(move || {
        recover_from(&app, &app.args.indexer_peers);
        app.set_recovered();
    });
}

/// Recovers the index from the first of `peers` whose dump answers and parses (blocking:
/// one GET per peer tried); false when none could be used. Also the Python bindings'
/// `recover_indexer_from_peers`.
pub fn recover_from(app: &App, peers: &[String]) -> bool {
    let m = &app.metrics.recovery;
    for peer in peers {
        m.attempts.fetch_add(1, Ordering::Relaxed);
        let url = format!("{}/dump", peer.trim_end_matches('/'));
        let timeout = Duration::from_secs(app.args.recovery_timeout_secs.max(1));
        match fetch(&url, app.args.recovery_max_bytes, timeout).and_then(|b| parse(&b)) {
            Ok(dump) => {
                let applied = apply(app, &dump);
                distrust_until_joined(app, &dump);
                m.events.fetch_add(applied, Ordering::Relaxed);
                tracing::info!(%peer, events = applied, partitions = dump.len(), "recovered the index from a peer");
                return true;
            }
            Err(e) => {
                m.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, error = %e, "peer dump refused; trying the next peer");
            }
        }
    }
    tracing::warn!("no peer dump could be used: starting with an empty index");
    false
}

fn fetch(url: &str, max_bytes: u64, timeout: Duration) -> Result<Vec<u8>, String> {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .new_agent();
    let resp = agent
        .get(url)
        .call()
        .map_err(|e| format!("GET {url}: {e}"))?;
    if resp.status() != 200 {
        return Err(format!("GET {url}: status {}", resp.status()));
    }
    let mut body = Vec::new();
    resp.into_body()
        .into_reader()
        .take(max_bytes + 1)
        .read_to_end(&mut body)
        .map_err(|e| format!("GET {url}: reading the body: {e}"))?;
    if body.len() as u64 > max_bytes {
        return Err(format!("GET {url}: dump larger than {max_bytes} bytes"));
    }
    Ok(body)
}

/// One partition of a peer's dump, checked and converted.
#[derive(Debug)]
pub struct RecoveredPartition {
    pub key: PartitionKey,
    pub block_size: u32,
    pub stores: Vec<DumpedStore>,
}

/// Parses and checks a whole dump (nothing is applied from a dump that does not parse).
pub fn parse(body: &[u8]) -> Result<Vec<RecoveredPartition>, String> {
    let dump: Dump = serde_json::from_slice(body).map_err(|e| format!("not a dump: {e}"))?;
    dump.iter()
        .map(|(name, p)| {
            let key = parse_partition_name(name)
                .ok_or_else(|| format!("partition name {name:?} is not <model>:<routing_group>"))?;
            if p.block_size == 0 {
                return Err(format!("partition {name:?} has block_size 0"));
            }
            let stores = stores_of(p).map_err(|e| format!("partition {name:?}: {e}"))?;
            Ok(RecoveredPartition {
                key,
                block_size: p.block_size,
                stores,
            })
        })
        .collect()
}

/// Lists every rank the dump filled as stale (selection gives it no overlap credit, as for
/// a stream with a known loss: `kvr::stats::StaleRanks`) until its KV-event stream has
/// joined: the join replays the publisher's buffer from its first batch, history older
/// than the dump, whose blocks would otherwise be credited until the replay reaches their
/// removal. Listed before the streams start (they wait for `App::set_recovered`).
fn distrust_until_joined(app: &App, dump: &[RecoveredPartition]) {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut listed: Vec<(Arc<Partition>, RankId)> = Vec::new();
    for p in dump {
        let Ok(partition) = app.engine.partition(&p.key) else {
            continue;
        };
        let ranks: BTreeSet<RankId> = p.stores.iter().map(|s| s.rank).collect();
        for rank in ranks {
            partition.mark_stale(rank.worker_id, &[rank.dp_rank], Some(since));
            listed.push((partition.clone(), rank));
        }
    }
    if listed.is_empty() {
        return;
    }
    let registry = app.registry.clone();
    let gate = app.live_events_gate.clone();
    let watch = move || {
        let give_up = Instant::now() + DISTRUST_AT_MOST;
        while !listed.is_empty() {
            let late = Instant::now() >= give_up;
            let started = gate.as_ref().is_none_or(|g| g.is_open());
            // Workers whose streams replay (a replay endpoint): only those replay history.
            let replaying: BTreeSet<u64> = registry
                .records()
                .into_iter()
                .filter(|r| r.replay_endpoint.as_deref().is_some_and(|e| !e.is_empty()))
                .map(|r| r.worker_id)
                .collect();
            listed.retain(|(p, rank)| {
                let trusted = late
                    || (started
                        && p.ingress_stats()
                            .iter()
                            .any(|s| has_joined(s, *rank, replaying.contains(&rank.worker_id))));
                if trusted {
                    p.mark_stale(rank.worker_id, &[rank.dp_rank], None);
                    // The stream may have listed the rank itself (a loss) between the
                    // check above and that unlisting: list it again, with its time, so a
                    // stale rank is never credited (the stream unlists it at its repair).
                    let own = p.ingress_stats().into_iter().find(|s| {
                        s.worker_id == rank.worker_id
                            && s.stream == rank.dp_rank
                            && s.stale_since_unix_ms != 0
                    });
                    if let Some(s) = own {
                        p.mark_stale(rank.worker_id, &[rank.dp_rank], Some(s.stale_since_unix_ms));
                    }
                }
                !trusted
            });
            std::thread::sleep(JOIN_POLL);
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kvr-recovery-join".to_string())
        .spawn(watch)
    {
        tracing::warn!(error = %e, "could not watch the recovered ranks' streams: they stay without overlap credit");
    }
}

/// Whether `rank`'s stream has joined: it exists (its worker registered), and, if it
/// replays (`replays`), its join replay has ended (a stream without replay applies no
/// history: it joins as it starts). Not while the stream lists its own ranks stale after
/// applying something: unlisting the rank then would drop the stream's listing too.
fn has_joined(s: &StreamStats, rank: RankId, replays: bool) -> bool {
    let q = &s.sequence;
    s.worker_id == rank.worker_id
        && s.stream == rank.dp_rank
        && !q.recovering
        && (s.stale_since_unix_ms == 0 || q.last_seq.is_none())
        && (!replays || q.replays_requested > 0)
}

/// Applies a parsed dump; returns the events applied.
pub fn apply(app: &App, dump: &[RecoveredPartition]) -> u64 {
    let mut applied = 0;
    for p in dump {
        let partition = match app.registry.ensure_partition(&p.key, p.block_size) {
            Ok(part) => part,
            Err(e) => {
                tracing::warn!(model = %p.key.model, routing_group = %p.key.routing_group, error = %e.message, "dump partition skipped");
                continue;
            }
        };
        for s in &p.stores {
            let out = partition.apply_events(
                s.rank,
                [KvEvent::Stored {
                    tier: s.tier,
                    parent: s.parent,
                    blocks: &s.blocks,
                }],
            );
            applied += out.applied;
        }
    }
    applied
}
