//! [`TokenizeClient`]: asks an engine that tokenizes itself for a prompt's token ids, with
//! vLLM's `POST /tokenize` (`{"model", "prompt"}` or `{"model", "messages",
//! "add_generation_prompt": true}`, answered with `{"tokens": [...], "count",
//! "max_model_len"}`). The engine's own tokenizer and template then decide the ids, so a
//! host needs no tokenizer files for such a model.
//!
//! Blocking (ureq 3, no TLS, as kvr's remote-index client): the call is one small
//! request-answer exchange, an async caller runs it on a blocking thread
//! (`tokio::task::spawn_blocking`), and ureq keeps this crate free of an async runtime
//! that the engine emulator and the tests would otherwise have to carry.

use std::io;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::chat::ChatMessage;

/// The largest answer read (a 1M-token prompt's ids as JSON are about 8 MB).
const MAX_ANSWER_BYTES: u64 = 16 << 20;

/// The smallest timeout used (a zero timeout would fail every call).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// The default time allowed for a whole call.
pub const DEFAULT_TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a `/tokenize` call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeCallError {
    /// The base URL is not `http://host[:port][/path]`.
    InvalidUrl(String),
    /// No connection (refused, unreachable, unknown host).
    Unreachable(String),
    /// The call took longer than the timeout.
    Timeout,
    /// The engine answered with a status other than 2xx.
    BadStatus(u16),
    /// The answer is not `{"tokens": [u32...], ...}` (or is too large).
    BadBody(String),
}

impl TokenizeCallError {
    /// A stable name per kind (counter labels).
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizeCallError::InvalidUrl(_) => "invalid_url",
            TokenizeCallError::Unreachable(_) => "unreachable",
            TokenizeCallError::Timeout => "timeout",
            TokenizeCallError::BadStatus(_) => "bad_status",
            TokenizeCallError::BadBody(_) => "bad_body",
        }
    }
}

impl std::fmt::Display for TokenizeCallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizeCallError::InvalidUrl(e) => write!(f, "invalid tokenize URL: {e}"),
            TokenizeCallError::Unreachable(e) => write!(f, "tokenize endpoint unreachable: {e}"),
            TokenizeCallError::Timeout => f.write_str("tokenize call timed out"),
            TokenizeCallError::BadStatus(s) => write!(f, "tokenize endpoint answered {s}"),
            TokenizeCallError::BadBody(e) => write!(f, "bad tokenize answer: {e}"),
        }
    }
}

impl std::error::Error for TokenizeCallError {}

/// An engine's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// The engine's context length, when it says.
    pub max_model_len: Option<u64>,
}

#[derive(Serialize)]
struct PromptRequest<'a> {
    model: &'a str,
    prompt: &'a str,
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
}

#[derive(Deserialize)]
struct Answer {
    tokens: Vec<u32>,
    #[serde(default)]
    count: Option<u64>,
    #[serde(default)]
    max_model_len: Option<u64>,
}

/// A client of one engine's `/tokenize`. `Send + Sync`; pools its connections.
pub struct TokenizeClient {
    agent: ureq::Agent,
    url: String,
}

impl std::fmt::Debug for TokenizeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizeClient")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl TokenizeClient {
    /// A client of `{base_url}/tokenize` (`base_url` is `http://host[:port][/path]`;
    /// https is not supported). `timeout` bounds each whole call (connect included);
    /// below 1 ms it is raised to 1 ms. Connects to nothing yet.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, TokenizeCallError> {
        let url = tokenize_url(base_url)?;
        let timeout = timeout.max(MIN_TIMEOUT);
        let config = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(None)
            .build();
        Ok(Self {
            agent: ureq::Agent::new_with_config(config),
            url,
        })
    }

    /// The URL calls are posted to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The token ids of a completion prompt (the engine adds special tokens as it does
    /// for `/v1/completions`).
    pub fn tokenize_prompt(
        &self,
        model: &str,
        prompt: &str,
    ) -> Result<Tokenized, TokenizeCallError> {
        self.call(&PromptRequest { model, prompt })
    }

    /// The token ids of a chat, rendered by the engine's template with the generation
    /// prompt.
    pub fn tokenize_chat(
        &self,
        model: &str,
        messages: &[ChatMessage],
    ) -> Result<Tokenized, TokenizeCallError> {
        self.call(&ChatRequest {
            model,
            messages,
            add_generation_prompt: true,
        })
    }

    fn call<B: Serialize>(&self, body: &B) -> Result<Tokenized, TokenizeCallError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| TokenizeCallError::BadBody(format!("encoding the request: {e}")))?;
        let mut resp = self
            .agent
            .post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json")
            .send(&body[..])
            .map_err(classify)?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            return Err(TokenizeCallError::BadStatus(status));
        }
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(MAX_ANSWER_BYTES)
            .read_to_vec()
            .map_err(classify)?;
        let answer: Answer = serde_json::from_slice(&bytes)
            .map_err(|e| TokenizeCallError::BadBody(e.to_string()))?;
        if let Some(count) = answer.count {
            if count != answer.tokens.len() as u64 {
                return Err(TokenizeCallError::BadBody(format!(
                    "count {count} but {} tokens",
                    answer.tokens.len()
                )));
            }
        }
        Ok(Tokenized {
            tokens: answer.tokens,
            max_model_len: answer.max_model_len,
        })
    }
}

/// Checks `base_url` and returns `{base_url}/tokenize`.
fn tokenize_url(base_url: &str) -> Result<String, TokenizeCallError> {
    let invalid = |why: &str| TokenizeCallError::InvalidUrl(format!("{base_url:?}: {why}"));
    let url = base_url.trim();
    let uri: ureq::http::Uri = url.parse().map_err(|e| invalid(&format!("{e}")))?;
    match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") => {}
        Some(s) => return Err(invalid(&format!("unsupported scheme {s:?} (http:// only)"))),
        None => return Err(invalid("no scheme (expected http://host[:port][/path])")),
    }
    let authority = match uri.authority() {
        Some(a) if !a.host().is_empty() => a,
        _ => return Err(invalid("no host")),
    };
    if uri.query().is_some() {
        return Err(invalid("a base URL takes no query"));
    }
    let path = uri.path().trim_end_matches('/');
    Ok(format!("http://{}{path}/tokenize", authority.as_str()))
}

/// Sorts a ureq error into the client's kinds.
fn classify(e: ureq::Error) -> TokenizeCallError {
    match e {
        ureq::Error::Timeout(_) => TokenizeCallError::Timeout,
        ureq::Error::StatusCode(s) => TokenizeCallError::BadStatus(s),
        ureq::Error::HostNotFound => TokenizeCallError::Unreachable("host not found".into()),
        ureq::Error::ConnectionFailed => TokenizeCallError::Unreachable("connection failed".into()),
        ureq::Error::BodyExceedsLimit(n) => {
            TokenizeCallError::BadBody(format!("answer larger than {n} bytes"))
        }
        ureq::Error::Io(io) => match io.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => TokenizeCallError::Timeout,
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::AddrNotAvailable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::HostUnreachable => TokenizeCallError::Unreachable(io.to_string()),
            _ => TokenizeCallError::Unreachable(format!("io: {io}")),
        },
        other => TokenizeCallError::BadBody(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            tokenize_url("http://127.0.0.1:8000/").unwrap(),
            "http://127.0.0.1:8000/tokenize"
        );
        assert_eq!(tokenize_url("http://h/v1").unwrap(), "http://h/v1/tokenize");
        for bad in ["", "127.0.0.1:8000", "https://h", "http://h/?x=1"] {
            assert!(tokenize_url(bad).is_err(), "{bad}");
        }
    }
}
