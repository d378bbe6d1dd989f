//! `kvr epp`'s flags (each with an environment variable, as `kvr serve`'s).

use std::path::PathBuf;

use clap::Args;

use kvr_service::ServeArgs;

/// `kvr epp`: the endpoint picker of a gateway (Envoy ext_proc), with the selection
/// service's HTTP API (`/metrics`, `/ready`, `/dump`, ...) beside it.
#[derive(Clone, Debug, Args)]
pub struct EppArgs {
    /// gRPC port of the ext_proc and health services (the Gateway API Inference
    /// Extension's usual EPP port).
    #[arg(long, default_value_t = 9002, env = "KVR_EPP_GRPC_PORT")]
    pub grpc_port: u16,
    /// gRPC address; the default takes connections from this machine only.
    #[arg(long, default_value = "127.0.0.1", env = "KVR_EPP_GRPC_HOST")]
    pub grpc_host: String,
    /// The pool membership file (JSON: pods, their ports per DP rank and KV-event
    /// endpoints); watched and applied without a restart.
    #[arg(long, env = "KVR_EPP_POOL")]
    pub pool: PathBuf,
    /// How often the membership file is checked for changes, ms.
    #[arg(long, default_value_t = 1000, env = "KVR_EPP_POOL_POLL_MS")]
    pub pool_poll_ms: u64,
    /// Fallback endpoints sent after the best one (the next-best workers).
    #[arg(long, default_value_t = 2, env = "KVR_EPP_FALLBACKS")]
    pub fallbacks: usize,
    /// Answer 429 when every eligible rank is over its busy threshold; `false` picks the
    /// least-costly rank anyway.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "KVR_EPP_SHED_WHEN_BUSY")]
    pub shed_when_busy: bool,
    /// A request header whose value names the request's session (affinity).
    #[arg(long, env = "KVR_EPP_SESSION_HEADER")]
    pub session_header: Option<String>,
    /// A model's local tokenizer: `MODEL=DIR`, DIR holding its `tokenizer.json` (and
    /// `tokenizer_config.json` with its chat template). Repeat per model.
    #[arg(long = "tokenizer", value_parser = parse_tokenizer, env = "KVR_EPP_TOKENIZERS", value_delimiter = ',')]
    pub tokenizers: Vec<(String, PathBuf)>,
    /// Tokenize through an engine's `/tokenize` (vLLM's) at this base URL, for models
    /// without a local tokenizer.
    #[arg(long, env = "KVR_EPP_TOKENIZE_URL")]
    pub tokenize_url: Option<String>,
    /// Memory for token reuse, MiB per local tokenizer: the token ids of prompts seen
    /// before are kept, and a prompt resending one's head (a conversation's history, up
    /// to an added token such as `<|im_start|>`) is tokenized only from there. 0 turns
    /// it off.
    #[arg(long, default_value_t = 64, env = "KVR_EPP_TOKENIZE_REUSE_MB")]
    pub tokenize_reuse_mb: u64,
    /// Timeout of a `/tokenize` call, ms.
    #[arg(long, default_value_t = 2000)]
    pub tokenize_timeout_ms: u64,
    /// At shutdown, how long to keep taking streams after reporting not serving, ms, so
    /// the gateway's health check sees it before the listener closes (a gateway that
    /// fails open cannot once a streamed body has gone out). At least twice the gateway's
    /// health-check interval.
    #[arg(long, default_value_t = 2000, env = "KVR_EPP_DRAIN_MS")]
    pub drain_ms: u64,
    /// How often readiness is recomputed, ms.
    #[arg(long, default_value_t = 500)]
    pub readiness_poll_ms: u64,
    #[command(flatten)]
    pub serve: ServeArgs,
}

fn parse_tokenizer(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((m, d)) if !m.is_empty() && !d.is_empty() => Ok((m.to_owned(), PathBuf::from(d))),
        _ => Err(format!("{s:?}: expected MODEL=DIR")),
    }
}
