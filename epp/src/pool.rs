//! Pool membership: which model-server endpoints (`ip:port`) the picker chooses among,
//! which kvr worker and DP rank each one is, and where each pod publishes its KV events.
//!
//! Read from a JSON file (a Kubernetes InferencePool/EndpointSlice watcher can come later
//! behind the same [`Membership`] value), watched by polling and applied without a
//! restart: new or changed pods are registered as workers (the service's own upsert, so
//! KV-event subscriptions follow), pods gone are removed. A file that does not parse or
//! check is refused whole, logged and counted; the membership in force stays.
//!
//! Decisions: a pod with several DP ranks lists one port per rank (vLLM's data-parallel
//! deployments serve each rank on its own port): each port is an endpoint of its own, and
//! the pod is one kvr worker with that many ranks. A pod's worker id is given, or derived
//! from its name (stable across reloads and replicas).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use kvr_service::wire::worker::WorkerRequest;
use kvr_service::App;

/// Most pods one file may list (a bound on what a file can make the picker register).
pub const MAX_PODS: usize = 4096;
/// Most DP ranks (ports) per pod.
pub const MAX_RANKS_PER_POD: usize = 256;

/// The membership file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolFile {
    /// The model of pods that name none (requests name models in their `model` field).
    #[serde(default)]
    pub model: Option<String>,
    /// Tokens per KV block of pods that give none.
    #[serde(default)]
    pub block_size: Option<u32>,
    pub pods: Vec<PodSpec>,
}

/// One model-server pod.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PodSpec {
    /// A name unique in the pool (a pod name): the worker id derives from it.
    pub name: String,
    /// The pod's IP address (or host name Envoy can reach).
    pub address: String,
    /// The serving port of each DP rank, rank 0 first.
    pub ports: Vec<u16>,
    #[serde(default)]
    pub worker_id: Option<u64>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub block_size: Option<u32>,
    /// KV-event PUB endpoints, one per rank (`tcp://host:port`); absent: the pod publishes
    /// none (kvr then learns from its own bookings).
    #[serde(default)]
    pub kv_events: Vec<String>,
    /// The replay endpoint of rank 0 (kvr offsets it by the rank, as engines bind them).
    #[serde(default)]
    pub replay: Option<String>,
    #[serde(default)]
    pub total_kv_blocks: Option<u64>,
    /// LoRA adapters the pod serves: a request naming one in its `model` field is a
    /// request for the pod's model with that adapter.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
}

/// One endpoint the gateway can send a request to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub model: String,
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// The membership in force: endpoints both ways.
#[derive(Clone, Debug, Default)]
pub struct Membership {
    pub by_endpoint: HashMap<String, Endpoint>,
    pub by_rank: HashMap<(u64, u32), String>,
    /// Worker id → the model it serves.
    pub workers: BTreeMap<u64, String>,
    /// LoRA adapter → (its base model, the workers serving it).
    pub adapters: HashMap<String, (String, Vec<u64>)>,
    /// The default model (the file's).
    pub default_model: Option<String>,
    /// The registrations it was built from, by worker id.
    requests: BTreeMap<u64, WorkerRequest>,
}

impl Membership {
    /// The endpoint `ip:port` of a rank.
    pub fn endpoint_of(&self, worker_id: u64, dp_rank: u32) -> Option<&str> {
        self.by_rank.get(&(worker_id, dp_rank)).map(String::as_str)
    }
}

/// A worker id from a pod name: FNV-1a, high bit clear (stable across runs and replicas).
pub fn worker_id_of(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h >> 1
}

impl PoolFile {
    /// Parses and checks a membership file's text.
    pub fn parse(text: &str) -> Result<PoolFile, String> {
        let f: PoolFile = serde_json::from_str(text).map_err(|e| format!("pool file: {e}"))?;
        f.check()?;
        Ok(f)
    }

    fn check(&self) -> Result<(), String> {
        if self.pods.len() > MAX_PODS {
            return Err(format!(
                "pool file: {} pods, at most {MAX_PODS}",
                self.pods.len()
            ));
        }
        let mut names = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        let mut endpoints = std::collections::HashSet::new();
        for p in &self.pods {
            let what = |e: &str| format!("pool file: pod {:?}: {e}", p.name);
            if p.name.is_empty() || !names.insert(p.name.as_str()) {
                return Err(what("names must be unique and not empty"));
            }
            if p.address.is_empty() || p.address.contains([',', ' ']) {
                return Err(what("address must be one host"));
            }
            if p.ports.is_empty() || p.ports.len() > MAX_RANKS_PER_POD {
                return Err(what(&format!(
                    "1 to {MAX_RANKS_PER_POD} ports (one per DP rank)"
                )));
            }
            if !p.kv_events.is_empty() && p.kv_events.len() != p.ports.len() {
                return Err(what("kv_events lists one endpoint per port, or none"));
            }
            if p.model.as_ref().or(self.model.as_ref()).is_none() {
                return Err(what("no model (give the pod's or the file's)"));
            }
            let model = p.model.as_ref().or(self.model.as_ref());
            if p.lora_adapters
                .iter()
                .any(|a| Some(a) == model || a.is_empty())
            {
                return Err(what("a LoRA adapter named like its model, or empty"));
            }
            if !ids.insert(p.worker_id.unwrap_or_else(|| worker_id_of(&p.name))) {
                return Err(what("worker id taken by another pod"));
            }
            for port in &p.ports {
                if !endpoints.insert(format!("{}:{port}", p.address)) {
                    return Err(what(&format!("endpoint {}:{port} listed twice", p.address)));
                }
            }
        }
        Ok(())
    }

    /// The membership this file describes.
    pub fn membership(&self) -> Membership {
        let mut m = Membership {
            default_model: self.model.clone(),
            ..Default::default()
        };
        for p in &self.pods {
            let id = p.worker_id.unwrap_or_else(|| worker_id_of(&p.name));
            let model = p
                .model
                .clone()
                .or_else(|| self.model.clone())
                .unwrap_or_default();
            for (rank, port) in p.ports.iter().enumerate() {
                let ep = format!("{}:{port}", p.address);
                m.by_endpoint.insert(
                    ep.clone(),
                    Endpoint {
                        model: model.clone(),
                        worker_id: id,
                        dp_rank: rank as u32,
                    },
                );
                m.by_rank.insert((id, rank as u32), ep);
            }
            m.workers.insert(id, model.clone());
            for a in &p.lora_adapters {
                let e = m
                    .adapters
                    .entry(a.clone())
                    .or_insert_with(|| (model.clone(), Vec::new()));
                if e.0 == model {
                    e.1.push(id);
                }
            }
            let kv_events = (!p.kv_events.is_empty()).then(|| {
                p.kv_events
                    .iter()
                    .enumerate()
                    .map(|(r, e)| (r.to_string(), e.clone()))
                    .collect()
            });
            m.requests.insert(
                id,
                WorkerRequest {
                    worker_id: id,
                    model_name: model,
                    routing_group: "default".into(),
                    endpoint: Some(format!("http://{}:{}", p.address, p.ports[0])),
                    kv_events_endpoints: kv_events,
                    replay_endpoint: p.replay.clone(),
                    block_size: p.block_size.or(self.block_size),
                    data_parallel_size: Some(p.ports.len() as u32),
                    total_kv_blocks: p.total_kv_blocks,
                    ..Default::default()
                },
            );
        }
        m
    }
}

/// Registers `next`'s workers with `app` where they differ from `prev`'s, and removes the
/// workers `prev` had that `next` has not. Returns the errors of registrations refused
/// (those workers are left as they were).
pub fn apply(app: &App, prev: &Membership, next: &Membership) -> Vec<String> {
    let mut errors = Vec::new();
    for (id, req) in &next.requests {
        if prev.requests.get(id) == Some(req) {
            continue;
        }
        if let Err(e) = app.upsert_worker(req.clone()) {
            errors.push(format!("worker {id}: {}", e.message));
        }
    }
    for id in prev.requests.keys() {
        if !next.requests.contains_key(id) {
            let _ = app.delete_worker(*id);
        }
    }
    errors
}

/// The file's modification time and length: what the watcher compares.
fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Loads `path`, then applies its changes every `every` while the task lives; the
/// membership in force is published through `on_change`.
pub async fn watch(
    app: Arc<App>,
    path: PathBuf,
    every: Duration,
    mut current: Membership,
    on_change: impl Fn(Membership) + Send + 'static,
    on_error: impl Fn(&str) + Send + 'static,
) {
    let mut seen = stamp(&path);
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let now = stamp(&path);
        if now == seen {
            continue;
        }
        seen = now;
        let next = match std::fs::read_to_string(&path)
            .map_err(|e| format!("pool file {}: {e}", path.display()))
            .and_then(|t| PoolFile::parse(&t))
        {
            Ok(f) => f.membership(),
            Err(e) => {
                tracing::warn!(error = %e, "pool file refused; the membership in force stays");
                on_error(&e);
                continue;
            }
        };
        for e in apply(&app, &current, &next) {
            tracing::warn!(error = %e, "pool member not registered");
            on_error(&e);
        }
        tracing::info!(
            endpoints = next.by_endpoint.len(),
            "pool membership applied"
        );
        current = next.clone();
        on_change(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"model": "m", "block_size": 16, "pods": [
        {"name": "a", "address": "10.0.0.1", "ports": [8000, 8001],
         "kv_events": ["tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"]},
        {"name": "b", "address": "10.0.0.2", "ports": [8000], "worker_id": 7, "model": "n"}]}"#;

    #[test]
    fn each_port_is_an_endpoint_and_each_pod_a_worker() {
        let m = PoolFile::parse(FILE).unwrap().membership();
        let a = worker_id_of("a");
        assert_eq!(
            m.by_endpoint["10.0.0.1:8001"],
            Endpoint {
                model: "m".into(),
                worker_id: a,
                dp_rank: 1
            }
        );
        assert_eq!(m.endpoint_of(7, 0), Some("10.0.0.2:8000"));
        assert_eq!(m.workers.len(), 2);
        let r = &m.requests[&a];
        assert_eq!(r.data_parallel_size, Some(2));
        assert_eq!(
            r.kv_events_endpoints.as_ref().unwrap()["1"],
            "tcp://10.0.0.1:5558"
        );
        assert_eq!(m.requests[&7].model_name, "n");
    }

    #[test]
    fn bad_files_are_refused_whole() {
        for (bad, why) in [
            (
                r#"{"pods": [{"name": "a", "address": "x", "ports": [1]}]}"#,
                "no model",
            ),
            (
                r#"{"model": "m", "pods": [{"name": "a", "address": "x", "ports": []}]}"#,
                "ports",
            ),
            (
                r#"{"model": "m", "pods": [{"name": "a", "address": "x", "ports": [1]},
                    {"name": "a", "address": "y", "ports": [1]}]}"#,
                "unique",
            ),
            (
                r#"{"model": "m", "pods": [{"name": "a", "address": "x", "ports": [1]},
                    {"name": "b", "address": "x", "ports": [1]}]}"#,
                "twice",
            ),
            (
                r#"{"model": "m", "pods": [{"name": "a", "address": "x", "ports": [1, 2],
                    "kv_events": ["tcp://x:1"]}]}"#,
                "kv_events",
            ),
            (r#"{"model": "m", "pods": [], "extra": 1}"#, "unknown field"),
            ("not json", "pool file"),
        ] {
            let e = PoolFile::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn worker_ids_are_stable_and_positive() {
        assert_eq!(worker_id_of("pod-1"), worker_id_of("pod-1"));
        assert_ne!(worker_id_of("pod-1"), worker_id_of("pod-2"));
        assert!(worker_id_of("pod-1") < 1 << 63);
    }
}
