//! kvr's extra-key vectors (`tests/conformance/extra_key_vectors.json`): the request side
//! (`BlockExtras`) and the event side (vLLM 0.33's `extra_keys` through
//! `Partition::ingest`) give each vector's pinned hashes, and so does a second
//! implementation of the rule written here from its xxh3 formulas (`kvr::hash`).
//! An unknown key in a vector fails the test, so nothing is silently skipped.

use kvr::config::PartitionConfig;
use kvr::hash::prompt_embeds_key;
use kvr::hash::{sequence_hashes, BlockExtras, HashSalt};
use kvr::ingress::Medium;
use kvr::RankId;
use kvr::{Partition, PartitionKey};
use kvr_emulator::{BatchEncoder, WireExtraKey};
use serde_json::{Map, Value};
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

const KNOWN: [&str; 12] = [
    "name",
    "block_size",
    "tokens",
    "lora_name",
    "cache_salt",
    "mm_inputs",
    "prompt_embeds",
    "block_keys",
    "event_extra_keys",
    "local",
    "sequence",
    "about",
];

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digest"))
        .collect()
}

fn u64s(v: Option<&Value>) -> Vec<u64> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().map(|x| x.as_u64().expect("u64")).collect())
        .unwrap_or_default()
}

/// The rule, again, from its formulas: each block's key values, then the local hashes.
mod spec {
    use super::*;
    const MM: u64 = 0x6b76_725f_6d6d;
    const TEXT: u64 = 0x6b76_725f_7478;
    const BYTES: u64 = 0x6b76_725f_6279;

    pub(crate) fn text(s: &str) -> u64 {
        xxh3_64_with_seed(s.as_bytes(), TEXT)
    }
    pub(crate) fn mm(id: &str, offset: i64) -> u64 {
        let mut b = xxh3_64_with_seed(id.as_bytes(), MM).to_le_bytes().to_vec();
        b.extend_from_slice(&offset.to_le_bytes());
        xxh3_64_with_seed(&b, MM)
    }
    pub(crate) fn bytes(d: &[u8]) -> u64 {
        xxh3_64_with_seed(d, BYTES)
    }
    pub(crate) fn local(tokens: &[u32], keys: &[u64], lora: Option<&str>) -> u64 {
        let seed = lora.map_or(1337, |l| {
            1337u64.wrapping_add(xxh3_64_with_seed(l.as_bytes(), 0))
        });
        let mut h = Xxh3::with_seed(seed);
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        let mut k = keys.to_vec();
        k.sort_unstable();
        for v in k {
            h.update(&v.to_le_bytes());
        }
        h.digest()
    }
}

/// An event extra key as the vector spells it.
enum Owned {
    Text(String),
    Mm(String, i64),
    Bytes(Vec<u8>),
}

impl Owned {
    fn wire(&self) -> WireExtraKey<'_> {
        match self {
            Owned::Text(s) => WireExtraKey::Text(s),
            Owned::Mm(id, off) => WireExtraKey::Mm(id, *off),
            Owned::Bytes(b) => WireExtraKey::Bytes(b),
        }
    }
}

struct Case<'a> {
    name: &'a str,
    v: &'a Map<String, Value>,
    bs: usize,
    tokens: Vec<u32>,
    lora: Option<&'a str>,
}

impl Case<'_> {
    fn key(&self, k: &Value) -> Owned {
        match k {
            Value::String(s) => Owned::Text(s.clone()),
            Value::Array(p) => Owned::Mm(p[0].as_str().unwrap().into(), p[1].as_i64().unwrap()),
            Value::Object(o) => Owned::Bytes(hex(o["bytes"].as_str().unwrap())),
            other => panic!("{}: extra key {other}", self.name),
        }
    }

    /// Request side: `BlockExtras` from the vector's inputs; and the spec's key values.
    fn request(&self) -> (Vec<u64>, Vec<u64>) {
        let mut extras = BlockExtras::new();
        let n = self.tokens.len() / self.bs;
        let mut keys: Vec<Vec<u64>> = vec![Vec::new(); n];
        if let Some(s) = self.v.get("cache_salt").and_then(Value::as_str) {
            extras.set_cache_salt(Some(s));
            keys[0].push(spec::text(s));
        }
        for m in self
            .v
            .get("mm_inputs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let id = m["identifier"].as_str().unwrap();
            let (off, len) = (m["offset"].as_u64().unwrap(), m["length"].as_u64().unwrap());
            extras.multimodal(id.as_bytes(), off, len).unwrap();
            for (b, k) in keys.iter_mut().enumerate() {
                let start = (b * self.bs) as u64;
                if start + self.bs as u64 > off && start < off + len {
                    k.push(spec::mm(id, off as i64 - start as i64));
                }
            }
        }
        for e in self
            .v
            .get("prompt_embeds")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (b, d) = (e[0].as_u64().unwrap() as usize, hex(e[1].as_str().unwrap()));
            extras.block_key(b, prompt_embeds_key(&d)).unwrap();
            keys[b].push(spec::bytes(&d));
        }
        for e in self
            .v
            .get("block_keys")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (b, k) = (e[0].as_u64().unwrap() as usize, e[1].as_u64().unwrap());
            extras.block_key(b, k).unwrap();
            keys[b].push(k);
        }
        let mut got = Vec::new();
        extras.local_hashes(
            &self.tokens,
            self.bs,
            HashSalt::new(self.lora, None),
            &mut got,
        );
        let spec = self
            .tokens
            .chunks_exact(self.bs)
            .zip(&keys)
            .map(|(t, k)| spec::local(t, k, self.lora))
            .collect();
        (got, spec)
    }

    /// Event side: the vector's `extra_keys` published by an engine; the depth a prompt
    /// with local hashes `want` then finds.
    fn event_depth(&self, want: &[u64]) -> Option<u32> {
        let entries = self.v.get("event_extra_keys")?;
        let owned: Option<Vec<Option<Vec<Owned>>>> = entries.as_array().map(|blocks| {
            blocks
                .iter()
                .map(|b| {
                    b.as_array()
                        .map(|items| items.iter().map(|k| self.key(k)).collect())
                })
                .collect()
        });
        let wire: Option<Vec<Option<Vec<WireExtraKey<'_>>>>> = owned.as_ref().map(|blocks| {
            blocks
                .iter()
                .map(|b| {
                    b.as_ref()
                        .map(|items| items.iter().map(Owned::wire).collect())
                })
                .collect()
        });
        let p = Partition::new(
            PartitionKey::new("m", "g"),
            PartitionConfig::new(self.bs as u32),
        );
        let mut e = BatchEncoder::new();
        if let Some(w) = &wire {
            let refs: Vec<Option<&[WireExtraKey<'_>]>> = w.iter().map(|b| b.as_deref()).collect();
            e.with_extra_keys(&refs);
        }
        let n = self.tokens.len() / self.bs;
        let ext: Vec<u64> = (100..100 + n as u64).collect();
        e.stored(
            &ext,
            None,
            &self.tokens,
            self.bs as u32,
            Medium::Gpu,
            self.lora,
        );
        let out = p.ingest(1, 0, b"", 0, &e.finish(1.0, None));
        assert_eq!(
            (out.batches_applied, out.decode_errors),
            (1, 0),
            "{}",
            self.name
        );
        Some(p.index().find_matches(want).get(RankId::new(1, 0)))
    }
}

#[test]
fn extra_key_vectors_hold_on_both_sides_and_in_the_spec() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/conformance/extra_key_vectors.json"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let vectors = doc["vectors"].as_array().expect("vectors");
    assert!(vectors.len() >= 6);
    let mut events_checked = 0;
    for v in vectors {
        let v = v.as_object().expect("a vector is an object");
        let name = v["name"].as_str().expect("name");
        for k in v.keys() {
            assert!(KNOWN.contains(&k.as_str()), "{name}: unknown key {k:?}");
        }
        let case = Case {
            name,
            v,
            bs: v["block_size"].as_u64().unwrap() as usize,
            tokens: u64s(v.get("tokens"))
                .into_iter()
                .map(|t| t as u32)
                .collect(),
            lora: v.get("lora_name").and_then(Value::as_str),
        };
        let (got, spec) = case.request();
        let seq = sequence_hashes(&got);
        assert_eq!(
            got, spec,
            "{name}: BlockExtras disagrees with the rule's formulas"
        );
        // KVR_PRINT_VECTORS=1 prints the hashes to pin (after a deliberate rule change).
        if std::env::var_os("KVR_PRINT_VECTORS").is_some() {
            println!("{name}: \"local\": {got:?}, \"sequence\": {seq:?}");
        } else {
            assert_eq!(got, u64s(v.get("local")), "{name}: local hashes");
            assert_eq!(seq, u64s(v.get("sequence")), "{name}: sequence hashes");
        }
        if let Some(depth) = case.event_depth(&got) {
            assert_eq!(
                depth as usize,
                got.len(),
                "{name}: the engine's blocks are not the request's"
            );
            events_checked += 1;
        }
    }
    assert!(
        events_checked >= 5,
        "the event side was checked on {events_checked} vectors"
    );
}
