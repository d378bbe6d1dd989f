//! OpenAI-style request bodies: what a prompt is before it is tokenized.
//!
//! [`parse_openai`] reads a `/v1/completions` or `/v1/chat/completions` body. Only the
//! fields routing needs are read; the rest of the body is skipped, not copied. The
//! prompt of a completion is a string, an array of token ids (as vLLM accepts), or a
//! one-element array of either; batches of several prompts are refused (one request is
//! routed to one server, and their prefixes differ). A chat's `messages` content is a
//! string, null, or a list of `{"type": "text", "text": ...}` parts.
//!
//! A refused body is a [`BodyError`], whose [`BodyError::kind`] is a stable name to count
//! by; the caller answers 400.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::chat::ChatMessage;
use crate::tokenizer::{TokenizeError, Tokenizer};

/// The default largest body parsed: 8 MiB (a 128k-token prompt is about 0.5 MB of text).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// The OpenAI endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
}

impl Api {
    /// The endpoint of a request path (a query string is ignored), or `None`.
    pub fn from_path(path: &str) -> Option<Api> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        match path {
            "/v1/completions" => Some(Api::Completions),
            "/v1/chat/completions" => Some(Api::ChatCompletions),
            _ => None,
        }
    }

    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// A request's prompt, not yet tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// A completion prompt's text.
    Text(String),
    /// Token ids the client sent (a completion's `prompt` as an array of integers): used
    /// as they are, never re-tokenized.
    TokenIds(Vec<u32>),
    /// A chat's messages.
    Chat(Vec<ChatMessage>),
}

/// What [`parse_openai`] read from a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptInput {
    /// The endpoint.
    pub api: Api,
    /// `model`, when given.
    pub model: Option<String>,
    /// `stream` (false when absent).
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens` (vLLM's order), when given.
    pub max_tokens: Option<u64>,
    /// The prompt.
    pub prompt: Prompt,
}

impl PromptInput {
    /// The token ids the client attached (a completion whose prompt is token ids).
    pub fn attached_token_ids(&self) -> Option<&[u32]> {
        match &self.prompt {
            Prompt::TokenIds(ids) => Some(ids),
            _ => None,
        }
    }

    /// The prompt's token ids: attached ids as they are, a text through
    /// [`Tokenizer::encode`], a chat through [`Tokenizer::encode_chat`].
    pub fn token_ids(&self, tokenizer: &Tokenizer) -> Result<Cow<'_, [u32]>, TokenizeError> {
        match &self.prompt {
            Prompt::TokenIds(ids) => Ok(Cow::Borrowed(ids)),
            Prompt::Text(t) => tokenizer.encode(t).map(Cow::Owned),
            Prompt::Chat(m) => tokenizer.encode_chat(m).map(Cow::Owned),
        }
    }
}

/// Why a body was refused. Each variant's [`Self::kind`] is stable (counter labels).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// The path is neither completions endpoint.
    UnknownPath(String),
    /// The body is larger than the limit (it was not parsed).
    TooLarge {
        /// The body's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The body is not JSON (or not UTF-8, or has a repeated field).
    NotJson(String),
    /// The body is JSON but not an object.
    NotObject,
    /// `model`, `stream`, `max_tokens` or `max_completion_tokens` has the wrong type.
    BadField {
        /// The field's name.
        field: &'static str,
        /// What it should be.
        expected: &'static str,
    },
    /// A completion without `prompt`.
    MissingPrompt,
    /// `prompt` is neither a string, nor token ids, nor a one-element array of either.
    BadPrompt(String),
    /// `prompt` is a batch of several prompts.
    BatchedPrompt(usize),
    /// A token id that is not an integer in `0..2^32`.
    BadTokenId(String),
    /// An empty array of token ids, or of messages.
    EmptyPrompt,
    /// A chat without `messages`.
    MissingMessages,
    /// `messages` or one of its messages is malformed.
    BadMessages(String),
    /// A content part that is not text (an image, audio...).
    UnsupportedContent(String),
}

impl BodyError {
    /// Every [`Self::kind`], for declaring counters up front.
    pub const KINDS: [&'static str; 13] = [
        "unknown_path",
        "too_large",
        "not_json",
        "not_object",
        "bad_field",
        "missing_prompt",
        "bad_prompt",
        "batched_prompt",
        "bad_token_id",
        "empty_prompt",
        "missing_messages",
        "bad_messages",
        "unsupported_content",
    ];

    /// The error's stable name (one of [`Self::KINDS`]).
    pub fn kind(&self) -> &'static str {
        match self {
            BodyError::UnknownPath(_) => "unknown_path",
            BodyError::TooLarge { .. } => "too_large",
            BodyError::NotJson(_) => "not_json",
            BodyError::NotObject => "not_object",
            BodyError::BadField { .. } => "bad_field",
            BodyError::MissingPrompt => "missing_prompt",
            BodyError::BadPrompt(_) => "bad_prompt",
            BodyError::BatchedPrompt(_) => "batched_prompt",
            BodyError::BadTokenId(_) => "bad_token_id",
            BodyError::EmptyPrompt => "empty_prompt",
            BodyError::MissingMessages => "missing_messages",
            BodyError::BadMessages(_) => "bad_messages",
            BodyError::UnsupportedContent(_) => "unsupported_content",
        }
    }
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::UnknownPath(p) => write!(
                f,
                "path {p:?} is not /v1/completions or /v1/chat/completions"
            ),
            BodyError::TooLarge { len, limit } => {
                write!(f, "body of {len} bytes is larger than the limit of {limit}")
            }
            BodyError::NotJson(e) => write!(f, "body is not JSON: {e}"),
            BodyError::NotObject => f.write_str("body is not a JSON object"),
            BodyError::BadField { field, expected } => write!(f, "`{field}` must be {expected}"),
            BodyError::MissingPrompt => f.write_str("`prompt` is missing"),
            BodyError::BadPrompt(e) => write!(
                f,
                "`prompt` must be a string, an array of token ids, or a one-element array of either; {e}"
            ),
            BodyError::BatchedPrompt(n) => {
                write!(f, "`prompt` is a batch of {n} prompts; send one per request")
            }
            BodyError::BadTokenId(e) => {
                write!(f, "token ids must be integers from 0 to 4294967295; {e}")
            }
            BodyError::EmptyPrompt => f.write_str("the prompt is empty"),
            BodyError::MissingMessages => f.write_str("`messages` is missing"),
            BodyError::BadMessages(e) => write!(f, "`messages`: {e}"),
            BodyError::UnsupportedContent(t) => {
                write!(f, "content part of type {t:?} is not supported (text only)")
            }
        }
    }
}

impl std::error::Error for BodyError {}

/// [`parse_openai_limited`] with [`DEFAULT_MAX_BODY_BYTES`].
pub fn parse_openai(path: &str, body: &[u8]) -> Result<PromptInput, BodyError> {
    parse_openai_limited(path, body, DEFAULT_MAX_BODY_BYTES)
}

/// Reads the body of a request to `path`. A body longer than `max_bytes` is refused
/// before it is parsed.
pub fn parse_openai_limited(
    path: &str,
    body: &[u8],
    max_bytes: usize,
) -> Result<PromptInput, BodyError> {
    let api = Api::from_path(path).ok_or_else(|| BodyError::UnknownPath(path.to_owned()))?;
    if body.len() > max_bytes {
        return Err(BodyError::TooLarge {
            len: body.len(),
            limit: max_bytes,
        });
    }
    let top = parse_top(body)?;
    let model = top
        .model
        .map(|v| field::<String>(v, "model", "a string"))
        .transpose()?;
    let stream = top
        .stream
        .map(|v| field::<bool>(v, "stream", "true or false"))
        .transpose()?
        .unwrap_or(false);
    let max_tokens = top
        .max_tokens
        .map(|v| field::<u64>(v, "max_tokens", "a non-negative integer"))
        .transpose()?;
    let max_completion_tokens = top
        .max_completion_tokens
        .map(|v| field::<u64>(v, "max_completion_tokens", "a non-negative integer"))
        .transpose()?;
    let prompt = match api {
        Api::Completions => parse_prompt(top.prompt.ok_or(BodyError::MissingPrompt)?)?,
        Api::ChatCompletions => Prompt::Chat(parse_messages(
            top.messages.ok_or(BodyError::MissingMessages)?,
        )?),
    };
    Ok(PromptInput {
        api,
        model,
        stream,
        max_tokens: max_completion_tokens.or(max_tokens),
        prompt,
    })
}

/// Token ids passed outside the body (a header): a JSON array (`[1,2,3]`) or
/// comma-separated integers (`1,2,3`, spaces allowed).
pub fn parse_token_ids(value: &str) -> Result<Vec<u32>, BodyError> {
    let v = value.trim();
    let ids = if v.starts_with('[') {
        let raw: &RawValue =
            serde_json::from_str(v).map_err(|e| BodyError::BadTokenId(e.to_string()))?;
        token_array(raw)?
    } else {
        v.split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                s.trim()
                    .parse::<u32>()
                    .map_err(|_| BodyError::BadTokenId(format!("{:?}", s.trim())))
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    if ids.is_empty() {
        return Err(BodyError::EmptyPrompt);
    }
    Ok(ids)
}

/// The fields read; every other field is skipped without being copied.
#[derive(Deserialize)]
struct Top<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
}

fn parse_top(body: &[u8]) -> Result<Top<'_>, BodyError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        // Tell "valid JSON of another shape" from "not JSON".
        return match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(BodyError::NotObject),
            Err(e) => Err(BodyError::NotJson(e.to_string())),
        };
    }
    serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))
}

/// A field of a known type. JSON `null` reads as absent before this is called.
fn field<'a, T: Deserialize<'a>>(
    v: &'a RawValue,
    field: &'static str,
    expected: &'static str,
) -> Result<T, BodyError> {
    serde_json::from_str(v.get()).map_err(|_| BodyError::BadField { field, expected })
}

/// The first byte of a raw value (it has no leading whitespace).
fn lead(v: &RawValue) -> u8 {
    v.get().as_bytes().first().copied().unwrap_or(b' ')
}

/// A JSON type's name, for error messages.
fn type_name(v: &RawValue) -> &'static str {
    match lead(v) {
        b'"' => "a string",
        b'[' => "an array",
        b'{' => "an object",
        b't' | b'f' => "a boolean",
        b'n' => "null",
        _ => "a number",
    }
}

fn parse_prompt(v: &RawValue) -> Result<Prompt, BodyError> {
    match lead(v) {
        b'"' => Ok(Prompt::Text(string(v)?)),
        b'[' => {
            // The common shapes first: token ids, then a one-element batch.
            if let Some(ids) = plain_ids(v.get()) {
                return if ids.is_empty() {
                    Err(BodyError::EmptyPrompt)
                } else {
                    Ok(Prompt::TokenIds(ids))
                };
            }
            let items: Vec<&RawValue> =
                serde_json::from_str(v.get()).map_err(|e| BodyError::BadPrompt(e.to_string()))?;
            match items.as_slice() {
                [] => Err(BodyError::EmptyPrompt),
                [one] if lead(one) == b'"' => Ok(Prompt::Text(string(one)?)),
                [one] if lead(one) == b'[' => {
                    let ids = token_array(one)?;
                    if ids.is_empty() {
                        Err(BodyError::EmptyPrompt)
                    } else {
                        Ok(Prompt::TokenIds(ids))
                    }
                }
                items if items.iter().all(|i| is_number(i)) => Err(token_error(items)),
                [one] => Err(BodyError::BadPrompt(format!(
                    "its element is {}",
                    type_name(one)
                ))),
                items if items.iter().all(|i| matches!(lead(i), b'"' | b'[')) => {
                    Err(BodyError::BatchedPrompt(items.len()))
                }
                _ => Err(BodyError::BadPrompt(
                    "it mixes token ids with other values".into(),
                )),
            }
        }
        _ => Err(BodyError::BadPrompt(format!("got {}", type_name(v)))),
    }
}

/// A JSON array of token ids, as serde_json reads it into `Vec<u32>`. The common shape
/// (`[1, 2, 3]`: digits, commas, whitespace) is read in one pass without serde, 4-5 times
/// faster for long prompts; anything else goes to serde_json, which then decides.
fn plain_ids(json: &str) -> Option<Vec<u32>> {
    fast_ids(json.as_bytes()).or_else(|| serde_json::from_str(json).ok())
}

/// The fast path of [`plain_ids`]: `None` for anything but a canonical array of
/// non-negative integers that fit in a `u32` (serde_json then decides: it may still read
/// `-0`, or refuse).
fn fast_ids(b: &[u8]) -> Option<Vec<u32>> {
    let ws = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\n' | b'\r' | b'\t') {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i += 1;
    let mut ids = Vec::with_capacity(b.len() / 4);
    ws(&mut i);
    if b.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            let start = i;
            let mut n: u64 = 0;
            while i < b.len() && b[i].is_ascii_digit() && i - start < 11 {
                n = n * 10 + u64::from(b[i] - b'0');
                i += 1;
            }
            let len = i - start;
            // No digits, a leading zero, or too long or large for a u32.
            if len == 0 || (len > 1 && b[start] == b'0') || n > u64::from(u32::MAX) {
                return None;
            }
            ids.push(n as u32);
            ws(&mut i);
            match b.get(i) {
                Some(b',') => {
                    i += 1;
                    ws(&mut i);
                }
                Some(b']') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    ws(&mut i);
    (i == b.len()).then_some(ids)
}

fn is_number(v: &RawValue) -> bool {
    matches!(lead(v), b'-' | b'0'..=b'9')
}

/// The error for an array of numbers that are not all token ids: names the first bad one.
fn token_error(items: &[&RawValue]) -> BodyError {
    let bad = items
        .iter()
        .find(|i| serde_json::from_str::<u32>(i.get()).is_err())
        .map_or("", |i| i.get());
    BodyError::BadTokenId(format!("got {bad}"))
}

/// An array that must hold token ids only.
fn token_array(v: &RawValue) -> Result<Vec<u32>, BodyError> {
    if let Some(ids) = plain_ids(v.get()) {
        return Ok(ids);
    }
    let items: Vec<&RawValue> =
        serde_json::from_str(v.get()).map_err(|e| BodyError::BadPrompt(e.to_string()))?;
    if items.iter().all(|i| is_number(i)) {
        Err(token_error(&items))
    } else {
        Err(BodyError::BadPrompt(
            "an array inside `prompt` must hold token ids only".into(),
        ))
    }
}

fn string(v: &RawValue) -> Result<String, BodyError> {
    serde_json::from_str(v.get()).map_err(|e| BodyError::NotJson(e.to_string()))
}

/// One message: `role` and `content` read, other fields (`name`, `tool_calls`...) skipped.
#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// One content part: `type` and `text` read.
#[derive(Deserialize)]
struct RawPart<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
}

fn parse_messages(v: &RawValue) -> Result<Vec<ChatMessage>, BodyError> {
    if lead(v) != b'[' {
        return Err(BodyError::BadMessages(format!(
            "must be an array, got {}",
            type_name(v)
        )));
    }
    let items: Vec<&RawValue> =
        serde_json::from_str(v.get()).map_err(|e| BodyError::BadMessages(e.to_string()))?;
    if items.is_empty() {
        return Err(BodyError::EmptyPrompt);
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, v: &RawValue) -> Result<ChatMessage, BodyError> {
    let bad = |why: String| BodyError::BadMessages(format!("message {i}: {why}"));
    if lead(v) != b'{' {
        return Err(bad(format!("must be an object, got {}", type_name(v))));
    }
    let m: RawMessage<'_> = serde_json::from_str(v.get()).map_err(|e| bad(e.to_string()))?;
    let role = match m.role {
        Some(r) if lead(r) == b'"' => string(r)?,
        Some(r) => {
            return Err(bad(format!(
                "`role` must be a string, got {}",
                type_name(r)
            )))
        }
        None => return Err(bad("`role` is missing".into())),
    };
    let content = match m.content {
        None => None,
        Some(c) if lead(c) == b'"' => Some(string(c)?),
        Some(c) if lead(c) == b'[' => Some(parse_parts(c).map_err(|e| match e {
            BodyError::BadMessages(why) => bad(why),
            other => other,
        })?),
        Some(c) => {
            return Err(bad(format!(
                "`content` must be a string, a list of parts or null, got {}",
                type_name(c)
            )))
        }
    };
    Ok(ChatMessage { role, content })
}

/// Text parts joined with `"\n"` (vLLM's "string" content format).
fn parse_parts(v: &RawValue) -> Result<String, BodyError> {
    let parts: Vec<&RawValue> =
        serde_json::from_str(v.get()).map_err(|e| BodyError::BadMessages(e.to_string()))?;
    let mut out = String::new();
    for (j, p) in parts.iter().enumerate() {
        let bad = |why: &str| BodyError::BadMessages(format!("content part {j}: {why}"));
        if lead(p) != b'{' {
            return Err(bad("must be an object"));
        }
        let part: RawPart<'_> = serde_json::from_str(p.get()).map_err(|e| bad(&e.to_string()))?;
        let kind = match part.kind {
            Some(k) if lead(k) == b'"' => string(k)?,
            _ => return Err(bad("`type` must be a string")),
        };
        if kind != "text" {
            return Err(BodyError::UnsupportedContent(kind));
        }
        let text = match part.text {
            Some(t) if lead(t) == b'"' => string(t)?,
            _ => return Err(bad("`text` must be a string")),
        };
        if j > 0 {
            out.push('\n');
        }
        out.push_str(&text);
    }
    Ok(out)
}

#[cfg(test)]
mod fast_ids_tests {
    use super::fast_ids;

    /// Every answer of the fast path is serde_json's, on canonical arrays and on arrays
    /// mutated byte by byte; and it takes the canonical ones.
    #[test]
    fn the_fast_path_agrees_with_serde_json() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let alphabet = b"0123456789 ,[]-.e+\n\t\"a";
        let (mut fast, mut checked) = (0, 0);
        for _ in 0..20_000 {
            let n = next() % 12;
            let ids: Vec<u64> = (0..n)
                .map(|_| match next() % 4 {
                    0 => next() % 10,
                    1 => next() % 100_000,
                    2 => u64::from(u32::MAX) - next() % 3 + next() % 3,
                    _ => next() % 5_000_000_000,
                })
                .collect();
            let sep = [",", ", ", " ,\n"][(next() % 3) as usize];
            let mut text = format!(
                "{}[{}]{}",
                [" ", "", "\n"][(next() % 3) as usize],
                ids.iter().map(u64::to_string).collect::<Vec<_>>().join(sep),
                ["", " "][(next() % 2) as usize]
            )
            .into_bytes();
            let canonical = ids.iter().all(|&x| x <= u64::from(u32::MAX));
            if next() % 2 == 0 && !text.is_empty() {
                let at = (next() % text.len() as u64) as usize;
                text[at] = alphabet[(next() % alphabet.len() as u64) as usize];
            } else if canonical {
                assert!(
                    fast_ids(&text).is_some(),
                    "{:?}",
                    String::from_utf8_lossy(&text)
                );
            }
            let serde: Result<Vec<u32>, _> = serde_json::from_slice(&text);
            if let Some(v) = fast_ids(&text) {
                fast += 1;
                assert_eq!(
                    Some(&v),
                    serde.as_ref().ok(),
                    "{:?}",
                    String::from_utf8_lossy(&text)
                );
            }
            checked += 1;
        }
        assert!(fast > 5_000 && checked == 20_000, "{fast}");
    }
}
