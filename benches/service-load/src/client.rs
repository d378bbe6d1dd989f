//! The selection service's HTTP API (REFERENCE §7) over one pooled hyper client.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

/// A request that did not come back 2xx: the status, or `None` for a transport error.
#[derive(Debug)]
pub(crate) struct Failed(pub Option<StatusCode>, pub String);

#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

/// The fields of a SelectResponse the benchmark uses (the rest are ignored).
#[derive(Debug, Deserialize)]
pub(crate) struct Selected {
    pub selection_id: String,
    pub worker_id: u64,
    #[serde(default)]
    pub overlap: Overlap,
    /// Dynamo returns the prompt's sequence hashes; checked against ours once.
    #[serde(default)]
    pub sequence_hashes: Option<Vec<i64>>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct Overlap {
    /// Matched tokens on the device tier of the chosen worker.
    #[serde(default)]
    pub gpu: u64,
}

impl Api {
    pub(crate) fn new(port: u16) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(usize::MAX)
            .build(conn);
        Api {
            client,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Sends one request; the body of a 2xx answer, else `Failed`.
    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<Bytes, Failed> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| Failed(None, e.to_string()))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| Failed(None, e.to_string()))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| Failed(None, e.to_string()))?
            .to_bytes();
        if status.is_success() {
            Ok(bytes)
        } else {
            Err(Failed(
                Some(status),
                String::from_utf8_lossy(&bytes).into_owned(),
            ))
        }
    }

    pub(crate) async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<Bytes, Failed> {
        let body = Bytes::from(serde_json::to_vec(body).expect("json"));
        self.call(Method::POST, path, Some(body)).await
    }

    pub(crate) async fn get_json(&self, path: &str) -> Result<serde_json::Value, Failed> {
        let b = self.call(Method::GET, path, None).await?;
        serde_json::from_slice(&b).map_err(|e| Failed(None, e.to_string()))
    }

    /// `POST /select_and_reserve` with a prebuilt body.
    pub(crate) async fn select_and_reserve(&self, body: Bytes) -> Result<Selected, Failed> {
        let b = self
            .call(Method::POST, "/select_and_reserve", Some(body))
            .await?;
        serde_json::from_slice(&b).map_err(|e| Failed(None, format!("bad answer: {e}")))
    }

    pub(crate) async fn prefill_complete(&self, id: &str) -> Result<(), Failed> {
        let path = format!("/reservations/{id}/prefill_complete");
        self.call(Method::POST, &path, Some(Bytes::from_static(b"{}")))
            .await
            .map(|_| ())
    }

    pub(crate) async fn free(&self, id: &str) -> Result<(), Failed> {
        let path = format!("/reservations/{id}");
        self.call(Method::DELETE, &path, None).await.map(|_| ())
    }
}

/// `{"model_name":…,"token_ids":[…]}`, written directly: the bodies are up to ~50 KB,
/// one per operation, and `write!` per integer cost the generator ~30 ns a token.
pub(crate) fn select_body(model: &str, tokens: &[u32]) -> Bytes {
    let mut b = Vec::with_capacity(32 + model.len() + tokens.len() * 6);
    b.extend_from_slice(b"{\"model_name\":");
    b.extend_from_slice(serde_json::to_string(model).expect("str").as_bytes());
    b.extend_from_slice(b",\"token_ids\":[");
    let mut digits = [0u8; 10];
    for (i, &t) in tokens.iter().enumerate() {
        if i > 0 {
            b.push(b',');
        }
        let (mut v, mut at) = (t, digits.len());
        loop {
            at -= 1;
            digits[at] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        b.extend_from_slice(&digits[at..]);
    }
    b.extend_from_slice(b"]}");
    Bytes::from(b)
}

#[cfg(test)]
mod tests {
    #[test]
    fn select_body_is_json() {
        let b = super::select_body("bench", &[0, 1, 22, 333, u32::MAX]);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["model_name"], "bench");
        assert_eq!(v["token_ids"], serde_json::json!([0, 1, 22, 333, u32::MAX]));
    }
}
