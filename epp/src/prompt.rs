//! From a request's path and body to what picking needs: the model, the prompt's token
//! ids and the request's shape.
//!
//! Token ids come, in this order, from: the body itself (a `/v1/completions` prompt given
//! as token ids, what vLLM accepts), or the configured tokenizer of the model (a local
//! `tokenizer.json`, or the engine's `/tokenize`). A request is tokenized once.

use std::time::Instant;

use serde_json::Value;

/// Why a body gave no prompt: each kind is counted and answered with its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// 413: the body is over the limit.
    TooLarge { limit: usize },
    /// 400: not JSON, or not a completions / chat body.
    Malformed(String),
    /// 400: a prompt kvr needs a tokenizer for, and none is configured for the model.
    NoTokenizer(String),
    /// 503: the tokenizer failed (the engine's `/tokenize` unreachable, ...).
    Tokenizer(String),
}

impl PromptError {
    pub fn status(&self) -> u16 {
        match self {
            PromptError::TooLarge { .. } => 413,
            PromptError::Malformed(_) | PromptError::NoTokenizer(_) => 400,
            PromptError::Tokenizer(_) => 503,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            PromptError::TooLarge { .. } => "body_too_large",
            PromptError::Malformed(_) => "malformed_body",
            PromptError::NoTokenizer(_) => "no_tokenizer",
            PromptError::Tokenizer(_) => "tokenizer_error",
        }
    }

    pub fn message(&self) -> String {
        match self {
            PromptError::TooLarge { limit } => format!("request body over {limit} bytes"),
            PromptError::Malformed(m) | PromptError::NoTokenizer(m) | PromptError::Tokenizer(m) => {
                m.clone()
            }
        }
    }
}

/// What a request's text is, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub enum Text {
    /// A completion prompt.
    Prompt(String),
    /// Chat messages (the OpenAI `messages` array), rendered by the model's template.
    Chat(Value),
}

/// Turns a model's text into token ids (a local tokenizer, or the engine's `/tokenize`).
pub trait Tokenize: Send + Sync + std::fmt::Debug {
    /// `Err(None)`: no tokenizer for this model; `Err(Some(e))`: it failed.
    fn tokens(&self, model: &str, text: &Text) -> Result<Vec<u32>, Option<String>>;
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

/// Reads `body` (a request to `path`), tokenizing with `tok` where needed.
pub fn read(
    path: &str,
    body: &[u8],
    limit: usize,
    tok: Option<&dyn Tokenize>,
) -> Result<RequestPrompt, PromptError> {
    if body.len() > limit {
        return Err(PromptError::TooLarge { limit });
    }
    let t0 = Instant::now();
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| PromptError::Malformed(format!("body is not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| PromptError::Malformed("body is not a JSON object".into()))?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(PromptError::Malformed("model is not a string".into())),
    };
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let max_tokens = obj
        .get("max_completion_tokens")
        .or_else(|| obj.get("max_tokens"))
        .and_then(Value::as_u64);
    let route = path.split('?').next().unwrap_or(path);
    let text = if route.ends_with("/chat/completions") {
        match obj.get("messages") {
            Some(m @ Value::Array(_)) => Text::Chat(m.clone()),
            _ => return Err(PromptError::Malformed("messages is not an array".into())),
        }
    } else if route.ends_with("/completions") {
        match obj.get("prompt") {
            Some(Value::String(s)) => Text::Prompt(s.clone()),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Text::Prompt(a[0].as_str().unwrap_or_default().to_owned())
            }
            Some(Value::Array(a)) => {
                // Token ids, or a one-prompt batch of them.
                let ids = match a.first() {
                    Some(Value::Array(inner)) if a.len() == 1 => inner,
                    _ => a,
                };
                let tokens = ids
                    .iter()
                    .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| {
                        PromptError::Malformed(
                            "prompt is not a string, a token id array or one of either".into(),
                        )
                    })?;
                return Ok(RequestPrompt {
                    model,
                    tokens,
                    stream,
                    max_tokens,
                    parse_secs: t0.elapsed().as_secs_f64(),
                    tokenize_secs: 0.0,
                });
            }
            _ => return Err(PromptError::Malformed("prompt is missing".into())),
        }
    } else {
        return Err(PromptError::Malformed(format!(
            "{route}: not a completions or chat completions request"
        )));
    };
    let parse_secs = t0.elapsed().as_secs_f64();
    let name = model.clone().unwrap_or_default();
    let t1 = Instant::now();
    let tokens = match tok {
        None => Err(None),
        Some(t) => t.tokens(&name, &text),
    }
    .map_err(|e| match e {
        None => PromptError::NoTokenizer(format!(
            "no tokenizer is configured for model {name:?}: send the prompt as token ids"
        )),
        Some(e) => PromptError::Tokenizer(e),
    })?;
    Ok(RequestPrompt {
        model,
        tokens,
        stream,
        max_tokens,
        parse_secs,
        tokenize_secs: t1.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Words;
    impl Tokenize for Words {
        fn tokens(&self, model: &str, text: &Text) -> Result<Vec<u32>, Option<String>> {
            match (model, text) {
                ("broken", _) => Err(Some("down".into())),
                ("m", Text::Prompt(p)) => Ok(p.split(' ').map(|w| w.len() as u32).collect()),
                ("m", Text::Chat(_)) => Ok(vec![1, 2]),
                _ => Err(None),
            }
        }
    }

    #[test]
    fn token_ids_pass_through_and_text_is_tokenized() {
        let r = read(
            "/v1/completions",
            br#"{"model":"m","prompt":[1,2,3],"stream":true}"#,
            1000,
            None,
        )
        .unwrap();
        assert_eq!((r.tokens, r.stream), (vec![1, 2, 3], true));
        let r = read(
            "/v1/completions",
            br#"{"model":"m","prompt":[[4,5]]}"#,
            1000,
            None,
        )
        .unwrap();
        assert_eq!(r.tokens, vec![4, 5]);
        let r = read(
            "/v1/completions",
            br#"{"model":"m","prompt":"ab c","max_tokens":7}"#,
            1000,
            Some(&Words),
        )
        .unwrap();
        assert_eq!((r.tokens, r.max_tokens), (vec![2, 1], Some(7)));
        let r = read(
            "/v1/chat/completions?x=1",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            1000,
            Some(&Words),
        )
        .unwrap();
        assert_eq!(r.tokens, vec![1, 2]);
    }

    #[test]
    fn every_error_has_its_kind_and_status() {
        let cases: [(&str, &[u8], Option<&dyn Tokenize>, &str, u16); 8] = [
            ("/v1/completions", b"{not json", None, "malformed_body", 400),
            ("/v1/completions", b"[1]", None, "malformed_body", 400),
            (
                "/v1/completions",
                br#"{"model":1,"prompt":"x"}"#,
                None,
                "malformed_body",
                400,
            ),
            (
                "/v1/completions",
                br#"{"prompt":[1,-2]}"#,
                None,
                "malformed_body",
                400,
            ),
            (
                "/v1/embeddings",
                br#"{"input":"x"}"#,
                None,
                "malformed_body",
                400,
            ),
            (
                "/v1/completions",
                br#"{"model":"m","prompt":"x"}"#,
                None,
                "no_tokenizer",
                400,
            ),
            (
                "/v1/completions",
                br#"{"model":"broken","prompt":"x"}"#,
                Some(&Words),
                "tokenizer_error",
                503,
            ),
            (
                "/v1/completions",
                &[b' '; 2000],
                None,
                "body_too_large",
                413,
            ),
        ];
        for (path, body, tok, kind, status) in cases {
            let e = read(path, body, 1000, tok).unwrap_err();
            assert_eq!((e.kind(), e.status()), (kind, status), "{path} {e:?}");
        }
    }
}
