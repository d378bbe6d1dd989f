//! kvr-emulate: GPU-free model servers for testing and demonstrating KV-cache-aware
//! routing. Each emulated pod serves vLLM's OpenAI-compatible HTTP API, keeps a prefix KV
//! cache of fixed capacity (chained block hashes, LRU eviction) whose hits shorten its
//! prefill, and publishes the cache's changes as vLLM's KV events over ZMQ, with vLLM's
//! replay socket. `kvr emulate` runs N of them in one process.

pub mod args;
pub mod cache;
pub mod openai;
pub mod pod;
pub mod publisher;
pub mod server;
pub mod tokenizer;

use std::net::SocketAddr;
use std::sync::Arc;

pub use args::EmulateArgs;
pub use pod::{Mode, Pod, PodConfig, Timing};
pub use server::POD_HEADER;

/// A pod serving on the current tokio runtime.
#[derive(Clone, Debug)]
pub struct PodHandle {
    pub pod: Arc<Pod>,
    /// The HTTP address as bound (a port 0 resolved).
    pub http: SocketAddr,
}

/// Binds a pod's sockets (HTTP, KV-event PUB, replay ROUTER) and serves it on the current
/// tokio runtime until the runtime ends.
pub async fn start_pod(
    cfg: PodConfig,
    tokenizer: Arc<dyn tokenizer::Tokenizer>,
) -> std::io::Result<PodHandle> {
    let listener = tokio::net::TcpListener::bind(cfg.http)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("bind HTTP {}: {e}", cfg.http)))?;
    let http = listener.local_addr()?;
    let pod = Pod::start(cfg, tokenizer).await?;
    let app = server::router(pod.clone());
    // No Nagle delay on answers: a gateway in front keeps connections open, and a reply
    // held back for the peer's delayed ACK costs tens of milliseconds.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("kvr-emulate: HTTP server ended: {e}");
        }
    });
    Ok(PodHandle { pod, http })
}

/// `kvr emulate`: starts the pods `args` describe and serves until interrupted.
pub fn run(args: EmulateArgs) -> Result<(), String> {
    let configs = args::pod_configs(&args)?;
    let tokenizer = args::tokenizer(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("start the runtime: {e}"))?;
    runtime.block_on(async move {
        let mut pods = Vec::new();
        for cfg in configs {
            let name = cfg.name.clone();
            let h = start_pod(cfg, tokenizer.clone())
                .await
                .map_err(|e| format!("pod {name}: {e}"))?;
            eprintln!(
                "kvr-emulate pod={} http=http://{} kv_events={} replay={} mode={}",
                h.pod.name(),
                h.http,
                h.pod.kv_events_endpoint().unwrap_or("-"),
                h.pod.replay_endpoint().unwrap_or("-"),
                h.pod.mode().name(),
            );
            pods.push(h);
        }
        eprintln!("kvr-emulate: {} pods serving; Ctrl-C stops", pods.len());
        tokio::signal::ctrl_c()
            .await
            .map_err(|e| format!("wait for Ctrl-C: {e}"))
    })
}
