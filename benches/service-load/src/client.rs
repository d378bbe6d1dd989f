//! The selection service's HTTP API (REFERENCE §7) over one pooled hyper client.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

/// How a select_and_reserve body is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BodyForm {
    /// `application/json`, `token_ids` as an array of decimals.
    Json,
    /// `application/msgpack` (kvr's binary form), `token_ids` as a `bin` of
    /// little-endian u32s.
    Msgpack,
}

impl BodyForm {
    fn content_type(self) -> &'static str {
        match self {
            BodyForm::Json => "application/json",
            BodyForm::Msgpack => "application/msgpack",
        }
    }
}

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
    /// The prompt's sequence hashes, as both services return them: read on every
    /// [`HASH_CHECK_EVERY`]th answer only (at 32k tokens they are 2,048 integers, whose
    /// parsing would make the generator, not the server, the limit).
    #[serde(default, skip)]
    pub sequence_hashes: Option<Vec<i64>>,
}

/// The answer's `sequence_hashes` alone.
#[derive(Debug, Deserialize)]
struct Hashes {
    #[serde(default)]
    sequence_hashes: Option<Vec<i64>>,
}

/// Every this many answers, the sequence hashes are read and checked against ours.
pub(crate) const HASH_CHECK_EVERY: u64 = 16;

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
        self.call_as(method, path, body, BodyForm::Json).await
    }

    /// [`Api::call`] with a body of the given form.
    async fn call_as(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        form: BodyForm,
    ) -> Result<Bytes, Failed> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if body.is_some() {
            req = req.header("content-type", form.content_type());
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
    /// `POST /select_and_reserve` with a prebuilt body; `check_hashes` also reads the
    /// answer's `sequence_hashes`.
    pub(crate) async fn select_and_reserve(
        &self,
        form: BodyForm,
        body: Bytes,
        check_hashes: bool,
    ) -> Result<Selected, Failed> {
        let b = self
            .call_as(Method::POST, "/select_and_reserve", Some(body), form)
            .await?;
        let bad = |e: serde_json::Error| Failed(None, format!("bad answer: {e}"));
        let mut sel: Selected = serde_json::from_slice(&b).map_err(bad)?;
        if check_hashes {
            sel.sequence_hashes = serde_json::from_slice::<Hashes>(&b)
                .map_err(bad)?
                .sequence_hashes;
        }
        Ok(sel)
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
pub(crate) fn select_body(form: BodyForm, model: &str, tokens: &[u32]) -> Bytes {
    match form {
        BodyForm::Json => json_body(model, tokens),
        BodyForm::Msgpack => msgpack_body(model, tokens),
    }
}

/// The msgpack form: `{"model_name": …, "token_ids": bin}`, the tokens' little-endian
/// bytes as they are in memory on every common platform.
fn msgpack_body(model: &str, tokens: &[u32]) -> Bytes {
    let mut b = Vec::with_capacity(32 + model.len() + tokens.len() * 4);
    rmp::encode::write_map_len(&mut b, 2).expect("vec");
    rmp::encode::write_str(&mut b, "model_name").expect("vec");
    rmp::encode::write_str(&mut b, model).expect("vec");
    rmp::encode::write_str(&mut b, "token_ids").expect("vec");
    rmp::encode::write_bin_len(&mut b, (tokens.len() * 4) as u32).expect("vec");
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    Bytes::from(b)
}

/// The JSON form. Each token is written as a fixed 16-byte store into a buffer sized
/// for the longest numbers, then the cursor moves by its length: a copy of a variable
/// 1 to 10 bytes per token (a `memmove` call each) was a fifth of the generator's CPU.
fn json_body(model: &str, tokens: &[u32]) -> Bytes {
    let mut b = Vec::with_capacity(48 + model.len() + tokens.len() * 11);
    b.extend_from_slice(b"{\"model_name\":");
    b.extend_from_slice(serde_json::to_string(model).expect("str").as_bytes());
    b.extend_from_slice(b",\"token_ids\":[");
    let mut at = b.len();
    // 10 digits and a comma per token at most, and room for the last 16-byte store.
    b.resize(at + tokens.len() * 11 + 16, 0);
    for &t in tokens {
        at += match decimal(t) {
            Some((word, n)) => {
                b[at..at + 8].copy_from_slice(&word.to_le_bytes());
                n
            }
            None => decimal_long(t, &mut b[at..at + 11]),
        };
    }
    if !tokens.is_empty() {
        at -= 1; // the last comma
    }
    b.truncate(at);
    b.extend_from_slice(b"]}");
    Bytes::from(b)
}

/// `t` below 10^7 in decimal followed by a comma, as the bytes of one little-endian
/// word, and its length: the digits are four ASCII pairs assembled in a register and
/// shifted past the leading zeros (no loop, no branch per digit, no store to memory
/// before the single 8-byte store).
#[inline(always)]
fn decimal(t: u32) -> Option<(u64, usize)> {
    if t >= 10_000_000 {
        return None;
    }
    let pair = |x: u32| {
        u64::from(u16::from_le_bytes([
            b'0' + (x / 10) as u8,
            b'0' + (x % 10) as u8,
        ]))
    };
    let n = t.checked_ilog10().map_or(1, |l| l as usize + 1);
    let w = pair(t / 1_000_000)
        | pair(t / 10_000 % 100) << 16
        | pair(t / 100 % 100) << 32
        | pair(t % 100) << 48;
    Some(((w >> (8 * (8 - n))) | u64::from(b',') << (8 * n), n + 1))
}

/// `t` in decimal and a comma into `out` (11 bytes), a digit at a time; its length.
fn decimal_long(mut t: u32, out: &mut [u8]) -> usize {
    let n = t.checked_ilog10().map_or(1, |l| l as usize + 1);
    for i in (0..n).rev() {
        out[i] = b'0' + (t % 10) as u8;
        t /= 10;
    }
    out[n] = b',';
    n + 1
}

#[cfg(test)]
mod tests {
    #[test]
    fn select_body_is_json() {
        let b = super::select_body(super::BodyForm::Json, "bench", &[0, 1, 22, 333, u32::MAX]);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["model_name"], "bench");
        assert_eq!(v["token_ids"], serde_json::json!([0, 1, 22, 333, u32::MAX]));
        let tokens: Vec<u32> = (0..32).map(|i| (1u64 << i) as u32 - 1).collect();
        let b = super::select_body(super::BodyForm::Json, "m", &tokens);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["token_ids"], serde_json::json!(tokens));
        let b = super::select_body(super::BodyForm::Json, "m", &[]);
        assert_eq!(&b[..], br#"{"model_name":"m","token_ids":[]}"#);
    }

    #[test]
    fn msgpack_body_is_a_map_with_a_bin_of_le_u32() {
        let b = super::select_body(super::BodyForm::Msgpack, "bench", &[1, 258, u32::MAX]);
        let v = rmpv::decode::read_value(&mut &b[..]).unwrap();
        let m = v.as_map().unwrap();
        assert_eq!(m[0].0.as_str(), Some("model_name"));
        assert_eq!(m[0].1.as_str(), Some("bench"));
        assert_eq!(m[1].0.as_str(), Some("token_ids"));
        assert_eq!(
            m[1].1.as_slice(),
            Some(&[1, 0, 0, 0, 2, 1, 0, 0, 255, 255, 255, 255][..])
        );
    }
}
