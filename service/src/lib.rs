//! `kvr serve`: kvr's engine behind Dynamo 1.6.1's standalone selection service API (and
//! its KV indexer's), so a client, EPP or router written for
//! `python -m dynamo.select_service` works unchanged.
//!
//! Layers: `wire` (the JSON bodies, Dynamo's names) → `registry` (workers, partitions,
//! KV-event subscriptions) → `routes` (one file per group of routes) → `server` (the
//! listener, shutdown, logging). The engine crate stays free of network code; this crate
//! is one of its hosts.
//!
//! Where kvr answers differently from Dynamo on purpose, `tests/compat/known-differences.md`
//! says so and why (the harness there checks every other answer against Dynamo's).

pub mod args;
pub mod conn;
pub mod coverage;
pub mod error;
pub mod figures;
pub mod ids;
pub mod metrics;
pub mod pending;
pub mod recovery;
pub mod refusals;
pub mod registry;
pub mod replica;
pub mod replica_slot;
pub mod replica_sync;
pub mod routes;
pub mod server;
pub mod sources;
pub mod state;
pub mod tracking;
pub mod wire;

/// Hooks for the fuzz targets and the parser bench (not an API).
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::wire::tokens::agrees_with_serde as token_split_agrees_with_serde;

    /// The hand-read `token_ids` of a JSON body, or `None` where the split declines.
    pub fn split_tokens(body: &[u8]) -> Option<Vec<u32>> {
        crate::wire::tokens::split_token_ids(body).map(|s| s.tokens)
    }

    /// The `token_ids` of a msgpack body as the service reads them.
    pub fn msgpack_tokens(body: &[u8]) -> Option<Vec<u32>> {
        crate::wire::msgpack::transcode(body, true)
            .ok()
            .and_then(|t| t.tokens)
    }
}

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvr::config::CostConfig;
use kvr::config::{IndexerConfig, PartitionConfig};
use kvr::Engine;

pub use args::ServeArgs;
pub use server::{run, serve_on};

use crate::ids::SelectionIds;
use crate::metrics::Metrics;
use crate::pending::{PendingCache, PendingLimits};
use crate::registry::Registry;

/// The service's shared state.
#[derive(Debug)]
pub struct App {
    pub engine: Arc<Engine>,
    pub registry: Arc<Registry>,
    pub ids: SelectionIds,
    pub pending: Arc<PendingCache>,
    pub metrics: Metrics,
    pub args: ServeArgs,
    /// `--state-dir`'s partitions and registrations.
    pub state: Option<Arc<crate::state::ServiceState>>,
    /// When the service started, for `/ready`'s wait bound (`coverage`).
    pub ready_gate: Arc<crate::coverage::ReadyGate>,
    /// Replica sync (`--replica-sync-port`), once started.
    pub replicas: Arc<crate::replica::Replicas>,
    /// False while recovering from peers: `/ready` answers 503.
    recovered: AtomicBool,
    /// Holds every KV-event stream while recovering from peers (opened with `recovered`).
    pub(crate) live_events_gate: Option<kvr_zmq::StartGate>,
}

impl App {
    pub fn new(args: ServeArgs) -> Result<Arc<Self>, String> {
        Self::with_metrics(args, |_| {})
    }

    /// As [`App::new`], with a host's own metrics in the same `/metrics` (`extra`
    /// registers them).
    pub fn with_metrics(
        args: ServeArgs,
        extra: impl FnOnce(&mut prometheus_client::registry::Registry),
    ) -> Result<Arc<Self>, String> {
        crate::replica::check_args(args.replica_sync_port, &args.replica_sync_peers)?;
        crate::replica_slot::check_args(args.replica_ordinal, args.replica_count)?;
        for warning in args.check_dynamo_flags()? {
            tracing::warn!("{warning}");
        }
        let engine = Arc::new(Engine::new());
        let config = partition_config(&args)?;
        let use_events = args.knobs.router_use_kv_events && args.remote_indexer_url.is_none();
        let factory = move |block_size: u32| {
            let mut c = config.clone();
            c.block_size = block_size;
            c
        };
        let live_events_gate = live_events_gate(&args);
        let subscribe = kvr_zmq::SubscribeOptions {
            start_gate: live_events_gate.clone(),
            idle_probe_after: (args.kv_events_idle_probe_ms > 0)
                .then(|| Duration::from_millis(args.kv_events_idle_probe_ms)),
            replay_timeout: Duration::from_millis(args.kv_events_replay_timeout_ms.max(1)),
            silence_bound: (args.kv_events_silence_ms > 0)
                .then(|| Duration::from_millis(args.kv_events_silence_ms)),
            ..kvr_zmq::SubscribeOptions::default()
        };
        let registry = Arc::new(
            Registry::new(engine.clone(), use_events, Box::new(factory))
                .with_subscribe_options(subscribe),
        );
        if let (Some(o), Some(n)) = (args.replica_ordinal, args.replica_count) {
            registry.set_partition_hooks(kvr::HostHooks {
                tie_break: Some(crate::replica_slot::tie_break(o, n)),
                ..kvr::HostHooks::default()
            });
        }
        let pending = Arc::new(PendingCache::new(PendingLimits {
            ttl: Duration::from_secs(args.selection_cache_ttl_secs),
            max_entries: args.selection_cache_max_entries.max(1),
            max_bytes: args.selection_cache_max_bytes,
        }));
        let state = match &args.state_dir {
            Some(dir) => {
                let s = crate::state::ServiceState::open(dir, args.state_io)?;
                registry.set_state(s.clone());
                Some(s)
            }
            None => None,
        };
        let ready_gate = Arc::new(crate::coverage::ReadyGate::default());
        let replicas = Arc::new(crate::replica::Replicas::default());
        let metrics = Metrics::with_extra(registry.clone(), pending.clone(), |r| {
            if let Some(s) = &state {
                r.register_collector(Box::new(crate::state::StateMetrics(s.clone())));
            }
            r.register_collector(Box::new(crate::replica::ReplicaMetrics(replicas.clone())));
            r.register_collector(Box::new(crate::coverage::CoverageMetrics {
                registry: registry.clone(),
                gate: ready_gate.clone(),
                min_exact_share: args.ready_min_exact_share,
            }));
            extra(r)
        });
        if state.is_some() {
            let n = registry.replay_saved_workers();
            tracing::info!(workers = n, "state: kept registrations registered again");
        }
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id());
        Ok(Arc::new(Self {
            engine,
            registry,
            ids: SelectionIds::new(seed),
            pending,
            metrics,
            recovered: AtomicBool::new(args.indexer_peers.is_empty()),
            live_events_gate,
            args,
            state,
            ready_gate,
            replicas,
        }))
    }

    pub fn recovered(&self) -> bool {
        self.recovered.load(Ordering::Acquire)
    }

    /// Recovery ended (the dump applied, or none could be used): the held KV-event
    /// streams start, each asking its publisher for what it still buffers.
    pub fn set_recovered(&self) {
        if let Some(gate) = &self.live_events_gate {
            gate.open();
        }
        self.recovered.store(true, Ordering::Release);
    }
}

/// With `--indexer-peers`, workers' KV-event streams wait until recovery ends: a live
/// event applied before the peer's dump (older than it) would be undone by the dump, e.g.
/// a block removed live brought back. `KVR_TEST_APPLY_LIVE_DURING_RECOVERY=1` lets them
/// apply at once instead: only for the recovery test's negative control.
fn live_events_gate(args: &ServeArgs) -> Option<kvr_zmq::StartGate> {
    if args.indexer_peers.is_empty() {
        return None;
    }
    if std::env::var_os("KVR_TEST_APPLY_LIVE_DURING_RECOVERY").is_some_and(|v| v == "1") {
        tracing::warn!("KVR_TEST_APPLY_LIVE_DURING_RECOVERY=1: live KV events apply before the peer's dump (a test control, never for production)");
        return None;
    }
    Some(kvr_zmq::StartGate::new())
}

/// A new partition's configuration from the flags (block size set per partition).
fn partition_config(args: &ServeArgs) -> Result<PartitionConfig, String> {
    let k = &args.knobs;
    let mut c = PartitionConfig::new(16);
    c.cost = CostConfig {
        overlap_score_credit: k.overlap_score_credit,
        prefill_load_scale: k.prefill_load_scale,
        host_cache_hit_weight: k.host_cache_hit_weight,
        disk_cache_hit_weight: k.disk_cache_hit_weight,
        temperature: k.router_temperature,
        decode_active_request_weight: k.decode_active_request_weight,
        credit_decay: k.credit_decay,
        model: k.cost_model,
        latency: kvr::config::LatencyConfig {
            prefill_rate_prior: k.prefill_rate_prior,
            learn_prefill_rate: k.learn_prefill_rate,
            request_overhead_ms: k.request_overhead_ms,
            kv_pressure_threshold: k.kv_pressure_threshold,
            kv_pressure_ms: k.kv_pressure_ms,
            itl_target_ms: k.itl_target_ms,
            itl_base_ms: k.itl_base_ms,
            itl_per_request_ms: k.itl_per_request_ms,
            queue_externality: k.queue_externality,
            decode_block_us: k.decode_block_us,
        },
        ..c.cost
    };
    c.booking_ttl = args.booking_ttl();
    // `GET /dump` (peer recovery) needs each block's lineage.
    c.index_dump = true;
    c.trust_stale_overlap = k.trust_stale_overlap;
    let mut indexer = IndexerConfig {
        use_kv_events: k.router_use_kv_events,
        ..IndexerConfig::default()
    };
    if let Some(url) = &args.remote_indexer_url {
        indexer.remote_url = Some(url.clone());
        indexer = kvr_remote::with_http_client(&indexer).map_err(|e| e.to_string())?;
    }
    c.indexer = indexer;
    if let Some(ttl) = args.session_affinity_ttl_secs {
        c.sessions = Some(kvr::config::SessionConfig {
            idle_ttl: Duration::from_secs(ttl),
            ..kvr::config::SessionConfig::default()
        });
    }
    c.validate()
        .map_err(|e| format!("invalid configuration: {e}"))?;
    Ok(c)
}
