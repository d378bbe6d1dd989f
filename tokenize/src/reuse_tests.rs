//! Differential test of token reuse: every text of random conversations and completion
//! prompts, encoded by a tokenizer reusing heads (runtime checks off, so a wrong id is
//! seen here) and by the same tokenizer without reuse, must give the same ids. Tokenizer
//! families: byte-level BPE (the test asset), Metaspace with the "first" prefix, a
//! prepending normalizer, and added tokens reuse must not start at (`lstrip`/`rstrip`,
//! `normalized`, one that spans another). Negative controls: loosening a rule (stripping
//! tokens taken as places; no margin) makes the comparison fail.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::chat::ChatMessage;
use crate::config::TokenizerConfig;
use crate::tokenizer::Tokenizer;

const WORDS: &[&str] = &[
    "the",
    "cache",
    "route",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "é",
    "日本",
    "42",
    "7",
    "END",
    "<|im_start|>",
    "<|im_end|>",
    "<|bos|>",
    "<tool>",
    "[x]",
    "END<|im_start|>user",
    "user",
    "assistant",
    "!",
    "'s",
    " the",
    "kv",
    "’",
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn text(&mut self, max_words: usize) -> String {
        (0..1 + self.below(max_words))
            .map(|_| WORDS[self.below(WORDS.len())])
            .collect()
    }
}

fn asset_json() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/assets/tokenizer/tokenizer.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn asset_config() -> TokenizerConfig {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/assets/tokenizer/tokenizer_config.json");
    TokenizerConfig::from_json(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Adds `▁` to the vocabulary (so Metaspace prefixes show in the ids) and extra added
/// tokens: one stripping its neighbours' whitespace, one matched after normalization,
/// one spanning `<|im_start|>` (stripping too: reuse's finder leaves it out, so only the
/// margin keeps a place inside it from being used).
fn with_extras(mut t: Value) -> Value {
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let next = vocab.len() as u64 + 10;
    vocab.insert("▁".into(), json!(next));
    let added = t["added_tokens"].as_array_mut().unwrap();
    for (i, (content, strip, normalized)) in [
        ("<tool>", true, false),
        ("[x]", false, true),
        ("END<|im_start|>user", true, false),
    ]
    .into_iter()
    .enumerate()
    {
        added.push(
            json!({"id": next + 1 + i as u64, "content": content, "single_word": false,
            "lstrip": strip, "rstrip": strip, "normalized": normalized, "special": true}),
        );
    }
    t
}

/// The tokenizer families, by name.
fn families() -> Vec<(&'static str, Value)> {
    let byte_level = with_extras(asset_json());
    let mut metaspace = byte_level.clone();
    metaspace["pre_tokenizer"] =
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
    metaspace["decoder"] =
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
    let mut prepend = byte_level.clone();
    prepend["normalizer"] = json!({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
    prepend["pre_tokenizer"] = Value::Null;
    prepend["decoder"] = Value::Null;
    vec![
        ("byte-level", byte_level),
        ("metaspace-first", metaspace),
        ("prepend-normalizer", prepend),
    ]
}

fn tokenizer(json: &Value, reuse: Option<ReuseConfig>) -> Tokenizer {
    let inner = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
    let t = Tokenizer::new(inner, asset_config()).unwrap();
    match reuse {
        Some(c) => t.with_reuse(c),
        None => t,
    }
}

/// No runtime check: a wrong id must reach the comparison.
const UNCHECKED: ReuseConfig = ReuseConfig {
    capacity_bytes: 1 << 20,
    check_first: 0,
    check_every: 0,
};

/// Random conversations (each turn resends the history, sometimes with an edit) and
/// completion prompts extending earlier ones: the texts, in order, as chats or prompts.
enum Input {
    Chat(Vec<ChatMessage>),
    Prompt(String),
}

fn inputs(seed: u64, n: usize) -> Vec<Input> {
    let mut rng = Rng(seed);
    let mut out = Vec::new();
    let mut chats: Vec<Vec<ChatMessage>> = Vec::new();
    let mut prompts: Vec<String> = Vec::new();
    while out.len() < n {
        match rng.below(6) {
            0 => chats.push(Vec::new()),
            1 if !prompts.is_empty() => {
                let i = rng.below(prompts.len());
                let mut p = prompts[i].clone();
                // Cut somewhere (at a char boundary; often right after an added token),
                // then extend.
                let ends: Vec<usize> = p
                    .match_indices("<|im_start|>")
                    .map(|(i, m)| i + m.len())
                    .collect();
                let mut cut = if !ends.is_empty() && rng.below(2) == 0 {
                    ends[rng.below(ends.len())]
                } else {
                    rng.below(p.len() + 1)
                };
                while !p.is_char_boundary(cut) {
                    cut -= 1;
                }
                p.truncate(cut);
                p.push_str(&rng.text(12));
                prompts.push(p.clone());
                out.push(Input::Prompt(p));
            }
            2 => {
                let p = rng.text(30);
                prompts.push(p.clone());
                out.push(Input::Prompt(p));
            }
            _ => {
                if chats.is_empty() {
                    chats.push(Vec::new());
                }
                let i = rng.below(chats.len());
                let c = &mut chats[i];
                if !c.is_empty() && rng.below(8) == 0 {
                    // An edit in the history: the heads diverge there.
                    let j = rng.below(c.len());
                    let more = rng.text(3);
                    c[j].content.get_or_insert_with(String::new).push_str(&more);
                }
                if !c.is_empty() {
                    c.push(ChatMessage::new("assistant", rng.text(10)));
                }
                c.push(ChatMessage::new("user", rng.text(10)));
                out.push(Input::Chat(c.clone()));
            }
        }
    }
    out
}

/// The first input whose ids differ, and the stats.
fn differential(json: &Value, reuse: &Tokenizer, seed: u64, n: usize) -> Option<String> {
    let plain = tokenizer(json, None);
    for (i, input) in inputs(seed, n).iter().enumerate() {
        let (a, b) = match input {
            Input::Chat(m) => (reuse.encode_chat(m), plain.encode_chat(m)),
            Input::Prompt(p) => (reuse.encode(p), plain.encode(p)),
        };
        if a != b {
            let text = match input {
                Input::Chat(m) => plain.render_chat(m).unwrap(),
                Input::Prompt(p) => p.clone(),
            };
            return Some(format!("input {i} ({text:?}): reuse {a:?}, full {b:?}"));
        }
    }
    None
}

#[test]
fn reused_ids_equal_a_full_encoding_in_every_family() {
    for (name, json) in families() {
        let reuse = tokenizer(&json, Some(UNCHECKED));
        for seed in 1..=4u64 {
            let d = differential(&json, &reuse, seed * 7919, 600);
            assert!(d.is_none(), "{name}, seed {seed}: {}", d.unwrap());
        }
        let s = reuse.reuse_stats().unwrap();
        assert!(
            s.hits > 500 && s.reused_tokens > s.encoded_tokens,
            "{name}: reuse hardly used: {s:?}"
        );
        assert_eq!((s.mismatches, s.disabled), (0, false), "{name}");
    }
}

#[test]
fn a_capacity_bounds_what_is_kept() {
    let json = with_extras(asset_json());
    let cap = 64 << 10;
    let reuse = tokenizer(
        &json,
        Some(ReuseConfig {
            capacity_bytes: cap,
            ..UNCHECKED
        }),
    );
    assert!(differential(&json, &reuse, 99, 800).is_none());
    let s = reuse.reuse_stats().unwrap();
    assert!(
        s.bytes <= cap as u64 && s.evictions > 0 && s.hits > 0,
        "{s:?}"
    );
    let r = reuse.reuse.as_ref().unwrap().lock();
    assert_eq!(r.order.len() as u64, s.texts);
    // Every key points at a text still kept.
    assert!(r
        .keys
        .values()
        .all(|(seen, _)| r.order.iter().any(|(o, _)| Arc::ptr_eq(o, seen))));
}

#[test]
fn a_mismatch_found_by_a_check_turns_reuse_off_and_answers_right() {
    let json = with_extras(asset_json());
    let mut reuse = tokenizer(
        &json,
        Some(ReuseConfig {
            check_first: u64::MAX,
            ..UNCHECKED
        }),
    );
    // Wrong on purpose (see the negative control below): no margin.
    reuse.reuse.as_mut().unwrap().margin = 0;
    for seed in 1..=8u64 {
        assert!(differential(&json, &reuse, seed, 600).is_none());
    }
    let s = reuse.reuse_stats().unwrap();
    assert!(s.mismatches == 1 && s.disabled && s.texts == 0, "{s:?}");
}

#[test]
fn negative_control_no_margin_gives_wrong_ids() {
    // A token spanning `<|im_start|>` matches in one text and not in a text sharing the
    // head only up to `<|im_start|>`.
    let json = with_extras(asset_json());
    let mut reuse = tokenizer(&json, Some(UNCHECKED));
    reuse.reuse.as_mut().unwrap().margin = 0;
    let found = (1..=8u64).any(|seed| differential(&json, &reuse, seed, 600).is_some());
    assert!(found, "a zero margin never gave a wrong id");
}

#[test]
fn negative_control_a_rest_tokenized_without_its_token_differs_under_metaspace_first() {
    // Why the rest is tokenized starting with the token: alone, it would be the text's
    // first piece and get the Metaspace prefix.
    let (_, json) = families().remove(1);
    let plain = tokenizer(&json, None);
    let text = "<|im_start|>user the cache<|im_end|>route the cache";
    let at = text.rfind("<|im_end|>").unwrap();
    let full = plain.encode_plain(text).unwrap();
    let head = plain.encode_plain(&text[..at]).unwrap();
    let with_token = plain.encode_plain(&text[at..]).unwrap();
    let without = plain
        .encode_plain(&text[at + "<|im_end|>".len()..])
        .unwrap();
    assert_eq!([head.as_slice(), &with_token].concat(), full);
    let token = plain.token_to_id("<|im_end|>").unwrap();
    assert_ne!([head.as_slice(), &[token], &without].concat(), full);
}
