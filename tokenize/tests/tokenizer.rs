//! Encoding, decoding, special tokens and chat rendering on the test asset.

mod common;

use kvr_tokenize::{
    render_plain, ChatError, ChatMessage, LoadError, RegistryError, TokenizeError, Tokenizer,
    TokenizerConfig, Tokenizers,
};

const BOS: u32 = 0;
const EOS: u32 = 1;
const IM_START: u32 = 2;

#[test]
fn round_trips() {
    let tok = common::asset();
    for text in [
        "Hello, world!",
        "  leading and trailing spaces  ",
        "kvr routes each request to the worker that holds its prefix.\n\nTwo lines.",
        "ünïcödé — 日本語 — emoji 🚀 and a tab\t.",
        "",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.first(), Some(&BOS), "{text:?}");
        assert_eq!(&ids[1..], tok.encode_plain(text).unwrap(), "{text:?}");
        assert_eq!(tok.decode(&ids[1..]).unwrap(), text);
        assert_eq!(tok.decode(&ids).unwrap(), format!("<|bos|>{text}"));
    }
    // The vocabulary was trained on English docs: a common word is one token, unseen
    // bytes are one token per byte.
    assert_eq!(tok.encode_plain("the").unwrap().len(), 1);
    assert_eq!(tok.encode_plain("🚀").unwrap().len(), 4);
}

#[test]
fn special_tokens_in_text_are_recognized() {
    let tok = common::asset();
    let ids = tok.encode_plain("<|im_start|>user").unwrap();
    assert_eq!(ids[0], IM_START);
    assert_eq!(tok.decode(&ids).unwrap(), "<|im_start|>user");
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

#[test]
fn asset_template_renders_like_transformers() {
    let tok = common::asset();
    let m = msgs(&[("user", "  Hi there ")]);
    let text = tok.render_chat(&m).unwrap();
    assert_eq!(
        text,
        "<|bos|><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
    let m = msgs(&[
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello"),
        ("user", "Bye"),
    ]);
    assert_eq!(
        tok.render_chat(&m).unwrap(),
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // Negative control: the same template without trim_blocks/lstrip_blocks (Jinja's
    // defaults, not transformers') renders differently.
    let src = tok.config().chat_template.clone().unwrap();
    let mut env = minijinja::Environment::new();
    env.add_template("t", &src).unwrap();
    let loose = env
        .get_template("t")
        .unwrap()
        .render(minijinja::context! { messages => &m, add_generation_prompt => true, bos_token => "<|bos|>" })
        .unwrap();
    assert_ne!(loose, tok.render_chat(&m).unwrap());
}

#[test]
fn chat_is_encoded_without_adding_special_tokens_again() {
    let tok = common::asset();
    let m = msgs(&[("user", "What is a prefix cache?")]);
    let ids = tok.encode_chat(&m).unwrap();
    let text = tok.render_chat(&m).unwrap();
    assert_eq!(ids, tok.encode_plain(&text).unwrap());
    assert_eq!(
        &ids[..2],
        &[BOS, IM_START],
        "one BOS, written by the template"
    );
    // What adding them again would give (vLLM avoids it too).
    assert_eq!(&tok.encode(&text).unwrap()[..2], &[BOS, BOS]);
    // A conversation's prompt is a prefix of its continuation's, up to the generation
    // prompt: what prefix routing relies on.
    let longer = msgs(&[
        ("user", "What is a prefix cache?"),
        ("assistant", "A cache of KV blocks."),
        ("user", "Thanks."),
    ]);
    let first_turn = tok
        .encode_plain(text.trim_end_matches("<|im_start|>assistant\n"))
        .unwrap();
    assert!(tok.encode_chat(&longer).unwrap().starts_with(&first_turn));
}

fn asset_inner() -> tokenizers::Tokenizer {
    common::asset().inner().clone()
}

#[test]
fn without_template_chats_use_the_plain_rendering() {
    let tok = Tokenizer::new(asset_inner(), TokenizerConfig::default()).unwrap();
    assert!(!tok.has_chat_template());
    let m = msgs(&[("system", "S"), ("user", "U")]);
    assert_eq!(
        tok.render_chat(&m).unwrap(),
        "system: S\nuser: U\nassistant: "
    );
    assert_eq!(tok.render_chat(&m).unwrap(), render_plain(&m));
    let ids = tok.encode_chat(&m).unwrap();
    assert_ne!(ids[0], BOS);
    assert_eq!(tok.decode(&ids).unwrap(), render_plain(&m));
}

fn config(add_bos: Option<bool>, add_eos: Option<bool>) -> TokenizerConfig {
    TokenizerConfig {
        bos_token: Some("<|bos|>".into()),
        eos_token: Some("<|eos|>".into()),
        add_bos_token: add_bos,
        add_eos_token: add_eos,
        ..TokenizerConfig::default()
    }
}

#[test]
fn configured_bos_and_eos_override_the_post_processor() {
    let plain = common::asset().encode_plain("hi there").unwrap();
    let with = |bos: &[u32], eos: &[u32]| [bos, &plain[..], eos].concat();
    let cases = [
        (None, None, with(&[BOS], &[])),
        (Some(true), None, with(&[BOS], &[])),
        (Some(false), None, with(&[], &[])),
        (None, Some(true), with(&[BOS], &[EOS])),
        (Some(false), Some(true), with(&[], &[EOS])),
    ];
    for (bos, eos, want) in cases {
        let tok = Tokenizer::new(asset_inner(), config(bos, eos)).unwrap();
        assert_eq!(tok.encode("hi there").unwrap(), want, "{bos:?} {eos:?}");
    }
    // A tokenizer.json without a post-processor, with add_bos_token: the BOS is added.
    let mut bare = asset_inner();
    bare.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
    let tok = Tokenizer::new(bare.clone(), config(Some(true), None)).unwrap();
    assert_eq!(tok.encode("hi there").unwrap(), with(&[BOS], &[]));
    let tok = Tokenizer::new(bare, TokenizerConfig::default()).unwrap();
    assert_eq!(tok.encode("hi there").unwrap(), plain);
    // A token to add must exist.
    let mut cfg = config(Some(true), None);
    cfg.bos_token = Some("<s>".into());
    assert!(matches!(
        Tokenizer::new(asset_inner(), cfg),
        Err(LoadError::UnknownSpecialToken(_, t)) if t == "<s>"
    ));
}

#[test]
fn chat_template_file_wins_over_the_config() {
    let dir = common::asset_copy("jinja");
    std::fs::write(dir.join("chat_template.jinja"), "n={{ messages|length }}").unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.render_chat(&msgs(&[("user", "a")])).unwrap(), "n=1");
    // Its errors name it.
    std::fs::write(dir.join("chat_template.jinja"), "{% if %}").unwrap();
    let e = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(
        matches!(&e, LoadError::Template(p, _) if p.ends_with("chat_template.jinja")),
        "{e}"
    );
}

#[test]
fn load_errors() {
    let empty = common::scratch("empty");
    assert!(matches!(
        Tokenizer::from_dir(&empty),
        Err(LoadError::Io(..))
    ));

    let bad = common::scratch("bad-json");
    std::fs::write(bad.join("tokenizer.json"), "{\"model\": 1}").unwrap();
    assert!(matches!(
        Tokenizer::from_dir(&bad),
        Err(LoadError::Tokenizer(..))
    ));

    let dir = common::asset_copy("bad-config");
    std::fs::write(dir.join("tokenizer_config.json"), "[]").unwrap();
    assert!(matches!(
        Tokenizer::from_dir(&dir),
        Err(LoadError::Config(..))
    ));

    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}"}"#,
    )
    .unwrap();
    let e = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(
        matches!(&e, LoadError::Template(p, ChatError::BadTemplate(_)) if p.ends_with("tokenizer_config.json")),
        "{e}"
    );

    // Without the config file, the tokenizer loads with no template.
    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    assert!(!Tokenizer::from_dir(&dir).unwrap().has_chat_template());
}

#[test]
fn registry_shares_a_directory_and_refuses_mistakes() {
    let dir = common::asset_dir();
    let reg = Tokenizers::load([("a", dir.clone()), ("a-lora", dir.clone())]).unwrap();
    assert_eq!(reg.len(), 2);
    let (a, b) = (reg.get("a").unwrap(), reg.get("a-lora").unwrap());
    assert!(std::sync::Arc::ptr_eq(a, b), "one directory is loaded once");
    assert!(reg.get("b").is_none());
    let mut names: Vec<_> = reg.models().collect();
    names.sort();
    assert_eq!(names, ["a", "a-lora"]);

    assert!(matches!(
        Tokenizers::load([("a", dir.clone()), ("a", dir.clone())]),
        Err(RegistryError::DuplicateModel(m)) if m == "a"
    ));
    let missing = common::scratch("missing");
    assert!(matches!(
        Tokenizers::load([("a", dir), ("m", missing.to_path_buf())]),
        Err(RegistryError::Load(m, LoadError::Io(..))) if m == "m"
    ));
}

#[test]
fn template_failures_are_errors_not_panics() {
    let mut cfg = config(None, None);
    cfg.chat_template = Some(
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
         {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
         {% endif %}{{ message['content'] }}{% endfor %}"
            .into(),
    );
    let tok = Tokenizer::new(asset_inner(), cfg).unwrap();
    assert_eq!(
        tok.render_chat(&msgs(&[("user", "a"), ("assistant", "b")]))
            .unwrap(),
        "ab"
    );
    let e = tok
        .encode_chat(&msgs(&[("user", "a"), ("user", "b")]))
        .unwrap_err();
    assert!(
        matches!(&e, TokenizeError::Chat(ChatError::Render(m)) if m.contains("must alternate")),
        "{e}"
    );
}
