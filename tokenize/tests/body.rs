//! OpenAI request bodies: every accepted shape, every error kind, the size limit.

mod common;

use std::borrow::Cow;
use std::collections::BTreeSet;

use kvr_tokenize::{
    parse_openai, parse_openai_limited, parse_token_ids, Api, BodyError, ChatMessage, Prompt,
    DEFAULT_MAX_BODY_BYTES,
};

const COMPL: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn ok(path: &str, body: &str) -> kvr_tokenize::PromptInput {
    parse_openai(path, body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
}

fn err(path: &str, body: &str) -> BodyError {
    match parse_openai(path, body.as_bytes()) {
        Ok(p) => panic!("{body} was accepted: {p:?}"),
        Err(e) => e,
    }
}

#[test]
fn completion_prompts() {
    let p = ok(
        COMPL,
        r#"{"model": "m", "prompt": "Hello\nworld", "stream": true, "max_tokens": 16,
            "temperature": 0.5, "logit_bias": {"1": 2}, "extra": [1, {"a": null}]}"#,
    );
    assert_eq!(p.api, Api::Completions);
    assert_eq!(p.model.as_deref(), Some("m"));
    assert!(p.stream);
    assert_eq!(p.max_tokens, Some(16));
    assert_eq!(p.prompt, Prompt::Text("Hello\nworld".into()));

    assert_eq!(
        ok(COMPL, r#"{"prompt": ["one"]}"#).prompt,
        Prompt::Text("one".into())
    );
    assert_eq!(
        ok(COMPL, r#"{"prompt": [1, 2, 3]}"#).prompt,
        Prompt::TokenIds(vec![1, 2, 3])
    );
    assert_eq!(
        ok(COMPL, r#"{"prompt": [[7, 4294967295]]}"#).prompt,
        Prompt::TokenIds(vec![7, u32::MAX])
    );
    // Absent and null optional fields.
    let p = ok(
        COMPL,
        r#"{"prompt": "x", "model": null, "stream": null, "max_tokens": null}"#,
    );
    assert_eq!((p.model, p.stream, p.max_tokens), (None, false, None));
    // An empty text is a prompt (the model adds its BOS); the query string is ignored.
    assert_eq!(
        ok("/v1/completions?x=1", r#"{"prompt": ""}"#).prompt,
        Prompt::Text(String::new())
    );
}

#[test]
fn chat_messages() {
    let p = ok(
        CHAT,
        r#"{"model": "m", "max_tokens": 5, "max_completion_tokens": 9, "messages": [
            {"role": "system", "content": "S", "name": "x"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "tool_call_id": "1"}
        ]}"#,
    );
    assert_eq!(p.api, Api::ChatCompletions);
    assert_eq!(p.max_tokens, Some(9), "max_completion_tokens wins");
    assert!(!p.stream);
    assert_eq!(
        p.prompt,
        Prompt::Chat(vec![
            ChatMessage::new("system", "S"),
            ChatMessage::new("user", "a\nb"),
            ChatMessage {
                role: "assistant".into(),
                content: None
            },
            ChatMessage {
                role: "tool".into(),
                content: None
            },
        ])
    );
    assert_eq!(
        ok(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "q"}], "max_tokens": 3}"#
        )
        .max_tokens,
        Some(3)
    );
}

#[test]
fn every_error_kind() {
    let cases: Vec<(&str, &str, &str)> = vec![
        ("/v1/embeddings", r#"{"input": "x"}"#, "unknown_path"),
        (COMPL, r#"{"prompt": "x""#, "not_json"),
        (COMPL, "", "not_json"),
        (COMPL, "\u{1}", "not_json"),
        (COMPL, r#"{"prompt": "a", "prompt": "b"}"#, "not_json"),
        (COMPL, r#"["prompt"]"#, "not_object"),
        (COMPL, "42", "not_object"),
        (COMPL, r#"{"prompt": "x", "model": 3}"#, "bad_field"),
        (COMPL, r#"{"prompt": "x", "stream": "yes"}"#, "bad_field"),
        (COMPL, r#"{"prompt": "x", "max_tokens": -1}"#, "bad_field"),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}"#,
            "bad_field",
        ),
        (COMPL, r#"{"model": "m"}"#, "missing_prompt"),
        (COMPL, r#"{"prompt": null}"#, "missing_prompt"),
        (COMPL, r#"{"prompt": 5}"#, "bad_prompt"),
        (COMPL, r#"{"prompt": {"text": "x"}}"#, "bad_prompt"),
        (COMPL, r#"{"prompt": true}"#, "bad_prompt"),
        (COMPL, r#"{"prompt": [1, "a"]}"#, "bad_prompt"),
        (COMPL, r#"{"prompt": [{"a": 1}]}"#, "bad_prompt"),
        (COMPL, r#"{"prompt": [[1, "a"]]}"#, "bad_prompt"),
        (COMPL, r#"{"prompt": ["a", "b"]}"#, "batched_prompt"),
        (COMPL, r#"{"prompt": [[1], [2], [3]]}"#, "batched_prompt"),
        (COMPL, r#"{"prompt": [1, -2]}"#, "bad_token_id"),
        (COMPL, r#"{"prompt": [1.5]}"#, "bad_token_id"),
        (COMPL, r#"{"prompt": [4294967296]}"#, "bad_token_id"),
        (COMPL, r#"{"prompt": [[3, -1]]}"#, "bad_token_id"),
        (COMPL, r#"{"prompt": []}"#, "empty_prompt"),
        (COMPL, r#"{"prompt": [[]]}"#, "empty_prompt"),
        (CHAT, r#"{"messages": []}"#, "empty_prompt"),
        (CHAT, r#"{"model": "m"}"#, "missing_messages"),
        (CHAT, r#"{"prompt": "x"}"#, "missing_messages"),
        (CHAT, r#"{"messages": "hi"}"#, "bad_messages"),
        (CHAT, r#"{"messages": ["hi"]}"#, "bad_messages"),
        (CHAT, r#"{"messages": [{"content": "hi"}]}"#, "bad_messages"),
        (
            CHAT,
            r#"{"messages": [{"role": 1, "content": "hi"}]}"#,
            "bad_messages",
        ),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": 7}]}"#,
            "bad_messages",
        ),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": ["x"]}]}"#,
            "bad_messages",
        ),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
            "bad_messages",
        ),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"text": "x"}]}]}"#,
            "bad_messages",
        ),
        (
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
            "unsupported_content",
        ),
    ];
    let mut seen = BTreeSet::new();
    for (path, body, kind) in cases {
        let e = err(path, body);
        assert_eq!(e.kind(), kind, "{body}: {e}");
        assert!(!e.to_string().is_empty());
        seen.insert(e.kind());
    }
    let big = parse_openai_limited(COMPL, b"{\"prompt\": \"xx\"}", 4).unwrap_err();
    seen.insert(big.kind());
    // Every declared kind is produced by some body, and nothing else is.
    assert_eq!(seen, BodyError::KINDS.into_iter().collect::<BTreeSet<_>>());
}

#[test]
fn messages_name_the_culprit() {
    let e = err(
        CHAT,
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": 2}]}"#,
    );
    assert!(e.to_string().contains("message 1"), "{e}");
    let e = err(COMPL, r#"{"prompt": [5, 6, -7]}"#);
    assert!(e.to_string().contains("-7"), "{e}");
    let e = err(
        CHAT,
        r#"{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}"#,
    );
    assert_eq!(e, BodyError::UnsupportedContent("input_audio".into()));
}

#[test]
fn size_limit() {
    let body = br#"{"prompt": "0123456789"}"#;
    let n = body.len();
    assert!(parse_openai_limited(COMPL, body, n).is_ok());
    assert_eq!(
        parse_openai_limited(COMPL, body, n - 1),
        Err(BodyError::TooLarge {
            len: n,
            limit: n - 1
        })
    );
    // Over the limit, a body is not even looked at: broken JSON still reads as too large.
    let broken = b"{{{{{{{{{{{{{{{{{{{{";
    assert_eq!(
        parse_openai_limited(COMPL, broken, 10).unwrap_err().kind(),
        "too_large"
    );
    assert_eq!(
        parse_openai_limited(COMPL, broken, 100).unwrap_err().kind(),
        "not_json"
    );
    // The default limit lets an 8 MiB body through and refuses one byte more.
    let filler = "a".repeat(DEFAULT_MAX_BODY_BYTES - r#"{"prompt": ""}"#.len());
    let max = format!(r#"{{"prompt": "{filler}"}}"#);
    assert_eq!(max.len(), DEFAULT_MAX_BODY_BYTES);
    assert!(parse_openai(COMPL, max.as_bytes()).is_ok());
    let over = format!(r#"{{"prompt": "{filler}a"}}"#);
    assert_eq!(
        parse_openai(COMPL, over.as_bytes()).unwrap_err().kind(),
        "too_large"
    );
}

#[test]
fn token_ids_pass_through_untouched() {
    let tok = common::asset();
    // Ids outside the asset's vocabulary, and its BOS in the middle: kept as they are.
    let ids = vec![5, 0, 4_000_000_000, 2047, 0];
    let body = format!(
        r#"{{"model": "m", "prompt": {}}}"#,
        serde_json::to_string(&ids).unwrap()
    );
    let p = ok(COMPL, &body);
    assert_eq!(p.attached_token_ids(), Some(&ids[..]));
    match p.token_ids(&tok).unwrap() {
        Cow::Borrowed(got) => assert_eq!(got, &ids[..]),
        Cow::Owned(_) => panic!("attached ids were re-tokenized"),
    }
    // Text and chat prompts go through the tokenizer.
    let p = ok(COMPL, r#"{"prompt": "hello"}"#);
    assert_eq!(p.attached_token_ids(), None);
    assert_eq!(
        p.token_ids(&tok).unwrap().into_owned(),
        tok.encode("hello").unwrap()
    );
    let p = ok(
        CHAT,
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}"#,
    );
    assert_eq!(
        p.token_ids(&tok).unwrap().into_owned(),
        tok.encode_chat(&[ChatMessage::new("user", "hello")])
            .unwrap()
    );
}

#[test]
fn header_token_ids() {
    assert_eq!(parse_token_ids("[1, 2, 3]"), Ok(vec![1, 2, 3]));
    assert_eq!(parse_token_ids(" 1,2 , 3 "), Ok(vec![1, 2, 3]));
    assert_eq!(parse_token_ids("4294967295"), Ok(vec![u32::MAX]));
    assert_eq!(parse_token_ids("1,x").unwrap_err().kind(), "bad_token_id");
    assert_eq!(
        parse_token_ids("[1,-1]").unwrap_err().kind(),
        "bad_token_id"
    );
    assert_eq!(parse_token_ids("[1,").unwrap_err().kind(), "bad_token_id");
    assert_eq!(parse_token_ids("").unwrap_err().kind(), "empty_prompt");
    assert_eq!(parse_token_ids("[]").unwrap_err().kind(), "empty_prompt");
}

#[test]
fn paths() {
    assert_eq!(
        Api::from_path("/v1/chat/completions"),
        Some(Api::ChatCompletions)
    );
    assert_eq!(
        Api::from_path("/v1/completions?stream=1"),
        Some(Api::Completions)
    );
    for p in [
        "/v1/completions/",
        "/completions",
        "/v1/chat/completions/x",
        "",
    ] {
        assert_eq!(Api::from_path(p), None, "{p}");
    }
    for api in [Api::Completions, Api::ChatCompletions] {
        assert_eq!(Api::from_path(api.path()), Some(api));
    }
}
