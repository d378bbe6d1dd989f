//! From a request's path and body to what picking needs: the model, the prompt's token
//! ids and the request's shape (`kvr-tokenize` reads the body and tokenizes).
//!
//! Token ids come, in this order, from: the body itself (a `/v1/completions` prompt given
//! as token ids, as vLLM accepts), the model's local tokenizer (`tokenizer.json`, chats
//! through its template), or the engine's `/tokenize` when configured. A request is
//! tokenized once.

use std::time::{Duration, Instant};

use kvr_tokenize::{
    parse_openai_limited, BodyError, Prompt, PromptInput, ReuseConfig, TokenizeCallError,
    TokenizeClient, Tokenizers,
};

/// Why a body gave no prompt: each kind is counted and answered with its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// 413 (too large) or 400: the body is not a completions / chat body kvr can read.
    Body(BodyError),
    /// 400: a text prompt, and no tokenizer is configured for its model.
    NoTokenizer(String),
    /// 503: the tokenizer failed (the engine's `/tokenize` unreachable, ...).
    Tokenizer(String),
}

impl PromptError {
    pub fn status(&self) -> u16 {
        match self {
            PromptError::Body(BodyError::TooLarge { .. }) => 413,
            PromptError::Body(_) | PromptError::NoTokenizer(_) => 400,
            PromptError::Tokenizer(_) => 503,
        }
    }

    /// The metric label and error type: `body_<kind>`, `no_tokenizer`, `tokenizer_error`.
    pub fn kind(&self) -> &'static str {
        match self {
            PromptError::Body(BodyError::TooLarge { .. }) => "body_too_large",
            PromptError::Body(_) => "malformed_body",
            PromptError::NoTokenizer(_) => "no_tokenizer",
            PromptError::Tokenizer(_) => "tokenizer_error",
        }
    }

    pub fn message(&self) -> String {
        match self {
            PromptError::Body(e) => e.to_string(),
            PromptError::NoTokenizer(m) | PromptError::Tokenizer(m) => m.clone(),
        }
    }
}

/// How text becomes token ids: local tokenizers by model, else the engine's `/tokenize`.
#[derive(Debug, Default)]
pub struct Tokenization {
    pub local: Option<Tokenizers>,
    pub remote: Option<TokenizeClient>,
}

impl Tokenization {
    /// Local tokenizers from `(model, directory)` pairs (reusing the token ids of prompt
    /// heads seen before as `reuse` says), and the engine's `/tokenize` at `url` if given.
    pub fn new(
        local: &[(String, std::path::PathBuf)],
        url: Option<&str>,
        timeout: Duration,
        reuse: ReuseConfig,
    ) -> Result<Self, String> {
        let local = if local.is_empty() {
            None
        } else {
            Some(
                Tokenizers::load_reusing(local.iter().cloned(), reuse)
                    .map_err(|e| e.to_string())?,
            )
        };
        let remote = url
            .map(|u| TokenizeClient::new(u, timeout).map_err(|e| format!("--tokenize-url: {e}")))
            .transpose()?;
        Ok(Tokenization { local, remote })
    }
}

/// Token reuse keeping up to `mb` MiB (0: off), checked as [`ReuseConfig::default`].
pub fn reuse_config(mb: u64) -> ReuseConfig {
    ReuseConfig {
        capacity_bytes: usize::try_from(mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
        ..ReuseConfig::default()
    }
}

/// A request, read.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RequestPrompt {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// Seconds spent parsing and tokenizing.
    pub parse_secs: f64,
    pub tokenize_secs: f64,
}

/// A request body, parsed and not yet tokenized (the picker checks its model first).
#[derive(Debug)]
pub struct ParsedBody {
    input: PromptInput,
    parse_secs: f64,
}

/// Parses `body` (a request to `path`).
pub fn parse(path: &str, body: &[u8], limit: usize) -> Result<ParsedBody, PromptError> {
    let t0 = Instant::now();
    let input = parse_openai_limited(path, body, limit).map_err(PromptError::Body)?;
    Ok(ParsedBody {
        input,
        parse_secs: t0.elapsed().as_secs_f64(),
    })
}

/// Reads `body` (a request to `path`), tokenizing with `tok` where needed.
pub fn read(
    path: &str,
    body: &[u8],
    limit: usize,
    tok: &Tokenization,
) -> Result<RequestPrompt, PromptError> {
    let parsed = parse(path, body, limit)?;
    let base = parsed.model().unwrap_or_default().to_owned();
    parsed.tokenize(tok, &base)
}

impl ParsedBody {
    /// The model the request names.
    pub fn model(&self) -> Option<&str> {
        self.input.model.as_deref()
    }

    /// The prompt's token ids, with `tok` where the body has none attached.
    /// `base`: the pool model the request's model names (a LoRA adapter's base model):
    /// its local tokenizer is used; the engine's `/tokenize` is asked with the request's
    /// own model name (an engine knows its adapters).
    pub fn tokenize(self, tok: &Tokenization, base: &str) -> Result<RequestPrompt, PromptError> {
        let ParsedBody { input, parse_secs } = self;
        let t1 = Instant::now();
        let name = input.model.clone().unwrap_or_else(|| base.to_owned());
        let tokens = if let Some(ids) = input.attached_token_ids() {
            ids.to_vec()
        } else if let Some(t) = tok.local.as_ref().and_then(|l| l.get(base)) {
            input
                .token_ids(t)
                .map(|c| c.into_owned())
                .map_err(|e| PromptError::Tokenizer(e.to_string()))?
        } else if let Some(client) = &tok.remote {
            let called = match &input.prompt {
                Prompt::Text(t) => client.tokenize_prompt(&name, t),
                Prompt::Chat(m) => client.tokenize_chat(&name, m),
                Prompt::TokenIds(_) => unreachable!("attached ids are taken above"),
            };
            called
                .map(|t| t.tokens)
                .map_err(|e: TokenizeCallError| PromptError::Tokenizer(format!("/tokenize: {e}")))?
        } else {
            return Err(PromptError::NoTokenizer(format!(
                "no tokenizer is configured for model {name:?}: send the prompt as token ids, \
                 or start kvr epp with --tokenizer {name}=DIR or --tokenize-url"
            )));
        };
        Ok(RequestPrompt {
            model: input.model,
            tokens,
            stream: input.stream,
            max_tokens: input.max_tokens,
            parse_secs,
            tokenize_secs: t1.elapsed().as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asset() -> Tokenization {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tokenize/tests/assets/tokenizer");
        Tokenization::new(
            &[("m".into(), dir)],
            None,
            Duration::from_secs(1),
            reuse_config(1),
        )
        .unwrap()
    }

    #[test]
    fn token_ids_pass_through_and_text_is_tokenized_once() {
        let tok = asset();
        let r = read(
            "/v1/completions",
            br#"{"model":"m","prompt":[1,2,3],"stream":true}"#,
            1000,
            &tok,
        )
        .unwrap();
        assert_eq!((r.tokens, r.stream), (vec![1, 2, 3], true));
        let r = read(
            "/v1/completions",
            br#"{"model":"m","prompt":"the cache","max_tokens":7}"#,
            1000,
            &tok,
        )
        .unwrap();
        let local = tok.local.as_ref().unwrap().get("m").unwrap();
        assert_eq!(r.tokens, local.encode("the cache").unwrap());
        assert_eq!(r.max_tokens, Some(7));
        let r = read(
            "/v1/chat/completions?x=1",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            1000,
            &tok,
        )
        .unwrap();
        assert!(!r.tokens.is_empty());
    }

    #[test]
    fn every_error_has_its_kind_and_status() {
        let tok = asset();
        let none = Tokenization::default();
        let cases: [(&str, &[u8], &Tokenization, &str, u16); 6] = [
            ("/v1/completions", b"{not json", &tok, "malformed_body", 400),
            (
                "/v1/completions",
                br#"{"prompt":[1,-2]}"#,
                &tok,
                "malformed_body",
                400,
            ),
            (
                "/v1/embeddings",
                br#"{"input":"x"}"#,
                &tok,
                "malformed_body",
                400,
            ),
            (
                "/v1/completions",
                br#"{"model":"m","prompt":"x"}"#,
                &none,
                "no_tokenizer",
                400,
            ),
            (
                "/v1/completions",
                br#"{"model":"other","prompt":"x"}"#,
                &tok,
                "no_tokenizer",
                400,
            ),
            (
                "/v1/completions",
                &[b' '; 2000],
                &tok,
                "body_too_large",
                413,
            ),
        ];
        for (path, body, t, kind, status) in cases {
            let e = read(path, body, 1000, t).unwrap_err();
            assert_eq!((e.kind(), e.status()), (kind, status), "{path} {e:?}");
        }
        // An engine /tokenize that does not answer.
        let dead = Tokenization::new(
            &[],
            Some("http://127.0.0.1:9"),
            Duration::from_millis(200),
            reuse_config(0),
        )
        .unwrap();
        let e = read(
            "/v1/completions",
            br#"{"model":"m","prompt":"x"}"#,
            1000,
            &dead,
        )
        .unwrap_err();
        assert_eq!((e.kind(), e.status()), ("tokenizer_error", 503), "{e:?}");
    }
}
