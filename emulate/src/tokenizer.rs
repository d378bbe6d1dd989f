//! Text to token ids. The emulator needs the same ids for the same text every time (its
//! prefix cache, and a router that tokenizes the same way, key blocks by them), not a
//! real model's vocabulary: [`WordTokenizer`] hashes words. A HuggingFace tokenizer goes
//! behind the same [`Tokenizer`] trait (see `--tokenizer`).

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

/// How prompts become tokens: plain text, and chat messages rendered to text first.
pub trait Tokenizer: Send + Sync {
    /// The token ids of `text`; the same text gives the same ids every time.
    fn encode(&self, text: &str) -> Vec<u32>;

    /// Chat `messages` as the prompt text the model would see.
    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String;

    /// The token ids of a chat: its rendering, encoded (a HuggingFace tokenizer adds no
    /// special tokens there, as vLLM does not: the template has them).
    fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Vec<u32> {
        self.encode(&self.render_chat(messages, add_generation_prompt))
    }

    /// A short name for logs and `/v1/models`.
    fn name(&self) -> &str;
}

/// One chat message; `content` is a string or OpenAI's list of parts (text parts are
/// concatenated, others ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// A message's `content`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a list `content` (`{"type": "text", "text": ...}`).
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(default)]
    pub text: Option<String>,
}

impl ChatMessage {
    /// The message's text.
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                parts.iter().filter_map(|p| p.text.as_deref()).collect()
            }
        }
    }
}

/// The built-in tokenizer: a token is a run of letters and digits, or one other
/// non-space character; its id is a hash of its text (ids `FIRST_ID..FIRST_ID + VOCAB`).
/// Chat renders as `role: content\n` lines, then `assistant: ` for a generation prompt.
#[derive(Clone, Copy, Debug, Default)]
pub struct WordTokenizer;

/// The built-in vocabulary's size.
pub const VOCAB: u32 = 100_000;
/// The built-in tokenizer's lowest id (below it: room for special tokens).
pub const FIRST_ID: u32 = 1_000;

impl WordTokenizer {
    fn id(word: &str) -> u32 {
        FIRST_ID + (xxh3_64(word.as_bytes()) % u64::from(VOCAB)) as u32
    }
}

impl Tokenizer for WordTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut word_start: Option<usize> = None;
        for (i, c) in text.char_indices() {
            if c.is_alphanumeric() {
                word_start.get_or_insert(i);
                continue;
            }
            if let Some(s) = word_start.take() {
                out.push(Self::id(&text[s..i]));
            }
            if !c.is_whitespace() {
                out.push(Self::id(&text[i..i + c.len_utf8()]));
            }
        }
        if let Some(s) = word_start {
            out.push(Self::id(&text[s..]));
        }
        out
    }

    fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        for m in messages {
            out.push_str(&m.role);
            out.push_str(": ");
            out.push_str(&m.text());
            out.push('\n');
        }
        if add_generation_prompt {
            out.push_str("assistant: ");
        }
        out
    }

    fn name(&self) -> &str {
        "kvr-emulate-words"
    }
}

/// The words an emulated completion writes: output token `i` of every completion is
/// `OUTPUT_WORDS[i % len]`, so outputs are reproducible.
pub const OUTPUT_WORDS: &[&str] = &[
    "the", "cache", "holds", "a", "prefix", "of", "blocks", "and", "this", "pod", "emulates", "an",
    "engine", "without", "any", "gpu",
];

/// A HuggingFace tokenizer (`tokenizer.json` and its chat template) through
/// `kvr-tokenize`: the same ids `kvr epp --tokenizer` computes for the same text, as a
/// real engine and a router sharing a model's tokenizer would.
#[derive(Debug)]
pub struct HfTokenizer {
    inner: kvr_tokenize::Tokenizer,
    name: String,
}

impl HfTokenizer {
    pub fn from_dir(dir: &std::path::Path) -> Result<Self, String> {
        let inner = kvr_tokenize::Tokenizer::from_dir(dir)
            .map_err(|e| format!("--tokenizer {}: {e}", dir.display()))?;
        Ok(HfTokenizer {
            inner,
            name: format!("hf:{}", dir.display()),
        })
    }

    fn messages(messages: &[ChatMessage]) -> Vec<kvr_tokenize::ChatMessage> {
        messages
            .iter()
            .map(|m| kvr_tokenize::ChatMessage::new(m.role.clone(), m.text()))
            .collect()
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.inner.encode(text).unwrap_or_else(|e| {
            eprintln!("kvr-emulate: tokenizing failed: {e}");
            Vec::new()
        })
    }

    /// The model's template always adds the generation prompt.
    fn render_chat(&self, messages: &[ChatMessage], _add_generation_prompt: bool) -> String {
        self.inner
            .render_chat(&Self::messages(messages))
            .unwrap_or_else(|e| {
                eprintln!("kvr-emulate: chat template failed: {e}");
                String::new()
            })
    }

    fn encode_chat(&self, messages: &[ChatMessage], _add_generation_prompt: bool) -> Vec<u32> {
        self.inner
            .encode_chat(&Self::messages(messages))
            .unwrap_or_else(|e| {
                eprintln!("kvr-emulate: chat template failed: {e}");
                Vec::new()
            })
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_punctuation_are_tokens_and_ids_are_stable() {
        let t = WordTokenizer;
        let a = t.encode("Hello, world!  hello");
        assert_eq!(a.len(), 5, "{a:?}");
        assert_eq!(a, t.encode("Hello , world ! hello"));
        assert_ne!(a[0], a[4], "case matters");
        assert_eq!(a[0], WordTokenizer::id("Hello"));
        assert!(a.iter().all(|id| (FIRST_ID..FIRST_ID + VOCAB).contains(id)));
        assert!(t.encode("  \n\t").is_empty());
        assert_eq!(
            t.encode("héllo wörld").len(),
            2,
            "unicode letters join words"
        );
    }

    #[test]
    fn chat_renders_role_lines() {
        let msgs: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url"}]}]"#,
        )
        .unwrap();
        let t = WordTokenizer;
        assert_eq!(
            t.render_chat(&msgs, true),
            "system: be brief\nuser: hi\nassistant: "
        );
        assert_eq!(t.render_chat(&msgs, false), "system: be brief\nuser: hi\n");
    }
}
