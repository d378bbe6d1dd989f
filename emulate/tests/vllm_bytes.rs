//! The emulator's KV-event batches, byte for byte against vLLM 0.33's own encoder: its
//! unchanged `kv_events.py` (loaded by tests/compat/vllm_publisher.py) encodes the same
//! events, built as vLLM's KV cache manager builds them, with the msgspec encoder its
//! publisher thread uses; and each of our payloads decoded into vLLM's `KVEventBatch`
//! type re-encodes to the same bytes. Cases: integers at every msgpack width boundary, and
//! every batch a live pod published (fetched raw from its replay ROUTER).
//!
//! On msgspec's encoding: it writes a Python float always as float64 and an int in its
//! smallest msgpack form, as `rmp`'s `write_f64`/`write_uint` do; the ts values compared
//! are Python floats (`time.time()` in vLLM), so an integral ts sent as a Python int
//! (which msgspec would write as an int) is out of scope, as it is for vLLM's publisher.
//!
//! Needs the compat venv (tests/compat/ensure-venv.sh); skipped with a notice without
//! it, unless `KVR_REQUIRE_COMPAT=1`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{config, Emu};
use kvr::ingress::{decode_batch, DecodedBatch, DecodedEvent};
use kvr_emulator::BatchEncoder;
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn compat_python() -> Option<PathBuf> {
    let home = std::env::var("HOME").unwrap_or_default();
    let venv = std::env::var("KVR_COMPAT_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(&home).join(".cache/kvr/compat-venv"));
    let vllm = std::env::var("KVR_COMPAT_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(&home).join(".cache/kvr/vllm-0.33.0"));
    let python = venv.join("bin/python");
    let ready = python.exists() && vllm.join("vllm/distributed/kv_events.py").exists();
    if !ready {
        assert!(
            std::env::var("KVR_REQUIRE_COMPAT").as_deref() != Ok("1"),
            "KVR_REQUIRE_COMPAT=1 but the compat venv or vLLM's kv_events.py is missing"
        );
        eprintln!("SKIPPED: run tests/compat/ensure-venv.sh for the vLLM byte comparison");
        return None;
    }
    Some(python)
}

#[derive(Clone, Debug)]
enum Ev {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
    },
    Removed(Vec<u64>),
    Cleared,
}

impl Ev {
    fn json(&self) -> Value {
        match self {
            Ev::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => json!({"type": "stored", "hashes": hashes, "parent": parent,
                        "tokens": tokens, "block_size": block_size}),
            Ev::Removed(h) => json!({"type": "removed", "hashes": h}),
            Ev::Cleared => json!({"type": "cleared"}),
        }
    }
}

fn encode(events: &[Ev], ts: f64, dp: u32) -> Vec<u8> {
    let mut enc = BatchEncoder::new();
    for e in events {
        match e {
            Ev::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => enc.vllm_stored(hashes, *parent, tokens, *block_size, None),
            Ev::Removed(h) => enc.vllm_removed(h),
            Ev::Cleared => enc.cleared(),
        };
    }
    enc.finish(ts, Some(dp))
}

/// The events of a payload, read back with kvr's decoder.
fn decoded(payload: &[u8]) -> (Vec<Ev>, f64, u32) {
    let mut b = DecodedBatch::default();
    decode_batch(payload, &mut b).expect("decodes");
    let events = b
        .events
        .iter()
        .map(|e| match e {
            DecodedEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                ..
            } => Ev::Stored {
                hashes: b.hashes[hashes.clone()].to_vec(),
                parent: *parent,
                tokens: b.tokens[tokens.clone()].to_vec(),
                block_size: *block_size,
            },
            DecodedEvent::Removed { hashes, .. } => Ev::Removed(b.hashes[hashes.clone()].to_vec()),
            DecodedEvent::Cleared => Ev::Cleared,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    (events, b.ts, b.data_parallel_rank.expect("a DP rank"))
}

/// vLLM's encodings of each case: (built from the events, our payload round-tripped).
fn vllm_encodings(
    python: &PathBuf,
    cases: &[(Vec<u8>, Vec<Ev>, f64, u32)],
) -> Vec<(String, Option<String>)> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vllm_bytes.py");
    let mut child = Command::new(python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start vllm_bytes.py");
    let mut stdin = child.stdin.take().unwrap();
    for (payload, events, ts, dp) in cases {
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        let events: Vec<Value> = events.iter().map(Ev::json).collect();
        let line = json!({"payload": hex, "ts": ts, "dp_rank": dp, "events": events});
        writeln!(stdin, "{line}").unwrap();
    }
    drop(stdin);
    let out: Vec<(String, Option<String>)> = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(&l.unwrap()).unwrap();
            (
                v["built"].as_str().unwrap().to_owned(),
                v["roundtrip"].as_str().map(str::to_owned),
            )
        })
        .collect();
    assert!(child.wait().unwrap().success(), "vllm_bytes.py failed");
    assert_eq!(out.len(), cases.len());
    out
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every integer width msgpack has (positive fixint, uint8/16/32/64 and their edges).
const EDGES: [u64; 12] = [
    0,
    1,
    127,
    128,
    255,
    256,
    65_535,
    65_536,
    4_294_967_295,
    4_294_967_296,
    1 << 63,
    u64::MAX,
];

fn synthetic_cases() -> Vec<(Vec<u8>, Vec<Ev>, f64, u32)> {
    let tokens: Vec<u32> = [
        0u32,
        1,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u32::MAX,
        7,
        8,
        9,
    ]
    .to_vec();
    let mut cases = Vec::new();
    let batches: Vec<Vec<Ev>> = vec![
        vec![Ev::Stored {
            hashes: EDGES[..3].to_vec(),
            parent: None,
            tokens: tokens.clone(),
            block_size: 4,
        }],
        vec![Ev::Stored {
            hashes: vec![u64::MAX],
            parent: Some(1 << 63),
            tokens: tokens[..4].to_vec(),
            block_size: 4,
        }],
        vec![Ev::Removed(EDGES.to_vec())],
        vec![Ev::Removed(Vec::new()), Ev::Cleared],
        vec![
            Ev::Removed(vec![65_536]),
            Ev::Stored {
                hashes: EDGES[3..6].to_vec(),
                parent: Some(255),
                tokens: (0..48).collect(),
                block_size: 16,
            },
            Ev::Stored {
                hashes: EDGES[6..].to_vec(),
                parent: Some(EDGES[5]),
                tokens: (1000..1096).collect(),
                block_size: 16,
            },
        ],
        vec![Ev::Cleared],
    ];
    for (i, events) in batches.into_iter().enumerate() {
        for (ts, dp) in [
            (1_733_400_000.123_456_7, 0),
            (0.5 + i as f64, 3),
            (1e-300, 255),
        ] {
            cases.push((encode(&events, ts, dp), events.clone(), ts, dp));
        }
    }
    cases
}

/// Every batch a live pod published, raw from its replay ROUTER (start seq 0).
fn live_cases() -> Vec<(Vec<u8>, Vec<Ev>, f64, u32)> {
    let mut cfg = config("bytes");
    cfg.cache.capacity_blocks = 12;
    let e = Emu::start(cfg);
    for i in 0..8 {
        e.complete(
            json!(format!(
                "prompt number {i} with a shared head and a tail {}",
                i * 31
            )),
            2,
        );
    }
    assert_eq!(e.post("/reset_prefix_cache", &json!({})).status, 200);
    e.complete(json!("after the reset"), 1);
    let replay = e.h.pod.replay_endpoint().unwrap().to_owned();
    let payloads = e.rt.block_on(async move {
        let mut dealer = DealerSocket::new();
        dealer.connect(&replay).await.unwrap();
        let mut req = ZmqMessage::from(Vec::<u8>::new());
        req.push_back(0u64.to_be_bytes().to_vec().into());
        dealer.send(req).await.unwrap();
        let mut out = Vec::new();
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
                .await
                .expect("a replay reply")
                .unwrap();
            let f: Vec<Vec<u8>> = msg.iter().map(|f| f.to_vec()).collect();
            assert_eq!(f.len(), 4, "replies are [empty, topic, seq, payload]");
            assert!(f[0].is_empty());
            if f[2] == [0xff; 8] {
                assert!(f[1].is_empty() && f[3].is_empty(), "the end marker");
                return out;
            }
            let seq = u64::from_be_bytes(f[2][..].try_into().unwrap());
            assert_eq!(seq, out.len() as u64, "replayed in order from 0");
            out.push(f[3].clone());
        }
    });
    let mut kinds = [0usize; 3];
    let cases: Vec<_> = payloads
        .into_iter()
        .map(|p| {
            let (events, ts, dp) = decoded(&p);
            for e in &events {
                kinds[match e {
                    Ev::Stored { .. } => 0,
                    Ev::Removed(_) => 1,
                    Ev::Cleared => 2,
                }] += 1;
            }
            (p, events, ts, dp)
        })
        .collect();
    assert!(
        kinds.iter().all(|k| *k > 0),
        "stored, removed, cleared: {kinds:?}"
    );
    cases
}

#[test]
fn batches_match_vllms_own_encoder_byte_for_byte() {
    let Some(python) = compat_python() else {
        return;
    };
    let mut cases = synthetic_cases();
    let synthetic = cases.len();
    cases.extend(live_cases());
    let vllm = vllm_encodings(&python, &cases);
    for (i, ((payload, events, ..), (built, roundtrip))) in cases.iter().zip(&vllm).enumerate() {
        let ours = hex(payload);
        assert_eq!(&ours, built, "case {i} {events:?}: ours vs vLLM's");
        assert_eq!(
            Some(&ours),
            roundtrip.as_ref(),
            "case {i}: vLLM's round trip"
        );
    }
    eprintln!(
        "{} batches ({synthetic} synthetic, {} from a live pod) identical to vLLM 0.33's encoding",
        cases.len(),
        cases.len() - synthetic
    );

    // Negative control: the generic encoder's store (no lora_id/lora_name/extra_keys/
    // group fields) is a different byte string, and the comparison says so.
    let ev = Ev::Stored {
        hashes: vec![5],
        parent: None,
        tokens: vec![1, 2, 3, 4],
        block_size: 4,
    };
    let mut enc = BatchEncoder::new();
    enc.stored(
        &[5],
        None,
        &[1, 2, 3, 4],
        4,
        kvr::ingress::Medium::Gpu,
        None,
    );
    let generic = enc.finish(2.0, Some(0));
    let vllm = vllm_encodings(&python, &[(generic.clone(), vec![ev], 2.0, 0)]);
    assert_ne!(
        hex(&generic),
        vllm[0].0,
        "the check cannot tell encodings apart"
    );
}
