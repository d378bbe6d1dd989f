//! The OpenAI (and vLLM) request and response bodies the emulator reads and writes.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::tokenizer::{ChatMessage, OUTPUT_WORDS};

/// A completion's `prompt`: text, or token ids; a list of one is accepted as that one.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

fn yes() -> bool {
    true
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
}

/// `POST /tokenize` (vLLM's): a prompt, or chat messages.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
}

/// vLLM's error body.
pub fn error_body(message: &str, kind: &str, code: u16) -> Value {
    json!({"object": "error", "message": message, "type": kind, "param": null, "code": code})
}

/// The `usage` object, with vLLM's `prompt_tokens_details.cached_tokens`.
pub fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Output token `i`'s text, with its leading space.
pub fn output_piece(i: usize) -> String {
    format!(" {}", OUTPUT_WORDS[i % OUTPUT_WORDS.len()])
}

/// The whole output of `n` tokens.
pub fn output_text(n: usize) -> String {
    (0..n).map(output_piece).collect()
}

/// What kind of completion a response is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Text,
    Chat,
}

/// The identity every body of one request carries.
#[derive(Clone, Debug)]
pub struct Envelope {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Envelope {
    /// The non-streaming response.
    pub fn full(&self, text: &str, usage: Value) -> Value {
        let choice = match self.kind {
            Kind::Text => json!({"index": 0, "text": text, "logprobs": null,
                                 "finish_reason": "length", "stop_reason": null}),
            Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": null, "finish_reason": "length", "stop_reason": null}),
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created,
               "model": self.model, "choices": [choice], "usage": usage})
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Text, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A streamed chunk of `piece`; `last` carries the finish reason. A chat stream's
    /// first chunk (`piece` None) announces the assistant role.
    pub fn chunk(&self, piece: Option<&str>, last: bool) -> Value {
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match (self.kind, piece) {
            (Kind::Text, p) => json!({"index": 0, "text": p.unwrap_or(""), "logprobs": null,
                                      "finish_reason": finish}),
            (Kind::Chat, None) => json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": null, "finish_reason": null}),
            (Kind::Chat, Some(p)) => json!({"index": 0, "delta": {"content": p},
                                            "logprobs": null, "finish_reason": finish}),
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model, "choices": [choice]})
    }

    /// The final usage chunk (`stream_options.include_usage`).
    pub fn usage_chunk(&self, usage: Value) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model, "choices": [], "usage": usage})
    }
}
