//! Shared by the integration tests: pods on 127.0.0.1 (every port chosen by the OS) on a
//! runtime of their own, and a blocking HTTP client.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use kvr_emulate::cache::CacheConfig;
use kvr_emulate::tokenizer::WordTokenizer;
use kvr_emulate::{start_pod, Mode, PodConfig, PodHandle, Timing, POD_HEADER};
use serde_json::Value;

pub fn config(name: &str) -> PodConfig {
    PodConfig {
        name: name.to_owned(),
        http: "127.0.0.1:0".parse().unwrap(),
        kv_events_endpoint: Some("tcp://127.0.0.1:0".into()),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: String::new(),
        data_parallel_rank: 0,
        cache: CacheConfig {
            block_size: 4,
            capacity_blocks: 1000,
            hash_seed: 0,
        },
        timing: Timing {
            prefill_ns_per_token: 0,
            decode_ns_per_token: 0,
        },
        model: "emu-model".into(),
        max_model_len: 4096,
        default_max_tokens: 4,
        mode: Mode::Serve,
        log_requests: true,
    }
}

/// A pod and the runtime serving it.
pub struct Emu {
    pub rt: tokio::runtime::Runtime,
    pub h: PodHandle,
    agent: ureq::Agent,
}

/// What an HTTP call returned.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub pod: Option<String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

impl Emu {
    pub fn start(cfg: PodConfig) -> Emu {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let h = rt
            .block_on(start_pod(cfg, Arc::new(WordTokenizer)))
            .expect("start pod");
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(20)))
            .build()
            .into();
        Emu { rt, h, agent }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.h.http)
    }

    fn reply(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Reply {
        let mut r = r.expect("HTTP call");
        Reply {
            status: r.status().as_u16(),
            pod: r
                .headers()
                .get(POD_HEADER)
                .map(|v| v.to_str().unwrap().to_owned()),
            body: r.body_mut().read_to_string().unwrap(),
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> Reply {
        Self::reply(
            self.agent
                .post(self.url(path))
                .content_type("application/json")
                .send(body.to_string()),
        )
    }

    /// A POST that gives up after `timeout` (Err: it did not answer in time).
    pub fn post_within(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Reply, String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .build()
            .into();
        let r = agent
            .post(self.url(path))
            .content_type("application/json")
            .send(body.to_string())
            .map_err(|e| e.to_string())?;
        Ok(Self::reply(Ok(r)))
    }

    pub fn get(&self, path: &str) -> Reply {
        Self::reply(self.agent.get(self.url(path)).call())
    }

    pub fn state(&self) -> Value {
        self.get("/emulate/state").json()
    }

    /// A completion of `prompt` (text or token ids); its usage.
    pub fn complete(&self, prompt: Value, max_tokens: usize) -> Value {
        let r = self.post(
            "/v1/completions",
            &serde_json::json!({"model": "emu-model", "prompt": prompt, "max_tokens": max_tokens}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"].clone()
    }
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_owned)
        .collect()
}
