//! `kvr emulate`'s flags and the pod configurations they make.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use crate::cache::CacheConfig;
use crate::pod::{Mode, PodConfig, Timing};
use crate::tokenizer::{Tokenizer, WordTokenizer};

/// Emulate N model servers without a GPU: each pod serves vLLM's OpenAI-compatible API on
/// its own HTTP port, keeps a prefix KV cache and publishes its KV events on vLLM's ZMQ
/// wire (a PUB socket and a replay ROUTER of its own).
#[derive(Clone, Debug, Args)]
pub struct EmulateArgs {
    /// How many pods (pod i: HTTP on --base-port + i, KV events on --kv-events-base-port
    /// + 2i, replay on --kv-events-base-port + 2i + 1). --pod replaces it.
    #[arg(long, default_value_t = 1)]
    pub pods: usize,
    /// The first pod's HTTP port.
    #[arg(long, default_value_t = 8000)]
    pub base_port: u16,
    /// The first pod's KV-event PUB port (its replay ROUTER is the next port).
    #[arg(long, default_value_t = 5557)]
    pub kv_events_base_port: u16,
    /// The address every socket binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// One pod, given explicitly (repeat for more; replaces --pods):
    /// `name=NAME,http=PORT[,kv-events=PORT][,replay=PORT][,seed=N][,mode=serve|refuse|hang][,dp-rank=N]`.
    /// A pod without kv-events publishes none; without replay it has no replay socket.
    /// `dp-rank` is the `data_parallel_rank` its KV-event batches carry (default 0): one
    /// spec per rank emulates a data-parallel deployment, each rank on its own ports.
    #[arg(long = "pod", value_name = "SPEC")]
    pub pod_specs: Vec<String>,
    /// Pod names are this prefix and the pod's index (with --pods).
    #[arg(long, default_value = "pod-")]
    pub name_prefix: String,
    /// The served model name (`/v1/models`; requests naming another model get 404).
    #[arg(long, default_value = "kvr-emulated")]
    pub model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks per pod (running requests' blocks plus cached ones).
    #[arg(long, default_value_t = 8192)]
    pub capacity_blocks: usize,
    /// Longest prompt plus output a request may ask for.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: usize,
    /// Prefill time per prompt token not found in the cache, in nanoseconds.
    #[arg(long, default_value_t = 20_000)]
    pub prefill_ns_per_token: u64,
    /// Decode time per output token, in nanoseconds.
    #[arg(long, default_value_t = 5_000_000)]
    pub decode_ns_per_token: u64,
    /// Output tokens of a request that gives no max_tokens.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// The engine block-hash seed of every pod (a pod spec's seed= overrides it); pods
    /// with different seeds name the same blocks differently, as separate vLLM processes do.
    #[arg(long, default_value_t = 0)]
    pub hash_seed: u64,
    /// The topic of every KV-event message (vLLM's default: none).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Publish no KV events (no ZMQ sockets at all).
    #[arg(long)]
    pub no_kv_events: bool,
    /// Bind no replay ROUTER (events only on the PUB socket).
    #[arg(long)]
    pub no_replay: bool,
    /// Start these pods (by name) refusing every request with 503 (repeatable).
    #[arg(long, value_name = "POD")]
    pub refuse: Vec<String>,
    /// Start these pods (by name) hanging on every request (repeatable).
    #[arg(long, value_name = "POD")]
    pub hang: Vec<String>,
    /// A HuggingFace tokenizer directory (tokenizer.json and its chat template) instead of
    /// the built-in word tokenizer (the ids `kvr epp --tokenizer` computes for the same text).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Do not log each request on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// The tokenizer `args` ask for.
pub fn tokenizer(args: &EmulateArgs) -> Result<Arc<dyn Tokenizer>, String> {
    match &args.tokenizer {
        None => Ok(Arc::new(WordTokenizer)),
        Some(dir) => Ok(Arc::new(crate::tokenizer::HfTokenizer::from_dir(dir)?)),
    }
}

fn parse_spec(spec: &str, args: &EmulateArgs) -> Result<PodConfig, String> {
    let mut cfg = base_config(args, String::new(), 0);
    cfg.kv_events_endpoint = None;
    cfg.replay_endpoint = None;
    let mut http = None;
    for field in spec.split(',').filter(|f| !f.is_empty()) {
        let (k, v) = field
            .split_once('=')
            .ok_or_else(|| format!("--pod {spec}: `{field}` is not key=value"))?;
        let port = || {
            v.parse::<u16>()
                .map_err(|e| format!("--pod {spec}: {k}={v}: {e}"))
        };
        match k {
            "name" => cfg.name = v.to_owned(),
            "http" => http = Some(port()?),
            "kv-events" => cfg.kv_events_endpoint = Some(tcp(args.host, port()?)),
            "replay" => cfg.replay_endpoint = Some(tcp(args.host, port()?)),
            "seed" => {
                cfg.cache.hash_seed = v
                    .parse()
                    .map_err(|e| format!("--pod {spec}: seed={v}: {e}"))?
            }
            "dp-rank" => {
                cfg.data_parallel_rank = v
                    .parse()
                    .map_err(|e| format!("--pod {spec}: dp-rank={v}: {e}"))?
            }
            "mode" => {
                cfg.mode = <Mode as clap::ValueEnum>::from_str(v, true)
                    .map_err(|_| format!("--pod {spec}: mode={v}: serve, refuse or hang"))?
            }
            _ => return Err(format!("--pod {spec}: unknown key `{k}`")),
        }
    }
    if cfg.name.is_empty() {
        return Err(format!("--pod {spec}: name= is required"));
    }
    let http = http.ok_or_else(|| format!("--pod {spec}: http= is required"))?;
    cfg.http = SocketAddr::new(args.host, http);
    if cfg.replay_endpoint.is_some() && cfg.kv_events_endpoint.is_none() {
        return Err(format!("--pod {spec}: replay= needs kv-events="));
    }
    Ok(cfg)
}

fn tcp(host: IpAddr, port: u16) -> String {
    match host {
        IpAddr::V4(h) => format!("tcp://{h}:{port}"),
        IpAddr::V6(h) => format!("tcp://[{h}]:{port}"),
    }
}

fn base_config(args: &EmulateArgs, name: String, index: u16) -> PodConfig {
    let events = args.kv_events_base_port.wrapping_add(2 * index);
    PodConfig {
        name,
        http: SocketAddr::new(args.host, args.base_port.wrapping_add(index)),
        kv_events_endpoint: Some(tcp(args.host, events)),
        replay_endpoint: Some(tcp(args.host, events.wrapping_add(1))),
        topic: args.topic.clone(),
        data_parallel_rank: 0,
        cache: CacheConfig {
            block_size: args.block_size,
            capacity_blocks: args.capacity_blocks,
            hash_seed: args.hash_seed,
        },
        timing: Timing {
            prefill_ns_per_token: args.prefill_ns_per_token,
            decode_ns_per_token: args.decode_ns_per_token,
        },
        model: args.model.clone(),
        max_model_len: args.max_model_len,
        default_max_tokens: args.max_tokens,
        mode: Mode::Serve,
        log_requests: !args.quiet,
    }
}

/// The pods `args` describe, checked.
pub fn pod_configs(args: &EmulateArgs) -> Result<Vec<PodConfig>, String> {
    if args.block_size == 0 || args.capacity_blocks == 0 {
        return Err("--block-size and --capacity-blocks must be at least 1".into());
    }
    let mut pods = if args.pod_specs.is_empty() {
        if args.pods == 0 || args.pods > 1000 {
            return Err(format!("--pods {}: give 1 to 1000", args.pods));
        }
        let last = u32::from(args.base_port) + args.pods as u32 - 1;
        let last_zmq = u32::from(args.kv_events_base_port) + 2 * args.pods as u32 - 1;
        if last > u32::from(u16::MAX) || last_zmq > u32::from(u16::MAX) {
            return Err(format!("--pods {}: the ports run past 65535", args.pods));
        }
        (0..args.pods as u16)
            .map(|i| base_config(args, format!("{}{i}", args.name_prefix), i))
            .collect()
    } else {
        args.pod_specs
            .iter()
            .map(|s| parse_spec(s, args))
            .collect::<Result<Vec<_>, _>>()?
    };
    for p in &mut pods {
        if args.no_kv_events {
            p.kv_events_endpoint = None;
        }
        if args.no_replay || p.kv_events_endpoint.is_none() {
            p.replay_endpoint = None;
        }
        if axum::http::HeaderValue::from_str(&p.name).is_err() {
            return Err(format!(
                "pod name {:?} cannot be an HTTP header value",
                p.name
            ));
        }
    }
    for (names, mode) in [(&args.refuse, Mode::Refuse), (&args.hang, Mode::Hang)] {
        for n in names {
            let p = pods
                .iter_mut()
                .find(|p| &p.name == n)
                .ok_or_else(|| format!("no pod named {n}"))?;
            p.mode = mode;
        }
    }
    let mut names: Vec<&str> = pods.iter().map(|p| p.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("two pods are named {}", w[0]));
    }
    Ok(pods)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EmulateArgs,
    }

    fn configs(argv: &[&str]) -> Result<Vec<PodConfig>, String> {
        let cli = Cli::try_parse_from(std::iter::once("x").chain(argv.iter().copied()))
            .map_err(|e| e.to_string())?;
        pod_configs(&cli.args)
    }

    #[test]
    fn pods_get_consecutive_ports_and_specs_their_own() {
        let p = configs(&[
            "--pods",
            "2",
            "--base-port",
            "9000",
            "--host",
            "127.0.0.1",
            "--refuse",
            "pod-1",
        ])
        .unwrap();
        assert_eq!(p[1].http.port(), 9001);
        assert_eq!(
            p[1].kv_events_endpoint.as_deref(),
            Some("tcp://127.0.0.1:5559")
        );
        assert_eq!(
            p[1].replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:5560")
        );
        assert_eq!((p[0].mode, p[1].mode), (Mode::Serve, Mode::Refuse));
        let p = configs(&[
            "--pod",
            "name=a,http=1,kv-events=2,seed=5,mode=hang",
            "--pod",
            "name=b,http=3,dp-rank=1",
        ])
        .unwrap();
        assert_eq!((p[0].cache.hash_seed, p[0].mode), (5, Mode::Hang));
        assert_eq!((p[0].data_parallel_rank, p[1].data_parallel_rank), (0, 1));
        assert!(p[0].replay_endpoint.is_none() && p[1].kv_events_endpoint.is_none());
        for bad in [
            &["--pod", "name=a"][..],
            &["--pod", "http=1"],
            &["--pod", "name=a,http=1,color=red"],
            &["--pod", "name=a,http=1,dp-rank=-1"],
            &["--pod", "name=a,http=1", "--pod", "name=a,http=2"],
            &["--pods", "1", "--hang", "nobody"],
            &["--pods", "0"],
        ] {
            assert!(configs(bad).is_err(), "{bad:?} accepted");
        }
    }
}
