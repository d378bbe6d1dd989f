//! One event: its type, its known fields (tagged-map or positional encoding), each field
//! decoded and type-checked, and the event appended to the batch.

use std::ops::Range;

use rmp::Marker;

use super::batch::{DecodedBatch, DecodedEvent, Medium, SpecKind};
use super::cursor::Cursor;
use super::error::{DecodeError, DecodeErrorKind as K, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Stored,
    Removed,
    Cleared,
}

impl EventType {
    fn from_tag(tag: &[u8]) -> Result<Self> {
        match tag {
            b"BlockStored" => Ok(Self::Stored),
            b"BlockRemoved" => Ok(Self::Removed),
            b"AllBlocksCleared" => Ok(Self::Cleared),
            _ => Err(DecodeError::new(
                K::UnknownEventType,
                "event type is not BlockStored, BlockRemoved or AllBlocksCleared",
            )),
        }
    }

    /// The event's fields in wire (positional) order, REFERENCE.md §2.
    fn fields(self) -> &'static [Field] {
        match self {
            Self::Stored => &STORED_FIELDS,
            Self::Removed => &REMOVED_FIELDS,
            Self::Cleared => &[],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    Ownership,
    SessionId,
    LookaheadTokenIds,
    /// SGLang 0.5's `cache_salt` (tagged maps only: SGLang has no positional encoding).
    CacheSalt,
}

const STORED_FIELDS: [Field; 15] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
    Field::KvCacheSpecSlidingWindow,
    Field::Locality,
    Field::Ownership,
    Field::SessionId,
    Field::LookaheadTokenIds,
];

const REMOVED_FIELDS: [Field; 5] = [
    Field::BlockHashes,
    Field::Medium,
    Field::GroupIdx,
    Field::Locality,
    Field::Ownership,
];

impl Field {
    fn from_key(key: &[u8]) -> Option<Self> {
        Some(match key {
            b"block_hashes" => Self::BlockHashes,
            b"parent_block_hash" => Self::ParentBlockHash,
            b"token_ids" => Self::TokenIds,
            b"block_size" => Self::BlockSize,
            b"lora_id" => Self::LoraId,
            b"medium" => Self::Medium,
            b"lora_name" => Self::LoraName,
            b"extra_keys" => Self::ExtraKeys,
            b"group_idx" => Self::GroupIdx,
            b"kv_cache_spec_kind" => Self::KvCacheSpecKind,
            b"kv_cache_spec_sliding_window" => Self::KvCacheSpecSlidingWindow,
            b"locality" => Self::Locality,
            b"ownership" => Self::Ownership,
            b"session_id" => Self::SessionId,
            b"lookahead_token_ids" => Self::LookaheadTokenIds,
            b"cache_salt" => Self::CacheSalt,
            _ => return None,
        })
    }
}

/// The kept fields of one event, at their defaults until read.
#[derive(Default)]
struct EventFields {
    hashes: Range<usize>,
    parent: Option<u64>,
    tokens: Range<usize>,
    block_size: u32,
    lora_name: Option<Range<usize>>,
    medium: Medium,
    group: Option<u32>,
    spec: SpecKind,
    /// `extra_keys`: its number of entries and its range of `batch.block_extras`.
    extras: Option<(usize, Range<usize>)>,
    /// SGLang's `cache_salt`, as its key value (`None`: nil, absent or empty).
    cache_salt: Option<u64>,
    /// `lookahead_token_ids`: its number of entries and its range of
    /// `batch.block_lookahead`.
    lookahead: Option<(usize, Range<usize>)>,
}

pub(super) fn decode_event(c: &mut Cursor<'_>, out: &mut DecodedBatch) -> Result<()> {
    let mut f = EventFields::default();
    let ty = match c.peek()? {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => decode_tagged(c, out, &mut f)?,
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            decode_positional(c, out, &mut f)?
        }
        _ => {
            return Err(DecodeError::new(
                K::EventShape,
                "event is neither a map nor an array",
            ))
        }
    };
    let event = match ty {
        EventType::Stored => stored_event(out, f),
        EventType::Removed => DecodedEvent::Removed {
            hashes: f.hashes,
            medium: f.medium,
            group: f.group,
        },
        EventType::Cleared => DecodedEvent::Cleared,
    };
    out.events.push(event);
    Ok(())
}

/// `{"type": tag, field: value, ...}`: keys in any order, any field absent, unknown keys
/// (of any type, with values of any type) skipped.
fn decode_tagged(
    c: &mut Cursor<'_>,
    out: &mut DecodedBatch,
    f: &mut EventFields,
) -> Result<EventType> {
    let n = c.map_len(K::EventShape, "event is not a map")?;
    // Find "type" first (msgspec writes it first, so the probe usually reads one key).
    let ty = {
        let mut probe = *c;
        let mut found = None;
        for _ in 0..n {
            if probe.key()? == Some(&b"type"[..]) {
                let tag = probe.str_bytes(K::EventShape, "event \"type\" is not a string")?;
                found = Some(EventType::from_tag(tag)?);
                break;
            }
            probe.skip_values(1)?;
        }
        found.ok_or_else(|| DecodeError::new(K::EventShape, "map event has no \"type\" key"))?
    };
    let fields = ty.fields();
    for _ in 0..n {
        match c.key()?.and_then(Field::from_key) {
            Some(field)
                if fields.contains(&field)
                    || (field == Field::CacheSalt && ty == EventType::Stored) =>
            {
                decode_field(c, out, f, field)?
            }
            // "type" (already read), unknown keys, and keys of the other event type.
            _ => c.skip_values(1)?,
        }
    }
    Ok(ty)
}

/// `[tag, field, field, ...]`: fields in REFERENCE.md §2 order, trailing defaults
/// omitted, extra trailing fields skipped.
fn decode_positional(
    c: &mut Cursor<'_>,
    out: &mut DecodedBatch,
    f: &mut EventFields,
) -> Result<EventType> {
    let n = c.array_len(K::EventShape, "event is not an array")?;
    if n == 0 {
        return Err(DecodeError::new(
            K::EventShape,
            "positional event has no tag",
        ));
    }
    let tag = c.str_bytes(K::EventShape, "positional event tag is not a string")?;
    let ty = EventType::from_tag(tag)?;
    let fields = ty.fields();
    for i in 0..n - 1 {
        match fields.get(i) {
            Some(&field) => decode_field(c, out, f, field)?,
            None => c.skip_values(1)?,
        }
    }
    Ok(ty)
}

fn decode_field(
    c: &mut Cursor<'_>,
    out: &mut DecodedBatch,
    f: &mut EventFields,
    field: Field,
) -> Result<()> {
    match field {
        Field::BlockHashes => {
            let n = c.array_len(K::FieldType, "block_hashes is not an array")?;
            let start = out.hashes.len();
            for _ in 0..n {
                let h = c.hash()?;
                out.hashes.push(h);
            }
            f.hashes = start..out.hashes.len();
        }
        Field::ParentBlockHash => {
            f.parent = if c.take_nil()? { None } else { Some(c.hash()?) };
        }
        Field::TokenIds => {
            let start = out.tokens.len();
            c.tokens(&mut out.tokens, "token_ids is not an array")?;
            f.tokens = start..out.tokens.len();
        }
        Field::BlockSize => f.block_size = c.u32(K::FieldType, "block_size is not a u32")?,
        Field::LoraId => c.opt_int("lora_id is not an int or nil")?,
        Field::Medium => {
            f.medium = c
                .opt_str("medium is not a string or nil")?
                .map_or(Medium::Gpu, Medium::from_name);
        }
        Field::LoraName => {
            f.lora_name = match c.opt_str("lora_name is not a string or nil")? {
                None | Some("") => None,
                Some(name) => Some(intern(&mut out.text, name)),
            };
        }
        Field::ExtraKeys => {
            // [[any...]|nil ...]|nil — one entry per block (LoRA name, mm inputs, cache
            // salt, prompt-embeddings digests), read into key values.
            f.extras = None;
            if !c.take_nil()? {
                let n = c.array_len(K::FieldType, "extra_keys is not an array or nil")?;
                let start = out.block_extras.len();
                for _ in 0..n {
                    let from = out.extra_keys.len();
                    if !c.take_nil()? {
                        let m =
                            c.array_len(K::FieldType, "extra_keys entry is not an array or nil")?;
                        for _ in 0..m {
                            if let Some(v) = c.extra_key()? {
                                out.extra_keys.push(v);
                            }
                        }
                    }
                    out.block_extras.push(from..out.extra_keys.len());
                }
                f.extras = Some((n, start..out.block_extras.len()));
            }
        }
        Field::GroupIdx => f.group = c.opt_u32_saturating("group_idx is not an int or nil")?,
        Field::KvCacheSpecKind => {
            f.spec = match c.opt_str("kv_cache_spec_kind is not a string or nil")? {
                None => SpecKind::Unspecified,
                Some(k)
                    if ["full_attention", "mla_attention", "sink_full_attention"]
                        .iter()
                        .any(|f| k.eq_ignore_ascii_case(f)) =>
                {
                    SpecKind::FullAttention
                }
                Some(k) if k.eq_ignore_ascii_case("mamba") => SpecKind::Recurrent,
                Some(_) => SpecKind::Other,
            };
        }
        Field::KvCacheSpecSlidingWindow => {
            c.opt_int("kv_cache_spec_sliding_window is not an int or nil")?
        }
        Field::Locality => {
            c.opt_str("locality is not a string or nil")?;
        }
        Field::Ownership => {
            c.opt_str("ownership is not a string or nil")?;
        }
        Field::SessionId => {
            c.opt_str("session_id is not a string or nil")?;
        }
        Field::CacheSalt => {
            f.cache_salt = c
                .opt_str("cache_salt is not a string or nil")?
                .filter(|s| !s.is_empty())
                .map(|s| crate::hash::extra::cache_salt_key(s.as_bytes()));
        }
        Field::LookaheadTokenIds => {
            // [[int...]...]|nil — one entry per block: the tokens after it that its
            // engine hash also covers.
            f.lookahead = None;
            if !c.take_nil()? {
                let n = c.array_len(K::FieldType, "lookahead_token_ids is not an array or nil")?;
                let start = out.block_lookahead.len();
                for _ in 0..n {
                    let from = out.lookahead.len();
                    c.tokens(
                        &mut out.lookahead,
                        "lookahead_token_ids entry is not an array",
                    )?;
                    out.block_lookahead.push(from..out.lookahead.len());
                }
                f.lookahead = Some((n, start..out.block_lookahead.len()));
            }
        }
    }
    Ok(())
}

/// A `BlockStored` event from its fields: a store of blocks with their tokens, a
/// tokenless store (blocks named by engine hash only), or a malformed one (skipped by
/// the door, counted; the batch's other events still apply).
fn stored_event(out: &mut DecodedBatch, f: EventFields) -> DecodedEvent {
    let n_blocks = f.hashes.len();
    let malformed = |detail| DecodedEvent::Malformed { detail };
    // A recurrent group's store names states by hash; its tokens span the blocks between
    // (vLLM skips the null ones in `block_hashes`), so it is never read as blocks.
    if n_blocks > 0 && (f.tokens.is_empty() || f.spec == SpecKind::Recurrent) {
        return DecodedEvent::Tokenless {
            hashes: f.hashes,
            medium: f.medium,
            group: f.group,
            spec: f.spec,
        };
    }
    if n_blocks > 0 && f.block_size == 0 {
        return malformed("block_size is 0 or absent for a store with token ids");
    }
    // u32 → usize is lossless on every supported target (≥ 32-bit).
    if n_blocks.checked_mul(f.block_size as usize) != Some(f.tokens.len()) {
        return malformed("len(token_ids) != len(block_hashes) * block_size");
    }
    let blocks = match f.extras {
        Some((n, _)) if n != n_blocks => {
            return malformed("extra_keys is not nil and len(extra_keys) != len(block_hashes)")
        }
        other => other.map(|(_, range)| range),
    };
    let lookahead = match f.lookahead {
        Some((n, _)) if n != n_blocks => {
            return malformed("lookahead_token_ids is not nil and its length != len(block_hashes)")
        }
        // Every block empty: the engine hashes without lookahead.
        Some((_, r)) if out.block_lookahead[r.clone()].iter().all(|b| b.is_empty()) => 0..0,
        Some((_, r)) => r,
        None => 0..0,
    };
    // SGLang's salt belongs to the prompt's first block (kvr's rule, as vLLM puts it):
    // only a store that starts a prompt holds that block.
    let salt = f.cache_salt.filter(|_| f.parent.is_none());
    let extras = finish_extras(out, blocks, n_blocks, f.lora_name.clone(), salt);
    DecodedEvent::Stored {
        hashes: f.hashes,
        parent: f.parent,
        tokens: f.tokens,
        block_size: f.block_size,
        lora_name: f.lora_name,
        medium: f.medium,
        group: f.group,
        spec: f.spec,
        extras,
        lookahead,
    }
}

/// A store's extra-key values, final: the LoRA name's dropped (LoRA salts the seed
/// instead, `crate::hash::extra`) and SGLang's `salt` added to block 0, in place (no
/// allocation once the batch's buffers are warm). `blocks` is the store's range of
/// `block_extras` if it had `extra_keys` (then one per block). Returns the store's
/// `extras`: empty when no block keeps a key.
fn finish_extras(
    out: &mut DecodedBatch,
    blocks: Option<Range<usize>>,
    n_blocks: usize,
    lora_name: Option<Range<usize>>,
    salt: Option<u64>,
) -> Range<usize> {
    if n_blocks == 0 {
        return 0..0;
    }
    let start = match blocks {
        Some(b) => {
            let lora =
                lora_name.map(|r| crate::hash::extra::cache_salt_key(out.text[r].as_bytes()));
            // The event's keys are contiguous and in block order: compact them forward.
            let mut write = out.block_extras[b.start].start;
            for i in b.clone() {
                let r = out.block_extras[i].clone();
                let from = write;
                for j in r {
                    let v = out.extra_keys[j];
                    if Some(v) != lora {
                        out.extra_keys[write] = v;
                        write += 1;
                    }
                }
                out.block_extras[i] = from..write;
            }
            out.extra_keys.truncate(write);
            b.start
        }
        None if salt.is_some() => {
            let (s, k) = (out.block_extras.len(), out.extra_keys.len());
            out.block_extras.resize(s + n_blocks, k..k);
            s
        }
        None => return 0..0,
    };
    let end = start + n_blocks;
    if let Some(v) = salt {
        let at = out.block_extras[start].end;
        out.extra_keys.insert(at, v);
        out.block_extras[start].end += 1;
        for r in &mut out.block_extras[start + 1..end] {
            *r = r.start + 1..r.end + 1;
        }
    }
    if out.block_extras[start..end].iter().all(|r| r.is_empty()) {
        let first = out.block_extras[start].start;
        out.extra_keys.truncate(first);
        out.block_extras.truncate(start);
        return 0..0;
    }
    start..end
}

/// Appends `s` to `text` unless it equals the last name appended (one LoRA per batch is
/// the common case); returns its range.
fn intern(text: &mut String, s: &str) -> Range<usize> {
    if let Some(start) = text.len().checked_sub(s.len()) {
        if text.is_char_boundary(start) && &text[start..] == s {
            return start..text.len();
        }
    }
    let start = text.len();
    text.push_str(s);
    start..text.len()
}
