//! Target (a): arbitrary bytes → `kvr::ingress::decode_batch`.
//!
//! Must never panic (overflow checks are on in cargo-fuzz builds). On every input: decoding
//! into a fresh batch and into a reused one agree. On a successful decode: every range is
//! in bounds, every store's tokens are `blocks × block_size`, no store of blocks is of a
//! recurrent group, and re-encoding the decoded batch (tagged maps or positional arrays,
//! hashes as uint64 / int64 / bin, each group kind in one of its spellings, a recurrent
//! group's store with or without token ids) decodes to the same events.

use std::cell::RefCell;

use kvr::ingress::{decode_batch, DecodedBatch, DecodedEvent, Medium, SpecKind};

thread_local! {
    static REUSED: RefCell<DecodedBatch> = RefCell::new(DecodedBatch::default());
}

/// Runs one input; panics on a finding.
pub fn run(data: &[u8]) {
    let mut fresh = DecodedBatch::default();
    let res = decode_batch(data, &mut fresh);
    let reused_res = REUSED.with(|b| {
        let mut b = b.borrow_mut();
        let r = decode_batch(data, &mut b);
        if r.is_ok() {
            assert_eq!(
                resolve(&b, true),
                resolve(&fresh, true),
                "reused batch decodes differently"
            );
        }
        r
    });
    assert_eq!(res, reused_res, "reused batch fails differently");
    if let Err(e) = res {
        assert!(!e.kind.name().is_empty());
        let _ = e.to_string();
        return;
    }
    check_invariants(&fresh);
    // Extra keys decode to key values (hashes), which cannot be written back as the wire
    // had them: the round trip compares everything else (re-encoded without them).
    let want = resolve(&fresh, false);
    for (i, style) in [Style::Tagged, Style::Positional].into_iter().enumerate() {
        let bytes = encode(&fresh, style, data.len() + i);
        let mut again = DecodedBatch::default();
        decode_batch(&bytes, &mut again).expect("re-encoded batch must decode");
        assert_eq!(
            resolve(&again, false),
            want,
            "re-encoded batch decodes differently ({style:?})"
        );
    }
}

fn check_invariants(b: &DecodedBatch) {
    for ev in &b.events {
        match ev {
            DecodedEvent::Stored {
                hashes,
                tokens,
                block_size,
                lora_name,
                extras,
                lookahead,
                spec,
                ..
            } => {
                assert!(hashes.start <= hashes.end && hashes.end <= b.hashes.len());
                // A recurrent group's store names states, never blocks.
                assert!(
                    hashes.is_empty() || *spec != SpecKind::Recurrent,
                    "a recurrent group's store decoded as blocks"
                );
                // Lookahead tokens: none, or one in-bounds range per block.
                if !lookahead.is_empty() {
                    assert_eq!(lookahead.len(), hashes.len());
                    for r in &b.block_lookahead[lookahead.clone()] {
                        assert!(r.start <= r.end && r.end <= b.lookahead.len());
                    }
                }
                // Extra keys: none, or one in-bounds range of key values per block.
                if !extras.is_empty() {
                    assert_eq!(extras.len(), hashes.len());
                    for r in &b.block_extras[extras.clone()] {
                        assert!(r.start <= r.end && r.end <= b.extra_keys.len());
                    }
                }
                assert!(tokens.start <= tokens.end && tokens.end <= b.tokens.len());
                if !hashes.is_empty() {
                    assert!(*block_size >= 1);
                }
                assert_eq!(tokens.len(), hashes.len() * *block_size as usize);
                if let Some(r) = lora_name {
                    assert!(!r.is_empty());
                    assert!(
                        b.text.get(r.clone()).is_some(),
                        "lora range not on char boundaries"
                    );
                }
            }
            DecodedEvent::Removed { hashes, .. } => {
                assert!(hashes.start <= hashes.end && hashes.end <= b.hashes.len());
            }
            DecodedEvent::Tokenless { hashes, .. } => {
                assert!(hashes.start < hashes.end && hashes.end <= b.hashes.len());
            }
            DecodedEvent::Cleared | DecodedEvent::Malformed { .. } => {}
        }
    }
}

/// An event with its ranges resolved, for comparing batches decoded from different bytes.
#[derive(Debug, PartialEq)]
enum Owned {
    Stored(
        Vec<u64>,
        Option<u64>,
        Vec<u32>,
        u32,
        Option<String>,
        Medium,
        Option<u32>,
        SpecKind,
        Vec<Vec<u64>>,
        Vec<Vec<u32>>,
    ),
    Tokenless(Vec<u64>, Medium, Option<u32>, SpecKind),
    Removed(Vec<u64>, Medium, Option<u32>),
    Cleared,
    /// Its detail is not compared: re-encoding writes one unusable shape for all.
    Malformed,
}

fn resolve(b: &DecodedBatch, with_extras: bool) -> (u64, Option<u32>, Vec<Owned>) {
    let events = b
        .events
        .iter()
        .map(|ev| match ev {
            DecodedEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                lora_name,
                medium,
                group,
                spec,
                extras,
                lookahead,
            } => Owned::Stored(
                b.hashes[hashes.clone()].to_vec(),
                *parent,
                b.tokens[tokens.clone()].to_vec(),
                *block_size,
                lora_name.clone().map(|r| b.text[r].to_owned()),
                *medium,
                *group,
                *spec,
                (0..hashes.len())
                    .filter(|_| with_extras && !extras.is_empty())
                    .map(|i| b.block_extra_keys(extras, i).to_vec())
                    .collect(),
                (0..hashes.len())
                    .filter(|_| !lookahead.is_empty())
                    .map(|i| b.block_lookahead_tokens(lookahead, i).to_vec())
                    .collect(),
            ),
            DecodedEvent::Tokenless {
                hashes,
                medium,
                group,
                spec,
            } => Owned::Tokenless(b.hashes[hashes.clone()].to_vec(), *medium, *group, *spec),
            DecodedEvent::Malformed { .. } => Owned::Malformed,
            DecodedEvent::Removed {
                hashes,
                medium,
                group,
            } => Owned::Removed(b.hashes[hashes.clone()].to_vec(), *medium, *group),
            DecodedEvent::Cleared => Owned::Cleared,
        })
        .collect();
    (b.ts.to_bits(), b.data_parallel_rank, events)
}

#[derive(Clone, Copy, Debug)]
enum Style {
    Tagged,
    Positional,
}

/// Token ids a re-encoded recurrent store spans (a prefix of them).
const SPAN_TOKENS: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = i as u32 * 7 % 11;
        i += 1;
    }
    t
};

fn encode(b: &DecodedBatch, style: Style, salt: usize) -> Vec<u8> {
    use rmp::encode as en;
    let mut w = Vec::new();
    let hash = |w: &mut Vec<u8>, h: u64, k: usize| match (salt + k) % 3 {
        0 => en::write_uint(w, h).map(|_| ()).unwrap(),
        1 => en::write_sint(w, h as i64).map(|_| ()).unwrap(),
        _ => {
            // 32-byte digest form: the hash is its last 8 bytes.
            let mut d = [0xa5u8; 32];
            d[24..].copy_from_slice(&h.to_be_bytes());
            en::write_bin(w, &d).unwrap()
        }
    };
    let medium = |m: Medium| match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Storage => "STORAGE",
        Medium::Unknown => "UNKNOWN_MEDIUM",
    };
    let group = |w: &mut Vec<u8>, g: Option<u32>| match g {
        Some(g) => en::write_uint(w, u64::from(g)).map(|_| ()).unwrap(),
        None => en::write_nil(w).unwrap(),
    };
    let key = |w: &mut Vec<u8>, k: &str| {
        if let Style::Tagged = style {
            en::write_str(w, k).unwrap();
        }
    };
    en::write_array_len(&mut w, 3).unwrap();
    en::write_f64(&mut w, b.ts).unwrap();
    en::write_array_len(&mut w, b.events.len() as u32).unwrap();
    for ev in &b.events {
        let (tag, n) = match ev {
            DecodedEvent::Stored { lookahead, .. } if !lookahead.is_empty() => ("BlockStored", 15),
            DecodedEvent::Stored { .. } | DecodedEvent::Tokenless { .. } => ("BlockStored", 10),
            DecodedEvent::Malformed { .. } => ("BlockStored", 4),
            DecodedEvent::Removed { .. } => ("BlockRemoved", 3),
            DecodedEvent::Cleared => ("AllBlocksCleared", 0),
        };
        match style {
            Style::Tagged => {
                en::write_map_len(&mut w, n + 1).unwrap();
                en::write_str(&mut w, "type").unwrap();
            }
            Style::Positional => {
                en::write_array_len(&mut w, n + 1).unwrap();
            }
        }
        en::write_str(&mut w, tag).unwrap();
        match ev {
            DecodedEvent::Stored { .. } | DecodedEvent::Tokenless { .. } => {
                // A tokenless store is a store with no parent, no tokens, block size 0.
                let (hashes, parent, tokens, block_size, lora_name, m, g, spec, lookahead) =
                    match ev {
                        DecodedEvent::Stored {
                            hashes,
                            parent,
                            tokens,
                            block_size,
                            lora_name,
                            medium,
                            group,
                            spec,
                            lookahead,
                            ..
                        } => (
                            hashes.clone(),
                            *parent,
                            &b.tokens[tokens.clone()],
                            *block_size,
                            lora_name.clone(),
                            *medium,
                            *group,
                            *spec,
                            lookahead.clone(),
                        ),
                        // A recurrent group's store may carry a parent and the token ids of
                        // every block its names span (vLLM's align mode): still tokenless.
                        DecodedEvent::Tokenless {
                            hashes,
                            medium,
                            group,
                            spec: SpecKind::Recurrent,
                        } if salt.is_multiple_of(2) => (
                            hashes.clone(),
                            Some(0x9a7e),
                            &SPAN_TOKENS[..(hashes.len() * 4 + salt % 3).min(SPAN_TOKENS.len())],
                            4,
                            None,
                            *medium,
                            *group,
                            SpecKind::Recurrent,
                            0..0,
                        ),
                        DecodedEvent::Tokenless {
                            hashes,
                            medium,
                            group,
                            spec,
                        } => (
                            hashes.clone(),
                            None,
                            &[][..],
                            0,
                            None,
                            *medium,
                            *group,
                            *spec,
                            0..0,
                        ),
                        _ => unreachable!("matched above"),
                    };
                key(&mut w, "block_hashes");
                en::write_array_len(&mut w, hashes.len() as u32).unwrap();
                for (k, &h) in b.hashes[hashes.clone()].iter().enumerate() {
                    hash(&mut w, h, k);
                }
                key(&mut w, "parent_block_hash");
                match parent {
                    Some(p) => hash(&mut w, p, 1),
                    None => en::write_nil(&mut w).unwrap(),
                }
                key(&mut w, "token_ids");
                en::write_array_len(&mut w, tokens.len() as u32).unwrap();
                for &t in tokens {
                    en::write_uint(&mut w, u64::from(t)).unwrap();
                }
                key(&mut w, "block_size");
                en::write_uint(&mut w, u64::from(block_size)).unwrap();
                key(&mut w, "lora_id");
                en::write_nil(&mut w).unwrap();
                key(&mut w, "medium");
                en::write_str(&mut w, medium(m)).unwrap();
                key(&mut w, "lora_name");
                match lora_name {
                    Some(r) => en::write_str(&mut w, &b.text[r]).unwrap(),
                    None => en::write_nil(&mut w).unwrap(),
                }
                key(&mut w, "extra_keys");
                en::write_nil(&mut w).unwrap();
                key(&mut w, "group_idx");
                group(&mut w, g);
                key(&mut w, "kv_cache_spec_kind");
                let names: &[&str] = match spec {
                    SpecKind::Unspecified => &[],
                    SpecKind::FullAttention => {
                        &["full_attention", "mla_attention", "sink_full_attention"]
                    }
                    SpecKind::Other => &["sliding_window", "chunked_local_attention"],
                    SpecKind::Recurrent => &["mamba", "MAMBA"],
                };
                match names.get(salt % names.len().max(1)) {
                    None => en::write_nil(&mut w).unwrap(),
                    Some(n) => en::write_str(&mut w, n).unwrap(),
                }
                if !lookahead.is_empty() {
                    for k in [
                        "kv_cache_spec_sliding_window",
                        "locality",
                        "ownership",
                        "session_id",
                    ] {
                        key(&mut w, k);
                        en::write_nil(&mut w).unwrap();
                    }
                    key(&mut w, "lookahead_token_ids");
                    en::write_array_len(&mut w, hashes.len() as u32).unwrap();
                    for i in 0..hashes.len() {
                        let t = b.block_lookahead_tokens(&lookahead, i);
                        en::write_array_len(&mut w, t.len() as u32).unwrap();
                        for &x in t {
                            en::write_uint(&mut w, u64::from(x)).unwrap();
                        }
                    }
                }
            }
            DecodedEvent::Malformed { .. } => {
                // One block of two tokens with one token id: unusable.
                key(&mut w, "block_hashes");
                en::write_array_len(&mut w, 1).unwrap();
                hash(&mut w, 1, 0);
                key(&mut w, "parent_block_hash");
                en::write_nil(&mut w).unwrap();
                key(&mut w, "token_ids");
                en::write_array_len(&mut w, 1).unwrap();
                en::write_uint(&mut w, 7).unwrap();
                key(&mut w, "block_size");
                en::write_uint(&mut w, 2).unwrap();
            }
            DecodedEvent::Removed {
                hashes,
                medium: m,
                group: g,
            } => {
                key(&mut w, "block_hashes");
                en::write_array_len(&mut w, hashes.len() as u32).unwrap();
                for (k, &h) in b.hashes[hashes.clone()].iter().enumerate() {
                    hash(&mut w, h, k);
                }
                key(&mut w, "medium");
                en::write_str(&mut w, medium(*m)).unwrap();
                key(&mut w, "group_idx");
                group(&mut w, *g);
            }
            DecodedEvent::Cleared => {}
        }
    }
    match b.data_parallel_rank {
        Some(r) => en::write_uint(&mut w, u64::from(r)).map(|_| ()).unwrap(),
        None => en::write_nil(&mut w).unwrap(),
    }
    w
}
