//! [`Tokenizers`]: the tokenizer of each served model, by model name.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::reuse::ReuseConfig;
use crate::tokenizer::{LoadError, Tokenizer};

/// Why a registry could not be built.
#[derive(Debug)]
pub enum RegistryError {
    /// The same model name was given twice.
    DuplicateModel(String),
    /// A model's tokenizer did not load.
    Load(String, LoadError),
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryError::DuplicateModel(m) => write!(f, "model {m:?} is listed twice"),
            RegistryError::Load(m, e) => write!(f, "model {m:?}: {e}"),
        }
    }
}

impl std::error::Error for RegistryError {}

/// The tokenizers of the models a host serves, loaded once at start. Several names may
/// share a directory (aliases, LoRA adapters of one base): it is loaded once.
#[derive(Debug, Default, Clone)]
pub struct Tokenizers {
    by_model: HashMap<String, Arc<Tokenizer>>,
}

impl Tokenizers {
    /// Loads the tokenizer of each `(model name, directory)` pair. Fails on the first
    /// directory that does not load or on a repeated model name, so a misconfigured host
    /// stops at start rather than mis-routing.
    pub fn load<I, S, P>(models: I) -> Result<Self, RegistryError>
    where
        I: IntoIterator<Item = (S, P)>,
        S: Into<String>,
        P: Into<PathBuf>,
    {
        let off = ReuseConfig {
            capacity_bytes: 0,
            ..ReuseConfig::default()
        };
        Self::load_reusing(models, off)
    }

    /// [`Self::load`], each tokenizer reusing the ids of prompt heads it has seen as
    /// `reuse` says ([`Tokenizer::with_reuse`]; a table per directory).
    pub fn load_reusing<I, S, P>(models: I, reuse: ReuseConfig) -> Result<Self, RegistryError>
    where
        I: IntoIterator<Item = (S, P)>,
        S: Into<String>,
        P: Into<PathBuf>,
    {
        let mut by_dir: HashMap<PathBuf, Arc<Tokenizer>> = HashMap::new();
        let mut by_model = HashMap::new();
        for (name, dir) in models {
            let (name, dir) = (name.into(), dir.into());
            if by_model.contains_key(&name) {
                return Err(RegistryError::DuplicateModel(name));
            }
            let tok = match by_dir.get(&dir) {
                Some(t) => Arc::clone(t),
                None => {
                    let t = Arc::new(
                        Tokenizer::from_dir(&dir)
                            .map_err(|e| RegistryError::Load(name.clone(), e))?
                            .with_reuse(reuse),
                    );
                    by_dir.insert(dir, Arc::clone(&t));
                    t
                }
            };
            by_model.insert(name, tok);
        }
        Ok(Self { by_model })
    }

    /// Adds (or replaces) a model's tokenizer.
    pub fn insert(&mut self, model: impl Into<String>, tokenizer: Arc<Tokenizer>) {
        self.by_model.insert(model.into(), tokenizer);
    }

    /// The tokenizer of `model`, if it is served.
    pub fn get(&self, model: &str) -> Option<&Arc<Tokenizer>> {
        self.by_model.get(model)
    }

    /// The model names, in no particular order.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(String::as_str)
    }

    /// How many model names are served.
    pub fn len(&self) -> usize {
        self.by_model.len()
    }

    /// Whether no model is served.
    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty()
    }
}
