//! [`Tokenizer`]: one model's tokenizer (its `tokenizer.json`), its special-token policy
//! and its chat template (from `tokenizer_config.json` or `chat_template.jinja`).

use std::path::{Path, PathBuf};

use crate::chat::{render_plain, ChatError, ChatMessage, ChatTemplate};
use crate::config::TokenizerConfig;
use crate::reuse::{Reuse, ReuseConfig, ReuseStats};

/// The file holding the vocabulary, model, normalizer, pre-tokenizer and post-processor.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The optional file with the chat template and special-token settings.
pub const CONFIG_FILE: &str = "tokenizer_config.json";
/// The optional file newer models keep their chat template in (it wins over the
/// config's `chat_template`, as in transformers).
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// Why a tokenizer could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// A file could not be read (`tokenizer.json` missing included).
    Io(PathBuf, std::io::Error),
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate reads.
    Tokenizer(PathBuf, String),
    /// `tokenizer_config.json` is not JSON of the expected shape.
    Config(PathBuf, String),
    /// The chat template does not parse.
    Template(PathBuf, ChatError),
    /// The configuration names a BOS/EOS token to add that is not in the vocabulary.
    UnknownSpecialToken(PathBuf, String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Io(p, e) => write!(f, "{}: {e}", p.display()),
            LoadError::Tokenizer(p, e) => write!(f, "{}: not a tokenizer: {e}", p.display()),
            LoadError::Config(p, e) => write!(f, "{}: {e}", p.display()),
            LoadError::Template(p, e) => write!(f, "{}: {e}", p.display()),
            LoadError::UnknownSpecialToken(p, t) => {
                write!(
                    f,
                    "{}: special token {t:?} is not in the vocabulary",
                    p.display()
                )
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// Why a prompt could not be turned into token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The tokenizer failed on the text (rare: a model that cannot represent a character).
    Encode(String),
    /// The chat template failed on the messages.
    Chat(ChatError),
}

impl std::fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizeError::Encode(e) => write!(f, "tokenizer failed: {e}"),
            TokenizeError::Chat(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for TokenizeError {}

impl From<ChatError> for TokenizeError {
    fn from(e: ChatError) -> Self {
        TokenizeError::Chat(e)
    }
}

/// How special tokens are added to a completion prompt (see [`Tokenizer::encode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpecialTokens {
    /// The post-processor of `tokenizer.json` adds them (the usual case).
    PostProcessor,
    /// The configuration's `add_bos_token`/`add_eos_token` differ from what the
    /// post-processor does: the text is encoded without it and these are added.
    Explicit { bos: Option<u32>, eos: Option<u32> },
}

/// One model's tokenizer, loaded once; `Send + Sync`, shared by every request thread.
pub struct Tokenizer {
    pub(crate) inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    template: Option<ChatTemplate>,
    special: SpecialTokens,
    /// Token reuse ([`Self::with_reuse`]); off by default.
    pub(crate) reuse: Option<Reuse>,
    /// What the post-processor adds before and after a completion prompt's ids, when it
    /// only adds (then reuse serves completions too).
    around: Option<(Vec<u32>, Vec<u32>)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("config", &self.config)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

/// A tokenizer is shared by the threads of a host.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
};

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, and `dir/tokenizer_config.json` and
    /// `dir/chat_template.jinja` when they exist. Reads only local files.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let tok_path = dir.join(TOKENIZER_FILE);
        let bytes = std::fs::read(&tok_path).map_err(|e| LoadError::Io(tok_path.clone(), e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| LoadError::Tokenizer(tok_path.clone(), e.to_string()))?;
        let cfg_path = dir.join(CONFIG_FILE);
        let mut config = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => TokenizerConfig::from_json(&text)
                .map_err(|e| LoadError::Config(cfg_path.clone(), e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => TokenizerConfig::default(),
            Err(e) => return Err(LoadError::Io(cfg_path, e)),
        };
        let tmpl_path = dir.join(TEMPLATE_FILE);
        let mut tmpl_source = cfg_path.clone();
        match std::fs::read_to_string(&tmpl_path) {
            Ok(text) => {
                config.chat_template = Some(text);
                tmpl_source = tmpl_path;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LoadError::Io(tmpl_path, e)),
        }
        Self::new(inner, config).map_err(|e| e.at(&tmpl_source, &cfg_path))
    }

    /// A tokenizer from parts already loaded (tests, or tokenizers built in memory).
    /// Errors carry an empty path.
    pub fn new(inner: tokenizers::Tokenizer, config: TokenizerConfig) -> Result<Self, LoadError> {
        let template = config
            .chat_template
            .as_deref()
            .map(|src| {
                ChatTemplate::new(
                    src,
                    config.bos_token.as_deref(),
                    config.eos_token.as_deref(),
                )
            })
            .transpose()
            .map_err(|e| LoadError::Template(PathBuf::new(), e))?;
        let special = special_tokens(&inner, &config)?;
        let around = added_around(&inner);
        Ok(Self {
            inner,
            config,
            template,
            special,
            reuse: None,
            around,
        })
    }

    /// Reuses the ids of prompt heads seen before (a conversation's resent history) as
    /// `config` says: `crate::reuse` has the rule that keeps the ids exact and the check
    /// that turns it off otherwise. Off when the tokenizer truncates or pads, or has no
    /// added token reuse can start at.
    pub fn with_reuse(mut self, config: ReuseConfig) -> Self {
        self.reuse = Reuse::new(&self.inner, config);
        self
    }

    /// What token reuse did, if it is on.
    pub fn reuse_stats(&self) -> Option<ReuseStats> {
        self.reuse.as_ref().map(Reuse::stats)
    }

    /// The token ids of a completion prompt, with the special tokens the model adds
    /// (as vLLM encodes a `/v1/completions` prompt: `add_special_tokens=True`).
    ///
    /// Those come from `tokenizer.json`'s post-processor, unless `tokenizer_config.json`
    /// sets `add_bos_token` or `add_eos_token` to something the post-processor does not
    /// do; then the text is encoded without the post-processor and exactly the configured
    /// BOS/EOS are added (what transformers does for Llama-family tokenizers).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match self.special {
            SpecialTokens::PostProcessor => match (&self.reuse, &self.around) {
                (Some(_), Some((before, after))) => {
                    let ids = self.encode_raw(text, false)?;
                    Ok([before.as_slice(), &ids, after].concat())
                }
                _ => self.encode_raw(text, true),
            },
            SpecialTokens::Explicit { bos, eos } => {
                let mut ids = self.encode_raw(text, false)?;
                if let Some(b) = bos {
                    ids.insert(0, b);
                }
                ids.extend(eos);
                Ok(ids)
            }
        }
    }

    /// The token ids of `text` with no special tokens added (special tokens written in
    /// the text are still recognized, as in HuggingFace's tokenizers).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_raw(text, false)
    }

    fn encode_raw(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        if let Some(r) = self.reuse.as_ref().filter(|_| !add_special) {
            // With offsets (byte offsets): reuse reads where each added token is.
            let reused = r.encode(text, |t| {
                self.inner.encode(t, false).map_err(|e| e.to_string())
            });
            if let Some(ids) = reused {
                return ids.map_err(TokenizeError::Encode);
            }
        }
        self.inner
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The text of `ids` (special tokens kept, so a round trip shows them).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The chat's prompt text: the model's template with `add_generation_prompt`, or
    /// [`render_plain`] where the model has none.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, ChatError> {
        match &self.template {
            Some(t) => t.render(messages),
            None => Ok(render_plain(messages)),
        }
    }

    /// The token ids of a chat: [`Self::render_chat`], encoded without adding special
    /// tokens (the template writes them), as vLLM does for `/v1/chat/completions`.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages)?;
        self.encode_raw(&text, false)
    }

    /// Whether the model has a chat template (else chats use [`render_plain`]).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The configuration read beside `tokenizer.json`.
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// The vocabulary's size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token's text (a special token's included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying HuggingFace tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl LoadError {
    /// Sets the path of an error raised while the files were not known.
    fn at(self, template: &Path, config: &Path) -> Self {
        match self {
            LoadError::Template(p, e) if p.as_os_str().is_empty() => {
                LoadError::Template(template.to_owned(), e)
            }
            LoadError::UnknownSpecialToken(p, t) if p.as_os_str().is_empty() => {
                LoadError::UnknownSpecialToken(config.to_owned(), t)
            }
            other => other,
        }
    }
}

/// What the post-processor adds around a text's ids, found on two probe texts; `None`
/// when it does anything else (reuse then leaves completion prompts to it).
fn added_around(inner: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut found = None;
    for probe in ["a", "kv cache 42"] {
        let with = inner.encode_fast(probe, true).ok()?;
        let without = inner.encode_fast(probe, false).ok()?;
        let (with, without) = (with.get_ids(), without.get_ids());
        let n = without.len();
        let start = (0..=with.len().checked_sub(n)?).find(|&p| with[p..p + n] == *without)?;
        let pair = (with[..start].to_vec(), with[start + n..].to_vec());
        match &found {
            Some(f) if *f != pair => return None,
            _ => found = Some(pair),
        }
    }
    found
}

/// Decides [`SpecialTokens`]: probes what the post-processor adds around a one-character
/// text, and compares with the configuration's explicit settings.
fn special_tokens(
    inner: &tokenizers::Tokenizer,
    config: &TokenizerConfig,
) -> Result<SpecialTokens, LoadError> {
    if config.add_bos_token.is_none() && config.add_eos_token.is_none() {
        return Ok(SpecialTokens::PostProcessor);
    }
    // A token the configuration asks to add must exist; one it only names may not (a
    // template may print it as text).
    let id_of = |t: &Option<String>, add: Option<bool>| -> Result<Option<u32>, LoadError> {
        match t {
            None => Ok(None),
            Some(t) => match inner.token_to_id(t) {
                Some(id) => Ok(Some(id)),
                None if add == Some(true) => {
                    Err(LoadError::UnknownSpecialToken(PathBuf::new(), t.clone()))
                }
                None => Ok(None),
            },
        }
    };
    let probe = |add: bool| {
        inner
            .encode_fast("a", add)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    let (with, without) = (probe(true), probe(false));
    let bos = id_of(&config.bos_token, config.add_bos_token)?;
    let eos = id_of(&config.eos_token, config.add_eos_token)?;
    let post_bos = with.len() > without.len() && bos.is_some() && with.first() == bos.as_ref();
    let post_eos = with.len() > without.len() && eos.is_some() && with.last() == eos.as_ref();
    let want_bos = config.add_bos_token.unwrap_or(post_bos) && bos.is_some();
    let want_eos = config.add_eos_token.unwrap_or(post_eos) && eos.is_some();
    if want_bos == post_bos && want_eos == post_eos {
        return Ok(SpecialTokens::PostProcessor);
    }
    Ok(SpecialTokens::Explicit {
        bos: bos.filter(|_| want_bos),
        eos: eos.filter(|_| want_eos),
    })
}
