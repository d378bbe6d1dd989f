//! The ext_proc target's input: streams of ext_proc messages, request bodies from a
//! grammar, response bodies (decoded from the fuzz bytes with `arbitrary`).

use arbitrary::Arbitrary;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;

use super::MAX_BODY;

const WORDS: [&str; 12] = [
    "the", "cache", "holds", "prefix", "blocks", "of", "every", "prompt", "kv", "router", "picks",
    "endpoint",
];

/// One fuzz input.
#[derive(Arbitrary, Debug)]
pub struct Input {
    pub streams: Vec<StreamIn>,
}

#[derive(Arbitrary, Debug)]
pub struct StreamIn {
    pub body: BodySpec,
    pub response: RespSpec,
    pub msgs: Vec<Msg>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum ModelSel {
    None,
    M,
    M2,
    Lora,
    Unknown(u8),
}

impl ModelSel {
    pub fn name(self) -> Option<String> {
        match self {
            ModelSel::None => None,
            ModelSel::M => Some("m".into()),
            ModelSel::M2 => Some("m2".into()),
            ModelSel::Lora => Some("m-lora".into()),
            ModelSel::Unknown(n) => Some(format!("x{n}")),
        }
    }
}

#[derive(Arbitrary, Debug)]
pub enum BodySpec {
    /// A completions body with token ids (`n % 300 + 1` of them).
    Ids {
        model: ModelSel,
        n: u16,
        seed: u16,
        max_tokens: Option<u8>,
        stream: bool,
    },
    /// A completions body with a text prompt (`words % 60 + 1` words).
    Text {
        model: ModelSel,
        words: u8,
        batch_of_one: bool,
    },
    /// A chat body.
    Chat {
        model: ModelSel,
        turns: u8,
        words: u8,
    },
    /// A valid completions body cut short.
    Truncated {
        n: u8,
        cut: u16,
    },
    /// A body with a field of the wrong type (never readable on either path).
    WrongType(u8),
    Garbage(Vec<u8>),
    /// A token-id body past the size limit.
    Oversized {
        extra: u16,
    },
}

/// What the full body is, for the model.
#[derive(Debug, Clone, PartialEq)]
pub enum BodyClass {
    Malformed,
    /// Garbage: it may happen to be a body (the model does not read JSON).
    Unknown,
    Valid {
        chat: bool,
        model: Option<String>,
        text: bool,
    },
}

pub(super) fn text(words: u8, salt: usize) -> String {
    (0..usize::from(words) % 60 + 1)
        .map(|i| WORDS[(i * 7 + salt) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn ids_json(n: usize, seed: u16) -> String {
    let ids: Vec<u32> = (0..n)
        .map(|i| (u32::from(seed) * 31 + i as u32 * 17) % 50_000)
        .collect();
    serde_json::to_string(&ids).unwrap()
}

impl BodySpec {
    pub fn build(&self) -> (Vec<u8>, BodyClass) {
        use serde_json::json;
        let valid = |chat, model: &ModelSel, text| BodyClass::Valid {
            chat,
            model: model.name(),
            text,
        };
        let with_model = |mut v: serde_json::Value, model: &ModelSel| {
            if let Some(m) = model.name() {
                v["model"] = json!(m);
            }
            serde_json::to_vec(&v).unwrap()
        };
        match self {
            BodySpec::Ids {
                model,
                n,
                seed,
                max_tokens,
                stream,
            } => {
                let ids: serde_json::Value =
                    serde_json::from_str(&ids_json(usize::from(*n) % 300 + 1, *seed)).unwrap();
                let mut v = json!({ "prompt": ids, "stream": stream });
                if let Some(t) = max_tokens {
                    v["max_tokens"] = json!(t);
                }
                (with_model(v, model), valid(false, model, false))
            }
            BodySpec::Text {
                model,
                words,
                batch_of_one,
            } => {
                let t = text(*words, usize::from(*words));
                let p = if *batch_of_one { json!([t]) } else { json!(t) };
                (
                    with_model(json!({ "prompt": p }), model),
                    valid(false, model, true),
                )
            }
            BodySpec::Chat {
                model,
                turns,
                words,
            } => {
                let msgs: Vec<_> = (0..usize::from(*turns) % 4 + 1)
                    .map(|i| {
                        let role = if i % 2 == 0 { "user" } else { "assistant" };
                        json!({ "role": role, "content": text(*words, i) })
                    })
                    .collect();
                (
                    with_model(json!({ "messages": msgs }), model),
                    valid(true, model, true),
                )
            }
            BodySpec::Truncated { n, cut } => {
                let full = format!(
                    r#"{{"model":"m","prompt":{}}}"#,
                    ids_json(usize::from(*n) + 1, 1)
                );
                let keep = usize::from(*cut) % full.len();
                (full.as_bytes()[..keep].to_vec(), BodyClass::Malformed)
            }
            BodySpec::WrongType(k) => {
                const BODIES: [&str; 10] = [
                    r#"{"model":7,"prompt":[1],"messages":[{"role":"user","content":"hi"}]}"#,
                    r#"{"model":"m","prompt":[1],"stream":"yes"}"#,
                    r#"{"model":"m","prompt":[1],"max_tokens":-1}"#,
                    r#"{"model":"m","prompt":true}"#,
                    r#"{"model":"m","prompt":[]}"#,
                    r#"{"model":"m","prompt":[1,-2]}"#,
                    r#"{"model":"m","messages":"hi"}"#,
                    r#"[1,2,3]"#,
                    r#"{"model":"m","prompt":[["a"],["b"]]}"#,
                    r#"{"model":"m","messages":7,"prompt":{"a":1}}"#,
                ];
                (
                    BODIES[usize::from(*k) % BODIES.len()].as_bytes().to_vec(),
                    BodyClass::Malformed,
                )
            }
            BodySpec::Garbage(b) => {
                // It (or a prefix) may happen to be a readable body.
                (b.clone(), BodyClass::Unknown)
            }
            BodySpec::Oversized { extra } => {
                let n = MAX_BODY / 4 + usize::from(*extra) % 512;
                let v = format!(r#"{{"model":"m","prompt":{}}}"#, ids_json(n, 3));
                assert!(v.len() > MAX_BODY);
                (v.into_bytes(), BodyClass::Malformed)
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
pub enum RespSpec {
    /// `events % 12` SSE events, then a usage object (if `usage`) and `[DONE]`.
    Sse {
        events: u8,
        usage: bool,
        prompt: u16,
        cached: u16,
    },
    Garbage(Vec<u8>),
}

impl RespSpec {
    /// The bytes, and the cached tokens they report (SSE only).
    pub fn build(&self) -> (Vec<u8>, Option<u64>) {
        match self {
            RespSpec::Sse {
                events,
                usage,
                prompt,
                cached,
            } => {
                let mut s = String::new();
                for i in 0..events % 12 {
                    s.push_str(&format!(
                        "data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n"
                    ));
                }
                let mut reported = Some(0);
                if *usage {
                    s.push_str(&format!(
                        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}}}}}\n\n"
                    ));
                    reported = Some(u64::from(*cached));
                }
                s.push_str("data: [DONE]\n\n");
                (s.into_bytes(), reported)
            }
            RespSpec::Garbage(b) => (b.clone(), None),
        }
    }
}

#[derive(Arbitrary, Debug)]
pub struct Msg {
    /// A protocol configuration on the message: body modes by index into [`MODES`].
    pub config: Option<(u8, u8)>,
    pub kind: MsgKind,
}

#[derive(Arbitrary, Debug)]
pub enum SubsetSel {
    /// Endpoints by index (pool endpoints, then unknown names), as one string.
    Joined(Vec<u8>),
    /// The same as a list value.
    List(Vec<u8>),
    /// A number: not a hint.
    WrongType,
}

#[derive(Arbitrary, Debug)]
pub enum ServedSel {
    /// The pick's first endpoint.
    Picked,
    /// The pick's `i`-th endpoint (a fallback), else a pool endpoint of the model.
    Fallback(u8),
    /// A pool endpoint by index.
    Pool(u8),
    Unknown(u8),
    Garbage(String),
    Empty,
}

#[derive(Arbitrary, Debug)]
pub enum MsgKind {
    NoRequest,
    RequestHeaders {
        path: u8,
        session: Option<u8>,
        subset: Option<SubsetSel>,
        end: bool,
    },
    /// The next bytes of the body (`chunk_len`).
    RequestBody {
        take: u16,
        end: bool,
    },
    RequestTrailers,
    ResponseHeaders {
        served: Option<ServedSel>,
        end: bool,
    },
    ResponseBody {
        take: u16,
        end: bool,
    },
    ResponseTrailers,
}

pub(super) const MODES: [BodySendMode; 6] = [
    BodySendMode::None,
    BodySendMode::Buffered,
    BodySendMode::Streamed,
    BodySendMode::BufferedPartial,
    BodySendMode::FullDuplexStreamed,
    BodySendMode::FullDuplexStreamed,
];
pub(super) const PATHS: [&str; 7] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/completions?stream=1",
    "/v1/chat/completions?a=b",
    "/v1/embeddings",
    "",
    "/v1/completions/",
];
