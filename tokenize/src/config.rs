//! `tokenizer_config.json`: the fields of HuggingFace's tokenizer configuration that
//! change the token ids of a prompt (the chat template, the special tokens the template
//! names, whether a BOS or EOS is added). Every other field is ignored.

use serde::Deserialize;
use serde_json::Value;

/// What kvr reads of a model's `tokenizer_config.json`. Every field is optional: a model
/// without the file (or with an empty one) gets [`TokenizerConfig::default`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The default chat template (Jinja source), if any.
    pub chat_template: Option<String>,
    /// The BOS token's text (templates print it as `bos_token`).
    pub bos_token: Option<String>,
    /// The EOS token's text (templates print it as `eos_token`).
    pub eos_token: Option<String>,
    /// `add_bos_token`, when the file sets it (see [`crate::Tokenizer::encode`]).
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when the file sets it.
    pub add_eos_token: Option<bool>,
}

/// The raw file: a special token is a string or an `AddedToken` object
/// (`{"content": "<s>", ...}`); a chat template is a string or a list of named templates.
#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    bos_token: Option<Value>,
    #[serde(default)]
    eos_token: Option<Value>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    add_eos_token: Option<bool>,
}

impl TokenizerConfig {
    /// Parses the file's text. A `chat_template` given as a list of `{name, template}`
    /// takes the one named `default` (as transformers does), else none.
    pub fn from_json(text: &str) -> Result<Self, String> {
        // serde would read a struct from an array too: the file must be an object.
        if !text.trim_start().starts_with('{') {
            return Err("not a JSON object".into());
        }
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Ok(Self {
            chat_template: raw.chat_template.as_ref().and_then(default_template),
            bos_token: raw.bos_token.as_ref().and_then(token_text),
            eos_token: raw.eos_token.as_ref().and_then(token_text),
            add_bos_token: raw.add_bos_token,
            add_eos_token: raw.add_eos_token,
        })
    }
}

/// A special token's text: a string, or an `AddedToken`'s `content`.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The default template: the string itself, or the entry named `default` of a list.
fn default_template(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list.iter().find_map(|e| {
            (e.get("name")?.as_str()? == "default")
                .then(|| e.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_strings_added_tokens_and_named_templates() {
        let c = TokenizerConfig::from_json(
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                "add_bos_token": true,
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.add_bos_token, Some(true));
        assert_eq!(c.add_eos_token, None);
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        let none = TokenizerConfig::from_json(r#"{"bos_token": null}"#).unwrap();
        assert_eq!(none, TokenizerConfig::default());
        assert!(TokenizerConfig::from_json("[1]").is_err());
    }
}
