//! `kvr serve`'s flags. Every flag of Dynamo 1.6.1's `python -m dynamo.select_service`
//! keeps its name; the scheduling knobs are also read from Dynamo's `DYN_ROUTER_*`
//! environment variables (a flag given wins over the environment), so a deployment's
//! existing environment configures kvr the same way.

use std::time::Duration;

use clap::Args;

/// Flags of `kvr serve`.
#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// HTTP port.
    #[arg(long, default_value_t = 8092, env = "KVR_PORT")]
    pub port: u16,
    /// Address to listen on. The default, 127.0.0.1, takes connections from this machine
    /// only; another address (0.0.0.0: every interface) lets anyone who reaches the port
    /// register workers, book and free selections, and is warned about at start.
    #[arg(long, default_value = "127.0.0.1", env = "KVR_HOST")]
    pub host: String,
    /// HTTP worker threads (Dynamo: KV indexer threads); 0 = one per core.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Comma-separated selector/indexer HTTP URLs: at start, the index is recovered from
    /// the first peer whose `GET /dump` answers (kvr's or Dynamo's); `/ready` answers 503
    /// until recovery ends.
    #[arg(long, value_delimiter = ',')]
    pub indexer_peers: Vec<String>,
    /// Keep each partition's index (a snapshot and a journal of what it applied) and the
    /// workers' registrations in this directory, so that a restart comes back warm: the
    /// registrations are replayed, the index restored, and each KV-event stream resumes
    /// from the last batch applied. Peer recovery is skipped when a partition was restored.
    #[arg(long, env = "KVR_STATE_DIR")]
    pub state_dir: Option<std::path::PathBuf>,
    /// How state files are written: `auto` (io_uring when the kernel allows it, else
    /// pwrite/fdatasync), `uring` (fail at start without it) or `plain`.
    #[arg(long, default_value = "auto", env = "KVR_STATE_IO")]
    pub state_io: kvr_state::IoMode,
    /// Largest peer `/dump` accepted at recovery, in bytes (a dump of 10 M holder-blocks
    /// is about 1 GiB of JSON).
    #[arg(long, default_value_t = 4 << 30, env = "KVR_RECOVERY_MAX_BYTES")]
    pub recovery_max_bytes: u64,
    /// The longest one peer's `GET /dump` may take at recovery, in seconds, before the
    /// next peer is tried (a peer holding 10 M holder-blocks takes tens of seconds).
    #[arg(long, default_value_t = 300, env = "KVR_RECOVERY_TIMEOUT_SECS")]
    pub recovery_timeout_secs: u64,
    /// A remote primary index (`POST {url}/query_tiered_by_hash`, Dynamo's standalone
    /// indexer or `kvr serve --indexer-only`): overlaps come from there; no local events.
    #[arg(long, env = "DYN_ROUTER_REMOTE_INDEXER_URL")]
    pub remote_indexer_url: Option<String>,
    /// Serve the standalone indexer's routes only (Dynamo's `python -m dynamo.indexer`).
    #[arg(long)]
    pub indexer_only: bool,
    /// Publish this replica's bookings on this port (ZMQ PUB, Dynamo's replica-sync wire
    /// format) for its peer replicas to subscribe to.
    #[arg(long, env = "KVR_REPLICA_SYNC_PORT")]
    pub replica_sync_port: Option<u16>,
    /// Peer replicas' sync endpoints (`tcp://host:port`, comma-separated) whose bookings
    /// this replica applies; more can be registered at run time.
    #[arg(long, env = "KVR_REPLICA_SYNC_PEERS", value_delimiter = ',')]
    pub replica_sync_peers: Vec<String>,
    /// The address the replica-sync publisher binds (default: `--host`).
    #[arg(long, env = "KVR_REPLICA_SYNC_HOST")]
    pub replica_sync_host: Option<String>,
    /// A peer replica's bookings are dropped when its link has been down this long, when
    /// it is deregistered, or when it restarts (0: keep them until they expire by age,
    /// as Dynamo does).
    #[arg(long, env = "KVR_REPLICA_SYNC_PEER_TIMEOUT_SECS", default_value_t = 30)]
    pub replica_sync_peer_timeout_secs: u64,
    /// Share bookings through this NATS server's JetStream instead (`nats://host:port`):
    /// acknowledged, ordered and replayed, so a replica that restarts or loses its link
    /// catches up. Not with `--replica-sync-port`.
    #[arg(long, env = "KVR_REPLICA_SYNC", conflicts_with_all = ["replica_sync_port", "replica_sync_peers"])]
    pub replica_sync: Option<String>,
    /// This replica's name in the JetStream sync (letters, digits, `-`, `_`; at most 64).
    /// Give the same name across restarts, so peers drop the previous process's bookings
    /// at once. Default: a random name.
    #[arg(long, env = "KVR_REPLICA_NAME")]
    pub replica_name: Option<String>,
    /// This replica's place among the router replicas, 0 to `--replica-count` - 1 (a
    /// StatefulSet's ordinal, say). Replicas with distinct places split ties between
    /// equally good workers in different ways, so replicas choosing at the same instant
    /// spread out instead of piling onto one worker. Default: a random tie-break.
    #[arg(long, env = "KVR_REPLICA_ORDINAL")]
    pub replica_ordinal: Option<u32>,
    /// How many router replicas there are (with `--replica-ordinal`).
    #[arg(long, env = "KVR_REPLICA_COUNT")]
    pub replica_count: Option<u32>,
    /// The JetStream stream the replicas share (created when missing; its subjects are
    /// `<stream>.ev.<replica name>`).
    #[arg(long, env = "KVR_REPLICA_SYNC_STREAM", default_value = kvr_replica::jetstream::DEFAULT_STREAM)]
    pub replica_sync_stream: String,
    /// JetStream sync: a replica whose heartbeats (one a second) stop this long, while
    /// this replica's own link to the server is up, has its bookings dropped here.
    #[arg(
        long,
        env = "KVR_REPLICA_SYNC_HEARTBEAT_TIMEOUT_SECS",
        default_value_t = 10
    )]
    pub replica_sync_heartbeat_timeout_secs: u64,
    /// The JetStream stream's byte bound (the oldest events go beyond it).
    #[arg(long, env = "KVR_REPLICA_SYNC_STREAM_MAX_BYTES", default_value_t = kvr_replica::jetstream::DEFAULT_MAX_BYTES)]
    pub replica_sync_stream_max_bytes: i64,
    /// Tests only: no replay in the JetStream sync (neither at start nor after a
    /// failure), to show what replay is for.
    #[arg(long, hide = true)]
    pub replica_sync_test_no_replay: bool,
    /// Pin each session id to the worker that served it for this many seconds after its
    /// last request.
    #[arg(long, env = "KVR_SESSION_AFFINITY_TTL_SECS")]
    pub session_affinity_ttl_secs: Option<u64>,
    /// Seconds an unclaimed pending selection lives.
    #[arg(long, default_value_t = 120)]
    pub selection_cache_ttl_secs: u64,
    /// Most pending selections at once.
    #[arg(long, default_value_t = 4096)]
    pub selection_cache_max_entries: usize,
    /// Approximate byte budget of the pending selections' prompts.
    #[arg(long, default_value_t = 256 << 20)]
    pub selection_cache_max_bytes: usize,
    /// Largest request body in bytes (Dynamo: 8 MiB).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a request's headers may take to arrive, counted from when the service
    /// starts waiting for them (so also the longest a keep-alive connection stays idle
    /// between requests); hyper's default. 0 = no limit.
    #[arg(long, default_value_t = 30, env = "KVR_HTTP_HEADER_READ_TIMEOUT_SECS")]
    pub http_header_read_timeout_secs: u64,
    /// Seconds a connection may move no byte while the service waits on it (a body
    /// stalled half-way, an answer nobody reads) before it is closed. 0 = no limit.
    #[arg(long, default_value_t = 60, env = "KVR_HTTP_IDLE_TIMEOUT_SECS")]
    pub http_idle_timeout_secs: u64,
    /// Seconds to let in-flight requests finish on SIGTERM/SIGINT before stopping.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_secs: u64,
    /// Milliseconds of silence after which a KV-event stream with a replay endpoint is
    /// probed (replay from its last batch: finds a loss at the end of a burst, or a
    /// restart of an idle engine; also once right after subscribing); 0 = never.
    #[arg(long, default_value_t = 1500, env = "KVR_KV_EVENTS_IDLE_PROBE_MS")]
    pub kv_events_idle_probe_ms: u64,
    /// Milliseconds a KV-event replay may go without a reply before it fails (the
    /// stream's ranks are then cleared and rebuilt).
    #[arg(long, default_value_t = 5000, env = "KVR_KV_EVENTS_REPLAY_TIMEOUT_MS")]
    pub kv_events_replay_timeout_ms: u64,
    /// Milliseconds without a message after which a connected KV-event stream counts as
    /// dead (reason "no message within the silence bound"); 0 = never (the default: an
    /// idle engine without a replay endpoint sends nothing). An unreachable endpoint is
    /// dead whatever this says.
    #[arg(long, default_value_t = 0, env = "KVR_KV_EVENTS_SILENCE_MS")]
    pub kv_events_silence_ms: u64,
    /// Answer `/ready` 503 while any KV-event stream is dead (off: `/ready` stays 200
    /// once a worker is schedulable, and its body lists the streams that are not exact).
    #[arg(long, env = "KVR_READY_REQUIRES_KV_EVENTS", default_value_t = false, action = clap::ArgAction::Set)]
    pub ready_requires_kv_events: bool,
    /// `/ready` answers 503 until this share (0 to 1) of the KV-event streams is exact
    /// (after a restart: until their replay caught up), or `--ready-wait-secs` passed.
    /// 0 (the default) does not wait; `/ready`'s body reports the share either way.
    #[arg(long, env = "KVR_READY_MIN_EXACT_SHARE", default_value_t = 0.0, value_parser = share)]
    pub ready_min_exact_share: f64,
    /// The longest `/ready` waits for `--ready-min-exact-share`, in seconds from start.
    #[arg(long, env = "KVR_READY_WAIT_SECS", default_value_t = 30)]
    pub ready_wait_secs: u64,
    /// Log format: `text` or `json` (structured, one object a line).
    #[arg(long, default_value = "text", env = "KVR_LOG_FORMAT")]
    pub log_format: String,
    #[command(flatten)]
    pub knobs: Knobs,
    /// Dynamo's `--no-router-assume-kv-reuse`: accepted; kvr always assumes reuse (see
    /// `--router-assume-kv-reuse`) and warns at start. Not refused next to
    /// `--router-assume-kv-reuse` (Dynamo refuses both flags together), as clap would also
    /// refuse it next to `DYN_ROUTER_ASSUME_KV_REUSE`, which Dynamo takes.
    #[arg(long)]
    pub no_router_assume_kv_reuse: bool,
    #[command(flatten)]
    pub tracking: crate::tracking::TrackingArgs,
}

/// The scheduling knobs, as Dynamo's router reads them.
#[derive(Clone, Debug, Args)]
pub struct Knobs {
    /// Use the engines' KV events (off: overlaps come from the service's own bookings).
    #[arg(long, env = "DYN_ROUTER_USE_KV_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub router_use_kv_events: bool,
    /// Credit a stale rank's overlap (a stream whose known loss is being replayed, or that
    /// is degraded or dead; off: it counts as none until repaired,
    /// `kvr_kv_stream_stale_seconds` > 0 meanwhile).
    #[arg(long, env = "KVR_TRUST_STALE_OVERLAP", default_value_t = false, action = clap::ArgAction::Set)]
    pub trust_stale_overlap: bool,
    /// Softmax temperature of the choice (0 = lowest cost wins).
    #[arg(long, env = "DYN_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub router_temperature: f64,
    /// Weight of cached blocks against load.
    #[arg(
        long,
        env = "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
        default_value_t = 1.0
    )]
    pub overlap_score_credit: f64,
    /// Multiplier on the (credited) prefill term; > 1 favours cache locality and prefill
    /// balance over decode balance.
    #[arg(long, env = "DYN_ROUTER_PREFILL_LOAD_SCALE", default_value_t = 1.0)]
    pub prefill_load_scale: f64,
    /// Credit per cached block in host memory (cheaper to bring back than to recompute).
    #[arg(long, env = "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", default_value_t = 0.75)]
    pub host_cache_hit_weight: f64,
    /// Credit per cached block on disk.
    #[arg(long, env = "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", default_value_t = 0.25)]
    pub disk_cache_hit_weight: f64,
    /// Block equivalents charged per active request on a rank (0 = off).
    #[arg(
        long,
        env = "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
        default_value_t = 0.0
    )]
    pub decode_active_request_weight: f64,
    /// Load-dependent decay of the device credit (Dynamo's `overlap_score_credit_decay`;
    /// unset or 0: off): a rank with more prefill backlog than the least-loaded candidate
    /// keeps only part of its cache credit.
    #[arg(long, env = "KVR_CREDIT_DECAY")]
    pub credit_decay: Option<f64>,
    /// Which cost a selection minimises: `latency` (kvr's default: each rank's predicted
    /// time to first token, decode load a tie-break) or `dynamo` (Dynamo's scorer, term
    /// for term: what an unconfigured Dynamo router routes by).
    #[arg(long, env = "KVR_COST_MODEL", default_value = "latency", value_parser = parse_cost_model)]
    pub cost_model: kvr::config::CostModel,
    /// Latency model: one rank's prefill throughput, tokens/s, before any is measured.
    #[arg(long, env = "KVR_PREFILL_RATE_PRIOR", default_value_t = 10_000.0)]
    pub prefill_rate_prior: f64,
    /// Latency model: learn the prefill rate from prefill-complete timings (off: keep the
    /// prior).
    #[arg(long, env = "KVR_LEARN_PREFILL_RATE", default_value_t = true, action = clap::ArgAction::Set)]
    pub learn_prefill_rate: bool,
    /// Latency model: fixed cost of one request's prefill, ms.
    #[arg(long, env = "KVR_REQUEST_OVERHEAD_MS", default_value_t = 5.0)]
    pub request_overhead_ms: f64,
    /// Latency model: share of a rank's KV blocks in use above which memory pressure is
    /// charged.
    #[arg(long, env = "KVR_KV_PRESSURE_THRESHOLD", default_value_t = 0.9)]
    pub kv_pressure_threshold: f64,
    /// Latency model: the pressure charge at full KV memory, ms.
    #[arg(long, env = "KVR_KV_PRESSURE_MS", default_value_t = 1_000.0)]
    pub kv_pressure_ms: f64,
    /// Latency model: a per-token latency target, ms (unset: none).
    #[arg(long, env = "KVR_ITL_TARGET_MS")]
    pub itl_target_ms: Option<f64>,
    /// Latency model: predicted per-token latency of a lone request, ms (read with a
    /// target).
    #[arg(long, env = "KVR_ITL_BASE_MS", default_value_t = 20.0)]
    pub itl_base_ms: f64,
    /// Latency model: extra per-token latency per running request, ms.
    #[arg(long, env = "KVR_ITL_PER_REQUEST_MS", default_value_t = 0.2)]
    pub itl_per_request_ms: f64,
    /// Latency model: weight of the delay a miss imposes on the requests queued behind
    /// it (0: price only this request's TTFT).
    #[arg(long, env = "KVR_QUEUE_EXTERNALITY", default_value_t = 2.0)]
    pub queue_externality: f64,
    /// Latency model: tie-break, µs per decode block the rank would hold.
    #[arg(long, env = "KVR_DECODE_BLOCK_US", default_value_t = 1.0)]
    pub decode_block_us: f64,
    /// Track booked prefill tokens in the load (off: a booking adds decode blocks only).
    #[arg(long, env = "DYN_ROUTER_TRACK_PREFILL_TOKENS", default_value_t = true, action = clap::ArgAction::Set)]
    pub router_track_prefill_tokens: bool,
    /// Lifetime in seconds of a booking nobody frees.
    #[arg(long, env = "DYN_ROUTER_TTL_SECS", default_value_t = 120.0)]
    pub router_ttl_secs: f64,
    /// Dynamo's `--router-assume-kv-reuse` (default on; the value is optional, as in
    /// Dynamo, which takes none); kvr always dedups a rank's shared prompt blocks, which
    /// is that behaviour: off is accepted and warned about at start.
    #[arg(
        long,
        env = "DYN_ROUTER_ASSUME_KV_REUSE",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub router_assume_kv_reuse: bool,
}

fn parse_cost_model(s: &str) -> Result<kvr::config::CostModel, String> {
    kvr::config::CostModel::parse(s).ok_or_else(|| {
        let valid: Vec<&str> = kvr::config::CostModel::ALL
            .iter()
            .map(|m| m.name())
            .collect();
        format!("unknown cost model {s:?} (valid: {})", valid.join(", "))
    })
}

impl ServeArgs {
    /// The listener's connection timeouts.
    pub fn conn_limits(&self) -> crate::conn::ConnLimits {
        let secs = |s: u64| (s > 0).then(|| Duration::from_secs(s));
        crate::conn::ConnLimits {
            header_read: secs(self.http_header_read_timeout_secs),
            idle: secs(self.http_idle_timeout_secs),
        }
    }

    /// Dynamo's start-up checks of its flags (`Err`: kvr refuses to start, with Dynamo's
    /// message), then the warnings about Dynamo settings kvr accepts but does not apply.
    pub fn check_dynamo_flags(&self) -> Result<Vec<String>, String> {
        let mut warnings: Vec<String> = self.tracking.check()?.into_iter().collect();
        if self.no_router_assume_kv_reuse || !self.knobs.router_assume_kv_reuse {
            warnings.push(
                "router_assume_kv_reuse=false is accepted but not applied: kvr always \
                 counts a prompt block active on a rank once, however many bookings share it"
                    .into(),
            );
        }
        Ok(warnings)
    }

    pub fn booking_ttl(&self) -> Duration {
        let s = self.knobs.router_ttl_secs;
        if s.is_finite() && s > 0.0 {
            Duration::from_secs_f64(s.min(30.0 * 86_400.0))
        } else {
            Duration::from_secs(120)
        }
    }
}

/// A share from 0 to 1.
fn share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s}: a share from 0 to 1")),
    }
}
