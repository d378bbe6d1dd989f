//! Target (b): raw engine messages → `Partition::ingest` → index, differential against the
//! naive model (`engine/tests/common/model.rs`).
//!
//! The input drives an [`Unstructured`]: a partition shape (block size 1–4, with or
//! without a cache namespace), then up to [`MAX_MESSAGES`] messages, each a header —
//! worker (1–3), stream (0–2), a sequence-number mode (in order, duplicate, gap, restart,
//! late join, near `u64::MAX`, anything), a topic — and a payload that is
//! - mostly a *structured* `KVEventBatch` (REFERENCE.md §2): a DP rank (the stream's, none,
//!   another, a large one) and up to 6 events — stores of chains of blocks whose tokens
//!   come from a 4-token vocabulary, continuing earlier stores of the rank, with unknown
//!   parents, LoRA names, other block sizes, content-addressed / colliding / arbitrary
//!   engine hashes; removes of names the rank holds (right or wrong tier), of other known
//!   or unknown hashes; clears; each worker's engine plain or hybrid (an attention group
//!   and a Mamba group, group 0 or 1: `hybrid`), whose recurrent group stores states at
//!   some blocks of an attention store of the same batch (before or after it), or of
//!   blocks the rank holds (with the token ids of every block spanned, or tokenless, as a
//!   CPU checkpoint) and removes them — encoded with `rmp` as tagged maps or positional arrays
//!   (hashes as uint64, int64 or bin; optional fields present or absent; unknown keys and
//!   trailing fields; `ts` as float or int; a 2-element batch without rank);
//! - sometimes such a payload with one byte flipped, inserted or removed, or cut short;
//! - sometimes raw bytes.
//!
//! The model side replicates `ingest.rs` / `sequence.rs` for a raw stream (no replay): per
//! stream the last sequence number and the DP ranks its batches named; in order → apply; a
//! repeated number with the payload applied last → dropped (another payload: a restart);
//! a gap or a restart → clear the ranks the stream fed (none if it applied nothing), then
//! apply. Applying decodes the payload (a
//! structured payload must decode to exactly the events it encodes; for the others the
//! decoder, fuzzed on its own by target (a), is the oracle of what they say): a failed
//! decode applies nothing; otherwise events go to rank `(worker, dp or stream)`; a store
//! of another block size is refused; local hashes are `local_block_hash(tokens,
//! HashSalt::new(lora_name, namespace))`; each event's group gets its verdict from the
//! group rule (`groups`, written again); the events are applied to the model, whose
//! semantics are the index's (unknown parent → refused; unknown removes ignored), a
//! recurrent group's events as states after the batch's other events, in batch order
//! (their unknown names counted as a tokenless store's, in no block counter).
//!
//! After every message, any difference is a panic: the `IngestOutcome`; every stream's
//! `StreamStats` (messages, bytes, batches, events, blocks stored/removed, refusals,
//! block-size mismatches, decode errors by cause, sequence counters); the index's rank
//! list and the batch's rank's stats (holder and tier blocks, event and refusal
//! counters), and all stats in total and per rank (also nodes) after every 4th message
//! and after every clear; prefix queries (device and tiered, by sequence and by local
//! hashes) for the chains the message stored and for earlier ones. At the end every worker is removed and the
//! index must be empty.
//!
//! The partition is reused by every input of its shape (block size, namespace): each
//! input checks it starts empty (no rank, node or holder, no ingress stream) and leaves it
//! so (its workers removed), and the model starts from the index's event totals.

use std::cell::RefCell;
use std::collections::BTreeMap;

use arbitrary::{Result, Unstructured};
use kvr::config::PartitionConfig;
use kvr::hash::{local_block_hash_mm, lookahead_key, HashSalt};

use kvr::ingress::{
    decode_batch, DecodeErrorKind, DecodedBatch, DecodedEvent, HealthReason, Medium, SpecKind,
};
use kvr::stats::StreamStats;
use kvr::{IngestOutcome, KvEvent, RankId, StoredBlock, Tier, WorkerId, WorkerInfo};
use kvr::{Partition, PartitionKey};

use crate::check::{check_all, Links, Scratch};
use crate::model::Model;

mod groups;
mod hybrid;

use groups::GroupModel;
use hybrid::Layout;

/// Messages per input at most.
pub const MAX_MESSAGES: usize = 48;
/// Worker ids are 1..=WORKERS.
const WORKERS: u64 = 3;
/// Streams are 0..STREAMS.
const STREAMS: u32 = 3;
/// Engine hashes remembered per worker (for parents and removes).
const KNOWN: usize = 48;

/// One event as the harness means it (and as a decoded payload says it).
#[derive(Clone, Debug, PartialEq)]
pub enum Ev {
    Stored {
        medium: Medium,
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        /// `None` for absent / nil / empty (the decoder's reading).
        lora: Option<String>,
        /// Each block's extra-key values (`kvr::hash`); empty when none has any.
        extras: Extras,
        /// Each block's lookahead tokens; empty when the engine hashes without lookahead.
        lookahead: Vec<Vec<u32>>,
        /// KV-cache group and its kind (never `Recurrent` with blocks: the decoder reads
        /// a recurrent group's store as tokenless).
        group: Option<u32>,
        spec: SpecKind,
    },
    /// A store named by engine hashes only: an offloading connector's placeholder (no
    /// token ids), or a recurrent group's store (with or without token ids).
    Tokenless {
        medium: Medium,
        hashes: Vec<u64>,
        group: Option<u32>,
        spec: SpecKind,
        /// What else the generator wrote (parent, token ids, block size), which the
        /// decoder does not give back.
        wire: Unread<TokenlessWire>,
    },
    Removed {
        medium: Medium,
        hashes: Vec<u64>,
        group: Option<u32>,
    },
    Cleared,
    /// A store the decoder reads as unusable (never generated; garbage may decode to it).
    Malformed,
}

/// A value the generator wrote that a decoded batch does not carry: equal to anything.
#[derive(Clone, Debug, Default)]
pub struct Unread<T>(pub T);

impl<T> PartialEq for Unread<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A tokenless store's fields beyond its names, as written (a recurrent group's store in
/// vLLM's align mode: token ids of every block its names span, its block size).
#[derive(Clone, Debug, Default)]
pub struct TokenlessWire {
    pub parent: Option<u64>,
    pub tokens: Vec<u32>,
    pub block_size: u32,
}

/// A store's extra keys: the values the model expects (compared with the decoder's) and
/// the wire form the generator writes (not compared: the decoder cannot give it back).
#[derive(Clone, Debug, Default)]
pub struct Extras {
    pub values: Vec<Vec<u64>>,
    wire: Option<V>,
}

impl PartialEq for Extras {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl Extras {
    /// Block `k`'s values.
    fn of(&self, k: usize) -> &[u64] {
        self.values.get(k).map_or(&[], Vec::as_slice)
    }

    /// vLLM 0.33's shapes for `n` blocks: nil, all-nil, per block the LoRA name (dropped)
    /// and an image with its offset, or a cache salt on block 0 only; the values follow
    /// the rule in `kvr::hash`, computed from its key functions.
    fn gen(u: &mut Unstructured<'_>, n: usize, lora_raw: &Option<String>) -> Result<Self> {
        use kvr::hash::{cache_salt_key, mm_key, opaque_key};
        let lora_v = lora_raw.clone().map_or(V::Nil, V::S);
        // "" is no LoRA name, so it is a cache salt; a real name is dropped.
        let lora_value = lora_raw
            .as_deref()
            .filter(|l| l.is_empty())
            .map(|l| cache_salt_key(l.as_bytes()));
        let (wire, mut values) = match pick(u, &[3, 1, 2, 1, 1])? {
            0 => (None, Vec::new()),
            1 => (Some(V::A((0..n).map(|_| V::Nil).collect())), Vec::new()),
            2 => {
                let img = ["a", "b"][u.choose_index(2)?];
                let wire = (0..n)
                    .map(|k| V::A(vec![lora_v.clone(), V::A(vec![s(img), V::I(k as i64 - 1)])]))
                    .collect();
                let values = (0..n)
                    .map(|k| {
                        lora_value
                            .into_iter()
                            .chain([mm_key(img.as_bytes(), k as i64 - 1)])
                            .collect()
                    })
                    .collect();
                (Some(V::A(wire)), values)
            }
            3 => {
                let wire = (0..n)
                    .map(|k| {
                        if k == 0 {
                            V::A(vec![s("salt")])
                        } else {
                            V::Nil
                        }
                    })
                    .collect();
                let values = (0..n)
                    .map(|k| {
                        if k == 0 {
                            vec![cache_salt_key(b"salt")]
                        } else {
                            Vec::new()
                        }
                    })
                    .collect();
                (Some(V::A(wire)), values)
            }
            // A shape kvr does not know (an int): opaque, never matched by a request.
            _ => (
                Some(V::A((0..n).map(|_| V::A(vec![V::I(-1)])).collect())),
                (0..n).map(|_| vec![opaque_key(&[0xff])]).collect(),
            ),
        };
        if values.iter().all(Vec::is_empty) {
            values.clear();
        }
        Ok(Extras { values, wire })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub dp: Option<u32>,
    pub events: Vec<Ev>,
}

impl Batch {
    fn from_decoded(b: &DecodedBatch) -> Self {
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
                    extras,
                    lookahead,
                    group,
                    spec,
                } => Ev::Stored {
                    medium: *medium,
                    parent: *parent,
                    hashes: b.hashes[hashes.clone()].to_vec(),
                    tokens: b.tokens[tokens.clone()].to_vec(),
                    block_size: *block_size,
                    lora: lora_name.clone().map(|r| b.text[r].to_owned()),
                    extras: Extras {
                        values: (0..hashes.len())
                            .filter(|_| !extras.is_empty())
                            .map(|k| b.block_extra_keys(extras, k).to_vec())
                            .collect(),
                        wire: None,
                    },
                    lookahead: (0..hashes.len())
                        .filter(|_| !lookahead.is_empty())
                        .map(|k| b.block_lookahead_tokens(lookahead, k).to_vec())
                        .collect(),
                    group: *group,
                    spec: *spec,
                },
                DecodedEvent::Tokenless {
                    hashes,
                    medium,
                    group,
                    spec,
                } => Ev::Tokenless {
                    medium: *medium,
                    hashes: b.hashes[hashes.clone()].to_vec(),
                    group: *group,
                    spec: *spec,
                    wire: Unread::default(),
                },
                DecodedEvent::Removed {
                    hashes,
                    medium,
                    group,
                } => Ev::Removed {
                    medium: *medium,
                    hashes: b.hashes[hashes.clone()].to_vec(),
                    group: *group,
                },
                DecodedEvent::Cleared => Ev::Cleared,
                DecodedEvent::Malformed { .. } => Ev::Malformed,
            })
            .collect();
        Batch {
            dp: b.data_parallel_rank,
            events,
        }
    }
}

/// The tier of a medium (`None`: unknown, the event is skipped and counted).
fn tier(m: Medium) -> Option<Tier> {
    match m {
        Medium::Gpu => Some(Tier::Device),
        Medium::Cpu => Some(Tier::Host),
        Medium::Storage => Some(Tier::Disk),
        Medium::Unknown => None,
    }
}

/// A weighted choice: index `i` with probability `w[i] / sum(w)`.
fn pick(u: &mut Unstructured<'_>, w: &[u32]) -> Result<usize> {
    let total: u32 = w.iter().sum();
    let mut r = u.int_in_range(0..=total - 1)?;
    for (i, &x) in w.iter().enumerate() {
        if r < x {
            return Ok(i);
        }
        r -= x;
    }
    Ok(w.len() - 1)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

// ---------------------------------------------------------------------------------------
// msgpack encoding of structured batches

/// A msgpack value, encoded with `rmp::encode`.
#[derive(Clone, Debug)]
enum V {
    Nil,
    Bool(bool),
    /// Smallest unsigned encoding.
    U(u64),
    /// Forced uint64 marker.
    U64(u64),
    /// Smallest signed encoding.
    I(i64),
    F64(f64),
    F32(f32),
    S(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn s(x: &str) -> V {
    V::S(x.to_owned())
}

fn write(w: &mut Vec<u8>, v: &V) {
    use rmp::encode as en;
    match v {
        V::Nil => en::write_nil(w).unwrap(),
        V::Bool(b) => en::write_bool(w, *b).unwrap(),
        V::U(x) => {
            en::write_uint(w, *x).unwrap();
        }
        V::U64(x) => en::write_u64(w, *x).unwrap(),
        V::I(x) => {
            en::write_sint(w, *x).unwrap();
        }
        V::F64(x) => en::write_f64(w, *x).unwrap(),
        V::F32(x) => en::write_f32(w, *x).unwrap(),
        V::S(x) => en::write_str(w, x).unwrap(),
        V::Bin(x) => en::write_bin(w, x).unwrap(),
        V::A(xs) => {
            en::write_array_len(w, xs.len() as u32).unwrap();
            for x in xs {
                write(w, x);
            }
        }
        V::M(kv) => {
            en::write_map_len(w, kv.len() as u32).unwrap();
            for (k, x) in kv {
                write(w, k);
                write(w, x);
            }
        }
    }
}

/// An engine hash in one of the wire forms a decoder must accept.
fn hash_v(u: &mut Unstructured<'_>, h: u64) -> Result<V> {
    Ok(match pick(u, &[6, 2, 2, 2, 1, 1])? {
        0 => V::U(h),
        1 => V::U64(h),
        // SGLang: int64 (its bits are the hash).
        2 => V::I(h as i64),
        // vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: a 32-byte digest, hash = last 8.
        3 => {
            let mut d = vec![0x5au8; 32];
            d[24..].copy_from_slice(&h.to_be_bytes());
            V::Bin(d)
        }
        4 => V::Bin(h.to_be_bytes().to_vec()),
        // A short bin: left-padded with zeros.
        _ => {
            let b = h.to_be_bytes();
            let skip = b.iter().take_while(|x| **x == 0).count();
            V::Bin(b[skip..].to_vec())
        }
    })
}

fn hashes_v(u: &mut Unstructured<'_>, hs: &[u64]) -> Result<V> {
    let mut out = Vec::with_capacity(hs.len());
    for &h in hs {
        out.push(hash_v(u, h)?);
    }
    Ok(V::A(out))
}

/// `medium` as written; `None` = may be omitted (GPU, the default).
fn medium_v(u: &mut Unstructured<'_>, m: Medium) -> Result<V> {
    Ok(match m {
        Medium::Gpu => match pick(u, &[3, 2, 1, 1])? {
            0 => s("GPU"),
            1 => V::Nil,
            2 => s("gpu"),
            _ => s("DEVICE"),
        },
        Medium::Cpu => match pick(u, &[4, 1, 1, 1])? {
            0 => s("CPU"),
            1 => s("cpu"),
            2 => s("CPU_PINNED"),
            _ => s("CPU_TIER1"),
        },
        Medium::Storage => match pick(u, &[2, 2, 1, 1, 1])? {
            0 => s("STORAGE"),
            1 => s("DISK"),
            2 => s("Storage"),
            3 => s("CPU_TIER2"),
            _ => s(["NVME", "EXTERNAL", "NETWORK", "REMOTE", "SHARED"][pick(u, &[1; 5])?]),
        },
        // Names no table has: the event is skipped, the batch applies.
        Medium::Unknown => s(["HBM", "", "GPU2"][pick(u, &[1, 1, 1])?]),
    })
}

fn group_v(g: Option<u32>) -> V {
    g.map_or(V::Nil, |g| V::U(u64::from(g)))
}

/// A group's `kv_cache_spec_kind` in one of the spellings that read as `spec`.
fn spec_v(u: &mut Unstructured<'_>, spec: SpecKind) -> Result<V> {
    let names: &[&str] = match spec {
        SpecKind::Unspecified => return Ok(V::Nil),
        SpecKind::FullAttention => &[
            "full_attention",
            "mla_attention",
            "sink_full_attention",
            "FULL_ATTENTION",
        ],
        SpecKind::Recurrent => &["mamba", "Mamba"],
        SpecKind::Other => &[
            "sliding_window",
            "chunked_local_attention",
            "linear_attention",
        ],
    };
    Ok(s(names[u.choose_index(names.len())?]))
}

/// A value of a newer engine's field (any shape).
fn unknown_v(u: &mut Unstructured<'_>) -> Result<V> {
    Ok(match pick(u, &[1, 1, 1, 1, 1])? {
        0 => V::Nil,
        1 => V::M(vec![(s("x"), V::A(vec![V::U(1), V::Nil, V::F64(0.5)]))]),
        2 => V::Bin(vec![0xc1, 0xff]),
        3 => V::I(-5),
        _ => V::A(vec![V::Bool(true), s("future")]),
    })
}

/// A stored event's 15 positional fields (REFERENCE.md §2 order) and how many leading
/// ones must be written (the rest are at their defaults).
fn stored_fields(u: &mut Unstructured<'_>, ev: &Ev, lora_raw: &Option<String>) -> Result<Vec<V>> {
    let Ev::Stored {
        medium,
        parent,
        hashes,
        tokens,
        block_size,
        extras,
        lookahead,
        group,
        spec,
        ..
    } = ev
    else {
        unreachable!()
    };
    let lora_v = match lora_raw {
        None => V::Nil,
        Some(l) => V::S(l.clone()),
    };
    let extra_keys = extras.wire.clone().unwrap_or(V::Nil);
    let fields = vec![
        hashes_v(u, hashes)?,
        match parent {
            None => V::Nil,
            Some(p) => hash_v(u, *p)?,
        },
        V::A(tokens.iter().map(|&t| V::U(u64::from(t))).collect()),
        V::U(u64::from(*block_size)),
        if u.ratio(1, 4)? { V::U(3) } else { V::Nil },
        medium_v(u, *medium)?,
        lora_v,
        extra_keys,
        group_v(*group),
        spec_v(u, *spec)?,
        if u.ratio(1, 3)? { V::U(128) } else { V::Nil },
        if u.ratio(1, 3)? { s("LOCAL") } else { V::Nil },
        V::Nil,
        if u.ratio(1, 4)? {
            s("session-1")
        } else {
            V::Nil
        },
        // Lookahead tokens: one list per block, as vLLM sends them.
        if lookahead.is_empty() {
            V::Nil
        } else {
            V::A(
                lookahead
                    .iter()
                    .map(|t| V::A(t.iter().map(|&x| V::U(u64::from(x))).collect()))
                    .collect(),
            )
        },
    ];
    Ok(fields)
}

const STORED_KEYS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

fn event_v(u: &mut Unstructured<'_>, ev: &Ev, lora_raw: &Option<String>) -> Result<V> {
    let tagged = u.ratio(3, 5)?;
    let min = min_fields(ev, lora_raw);
    let (tag, fields, keys): (&str, Vec<V>, &[&str]) = match ev {
        Ev::Stored { .. } => (
            "BlockStored",
            stored_fields(u, ev, lora_raw)?,
            &STORED_KEYS[..],
        ),
        Ev::Removed {
            medium,
            hashes,
            group,
        } => {
            let f = vec![
                hashes_v(u, hashes)?,
                medium_v(u, *medium)?,
                group_v(*group),
                if u.ratio(1, 3)? { s("LOCAL") } else { V::Nil },
                V::Nil,
            ];
            (
                "BlockRemoved",
                f,
                &[
                    "block_hashes",
                    "medium",
                    "group_idx",
                    "locality",
                    "ownership",
                ][..],
            )
        }
        Ev::Tokenless {
            medium,
            hashes,
            group,
            spec,
            wire,
        } => {
            // vLLM's placeholder: hashes, no tokens, block size 0, a medium; the rest nil.
            // A recurrent group's store: its parent, the token ids of every block its
            // names span, its block size.
            let mut f = vec![
                hashes_v(u, hashes)?,
                match wire.0.parent {
                    None => V::Nil,
                    Some(p) => hash_v(u, p)?,
                },
                V::A(wire.0.tokens.iter().map(|&t| V::U(u64::from(t))).collect()),
                V::U(u64::from(wire.0.block_size)),
                V::Nil,
                medium_v(u, *medium)?,
                V::Nil,
                V::Nil,
                group_v(*group),
                spec_v(u, *spec)?,
            ];
            f.resize(STORED_KEYS.len(), V::Nil);
            ("BlockStored", f, &STORED_KEYS[..])
        }
        Ev::Cleared => ("AllBlocksCleared", Vec::new(), &[][..]),
        Ev::Malformed => unreachable!("the generator makes no unusable store"),
    };
    if tagged {
        // Current vLLM: "type" plus one key per field; a field may be absent only when it
        // is at its default (medium GPU, nil parent / lora, no blocks).
        let mut entries = vec![(s("type"), s(tag))];
        for (i, (k, v)) in keys.iter().zip(fields).enumerate() {
            if !significant(ev, lora_raw, i) && u.ratio(1, 3)? {
                continue;
            }
            entries.push((s(k), v));
        }
        if u.ratio(1, 6)? {
            entries.push((s("zz_future_field"), unknown_v(u)?));
        }
        if u.ratio(1, 10)? {
            // A non-string key (skipped).
            entries.push((V::U(7), s("seven")));
        }
        if u.ratio(1, 8)? {
            // A key of the other event type (skipped): "token_ids" on a remove etc.
            entries.push((s("token_ids"), V::A(vec![V::U(1)])));
            if matches!(ev, Ev::Stored { .. } | Ev::Tokenless { .. }) {
                entries.pop();
                entries.push((s("group"), V::U(1)));
            }
        }
        let n = entries.len();
        if n > 1 && u.ratio(1, 4)? {
            // Keys in another order ("type" not first).
            let k = u.int_in_range(1..=n - 1)?;
            entries.rotate_left(k);
        }
        Ok(V::M(entries))
    } else {
        // Older vLLM / SGLang: [tag, field...] with trailing defaults omitted.
        let len = u.int_in_range(min..=fields.len())?;
        let mut arr = vec![s(tag)];
        arr.extend(fields.into_iter().take(len));
        if len == keys.len() && u.ratio(1, 3)? {
            arr.push(unknown_v(u)?);
        }
        Ok(V::A(arr))
    }
}

/// Whether field `i` (positional order) of `ev` is not at its default, so it must be
/// written (the others may be left out of a tagged map or off the end of an array).
fn significant(ev: &Ev, lora_raw: &Option<String>, i: usize) -> bool {
    match ev {
        Ev::Stored {
            medium,
            parent,
            hashes,
            tokens,
            block_size,
            extras,
            lookahead,
            group,
            spec,
            ..
        } => match i {
            0 => !hashes.is_empty(),
            1 => parent.is_some(),
            2 => !tokens.is_empty(),
            3 => *block_size != 0,
            5 => *medium != Medium::Gpu,
            6 => lora_raw.as_deref().is_some_and(|l| !l.is_empty()),
            7 => !extras.values.is_empty(),
            8 => group.is_some(),
            9 => *spec != SpecKind::Unspecified,
            14 => !lookahead.is_empty(),
            _ => false,
        },
        Ev::Removed {
            medium,
            hashes,
            group,
        } => match i {
            0 => !hashes.is_empty(),
            1 => *medium != Medium::Gpu,
            2 => group.is_some(),
            _ => false,
        },
        // A tokenless store must show its token ids, empty or not (or a reader could not
        // tell it from a store of nothing); its medium is field 5, its group 8 and 9.
        Ev::Tokenless {
            medium,
            group,
            spec,
            ..
        } => match i {
            0..=2 => true,
            5 => *medium != Medium::Gpu,
            8 => group.is_some(),
            9 => *spec != SpecKind::Unspecified,
            _ => false,
        },
        Ev::Cleared | Ev::Malformed => false,
    }
}

/// How many leading positional fields of `ev` must be written.
fn min_fields(ev: &Ev, lora_raw: &Option<String>) -> usize {
    (0..15)
        .rev()
        .find(|&i| significant(ev, lora_raw, i))
        .map_or(0, |i| i + 1)
}

/// Encodes `b` (whose stores' LoRA names as written are `loras`).
fn encode(
    u: &mut Unstructured<'_>,
    b: &Batch,
    loras: &[Option<String>],
    msg: usize,
) -> Result<Vec<u8>> {
    let ts = match pick(u, &[4, 1, 1])? {
        0 => V::F64(1.7e9 + msg as f64 * 0.25),
        1 => V::U(1_700_000_000 + msg as u64),
        _ => V::F32(msg as f32),
    };
    let mut events = Vec::with_capacity(b.events.len());
    for (ev, lora) in b.events.iter().zip(loras) {
        events.push(event_v(u, ev, lora)?);
    }
    let mut top = vec![ts, V::A(events)];
    match b.dp {
        Some(d) => top.push(V::U(u64::from(d))),
        // Older payloads have no rank element.
        None if u.ratio(1, 3)? => {}
        None => top.push(V::Nil),
    }
    if top.len() == 3 && u.ratio(1, 8)? {
        top.push(unknown_v(u)?);
    }
    let mut w = Vec::new();
    write(&mut w, &V::A(top));
    Ok(w)
}

// ---------------------------------------------------------------------------------------
// The harness

/// The model of one stream (`IngressStream` for a raw stream), with the counters it must
/// report.
struct StreamModel {
    groups: GroupModel,
    last: Option<u64>,
    /// The payload of the batch applied last (the same seq with another payload is a
    /// restart, the same payload a duplicate).
    last_payload: Vec<u8>,
    ranks_seen: Vec<u32>,
    stats: StreamStats,
    /// Health (`kvr::ingress::health`, rules written again for a raw stream): batches
    /// were lost and no batch applied since; the last batch did not decode.
    cleared: bool,
    decode_failed: bool,
}

struct Harness {
    p: &'static Partition,
    bs: u32,
    namespace: Option<String>,
    model: Model,
    links: Links,
    scratch: Scratch,
    /// In registration order (as `ingress_stats` lists them).
    streams: Vec<StreamModel>,
    /// Per worker (index `w - 1`): engine hashes of stores generated so far.
    known: Vec<Vec<u64>>,
    /// Per rank: the last engine hash of recent stores (chain tails to continue).
    tails: BTreeMap<RankId, Vec<u64>>,
    /// Per worker (index `w - 1`): its engine's KV-cache groups.
    layouts: Vec<Layout>,
    touched: Vec<u64>,
    msg: usize,
    sum: Summary,
}

#[derive(Clone, Copy, Debug)]
enum PayloadKind {
    Structured,
    Mutated,
    Raw,
}

/// What a run exercised (the replay test checks the committed seeds cover every path).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub messages: u64,
    pub structured: u64,
    pub batches_applied: u64,
    pub decode_errors: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub restarts: u64,
    /// Stream clears that emptied at least one rank holding blocks.
    pub effective_clears: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub events_rejected: u64,
    pub block_size_mismatches: u64,
    /// Stores with a LoRA name and blocks that reached the index (right block size).
    pub lora_stores: u64,
    pub queries: u64,
    pub device_hits: u64,
    pub lower_tier_hits: u64,
    /// Blocks a tokenless store put on a tier, and stores with lookahead that applied.
    pub tokenless_blocks: u64,
    pub lookahead_stores: u64,
    /// Recurrent states stored and removed; state stores that named a block the batch
    /// stored after them (applied in order, they would have missed it).
    pub states_stored: u64,
    pub states_removed: u64,
    pub states_late: u64,
    /// Queries a hybrid rank scored on the device, and ones where its states cut a score.
    pub state_hits: u64,
    pub state_cuts: u64,
}

impl Summary {
    /// Every counter, by name.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("messages", self.messages),
            ("structured", self.structured),
            ("batches_applied", self.batches_applied),
            ("decode_errors", self.decode_errors),
            ("duplicates", self.duplicates),
            ("gaps", self.gaps),
            ("restarts", self.restarts),
            ("effective_clears", self.effective_clears),
            ("blocks_stored", self.blocks_stored),
            ("blocks_removed", self.blocks_removed),
            ("events_rejected", self.events_rejected),
            ("block_size_mismatches", self.block_size_mismatches),
            ("lora_stores", self.lora_stores),
            ("queries", self.queries),
            ("device_hits", self.device_hits),
            ("lower_tier_hits", self.lower_tier_hits),
            ("tokenless_blocks", self.tokenless_blocks),
            ("lookahead_stores", self.lookahead_stores),
            ("states_stored", self.states_stored),
            ("states_removed", self.states_removed),
            ("states_late", self.states_late),
            ("state_hits", self.state_hits),
            ("state_cuts", self.state_cuts),
        ]
    }

    /// Field-wise sum.
    pub fn add(&mut self, o: &Summary) {
        let Summary {
            messages,
            structured,
            batches_applied,
            decode_errors,
            duplicates,
            gaps,
            restarts,
            effective_clears,
            blocks_stored,
            blocks_removed,
            events_rejected,
            block_size_mismatches,
            lora_stores,
            queries,
            device_hits,
            lower_tier_hits,
            tokenless_blocks,
            lookahead_stores,
            states_stored,
            states_removed,
            states_late,
            state_hits,
            state_cuts,
        } = o;
        self.messages += messages;
        self.tokenless_blocks += tokenless_blocks;
        self.lookahead_stores += lookahead_stores;
        self.states_stored += states_stored;
        self.states_removed += states_removed;
        self.states_late += states_late;
        self.state_hits += state_hits;
        self.state_cuts += state_cuts;
        self.structured += structured;
        self.batches_applied += batches_applied;
        self.decode_errors += decode_errors;
        self.duplicates += duplicates;
        self.gaps += gaps;
        self.restarts += restarts;
        self.effective_clears += effective_clears;
        self.blocks_stored += blocks_stored;
        self.blocks_removed += blocks_removed;
        self.events_rejected += events_rejected;
        self.block_size_mismatches += block_size_mismatches;
        self.lora_stores += lora_stores;
        self.queries += queries;
        self.device_hits += device_hits;
        self.lower_tier_hits += lower_tier_hits;
    }
}

/// Runs one input; panics on a finding.
pub fn run(data: &[u8]) {
    run_summary(data);
}

/// [`run`], returning what the input exercised.
pub fn run_summary(data: &[u8]) -> Summary {
    let mut u = Unstructured::new(data);
    let Ok(mut h) = Harness::new(&mut u) else {
        return Summary::default();
    };
    while h.msg < MAX_MESSAGES && !u.is_empty() {
        if h.message(&mut u).is_err() {
            break;
        }
    }
    h.finish()
}

thread_local! {
    /// One partition per shape (block size, namespace), reused by every input of that
    /// shape: building one (its index's 256 shard tables, the booking table's shards) per
    /// input cost more than running most inputs. An input leaves its partition empty
    /// ([`Harness::finish`]: every worker removed from the index, checked, then from the
    /// partition, which drops its ingress streams), and the next input checks it starts
    /// empty ([`partition_for`]).
    static PARTITIONS: RefCell<[Option<&'static Partition>; 8]> = const { RefCell::new([None; 8]) };
}

/// The reused partition of shape (`bs`, `namespace`), checked empty (no rank, node or
/// holder; no ingress stream); its index's event and refusal totals (kept across inputs,
/// as across removed ranks) seed the model's.
pub(crate) fn partition_for(
    bs: u32,
    namespace: Option<&str>,
    model: &mut Model,
) -> &'static Partition {
    assert!((1..=4).contains(&bs));
    let shape = (bs as usize - 1) * 2 + usize::from(namespace.is_some());
    let p = PARTITIONS.with(|c| {
        *c.borrow_mut()[shape].get_or_insert_with(|| {
            let mut cfg = PartitionConfig::new(bs);
            cfg.cache_namespace = namespace.map(str::to_owned);
            Box::leak(Box::new(Partition::new(
                PartitionKey::new("model", "group"),
                cfg,
            )))
        })
    });
    crate::check::start_on_reused(p.index(), "partition's index", model);
    assert!(
        p.ingress_stats().is_empty(),
        "a reused partition must start without ingress streams"
    );
    p
}

/// Leaves a reused partition empty for the next input: removes `workers` (registered
/// only to be removed: ingest needs no registration), which drops their index ranks and
/// their ingress streams.
pub(crate) fn release_partition(p: &Partition, workers: impl IntoIterator<Item = WorkerId>) {
    for w in workers {
        p.upsert_worker(WorkerInfo::new(w, 1))
            .expect("a plain worker is valid");
        assert!(p.remove_worker(w));
    }
}

impl Harness {
    fn new(u: &mut Unstructured<'_>) -> Result<Self> {
        let bs = [2, 1, 4, 3][pick(u, &[4, 2, 2, 1])?];
        let namespace = u.ratio(1, 4)?.then(|| "tenant-a".to_owned());
        let mut layouts = Vec::with_capacity(WORKERS as usize);
        for _ in 0..WORKERS {
            layouts.push(Layout::gen(u)?);
        }
        let mut model = Model::new();
        let p = partition_for(bs, namespace.as_deref(), &mut model);
        Ok(Harness {
            p,
            bs,
            namespace,
            model,
            links: Links::default(),
            scratch: Scratch::default(),
            streams: Vec::new(),
            known: vec![Vec::new(); WORKERS as usize],
            tails: BTreeMap::new(),
            layouts,
            touched: Vec::new(),
            msg: 0,
            sum: Summary::default(),
        })
    }

    fn stream_index(&mut self, w: WorkerId, st: u32) -> usize {
        if let Some(i) = self
            .streams
            .iter()
            .position(|s| s.stats.worker_id == w && s.stats.stream == st)
        {
            return i;
        }
        self.streams.push(StreamModel {
            groups: GroupModel::default(),
            last: None,
            last_payload: Vec::new(),
            ranks_seen: Vec::new(),
            stats: StreamStats {
                worker_id: w,
                stream: st,
                decode_errors: DecodeErrorKind::ALL.iter().map(|k| (k.name(), 0)).collect(),
                ..StreamStats::default()
            },
            cleared: false,
            decode_failed: false,
        });
        self.streams.len() - 1
    }

    fn remember(&mut self, w: WorkerId, rank: RankId, hashes: &[u64]) {
        let k = &mut self.known[(w - 1) as usize];
        for &h in hashes {
            if !k.contains(&h) {
                if k.len() == KNOWN {
                    k.remove(0);
                }
                k.push(h);
            }
        }
        if let Some(&last) = hashes.last() {
            let t = self.tails.entry(rank).or_default();
            if t.len() == 8 {
                t.remove(0);
            }
            t.push(last);
        }
    }

    fn known_pick(&self, u: &mut Unstructured<'_>, w: WorkerId) -> Result<Option<u64>> {
        let k = &self.known[(w - 1) as usize];
        Ok(if k.is_empty() {
            None
        } else {
            Some(k[u.choose_index(k.len())?])
        })
    }

    fn medium(u: &mut Unstructured<'_>) -> Result<Medium> {
        Ok([Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Unknown][pick(u, &[14, 4, 2, 1])?])
    }

    /// A store on `rank`: returns the event and its LoRA name as written.
    fn gen_store(
        &mut self,
        u: &mut Unstructured<'_>,
        w: WorkerId,
        rank: RankId,
    ) -> Result<(Ev, Option<String>)> {
        let medium = Self::medium(u)?;
        let (group, spec) = self.layouts[(w - 1) as usize].attention(u)?;
        let lora_raw = match pick(u, &[12, 2, 1, 1])? {
            0 => None,
            1 => Some("sql-lora".to_owned()),
            2 => Some("b".to_owned()),
            _ => Some(String::new()),
        };
        let parent = match pick(u, &[4, 5, 1, 1])? {
            0 => None,
            1 => match self.tails.get(&rank) {
                Some(t) if !t.is_empty() => {
                    // Mostly the latest tail.
                    let back = pick(u, &[4, 1, 1])?.min(t.len() - 1);
                    Some(t[t.len() - 1 - back])
                }
                _ => None,
            },
            2 => self.known_pick(u, w)?,
            _ => Some(u.arbitrary::<u64>()?),
        };
        let n = [1usize, 2, 3, 0, 4, 6][pick(u, &[5, 4, 2, 1, 1, 1])?];
        let bs = self.bs;
        let block_size = match pick(u, &[14, 1, 1, 1])? {
            0 => bs,
            1 => bs + 1,
            2 => {
                if bs > 1 {
                    bs - 1
                } else {
                    2
                }
            }
            _ => {
                if n == 0 {
                    0
                } else {
                    bs
                }
            }
        };
        let salt_tag = lora_raw.as_deref().map_or(0, |l| l.len() as u64 + 1);
        let mut tokens = Vec::with_capacity(n * block_size as usize);
        let mut hashes = Vec::with_capacity(n);
        let mut prev_ext = parent.unwrap_or(0x1337);
        for _ in 0..n {
            let start = tokens.len();
            for _ in 0..block_size {
                let t = match pick(u, &[30, 1])? {
                    0 => u.int_in_range(0..=3u32)?,
                    _ => u32::MAX,
                };
                tokens.push(t);
            }
            let mut content = prev_ext ^ salt_tag.wrapping_mul(0x9e37_79b9);
            for &t in &tokens[start..] {
                content = mix(content ^ u64::from(t));
            }
            let h = match pick(u, &[24, 2, 2, 1, 1])? {
                // Content-addressed, as engines do: equal chains, equal hashes.
                0 => content,
                // Colliding small values (a name moves to other content).
                1 => u.int_in_range(0..=5u64)?,
                2 => self.known_pick(u, w)?.unwrap_or(content),
                3 => u.arbitrary::<u64>()?,
                // The same name twice in one event.
                _ => hashes.last().copied().unwrap_or(content),
            };
            hashes.push(h);
            prev_ext = h;
        }
        self.remember(w, rank, &hashes);
        let lora = lora_raw.clone().filter(|l| !l.is_empty());
        let extras = Extras::gen(u, hashes.len(), &lora_raw)?;
        // Speculative lookahead: the two tokens after each block, in its hash (none
        // generated for an empty store: vLLM sends none).
        let lookahead = if !hashes.is_empty() && u.ratio(1, 4)? {
            (0..hashes.len()).map(|k| vec![k as u32, 2]).collect()
        } else {
            Vec::new()
        };
        Ok((
            Ev::Stored {
                medium,
                parent,
                hashes,
                tokens,
                block_size,
                lora,
                extras,
                lookahead,
                group,
                spec,
            },
            lora_raw,
        ))
    }

    /// A tokenless store (an offloading connector's placeholder): names the rank holds on
    /// any tier, mostly onto a slower one, and now and then a name it never stored.
    fn gen_tokenless(&mut self, u: &mut Unstructured<'_>, w: WorkerId, rank: RankId) -> Result<Ev> {
        let medium =
            [Medium::Cpu, Medium::Storage, Medium::Gpu, Medium::Unknown][pick(u, &[6, 3, 2, 1])?];
        let (group, spec) = self.layouts[(w - 1) as usize].attention(u)?;
        let mut names: Vec<u64> = self
            .model
            .rank(rank)
            .map(|rm| rm.names.iter().flat_map(|m| m.keys().copied()).collect())
            .unwrap_or_default();
        names.sort_unstable();
        names.dedup();
        let n = [1usize, 2, 3][pick(u, &[4, 2, 1])?];
        let mut hashes = Vec::with_capacity(n);
        for _ in 0..n {
            hashes.push(match pick(u, &[6, 1])? {
                0 if !names.is_empty() => names[u.choose_index(names.len())?],
                _ => match self.known_pick(u, w)? {
                    Some(h) => h,
                    None => u.arbitrary::<u64>()?,
                },
            });
        }
        Ok(Ev::Tokenless {
            medium,
            hashes,
            group,
            spec,
            wire: Unread(TokenlessWire::default()),
        })
    }

    fn gen_remove(&mut self, u: &mut Unstructured<'_>, w: WorkerId, rank: RankId) -> Result<Ev> {
        let medium = Self::medium(u)?;
        let group = self.layouts[(w - 1) as usize].attention_removal(u)?;
        // Names the rank holds: on the event's tier mostly, else on any tier (wrong tier).
        let mut names: Vec<u64> = Vec::new();
        if let Some(rm) = self.model.rank(rank) {
            if let Some(t) = tier(medium) {
                names.extend(rm.names[t as usize].keys().copied());
            }
            if names.is_empty() || u.ratio(1, 8)? {
                for m in &rm.names {
                    names.extend(m.keys().copied());
                }
            }
        }
        names.sort_unstable();
        names.dedup();
        let n = [1usize, 2, 3, 0, 5][pick(u, &[5, 3, 2, 1, 1])?];
        let mut hashes = Vec::with_capacity(n);
        for _ in 0..n {
            let h = match pick(u, &[8, 2, 1, 1])? {
                0 if !names.is_empty() => names[u.choose_index(names.len())?],
                0 | 1 => match self.known_pick(u, w)? {
                    Some(h) => h,
                    None => u.arbitrary::<u64>()?,
                },
                2 => u.int_in_range(0..=5u64)?,
                _ => u.arbitrary::<u64>()?,
            };
            hashes.push(h);
        }
        // Sometimes a tail first, as an LRU evicts leaves.
        if let Some(t) = self.tails.get(&rank) {
            if !t.is_empty() && u.ratio(1, 4)? {
                hashes.insert(0, t[t.len() - 1]);
            }
        }
        Ok(Ev::Removed {
            medium,
            hashes,
            group,
        })
    }

    fn gen_batch(
        &mut self,
        u: &mut Unstructured<'_>,
        w: WorkerId,
        st: u32,
    ) -> Result<(Batch, Vec<Option<String>>)> {
        let dp = match pick(u, &[6, 3, 2, 2, 1])? {
            0 => Some(st),
            1 => None,
            2 => Some((st + 1) % STREAMS),
            3 => Some(u.int_in_range(0..=4u32)?),
            _ => Some([1000, u32::MAX][u.choose_index(2)?]),
        };
        let rank = RankId::new(w, dp.unwrap_or(st));
        let n = [1usize, 2, 3, 0, 4, 6][pick(u, &[6, 4, 2, 1, 1, 1])?];
        let mut events = Vec::with_capacity(n);
        let mut loras = Vec::with_capacity(n);
        let layout = self.layouts[(w - 1) as usize];
        // Store, remove, clear, tokenless store; then the recurrent group's: an attention
        // store with its states, a store of states alone, a removal of states.
        let weights: &[u32] = if layout.is_hybrid() {
            &[8, 4, 1, 2, 6, 3, 4]
        } else {
            &[12, 6, 1, 2, 1, 1, 1]
        };
        for _ in 0..n {
            match pick(u, weights)? {
                0 => {
                    let (ev, l) = self.gen_store(u, w, rank)?;
                    events.push(ev);
                    loras.push(l);
                }
                4 => {
                    // In group order (the Mamba group first when it is group 0), or not.
                    let (ev, l) = self.gen_store(u, w, rank)?;
                    let states = self.gen_mamba_store(u, w, rank, layout, Some(&ev))?;
                    let mamba_first = matches!(layout, Layout::Hybrid { mamba: 0 });
                    if mamba_first != u.ratio(1, 5)? {
                        events.extend([states, ev]);
                        loras.extend([None, l]);
                    } else {
                        events.extend([ev, states]);
                        loras.extend([l, None]);
                    }
                }
                5 => {
                    events.push(self.gen_mamba_store(u, w, rank, layout, None)?);
                    loras.push(None);
                }
                6 => {
                    events.push(self.gen_mamba_remove(u, w, rank, layout)?);
                    loras.push(None);
                }
                1 => {
                    events.push(self.gen_remove(u, w, rank)?);
                    loras.push(None);
                }
                3 => {
                    events.push(self.gen_tokenless(u, w, rank)?);
                    loras.push(None);
                }
                _ => {
                    events.push(Ev::Cleared);
                    loras.push(None);
                }
            }
        }
        Ok((Batch { dp, events }, loras))
    }

    /// Generates one message and checks it.
    fn message(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let w = u.int_in_range(1..=WORKERS)?;
        let st = u.int_in_range(0..=STREAMS - 1)?;
        let si = self.stream_index(w, st);
        let last = self.streams[si].last;
        let mode = pick(u, &[24, 3, 3, 2, 1, 1, 1])?;
        let seq = match mode {
            0 => last.map_or(0, |l| l.wrapping_add(1)),
            1 => last.unwrap_or(0),
            2 => last.map_or(0, |l| {
                l.saturating_add(u.int_in_range(2..=4u64).unwrap_or(2))
            }),
            3 => u.int_in_range(0..=last.unwrap_or(0).min(2))?,
            // Joining late (first message not 0) or jumping far.
            4 => u.int_in_range(1..=1000u64)?,
            // About to wrap.
            5 => u64::MAX - u.int_in_range(0..=1u64)?,
            _ => u.arbitrary::<u64>()?,
        };
        let topic: &[u8] = [&b""[..], b"kv-events", b"\xff\x00"][pick(u, &[4, 2, 1])?];
        let kind = [
            PayloadKind::Structured,
            PayloadKind::Mutated,
            PayloadKind::Raw,
        ][pick(u, &[16, 2, 2])?];
        // A repeated number is a duplicate only with the same payload (another payload
        // there is a new publisher instance): mostly resend the batch applied last.
        let resend = mode == 1 && last.is_some() && u.ratio(2, 3)?;
        let (payload, intended) = match kind {
            _ if resend => (self.streams[si].last_payload.clone(), None),
            PayloadKind::Raw => {
                let n = u.int_in_range(0..=48usize)?;
                (u.bytes(n)?.to_vec(), None)
            }
            PayloadKind::Structured | PayloadKind::Mutated => {
                let (b, loras) = self.gen_batch(u, w, st)?;
                let mut bytes = encode(u, &b, &loras, self.msg)?;
                if let PayloadKind::Mutated = kind {
                    let i = u.choose_index(bytes.len())?;
                    match pick(u, &[3, 1, 1, 1])? {
                        0 => bytes[i] ^= u.int_in_range(1..=255u8)?,
                        1 => bytes.truncate(i),
                        2 => bytes.insert(i, u.arbitrary::<u8>()?),
                        _ => {
                            bytes.remove(i);
                        }
                    }
                    (bytes, None)
                } else {
                    (bytes, Some(b))
                }
            }
        };
        self.msg += 1;
        self.step(w, st, si, topic, seq, &payload, intended.as_ref(), kind);
        Ok(())
    }

    /// Ingests one message into the partition and the model; compares.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        w: WorkerId,
        st: u32,
        si: usize,
        topic: &[u8],
        seq: u64,
        payload: &[u8],
        intended: Option<&Batch>,
        kind: PayloadKind,
    ) {
        let msg = self.msg;
        let mut db = DecodedBatch::default();
        let decoded = match decode_batch(payload, &mut db) {
            Ok(()) => Ok(Batch::from_decoded(&db)),
            Err(e) => Err(e),
        };
        let ctx = || {
            let shown = &payload[..payload.len().min(512)];
            format!(
                "message {msg}: worker {w} stream {st} seq {seq} ({kind:?} payload of {} bytes, \
                 from {shown:02x?}); decoded {decoded:?}",
                payload.len()
            )
        };
        if let Some(b) = intended {
            assert_eq!(
                decoded.as_ref().ok(),
                Some(b),
                "a well-formed payload does not decode to the events it encodes; {}",
                ctx()
            );
        }

        // The sequence tracker of a raw stream (no replay).
        let sm = &mut self.streams[si];
        sm.stats.messages += 1;
        sm.stats.bytes += payload.len() as u64;
        // A batch that starts by clearing everything is a fence: a gap before it loses
        // nothing that matters (the index is cleared either way).
        let fence = kvr::ingress::starts_with_clear(payload);
        let mut lost = false;
        let (clear, apply) = match sm.last {
            None => (false, true),
            Some(l) if seq == l.wrapping_add(1) => (false, true),
            Some(l) if seq == l && payload == sm.last_payload.as_slice() => {
                sm.stats.sequence.duplicates += 1;
                (false, false)
            }
            Some(l) if seq <= l => {
                sm.stats.sequence.restarts += 1;
                sm.stats.sequence.clears += 1;
                (true, true)
            }
            Some(l) => {
                sm.stats.sequence.gaps += 1;
                if !fence {
                    // A counter saturates; it must never wrap (nor panic on overflow).
                    sm.stats.sequence.batches_lost =
                        sm.stats.sequence.batches_lost.saturating_add(seq - l - 1);
                    lost = true;
                }
                sm.stats.sequence.clears += 1;
                (true, true)
            }
        };
        if apply {
            sm.last = Some(seq);
            sm.last_payload.clear();
            sm.last_payload.extend_from_slice(payload);
        }
        sm.stats.sequence.last_seq = sm.last;

        let got = self.p.ingest(w, st, topic, seq, payload);

        let mut want = IngestOutcome::default();
        self.touched.clear();
        if clear {
            want.clears = 1;
            let emptied = self.clear_fed_ranks(w, si);
            self.sum.effective_clears += u64::from(emptied > 0);
        }
        if apply {
            match &decoded {
                Err(e) => {
                    want.decode_errors = 1;
                    // What the batch held is unknown: the stream's ranks are cleared.
                    want.clears += 1;
                    self.clear_fed_ranks(w, si);
                    let c = self.streams[si]
                        .stats
                        .decode_errors
                        .iter_mut()
                        .find(|c| c.0 == e.kind.name())
                        .expect("every decode error kind is listed");
                    c.1 += 1;
                }
                Ok(b) => {
                    // A batch refused for its DP rank is reported so, not as applied.
                    if self.apply_batch(w, st, si, b) {
                        want.batches_applied = 1;
                    } else {
                        want.refused = 1;
                    }
                }
            }
        }
        // Health: a batch that applies repairs a clear; one that does not decode makes
        // the stream degraded until one does; batches lost for good leave it cleared.
        let sm = &mut self.streams[si];
        if apply {
            sm.decode_failed = decoded.is_err();
            sm.cleared &= decoded.is_err();
        }
        sm.cleared |= lost;
        let reason = if sm.cleared {
            HealthReason::StateCleared
        } else if sm.decode_failed {
            HealthReason::DecodeErrors
        } else {
            HealthReason::InSequence
        };
        sm.stats.health_reason = reason;
        sm.stats.health = reason.health();
        assert_eq!(got, want, "IngestOutcome (engine vs model); {}", ctx());
        self.sum.messages += 1;
        self.sum.structured += u64::from(intended.is_some());
        self.sum.batches_applied += u64::from(want.batches_applied);
        self.sum.decode_errors += u64::from(want.decode_errors);

        // Every stream's counters, in registration order.
        let stats = self.p.ingress_stats();
        assert_eq!(
            stats.len(),
            self.streams.len(),
            "number of ingress streams; {}",
            ctx()
        );
        for (g, m) in stats.iter().zip(&self.streams) {
            let mut want = m.stats.clone();
            assert_eq!(
                g.last_batch_unix_ms > 0,
                want.batches > 0,
                "last_batch_unix_ms set iff a batch applied; {}",
                ctx()
            );
            want.last_batch_unix_ms = g.last_batch_unix_ms;
            // A degraded stream's ranks are listed stale; the times are the engine's.
            assert_eq!(
                (g.stale_since_unix_ms > 0, g.health_reason),
                (want.health_reason.may_overcount(), want.health_reason),
                "stale iff degraded, and why; {}",
                ctx()
            );
            want.stale_since_unix_ms = g.stale_since_unix_ms;
            want.health_since_unix_ms = g.health_since_unix_ms;
            assert_eq!(g, &want, "StreamStats (engine vs model); {}", ctx());
        }

        // Every stat after every 4th message and after a clear of the stream's ranks; the
        // batch's rank after the others.
        let rank = RankId::new(w, decoded.as_ref().ok().and_then(|b| b.dp).unwrap_or(st));
        check_all(
            self.p.index(),
            &self.model,
            &self.links,
            &self.touched,
            msg.wrapping_mul(2_654_435_761),
            clear || msg.is_multiple_of(4),
            &[rank],
            &mut self.scratch,
            &ctx,
        );
    }

    /// What `IngressStream::apply` does with a decoded batch, on the model.
    /// Clears, on the model, the ranks stream `si` of worker `w` fed (none if it applied
    /// nothing); returns the blocks that went.
    fn clear_fed_ranks(&mut self, w: WorkerId, si: usize) -> usize {
        let seen = self.streams[si].ranks_seen.clone();
        let mut emptied = 0;
        for r in self.model.ranks() {
            if r.worker_id == w && seen.contains(&r.dp_rank) {
                emptied += self.model.clear(r);
            }
        }
        emptied
    }

    fn apply_batch(&mut self, w: WorkerId, st: u32, si: usize, b: &Batch) -> bool {
        let dp = b.dp.unwrap_or(st);
        // The workers here are never registered while they publish: a DP rank of
        // MAX_DP_SIZE or more refuses the whole batch, counted, touching nothing else (no
        // rank, no group state, no ranks_seen).
        if dp >= kvr::MAX_DP_SIZE {
            let n = b.events.len() as u64;
            let s = &mut self.streams[si].stats;
            s.batches += 1;
            s.events += n;
            s.events_rejected += n;
            s.dp_rank_refused += 1;
            self.sum.events_rejected += n;
            return false;
        }
        let sm = &mut self.streams[si];
        if !sm.ranks_seen.contains(&dp) {
            sm.ranks_seen.push(dp);
        }
        let rank = RankId::new(w, dp);
        let (mut stored, mut removed, mut rejected, mut mismatched) = (0u64, 0u64, 0u64, 0u64);
        let (mut skipped_group, mut skipped_medium, mut switches) = (0u64, 0u64, 0u64);
        let (mut skipped_malformed, mut tokenless_unknown) = (0u64, 0u64);
        let mut blocks = Vec::new();
        // The recurrent group's events (index, tier, how many of their names the rank
        // resolved when they came), applied once the batch's other events are in.
        let mut states: Vec<(usize, Tier, usize)> = Vec::new();
        for (i, ev) in b.events.iter().enumerate() {
            let medium = match ev {
                Ev::Stored { medium, .. }
                | Ev::Tokenless { medium, .. }
                | Ev::Removed { medium, .. } => *medium,
                Ev::Cleared => Medium::Gpu,
                Ev::Malformed => {
                    skipped_malformed += 1;
                    continue;
                }
            };
            let Some(tier) = tier(medium) else {
                skipped_medium += 1;
                continue;
            };
            let sm = &mut self.streams[si];
            let verdict = match ev {
                Ev::Stored { block_size, .. } if *block_size != self.bs => {
                    mismatched += 1;
                    continue;
                }
                Ev::Stored { group, spec, .. } | Ev::Tokenless { group, spec, .. } => {
                    sm.groups.store(*group, *spec)
                }
                Ev::Removed { group, .. } => sm.groups.remove(*group),
                Ev::Cleared | Ev::Malformed => groups::APPLY,
            };
            if verdict.clear_first {
                switches += 1;
                self.clear_fed_ranks(w, si);
            }
            if !verdict.apply {
                skipped_group += 1;
                continue;
            }
            if verdict.state {
                let resolved = match ev {
                    Ev::Tokenless { hashes, .. } => self.resolved(rank, hashes),
                    _ => 0,
                };
                states.push((i, tier, resolved));
                continue;
            }
            let r = match ev {
                Ev::Stored {
                    parent,
                    hashes,
                    tokens,
                    lora,
                    extras,
                    lookahead,
                    ..
                } => {
                    self.sum.lora_stores += u64::from(lora.is_some() && !hashes.is_empty());
                    self.sum.lookahead_stores += u64::from(!lookahead.is_empty());
                    let salt = HashSalt::new(lora.as_deref(), self.namespace.as_deref());
                    blocks.clear();
                    for (k, &h) in hashes.iter().enumerate() {
                        let bs = self.bs as usize;
                        // The lookahead tokens are one more key value of the block.
                        let mut keys = extras.of(k).to_vec();
                        if let Some(la) = lookahead.get(k) {
                            keys.push(lookahead_key(la));
                        }
                        blocks.push(StoredBlock {
                            external_hash: h,
                            local_hash: local_block_hash_mm(
                                &tokens[k * bs..(k + 1) * bs],
                                &keys,
                                salt,
                            ),
                        });
                    }
                    self.links
                        .record(&self.model, rank, *parent, &blocks, &mut self.touched);
                    self.model.apply(
                        rank,
                        &KvEvent::Stored {
                            tier,
                            parent: *parent,
                            blocks: &blocks,
                        },
                    )
                }
                Ev::Tokenless { hashes, .. } => {
                    let o = self.model.store_known(rank, tier, hashes);
                    tokenless_unknown += o.not_found as u64;
                    self.sum.tokenless_blocks += o.stored as u64;
                    Ok(o)
                }
                Ev::Removed { hashes, .. } => self.model.apply(
                    rank,
                    &KvEvent::Removed {
                        tier,
                        external_hashes: hashes,
                    },
                ),
                Ev::Cleared => self.model.apply(rank, &KvEvent::Cleared),
                Ev::Malformed => unreachable!("skipped above"),
            };
            match r {
                Ok(o) => {
                    stored += o.stored as u64;
                    removed += o.removed as u64;
                }
                // Every refusal counts as one (as the engine's ingest does).
                Err(_) => rejected += 1,
            }
        }
        // States name attention blocks, which the batch may store after them; they count
        // in no block counter, and the names of a store the rank does not hold count as a
        // tokenless store's do. A store of blocks in a recurrent group (one that changed
        // its kind) is skipped as its group's.
        for (i, tier, resolved_then) in states {
            match &b.events[i] {
                Ev::Tokenless { hashes, .. } => {
                    self.sum.states_late += u64::from(self.resolved(rank, hashes) > resolved_then);
                    let o = self.model.store_states(rank, tier, hashes);
                    tokenless_unknown += o.not_found as u64;
                    self.sum.states_stored += o.stored as u64;
                }
                Ev::Removed { hashes, .. } => {
                    let o = self.model.remove_states(rank, tier, hashes);
                    self.sum.states_removed += o.removed as u64;
                }
                Ev::Stored { .. } => skipped_group += 1,
                _ => {}
            }
        }
        let s = &mut self.streams[si].stats;
        s.batches += 1;
        s.events += b.events.len() as u64;
        s.blocks_stored += stored;
        s.blocks_removed += removed;
        s.events_rejected += rejected;
        s.block_size_mismatches += mismatched;
        s.events_skipped_group += skipped_group;
        s.events_skipped_medium += skipped_medium;
        s.events_skipped_malformed += skipped_malformed;
        s.tokenless_blocks_unknown += tokenless_unknown;
        s.group_switches += switches;
        self.sum.blocks_stored += stored;
        self.sum.blocks_removed += removed;
        self.sum.events_rejected += rejected;
        self.sum.block_size_mismatches += mismatched;
        true
    }

    /// How many of `hashes` name a block `rank` holds (on the model).
    fn resolved(&self, rank: RankId, hashes: &[u64]) -> usize {
        self.model.rank(rank).map_or(0, |rm| {
            hashes.iter().filter(|h| rm.resolve(**h).is_some()).count()
        })
    }

    /// Removes every worker: the index must come back to nothing.
    fn finish(mut self) -> Summary {
        for sm in &self.streams {
            self.sum.duplicates += sm.stats.sequence.duplicates;
            self.sum.gaps += sm.stats.sequence.gaps;
            self.sum.restarts += sm.stats.sequence.restarts;
        }
        self.sum.queries = self.scratch.queries;
        self.sum.device_hits = self.scratch.device_hits;
        self.sum.lower_tier_hits = self.scratch.lower_tier_hits;
        self.sum.state_hits = self.scratch.state_hits;
        self.sum.state_cuts = self.scratch.state_cuts;
        let index = self.p.index();
        for w in 1..=WORKERS {
            let want = self.model.remove_worker(w);
            assert_eq!(index.remove_worker(w), want, "remove_worker({w})");
        }
        self.model.self_check();
        crate::model::assert_stats_equal(index, &self.model, &|| {
            "after removing every worker".into()
        });
        let s = index.stats();
        assert_eq!(
            (s.ranks, s.nodes, s.holder_blocks, s.holder_set_bytes),
            (0, 0, 0, 0),
            "an index without ranks holds nothing"
        );
        release_partition(self.p, 1..=WORKERS);
        crate::check::collect_garbage();
        self.sum
    }
}
