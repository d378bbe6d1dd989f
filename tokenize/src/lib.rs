//! Prompts to token ids, shared by kvr's endpoint picker (`kvr epp`) and the engine
//! emulator so that both tokenize a request the same way.
//!
//! - [`Tokenizer`]: a model's HuggingFace `tokenizer.json` (pure Rust: the `tokenizers`
//!   crate with the `fancy-regex` backend, no download), its `tokenizer_config.json` and
//!   chat template. [`Tokenizer::encode`] tokenizes a completion prompt with the special
//!   tokens the model adds; [`Tokenizer::encode_chat`] renders messages through the
//!   model's Jinja template ([`chat`]) and tokenizes the text without adding any, as vLLM
//!   does for each endpoint.
//! - [`Tokenizers`]: the tokenizer of each served model, by name.
//! - [`parse_openai`]: the prompt of a `/v1/completions` or `/v1/chat/completions` body,
//!   with `model`, `stream` and `max_tokens`; refusals are [`BodyError`]s with stable
//!   kind names.
//! - [`TokenizeClient`]: an engine's own `POST /tokenize`, for models whose tokenizer the
//!   host does not have.
//!
//! ```no_run
//! use kvr_tokenize::{parse_openai, Tokenizers};
//! let tokenizers = Tokenizers::load([("my-model", "/models/my-model")])?;
//! let body = br#"{"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}"#;
//! let input = parse_openai("/v1/chat/completions", body)?;
//! let tok = tokenizers.get(input.model.as_deref().unwrap_or("")).expect("served");
//! let ids = input.token_ids(tok)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! docs/tokenize.md describes the rules and where they differ from vLLM.

pub mod body;
pub mod chat;
pub mod client;
pub mod config;
mod registry;
mod reuse;
mod tokenizer;

pub use body::{
    parse_openai, parse_openai_limited, parse_token_ids, Api, BodyError, Prompt, PromptInput,
    DEFAULT_MAX_BODY_BYTES,
};
pub use chat::{render_plain, ChatError, ChatMessage, ChatTemplate};
pub use client::{TokenizeCallError, TokenizeClient, Tokenized, DEFAULT_TOKENIZE_TIMEOUT};
pub use config::TokenizerConfig;
pub use registry::{RegistryError, Tokenizers};
pub use reuse::{ReuseConfig, ReuseStats};
pub use tokenizer::{
    LoadError, TokenizeError, Tokenizer, CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_FILE,
};
