//! One emulated model server: its KV cache, its event publisher, its timing and its
//! serving mode. The HTTP side ([`crate::server`]) drives it through [`Pod::admit`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvr_emulator::BatchEncoder;
use tokio::sync::Notify;

use crate::cache::{Admission, AdmitError, CacheConfig, CacheEvent, CacheStats, KvCache};
use crate::publisher::Publisher;
use crate::tokenizer::Tokenizer;

/// How a pod answers (switchable at run time: `POST /emulate/mode`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Serve normally.
    Serve,
    /// Answer every request 503 (a pod that is up but refuses: overloaded, draining).
    Refuse,
    /// Accept every request and never answer (a stuck pod: tests a caller's timeout).
    Hang,
}

impl Mode {
    /// The name flags and `/emulate/mode` use.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Serve => "serve",
            Mode::Refuse => "refuse",
            Mode::Hang => "hang",
        }
    }

    fn from_u8(v: u8) -> Mode {
        match v {
            1 => Mode::Refuse,
            2 => Mode::Hang,
            _ => Mode::Serve,
        }
    }
}

/// Time per token.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Prefill time per prompt token not found in the cache.
    pub prefill_ns_per_token: u64,
    /// Decode time per output token.
    pub decode_ns_per_token: u64,
}

impl Timing {
    pub fn prefill(&self, uncached_tokens: usize) -> Duration {
        Duration::from_nanos(
            self.prefill_ns_per_token
                .saturating_mul(uncached_tokens as u64),
        )
    }

    pub fn decode_step(&self) -> Duration {
        Duration::from_nanos(self.decode_ns_per_token)
    }
}

/// Waits `d`; no wait at all for zero (a zero tokio sleep still waits for the timer's next
/// millisecond tick, which would be all a zero-cost pod's latency).
pub async fn wait(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Everything about one pod.
#[derive(Clone, Debug)]
pub struct PodConfig {
    /// Names the pod in the `x-kvr-emulated-pod` header and the logs.
    pub name: String,
    /// The HTTP listener (port 0: any free port).
    pub http: SocketAddr,
    /// The KV-event PUB endpoint to bind (`None`: no events).
    pub kv_events_endpoint: Option<String>,
    /// The replay ROUTER endpoint to bind (`None`: no replay).
    pub replay_endpoint: Option<String>,
    /// The topic of every KV-event message (vLLM's default: empty).
    pub topic: String,
    /// The `data_parallel_rank` the batches carry.
    pub data_parallel_rank: u32,
    pub cache: CacheConfig,
    pub timing: Timing,
    /// The served model name (`/v1/models`; other names are 404).
    pub model: String,
    /// Longest prompt plus output accepted (vLLM's `max_model_len`).
    pub max_model_len: usize,
    /// Output tokens when a request names no `max_tokens`.
    pub default_max_tokens: usize,
    pub mode: Mode,
    /// Log each request on stderr.
    pub log_requests: bool,
}

/// A running pod.
pub struct Pod {
    pub(crate) cfg: PodConfig,
    cache: Mutex<KvCache>,
    room: Notify,
    publisher: Option<Publisher>,
    mode: AtomicU8,
    pub(crate) tokenizer: Arc<dyn Tokenizer>,
    requests: AtomicU64,
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pod")
            .field("name", &self.cfg.name)
            .field("publisher", &self.publisher)
            .finish_non_exhaustive()
    }
}

/// What a pod reports about itself (`GET /emulate/state`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct PodState {
    pub pod: String,
    pub mode: Mode,
    pub requests: u64,
    pub cache: CacheStats,
    pub events_published: u64,
    pub events_dropped_live: u64,
    pub events_queue_full: u64,
    pub replays_served: u64,
}

/// A request admitted to a pod: holds its blocks until dropped.
#[derive(Debug)]
pub struct Running {
    pod: Arc<Pod>,
    admission: Option<Admission>,
    pub id: u64,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

impl Running {
    /// Waits out the prefill of the uncached prompt tokens, then caches the prompt's blocks.
    pub async fn prefill(&mut self, tokens: &[u32]) {
        let uncached = self.prompt_tokens - self.cached_tokens;
        wait(self.pod.cfg.timing.prefill(uncached)).await;
        let pod = &self.pod;
        let mut cache = pod.lock_cache();
        let mut events = Vec::new();
        if let Some(adm) = self.admission.as_mut() {
            cache.finish_prefill(adm, tokens, &mut events);
        }
        pod.emit(&cache, events);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(adm) = self.admission.take() {
            self.pod.lock_cache().release(adm);
            self.pod.room.notify_waiters();
        }
    }
}

impl Pod {
    /// Starts the pod's publisher (binding its sockets) on the current tokio runtime.
    pub async fn start(cfg: PodConfig, tokenizer: Arc<dyn Tokenizer>) -> std::io::Result<Arc<Pod>> {
        let publisher = match &cfg.kv_events_endpoint {
            Some(ep) => Some(
                Publisher::start(
                    ep,
                    cfg.replay_endpoint.as_deref(),
                    cfg.topic.clone().into_bytes(),
                )
                .await?,
            ),
            None => None,
        };
        Ok(Arc::new(Pod {
            cache: Mutex::new(KvCache::new(cfg.cache)),
            room: Notify::new(),
            publisher,
            mode: AtomicU8::new(cfg.mode as u8),
            tokenizer,
            requests: AtomicU64::new(0),
            cfg,
        }))
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    pub fn config(&self) -> &PodConfig {
        &self.cfg
    }

    /// The bound PUB endpoint, if the pod publishes events.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.publisher.as_ref().map(|p| p.pub_endpoint.as_str())
    }

    /// The bound replay endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.publisher
            .as_ref()
            .and_then(|p| p.replay_endpoint.as_deref())
    }

    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Relaxed))
    }

    pub fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Tokens of `text` by this pod's tokenizer.
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text)
    }

    /// Leading full blocks of `tokens` the pod's cache holds now.
    pub fn cached_prefix_blocks(&self, tokens: &[u32]) -> usize {
        self.lock_cache().cached_prefix_blocks(tokens)
    }

    /// Every cached block as the tokens from its root through it.
    pub fn cached_prefixes(&self) -> Vec<Vec<u32>> {
        self.lock_cache().cached_prefixes()
    }

    /// The next `n` event batches are not sent live (still replayable); false without events.
    pub fn drop_next_event_batches(&self, n: u64) -> bool {
        self.publisher.as_ref().map(|p| p.drop_next(n)).is_some()
    }

    pub fn state(&self) -> PodState {
        let c = self.publisher.as_ref().map(|p| p.counters());
        let get = |f: fn(&crate::publisher::PublisherCounters) -> &AtomicU64| {
            c.map_or(0, |c| f(c).load(Ordering::Relaxed))
        };
        PodState {
            pod: self.cfg.name.clone(),
            mode: self.mode(),
            requests: self.requests.load(Ordering::Relaxed),
            cache: self.lock_cache().stats(),
            events_published: get(|c| &c.published),
            events_dropped_live: get(|c| &c.dropped_live),
            events_queue_full: get(|c| &c.queue_full),
            replays_served: get(|c| &c.replays),
        }
    }

    fn lock_cache(&self) -> MutexGuard<'_, KvCache> {
        // A panic while holding the lock leaves consistent-enough bookkeeping for an
        // emulator; keep serving.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes `events` as one batch; called with the cache locked so that batches go
    /// out in the order the cache changed.
    fn emit(&self, _locked: &MutexGuard<'_, KvCache>, events: Vec<CacheEvent>) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if events.is_empty() {
            return;
        }
        let bs = self.cfg.cache.block_size;
        let mut enc = BatchEncoder::new();
        for e in &events {
            match e {
                CacheEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                } => {
                    enc.vllm_stored(hashes, *parent, tokens, bs, None);
                }
                CacheEvent::Removed { hashes } => {
                    enc.vllm_removed(hashes);
                }
                CacheEvent::Cleared => {
                    enc.cleared();
                }
            }
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        publisher.publish(enc.finish(ts, Some(self.cfg.data_parallel_rank)));
    }

    /// Admits a request, waiting while running requests hold the blocks it needs;
    /// `TooLarge` if it can never fit.
    pub async fn admit(
        self: &Arc<Self>,
        tokens: &[u32],
        output_len: usize,
    ) -> Result<Running, AdmitError> {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut cache = self.lock_cache();
                let mut events = Vec::new();
                let result = cache.admit(tokens, output_len, &mut events);
                self.emit(&cache, events);
                match result {
                    Ok(adm) => {
                        let id = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
                        return Ok(Running {
                            pod: self.clone(),
                            id,
                            prompt_tokens: tokens.len(),
                            cached_tokens: adm.cached_tokens,
                            admission: Some(adm),
                        });
                    }
                    Err(AdmitError::NoRoom) => {}
                    Err(e) => return Err(e),
                }
            }
            room.await;
        }
    }

    /// Drops every cached block and publishes `AllBlocksCleared`; `Err(running)` while
    /// requests run (as vLLM refuses to reset then).
    pub fn reset_prefix_cache(&self) -> Result<usize, usize> {
        let mut cache = self.lock_cache();
        let mut events = Vec::new();
        let r = cache.reset(&mut events);
        self.emit(&cache, events);
        r
    }

    /// One log line on stderr, if the pod logs requests.
    pub(crate) fn log(&self, line: std::fmt::Arguments<'_>) {
        if self.cfg.log_requests {
            eprintln!("kvr-emulate pod={} {line}", self.cfg.name);
        }
    }
}
