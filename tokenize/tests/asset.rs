//! The test tokenizer under tests/assets/tokenizer: checks it, and regenerates it with
//! `KVR_UPDATE_TOKENIZER=1 cargo test -p kvr-tokenize --release --locked --test asset`.
//!
//! It is a byte-level BPE (GPT-2 / Llama-3 style: every byte has a token, so any text
//! encodes) of 2,048 tokens trained on the repository's Markdown documentation, with
//! ChatML special tokens, a post-processor that adds `<|bos|>`, and a ChatML chat
//! template in tokenizer_config.json.

use std::path::{Path, PathBuf};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

const VOCAB_SIZE: usize = 2048;
const SPECIAL: [&str; 4] = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"];
const MAX_ASSET_BYTES: u64 = 200 << 10;

/// A ChatML template written the way HF templates are: it relies on `trim_blocks` (the
/// newline after a block tag is dropped) and `lstrip_blocks` (the indentation before one).
const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}
  {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}";

fn asset_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/assets/tokenizer")
}

fn corpus() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.push(root.join("README.md"));
    files.sort();
    files
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

fn generate() -> Tokenizer {
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tok.train(&mut trainer, corpus().into_iter()).unwrap();
    let bos = tok.token_to_id("<|bos|>").unwrap();
    tok.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<|bos|> $A")
            .unwrap()
            .try_pair("<|bos|> $A <|bos|> $B")
            .unwrap()
            .special_tokens(vec![("<|bos|>".to_string(), bos)])
            .build()
            .unwrap(),
    ));
    tok
}

fn config_json() -> String {
    let cfg = serde_json::json!({
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 32768,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    serde_json::to_string_pretty(&cfg).unwrap() + "\n"
}

#[test]
fn asset_is_small_and_loads() {
    let dir = asset_dir();
    if std::env::var_os("KVR_UPDATE_TOKENIZER").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        generate().save(dir.join("tokenizer.json"), false).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), config_json()).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let len = std::fs::metadata(dir.join(f)).unwrap().len();
        assert!(len < MAX_ASSET_BYTES, "{f} is {len} bytes");
    }
    let tok = kvr_tokenize::Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.vocab_size(), VOCAB_SIZE);
    assert!(tok.has_chat_template());
    for (i, s) in SPECIAL.iter().enumerate() {
        assert_eq!(tok.token_to_id(s), Some(i as u32), "{s}");
    }
}
