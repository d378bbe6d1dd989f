//! vLLM / SGLang `KVEventBatch` msgpack payloads (REFERENCE.md §2, DESIGN.md §10).
//!
//! A payload is one msgpack array `[ts, events, data_parallel_rank]`. Each event is either a
//! tagged map (current vLLM: `{"type": "BlockStored", "block_hashes": [...], ...}`, any
//! field may be absent, keys in any order) or a positional array (older vLLM and SGLang:
//! `["BlockStored", block_hashes, parent_block_hash, ...]`, trailing defaults omitted).
//! Both encodings are accepted in the same batch; unknown keys and extra trailing fields
//! (newer engine versions) are skipped, whatever their type.
//!
//! [`decode_batch`] reads with `rmp`'s low-level reader over the payload slice and writes
//! into a caller-owned [`DecodedBatch`]: events refer to ranges of its shared `hashes`,
//! `tokens` and `text` buffers, so a reused batch decodes without allocating once its
//! buffers have grown to the workload's size (no per-event or per-block allocation).
//!
//! Guards: every length prefix is checked against the bytes left in the payload before
//! anything is read or reserved; unknown values are skipped by an iterative skipper (a
//! count of pending values, no recursion, so nesting depth cannot exhaust the stack); all
//! arithmetic on wire-supplied numbers is checked; no input panics (fuzzed: `fuzz/`).
//!
//! Every listed field of an event is decoded and type-checked even when it is not kept
//! (`lora_id`, `extra_keys`, `group_idx`, `kv_cache_spec_*`, `locality`, `ownership`,
//! `session_id`, `lookahead_token_ids`): a payload whose known fields have the wrong
//! types is rejected rather than half-understood.

use std::fmt;
use std::ops::Range;

use rmp::decode::bytes::BytesReadError;
use rmp::decode::{self as rd, Bytes, NumValueReadError, RmpRead, ValueReadError};
use rmp::Marker;

use DecodeErrorKind as K;

/// Payloads larger than this are rejected ([`DecodeErrorKind::TooLarge`]) before any
/// decoding: decoded hashes can take up to 8× the payload's bytes, so the cap bounds the
/// memory one hostile payload can make a [`DecodedBatch`] grow to. Real batches are far
/// smaller (a 128k-token prefill is ~400 KiB of `token_ids`).
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// Where a block lives (vLLM `medium`): absent/nil/`"GPU"` → [`Medium::Gpu`], `"CPU"` →
/// [`Medium::Cpu`], `"STORAGE"`/`"DISK"` → [`Medium::Storage`] (ASCII case-insensitive);
/// any other string is [`DecodeErrorKind::UnknownMedium`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Medium {
    #[default]
    Gpu,
    Cpu,
    Storage,
}

/// One decoded event. Ranges index the owning [`DecodedBatch`]'s buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodedEvent {
    /// `BlockStored`: `hashes` are the engine's block hashes (`batch.hashes[hashes]`),
    /// chained after `parent`; `tokens` (`batch.tokens[tokens]`) holds exactly
    /// `hashes.len() * block_size` token ids; `block_size >= 1` whenever there are blocks
    /// (it is whatever the engine sent, possibly 0, when `hashes` is empty).
    /// `lora_name` (`&batch.text[range]`) is `None` for nil, absent or empty.
    Stored {
        hashes: Range<usize>,
        parent: Option<u64>,
        tokens: Range<usize>,
        block_size: u32,
        lora_name: Option<Range<usize>>,
        medium: Medium,
    },
    /// `BlockRemoved`: the engine's hashes of the evicted blocks (`batch.hashes[hashes]`).
    Removed {
        hashes: Range<usize>,
        medium: Medium,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// One decoded payload. Reuse one value across batches: [`decode_batch`] clears and
/// refills its vectors, so after warm-up decoding allocates nothing.
///
/// After a failed decode the contents are unspecified but consistent in type (events
/// decoded before the failure, plus partial buffers): callers must apply nothing from a
/// batch whose decode failed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodedBatch {
    /// The engine's wall-clock timestamp (seconds); ints and f32 are widened to f64.
    pub ts: f64,
    /// The batch's DP rank; `None` when nil or absent (older payloads have 2 elements).
    pub data_parallel_rank: Option<u32>,
    pub events: Vec<DecodedEvent>,
    /// Engine block hashes of all events (uint64 as is, int64 as its bits, bin folded to
    /// its last 8 bytes big-endian).
    pub hashes: Vec<u64>,
    /// Token ids of all `Stored` events.
    pub tokens: Vec<u32>,
    /// LoRA names of all `Stored` events.
    pub text: String,
}

impl DecodedBatch {
    fn reset(&mut self) {
        self.ts = 0.0;
        self.data_parallel_rank = None;
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.text.clear();
    }
}

/// Why a payload was rejected; each kind is one counter label ([`DecodeErrorKind::name`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeErrorKind {
    /// The payload ends inside a value, or a length prefix claims more elements or bytes
    /// than the payload has left.
    Truncated,
    /// The top level is not an array of at least `[ts, events]`, or `events` is not an
    /// array.
    BatchShape,
    /// An event is neither a map nor a non-empty array, its tag is not a string, or a map
    /// event has no `"type"`.
    EventShape,
    /// The event tag / `"type"` is not `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
    UnknownEventType,
    /// A field (or `ts`/`data_parallel_rank`) has the wrong msgpack type, is out of range
    /// (e.g. a negative token id) or is a string with invalid UTF-8; also a reserved
    /// marker (0xc1) inside a skipped value.
    FieldType,
    /// A block hash or parent hash is not uint64, int64 or bin.
    HashType,
    /// `len(token_ids) != len(block_hashes) * block_size`, or `block_size` is 0 (or
    /// absent) for a store with blocks.
    TokenCount,
    /// `medium` is a string other than GPU, CPU, STORAGE or DISK.
    UnknownMedium,
    /// The payload is larger than [`MAX_PAYLOAD_BYTES`].
    TooLarge,
    /// Bytes follow the batch array.
    TrailingBytes,
}

impl DecodeErrorKind {
    pub const ALL: [Self; 10] = [
        Self::Truncated,
        Self::BatchShape,
        Self::EventShape,
        Self::UnknownEventType,
        Self::FieldType,
        Self::HashType,
        Self::TokenCount,
        Self::UnknownMedium,
        Self::TooLarge,
        Self::TrailingBytes,
    ];

    /// A stable snake_case label (metrics, logs).
    pub fn name(self) -> &'static str {
        match self {
            Self::Truncated => "truncated",
            Self::BatchShape => "batch_shape",
            Self::EventShape => "event_shape",
            Self::UnknownEventType => "unknown_event_type",
            Self::FieldType => "field_type",
            Self::HashType => "hash_type",
            Self::TokenCount => "token_count",
            Self::UnknownMedium => "unknown_medium",
            Self::TooLarge => "too_large",
            Self::TrailingBytes => "trailing_bytes",
        }
    }
}

impl fmt::Display for DecodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A rejected payload: the cause, the index of the event it was found in (None for the
/// batch envelope), and a fixed human-readable detail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeError {
    pub kind: DecodeErrorKind,
    pub event_index: Option<usize>,
    pub detail: &'static str,
}

impl DecodeError {
    #[cold]
    fn new(kind: DecodeErrorKind, detail: &'static str) -> Self {
        Self {
            kind,
            event_index: None,
            detail,
        }
    }

    #[cold]
    fn truncated() -> Self {
        Self::new(DecodeErrorKind::Truncated, "payload ends inside a value")
    }

    #[cold]
    fn in_event(mut self, index: usize) -> Self {
        self.event_index = Some(index);
        self
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kv event payload: {}: {}", self.kind.name(), self.detail)?;
        if let Some(i) = self.event_index {
            write!(f, " (event {i})")?;
        }
        Ok(())
    }
}

impl std::error::Error for DecodeError {}

type Result<T> = std::result::Result<T, DecodeError>;

/// Decodes one msgpack `KVEventBatch` payload into `out` (cleared first).
///
/// Accepts tagged-map and positional-array events (mixed freely), uint64/int64/bin hashes,
/// `ts` as f64/f32/int, a missing or nil `data_parallel_rank`, and ignores extra trailing
/// batch elements, unknown map keys and extra positional fields. Bytes after the batch are
/// an error ([`DecodeErrorKind::TrailingBytes`]).
///
/// On error `out` may be partially filled; apply nothing from it.
pub fn decode_batch(payload: &[u8], out: &mut DecodedBatch) -> Result<()> {
    out.reset();
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::new(
            K::TooLarge,
            "payload exceeds MAX_PAYLOAD_BYTES",
        ));
    }
    let mut c = Cursor::new(payload);
    let n = c.array_len(K::BatchShape, "batch is not an array")?;
    if n < 2 {
        return Err(DecodeError::new(
            K::BatchShape,
            "batch array has fewer than 2 elements",
        ));
    }
    out.ts = c.float(K::FieldType, "ts is not a number")?;
    let n_events = c.array_len(K::BatchShape, "events is not an array")?;
    for i in 0..n_events {
        decode_event(&mut c, out).map_err(|e| e.in_event(i))?;
    }
    if n >= 3 {
        out.data_parallel_rank = if c.take_nil()? {
            None
        } else {
            Some(c.u32(K::FieldType, "data_parallel_rank is not a u32 or nil")?)
        };
        c.skip_values(n - 3)?;
    }
    if c.remaining() != 0 {
        return Err(DecodeError::new(
            K::TrailingBytes,
            "bytes follow the batch array",
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Events

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
}

fn decode_event(c: &mut Cursor<'_>, out: &mut DecodedBatch) -> Result<()> {
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
        EventType::Stored => {
            let n_blocks = f.hashes.len();
            if n_blocks > 0 && f.block_size == 0 {
                return Err(DecodeError::new(
                    K::TokenCount,
                    "block_size is 0 or absent for a store with blocks",
                ));
            }
            // u32 → usize is lossless on every supported target (≥ 32-bit).
            let expected = n_blocks.checked_mul(f.block_size as usize);
            if expected != Some(f.tokens.len()) {
                return Err(DecodeError::new(
                    K::TokenCount,
                    "len(token_ids) != len(block_hashes) * block_size",
                ));
            }
            DecodedEvent::Stored {
                hashes: f.hashes,
                parent: f.parent,
                tokens: f.tokens,
                block_size: f.block_size,
                lora_name: f.lora_name,
                medium: f.medium,
            }
        }
        EventType::Removed => DecodedEvent::Removed {
            hashes: f.hashes,
            medium: f.medium,
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
            Some(field) if fields.contains(&field) => decode_field(c, out, f, field)?,
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
            f.medium = match c.opt_str("medium is not a string or nil")? {
                None => Medium::Gpu,
                Some(s) if s.eq_ignore_ascii_case("GPU") => Medium::Gpu,
                Some(s) if s.eq_ignore_ascii_case("CPU") => Medium::Cpu,
                Some(s) if s.eq_ignore_ascii_case("STORAGE") || s.eq_ignore_ascii_case("DISK") => {
                    Medium::Storage
                }
                Some(_) => {
                    return Err(DecodeError::new(
                        K::UnknownMedium,
                        "medium is not GPU, CPU, STORAGE or DISK",
                    ))
                }
            };
        }
        Field::LoraName => {
            f.lora_name = match c.opt_str("lora_name is not a string or nil")? {
                None | Some("") => None,
                Some(name) => Some(intern(&mut out.text, name)),
            };
        }
        Field::ExtraKeys => {
            // [[any...]|nil ...]|nil — one entry per block (LoRA name, mm hashes, ...).
            if !c.take_nil()? {
                let n = c.array_len(K::FieldType, "extra_keys is not an array or nil")?;
                for _ in 0..n {
                    if !c.take_nil()? {
                        let m =
                            c.array_len(K::FieldType, "extra_keys entry is not an array or nil")?;
                        c.skip_values(m)?;
                    }
                }
            }
        }
        Field::GroupIdx => c.opt_int("group_idx is not an int or nil")?,
        Field::KvCacheSpecKind => {
            c.opt_str("kv_cache_spec_kind is not a string or nil")?;
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
        Field::LookaheadTokenIds => {
            // [[int...]...]|nil — checked as token ids, not kept.
            if !c.take_nil()? {
                let n = c.array_len(K::FieldType, "lookahead_token_ids is not an array or nil")?;
                // Reads into the shared token buffer, then drops what it read.
                let mark = out.tokens.len();
                for _ in 0..n {
                    c.tokens(&mut out.tokens, "lookahead_token_ids entry is not an array")?;
                    out.tokens.truncate(mark);
                }
            }
        }
    }
    Ok(())
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

// ---------------------------------------------------------------------------------------
// The reader

/// A position in the payload. `Copy`, so a probe can read ahead and be dropped.
#[derive(Clone, Copy)]
struct Cursor<'a> {
    rd: Bytes<'a>,
}

#[cold]
fn value_err(e: ValueReadError<BytesReadError>, kind: K, detail: &'static str) -> DecodeError {
    match e {
        ValueReadError::InvalidMarkerRead(_) | ValueReadError::InvalidDataRead(_) => {
            DecodeError::truncated()
        }
        ValueReadError::TypeMismatch(_) => DecodeError::new(kind, detail),
    }
}

#[cold]
fn num_err(e: NumValueReadError<BytesReadError>, kind: K, detail: &'static str) -> DecodeError {
    match e {
        NumValueReadError::InvalidMarkerRead(_) | NumValueReadError::InvalidDataRead(_) => {
            DecodeError::truncated()
        }
        NumValueReadError::TypeMismatch(_) | NumValueReadError::OutOfRange => {
            DecodeError::new(kind, detail)
        }
    }
}

fn is_int(m: Marker) -> bool {
    matches!(
        m,
        Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64
    )
}

impl<'a> Cursor<'a> {
    fn new(payload: &'a [u8]) -> Self {
        Self {
            rd: Bytes::new(payload),
        }
    }

    fn remaining(&self) -> usize {
        self.rd.remaining_slice().len()
    }

    /// The next value's marker, not consumed.
    fn peek(&self) -> Result<Marker> {
        match self.rd.remaining_slice().first() {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => Err(DecodeError::truncated()),
        }
    }

    fn marker(&mut self) -> Result<Marker> {
        rd::read_marker(&mut self.rd).map_err(|_| DecodeError::truncated())
    }

    /// Consumes `n` bytes.
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let rest = self.rd.remaining_slice();
        if n > rest.len() {
            return Err(DecodeError::truncated());
        }
        let (head, tail) = rest.split_at(n);
        self.rd = Bytes::new(tail);
        Ok(head)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.rd
            .read_exact_buf(&mut buf)
            .map_err(|_| DecodeError::truncated())?;
        Ok(buf)
    }

    /// Consumes a nil if one is next.
    fn take_nil(&mut self) -> Result<bool> {
        if self.peek()? == Marker::Null {
            self.bytes(1)?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// An array header; its length is at most the bytes left (each element takes ≥ 1).
    fn array_len(&mut self, kind: K, detail: &'static str) -> Result<usize> {
        let n = rd::read_array_len(&mut self.rd).map_err(|e| value_err(e, kind, detail))?;
        let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
        if n > self.remaining() {
            return Err(DecodeError::new(
                K::Truncated,
                "array length exceeds the remaining payload",
            ));
        }
        Ok(n)
    }

    /// A map header; its 2·len keys and values fit in the bytes left.
    fn map_len(&mut self, kind: K, detail: &'static str) -> Result<usize> {
        let n = rd::read_map_len(&mut self.rd).map_err(|e| value_err(e, kind, detail))?;
        let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
        if n.saturating_mul(2) > self.remaining() {
            return Err(DecodeError::new(
                K::Truncated,
                "map length exceeds the remaining payload",
            ));
        }
        Ok(n)
    }

    /// A str's raw bytes (not UTF-8 checked).
    fn str_bytes(&mut self, kind: K, detail: &'static str) -> Result<&'a [u8]> {
        let n = rd::read_str_len(&mut self.rd).map_err(|e| value_err(e, kind, detail))?;
        let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
        self.bytes(n)
    }

    /// A map key: `Some(bytes)` if it is a str, `None` (consumed) otherwise.
    fn key(&mut self) -> Result<Option<&'a [u8]>> {
        match self.peek()? {
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                self.str_bytes(K::FieldType, "map key").map(Some)
            }
            _ => {
                self.skip_values(1)?;
                Ok(None)
            }
        }
    }

    /// `str|nil`, UTF-8 checked.
    fn opt_str(&mut self, detail: &'static str) -> Result<Option<&'a str>> {
        if self.take_nil()? {
            return Ok(None);
        }
        let b = self.str_bytes(K::FieldType, detail)?;
        std::str::from_utf8(b)
            .map(Some)
            .map_err(|_| DecodeError::new(K::FieldType, detail))
    }

    /// `int|nil`, any width and sign.
    fn opt_int(&mut self, detail: &'static str) -> Result<()> {
        let m = self.peek()?;
        if m == Marker::Null || is_int(m) {
            self.skip_values(1)
        } else {
            Err(DecodeError::new(K::FieldType, detail))
        }
    }

    fn u32(&mut self, kind: K, detail: &'static str) -> Result<u32> {
        rd::read_int::<u32, _>(&mut self.rd).map_err(|e| num_err(e, kind, detail))
    }

    /// A number as f64: f64, f32 or any int.
    fn float(&mut self, kind: K, detail: &'static str) -> Result<f64> {
        match self.peek()? {
            Marker::F64 => rd::read_f64(&mut self.rd).map_err(|e| value_err(e, kind, detail)),
            Marker::F32 => rd::read_f32(&mut self.rd)
                .map(f64::from)
                .map_err(|e| value_err(e, kind, detail)),
            Marker::U64 => rd::read_int::<u64, _>(&mut self.rd)
                .map(|v| v as f64)
                .map_err(|e| num_err(e, kind, detail)),
            m if is_int(m) => rd::read_int::<i64, _>(&mut self.rd)
                .map(|v| v as f64)
                .map_err(|e| num_err(e, kind, detail)),
            _ => Err(DecodeError::new(kind, detail)),
        }
    }

    /// An engine block hash: uint64 as is, int64 as its two's-complement bits, bin folded
    /// to its last 8 bytes big-endian (shorter bins left-padded with zeros).
    fn hash(&mut self) -> Result<u64> {
        const DETAIL: &str = "block hash is not uint64, int64 or bin";
        match self.peek()? {
            Marker::FixPos(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => {
                rd::read_int::<u64, _>(&mut self.rd).map_err(|e| num_err(e, K::HashType, DETAIL))
            }
            Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                rd::read_int::<i64, _>(&mut self.rd)
                    .map(|v| v as u64)
                    .map_err(|e| num_err(e, K::HashType, DETAIL))
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = rd::read_bin_len(&mut self.rd)
                    .map_err(|e| value_err(e, K::HashType, DETAIL))?;
                let n = usize::try_from(n).map_err(|_| DecodeError::truncated())?;
                let bin = self.bytes(n)?;
                let tail = &bin[n.saturating_sub(8)..];
                let mut b = [0u8; 8];
                b[8 - tail.len()..].copy_from_slice(tail);
                Ok(u64::from_be_bytes(b))
            }
            _ => Err(DecodeError::new(K::HashType, DETAIL)),
        }
    }

    /// An array of u32 token ids, appended to `dst`.
    fn tokens(&mut self, dst: &mut Vec<u32>, detail: &'static str) -> Result<()> {
        let n = self.array_len(K::FieldType, detail)?;
        for _ in 0..n {
            let t = self.u32(K::FieldType, "token id is not a u32")?;
            dst.push(t);
        }
        Ok(())
    }

    /// Skips `n` complete values of any type. Iterative: `pending` counts the values still
    /// to skip (containers add their elements), so nesting depth costs no stack; `pending`
    /// never exceeds the bytes left, as every value takes at least one byte.
    fn skip_values(&mut self, n: usize) -> Result<()> {
        let mut pending = n;
        while pending > 0 {
            if pending > self.remaining() {
                return Err(DecodeError::new(
                    K::Truncated,
                    "container length exceeds the remaining payload",
                ));
            }
            pending -= 1;
            let (data, children): (usize, usize) = match self.marker()? {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => (0, 0),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(l) => (usize::from(l), 0),
                Marker::Str8 | Marker::Bin8 => (usize::from(self.be::<1>()?[0]), 0),
                Marker::Str16 | Marker::Bin16 => (usize::from(u16::from_be_bytes(self.be()?)), 0),
                Marker::Str32 | Marker::Bin32 => (self.len32()?, 0),
                Marker::FixArray(l) => (0, usize::from(l)),
                Marker::Array16 => (0, usize::from(u16::from_be_bytes(self.be()?))),
                Marker::Array32 => (0, self.len32()?),
                Marker::FixMap(l) => (0, usize::from(l) * 2),
                Marker::Map16 => (0, usize::from(u16::from_be_bytes(self.be()?)) * 2),
                Marker::Map32 => (0, self.len32()?.saturating_mul(2)),
                // Ext: a type byte, then the data.
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (usize::from(self.be::<1>()?[0]) + 1, 0),
                Marker::Ext16 => (usize::from(u16::from_be_bytes(self.be()?)) + 1, 0),
                Marker::Ext32 => (self.len32()?.saturating_add(1), 0),
                Marker::Reserved => {
                    return Err(DecodeError::new(
                        K::FieldType,
                        "reserved msgpack marker 0xc1",
                    ))
                }
            };
            self.bytes(data)?;
            pending = pending.saturating_add(children);
        }
        Ok(())
    }

    fn len32(&mut self) -> Result<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| DecodeError::truncated())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A msgpack value tree for building payloads; encoded with `rmp::encode`.
    #[derive(Clone, Debug)]
    enum V {
        Nil,
        Bool(bool),
        /// Smallest unsigned encoding.
        U(u64),
        /// Smallest signed encoding.
        I(i64),
        /// Forced 0xcf.
        U64(u64),
        /// Forced 0xd3.
        I64(i64),
        F64(f64),
        F32(f32),
        S(String),
        Bin(Vec<u8>),
        A(Vec<V>),
        M(Vec<(V, V)>),
        Ext(i8, Vec<u8>),
    }

    use rmp::encode as en;

    fn enc_into(v: &V, w: &mut Vec<u8>) {
        match v {
            V::Nil => en::write_nil(w).unwrap(),
            V::Bool(b) => en::write_bool(w, *b).unwrap(),
            V::U(x) => {
                en::write_uint(w, *x).unwrap();
            }
            V::I(x) => {
                en::write_sint(w, *x).unwrap();
            }
            V::U64(x) => en::write_u64(w, *x).unwrap(),
            V::I64(x) => en::write_i64(w, *x).unwrap(),
            V::F64(x) => en::write_f64(w, *x).unwrap(),
            V::F32(x) => en::write_f32(w, *x).unwrap(),
            V::S(s) => en::write_str(w, s).unwrap(),
            V::Bin(b) => en::write_bin(w, b).unwrap(),
            V::A(items) => {
                en::write_array_len(w, items.len() as u32).unwrap();
                items.iter().for_each(|i| enc_into(i, w));
            }
            V::M(entries) => {
                en::write_map_len(w, entries.len() as u32).unwrap();
                for (k, v) in entries {
                    enc_into(k, w);
                    enc_into(v, w);
                }
            }
            V::Ext(ty, data) => {
                en::write_ext_meta(w, data.len() as u32, *ty).unwrap();
                w.extend_from_slice(data);
            }
        }
    }

    fn enc(v: &V) -> Vec<u8> {
        let mut w = Vec::new();
        enc_into(v, &mut w);
        w
    }

    fn s(x: &str) -> V {
        V::S(x.to_owned())
    }
    fn u(x: u64) -> V {
        V::U(x)
    }
    fn a(items: Vec<V>) -> V {
        V::A(items)
    }
    /// A map with string keys.
    fn m(entries: Vec<(&str, V)>) -> V {
        V::M(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
    }
    fn toks(r: Range<u32>) -> V {
        a(r.map(|t| u(u64::from(t))).collect())
    }
    fn batch(events: Vec<V>) -> V {
        a(vec![V::F64(1700000000.25), a(events), u(0)])
    }

    fn decode(v: &V) -> Result<DecodedBatch> {
        let mut out = DecodedBatch::default();
        decode_batch(&enc(v), &mut out).map(|()| out)
    }

    fn err(v: &V) -> DecodeError {
        decode(v).expect_err("payload must be rejected")
    }

    fn err_kind(v: &V) -> K {
        err(v).kind
    }

    // vLLM's default hashes: the last 8 bytes of a SHA-256 as uint64 (large, so 0xcf).
    const H1: u64 = 0xf3a1_0000_0000_0001;
    const H2: u64 = 0x8000_0000_dead_beef;
    const H3: u64 = 0x0123_4567_89ab_cdef;

    /// REFERENCE.md §2's BlockStored as seen on the wire (vLLM 0.33.0), two blocks of 16.
    fn ref_stored() -> V {
        m(vec![
            ("type", s("BlockStored")),
            ("block_hashes", a(vec![V::U64(H1), V::U64(H2)])),
            ("parent_block_hash", V::Nil),
            ("token_ids", toks(0..32)),
            ("block_size", u(16)),
            ("lora_id", V::Nil),
            ("medium", s("GPU")),
            ("lora_name", V::Nil),
            ("extra_keys", a(vec![V::Nil, V::Nil])),
            ("group_idx", u(0)),
            ("kv_cache_spec_kind", s("full_attention")),
        ])
    }

    fn stored(
        b: &DecodedBatch,
        i: usize,
    ) -> (Vec<u64>, Option<u64>, Vec<u32>, u32, Option<String>, Medium) {
        match &b.events[i] {
            DecodedEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                lora_name,
                medium,
            } => (
                b.hashes[hashes.clone()].to_vec(),
                *parent,
                b.tokens[tokens.clone()].to_vec(),
                *block_size,
                lora_name.clone().map(|r| b.text[r].to_owned()),
                *medium,
            ),
            e => panic!("event {i} is not Stored: {e:?}"),
        }
    }

    fn removed(b: &DecodedBatch, i: usize) -> (Vec<u64>, Medium) {
        match &b.events[i] {
            DecodedEvent::Removed { hashes, medium } => {
                (b.hashes[hashes.clone()].to_vec(), *medium)
            }
            e => panic!("event {i} is not Removed: {e:?}"),
        }
    }

    #[test]
    fn reference_tagged_events_literally() {
        let mut cpu = ref_stored();
        if let V::M(entries) = &mut cpu {
            entries.retain(|(k, _)| !matches!(k, V::S(k) if k == "medium"));
            entries.push((s("medium"), s("CPU")));
            entries.push((s("locality"), s("LOCAL")));
        }
        let b = decode(&batch(vec![
            ref_stored(),
            cpu,
            m(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", a(vec![V::U64(H1)])),
                ("medium", s("GPU")),
                ("group_idx", u(0)),
            ]),
            m(vec![("type", s("AllBlocksCleared"))]),
        ]))
        .unwrap();
        assert_eq!(b.ts, 1700000000.25);
        assert_eq!(b.data_parallel_rank, Some(0));
        assert_eq!(b.events.len(), 4);
        let toks: Vec<u32> = (0..32).collect();
        assert_eq!(
            stored(&b, 0),
            (vec![H1, H2], None, toks.clone(), 16, None, Medium::Gpu)
        );
        assert_eq!(
            stored(&b, 1),
            (vec![H1, H2], None, toks, 16, None, Medium::Cpu)
        );
        assert_eq!(removed(&b, 2), (vec![H1], Medium::Gpu));
        assert_eq!(b.events[3], DecodedEvent::Cleared);
    }

    #[test]
    fn positional_sglang_and_older_vllm() {
        // SGLang: BlockStored with 9 fields, BlockRemoved with 3; signed int64 hashes.
        let sglang = batch(vec![
            a(vec![
                s("BlockStored"),
                a(vec![V::I64(-5), V::I64(7)]),
                V::I64(-1),
                toks(0..8),
                u(4),
                V::Nil,
                s("GPU"),
                V::Nil,
                V::Nil,
                u(0),
            ]),
            a(vec![s("BlockRemoved"), a(vec![V::I64(-5)]), V::Nil, u(0)]),
            a(vec![s("AllBlocksCleared")]),
        ]);
        let b = decode(&sglang).unwrap();
        assert_eq!(
            stored(&b, 0),
            (
                vec![(-5i64) as u64, 7],
                Some(u64::MAX),
                (0..8).collect(),
                4,
                None,
                Medium::Gpu
            )
        );
        assert_eq!(removed(&b, 1), (vec![(-5i64) as u64], Medium::Gpu));
        assert_eq!(b.events[2], DecodedEvent::Cleared);

        // Older vLLM: 2-element batch (no DP rank), trailing defaults omitted (no medium).
        let old = a(vec![
            V::F64(3.5),
            a(vec![
                a(vec![
                    s("BlockStored"),
                    a(vec![u(1)]),
                    u(9),
                    toks(10..14),
                    u(4),
                    V::Nil,
                ]),
                a(vec![s("BlockRemoved"), a(vec![u(1), u(2)])]),
                a(vec![s("BlockStored"), a(vec![]), V::Nil, a(vec![]), u(4)]),
            ]),
        ]);
        let b = decode(&old).unwrap();
        assert_eq!(b.data_parallel_rank, None);
        assert_eq!(
            stored(&b, 0),
            (vec![1], Some(9), (10..14).collect(), 4, None, Medium::Gpu)
        );
        assert_eq!(removed(&b, 1), (vec![1, 2], Medium::Gpu));
        assert_eq!(stored(&b, 2), (vec![], None, vec![], 4, None, Medium::Gpu));
    }

    #[test]
    fn all_fifteen_stored_fields_positional_and_tagged() {
        let values = vec![
            a(vec![u(11), u(12)]),
            u(10),
            toks(0..4),
            u(2),
            u(3),
            s("CPU"),
            s("my-lora"),
            a(vec![
                a(vec![s("my-lora")]),
                a(vec![s("my-lora"), a(vec![s("mm"), u(5)])]),
            ]),
            u(1),
            s("sliding_window"),
            u(4096),
            s("LOCAL"),
            s("OWNED"),
            s("sess-1"),
            a(vec![toks(100..103), a(vec![])]),
        ];
        let names = [
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
        let mut positional = vec![s("BlockStored")];
        positional.extend(values.iter().cloned());
        let tagged = m(std::iter::once(("type", s("BlockStored")))
            .chain(names.iter().copied().zip(values.iter().cloned()))
            .collect());
        let expect = (
            vec![11, 12],
            Some(10),
            (0..4).collect::<Vec<u32>>(),
            2,
            Some("my-lora".to_owned()),
            Medium::Cpu,
        );
        for ev in [a(positional), tagged] {
            let b = decode(&batch(vec![ev])).unwrap();
            assert_eq!(stored(&b, 0), expect);
            // lookahead tokens are checked but not kept.
            assert_eq!(b.tokens.len(), 4);
        }
        // BlockRemoved's 5 fields.
        let b = decode(&batch(vec![a(vec![
            s("BlockRemoved"),
            a(vec![u(1)]),
            s("STORAGE"),
            u(0),
            s("REMOTE"),
            V::Nil,
        ])]))
        .unwrap();
        assert_eq!(removed(&b, 0), (vec![1], Medium::Storage));
    }

    #[test]
    fn hash_encodings() {
        let mut digest = [0u8; 32];
        for (i, b) in digest.iter_mut().enumerate() {
            *b = i as u8;
        }
        let hashes = a(vec![
            u(5),                           // fixint
            V::U(300),                      // u16
            V::U64(u64::MAX),               // uint64
            V::I(-1),                       // negative fixint
            V::I64(i64::MIN),               // int64
            V::I64(42),                     // int64 marker, positive
            V::Bin(digest.to_vec()),        // 32-byte digest → last 8 bytes BE
            V::Bin(vec![0xab, 0xcd, 0xef]), // short → left-padded
            V::Bin(vec![]),                 // empty → 0
        ]);
        let b = decode(&batch(vec![m(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", hashes),
        ])]))
        .unwrap();
        assert_eq!(
            removed(&b, 0).0,
            vec![
                5,
                300,
                u64::MAX,
                u64::MAX,
                1 << 63,
                42,
                0x18191a1b1c1d1e1f,
                0xabcdef,
                0
            ]
        );
        // Parent in each kind too.
        for (parent, want) in [
            (V::U64(H3), H3),
            (V::I64(-2), (-2i64) as u64),
            (V::Bin(H3.to_be_bytes().to_vec()), H3),
        ] {
            let b = decode(&batch(vec![a(vec![
                s("BlockStored"),
                a(vec![u(1)]),
                parent,
                toks(0..2),
                u(2),
            ])]))
            .unwrap();
            assert_eq!(stored(&b, 0).1, Some(want));
        }
    }

    #[test]
    fn absent_fields_and_any_key_order() {
        // "type" last, most fields absent.
        let b = decode(&batch(vec![
            m(vec![
                ("token_ids", toks(0..3)),
                ("block_hashes", a(vec![u(7)])),
                ("block_size", u(3)),
                ("type", s("BlockStored")),
            ]),
            m(vec![("type", s("BlockRemoved"))]),
            m(vec![("type", s("BlockStored"))]),
        ]))
        .unwrap();
        assert_eq!(
            stored(&b, 0),
            (vec![7], None, vec![0, 1, 2], 3, None, Medium::Gpu)
        );
        assert_eq!(removed(&b, 1), (vec![], Medium::Gpu));
        assert_eq!(stored(&b, 2), (vec![], None, vec![], 0, None, Medium::Gpu));
    }

    #[test]
    fn unknown_keys_fields_and_trailing_elements_are_skipped() {
        let nested = a(vec![
            m(vec![(
                "x",
                a(vec![
                    V::F32(1.5),
                    V::Bin(vec![1; 300]),
                    V::Ext(5, vec![1, 2, 3]),
                ]),
            )]),
            V::M(vec![(u(1), V::Bool(true)), (V::Nil, a(vec![]))]),
            V::Ext(-1, vec![0; 16]),
            V::Ext(2, vec![0; 70_000]),
            s(&"long".repeat(20_000)),
            V::I(-100_000),
            V::F64(2.0),
        ]);
        let b = decode(&a(vec![
            V::F64(1.0),
            a(vec![
                m(vec![
                    ("type", s("BlockStored")),
                    ("future_field", nested.clone()),
                    ("block_hashes", a(vec![u(1)])),
                    ("token_ids", toks(0..1)),
                    ("block_size", u(1)),
                ]),
                // A non-string key with a nested value.
                V::M(vec![
                    (s("type"), s("BlockRemoved")),
                    (a(vec![u(1), m(vec![("k", V::Nil)])]), nested.clone()),
                    (s("block_hashes"), a(vec![u(2)])),
                    // A Stored-only key on a Removed event is unknown here.
                    (s("token_ids"), s("not tokens")),
                ]),
                a(vec![
                    s("BlockRemoved"),
                    a(vec![u(3)]),
                    V::Nil,
                    V::Nil,
                    V::Nil,
                    V::Nil,
                    nested.clone(),
                ]),
                a(vec![s("AllBlocksCleared"), nested.clone(), u(1)]),
                m(vec![
                    ("type", s("AllBlocksCleared")),
                    ("reason", s("reset")),
                ]),
            ]),
            u(3),
            nested,
            V::Nil,
        ]))
        .unwrap();
        assert_eq!(b.data_parallel_rank, Some(3));
        assert_eq!(stored(&b, 0).0, vec![1]);
        assert_eq!(removed(&b, 1).0, vec![2]);
        assert_eq!(removed(&b, 2).0, vec![3]);
        assert_eq!(b.events[3], DecodedEvent::Cleared);
        assert_eq!(b.events[4], DecodedEvent::Cleared);
    }

    #[test]
    fn deep_nesting_in_skipped_values_does_not_recurse() {
        // 200k nested single-element arrays inside an unknown key: no stack growth.
        let depth = 200_000;
        let mut p = Vec::new();
        en::write_array_len(&mut p, 3).unwrap();
        en::write_f64(&mut p, 0.0).unwrap();
        en::write_array_len(&mut p, 1).unwrap();
        en::write_map_len(&mut p, 2).unwrap();
        en::write_str(&mut p, "type").unwrap();
        en::write_str(&mut p, "AllBlocksCleared").unwrap();
        en::write_str(&mut p, "deep").unwrap();
        p.extend(std::iter::repeat(0x91).take(depth));
        en::write_nil(&mut p).unwrap();
        en::write_nil(&mut p).unwrap();
        let mut out = DecodedBatch::default();
        decode_batch(&p, &mut out).unwrap();
        assert_eq!(out.events, vec![DecodedEvent::Cleared]);
        // The same nesting, one level short of its innermost value: truncated.
        p.truncate(p.len() - 2);
        assert_eq!(decode_batch(&p, &mut out).unwrap_err().kind, K::Truncated);
    }

    #[test]
    fn ts_and_dp_rank_forms() {
        let with = |ts: V, rest: Vec<V>| {
            let mut items = vec![ts, a(vec![])];
            items.extend(rest);
            decode(&a(items))
        };
        assert_eq!(with(V::F32(2.5), vec![]).unwrap().ts, 2.5);
        assert_eq!(with(u(7), vec![]).unwrap().ts, 7.0);
        assert_eq!(with(V::I(-7), vec![]).unwrap().ts, -7.0);
        assert_eq!(with(V::U64(u64::MAX), vec![]).unwrap().ts, u64::MAX as f64);
        assert_eq!(
            with(V::F64(1.0), vec![V::Nil]).unwrap().data_parallel_rank,
            None
        );
        assert_eq!(
            with(V::F64(1.0), vec![u(7)]).unwrap().data_parallel_rank,
            Some(7)
        );
        assert_eq!(with(s("now"), vec![]).unwrap_err().kind, K::FieldType);
        assert_eq!(with(V::Nil, vec![]).unwrap_err().kind, K::FieldType);
        assert_eq!(
            with(V::F64(1.0), vec![V::I(-1)]).unwrap_err().kind,
            K::FieldType
        );
        assert_eq!(
            with(V::F64(1.0), vec![u(1 << 32)]).unwrap_err().kind,
            K::FieldType
        );
        assert_eq!(
            with(V::F64(1.0), vec![s("0")]).unwrap_err().kind,
            K::FieldType
        );
    }

    #[test]
    fn medium_mapping() {
        let removed_on = |medium: V| {
            decode(&batch(vec![m(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", a(vec![u(1)])),
                ("medium", medium),
            ])]))
            .map(|b| removed(&b, 0).1)
        };
        assert_eq!(removed_on(V::Nil).unwrap(), Medium::Gpu);
        assert_eq!(removed_on(s("GPU")).unwrap(), Medium::Gpu);
        assert_eq!(removed_on(s("CPU")).unwrap(), Medium::Cpu);
        assert_eq!(removed_on(s("cpu")).unwrap(), Medium::Cpu);
        assert_eq!(removed_on(s("STORAGE")).unwrap(), Medium::Storage);
        assert_eq!(removed_on(s("DISK")).unwrap(), Medium::Storage);
        assert_eq!(removed_on(s("NVME")).unwrap_err().kind, K::UnknownMedium);
        assert_eq!(removed_on(s("")).unwrap_err().kind, K::UnknownMedium);
        assert_eq!(removed_on(u(1)).unwrap_err().kind, K::FieldType);
    }

    #[test]
    fn lora_names_share_the_text_buffer() {
        let ev = |name: V| {
            a(vec![
                s("BlockStored"),
                a(vec![u(1)]),
                V::Nil,
                toks(0..1),
                u(1),
                u(1),
                V::Nil,
                name,
            ])
        };
        let b = decode(&batch(vec![
            ev(s("alpha")),
            ev(s("alpha")),
            ev(s("βeta")),
            ev(s("")),
            ev(V::Nil),
        ]))
        .unwrap();
        let names: Vec<_> = (0..5).map(|i| stored(&b, i).4).collect();
        assert_eq!(
            names,
            vec![
                Some("alpha".into()),
                Some("alpha".into()),
                Some("βeta".into()),
                None,
                None
            ]
        );
        assert_eq!(b.text, "alphaβeta");
    }

    #[test]
    fn every_error_kind() {
        let one = |ev: V| err(&batch(vec![ev]));
        let stored_with = |extra: Vec<(&str, V)>| {
            let mut e = vec![
                ("type", s("BlockStored")),
                ("block_hashes", a(vec![u(1), u(2)])),
                ("token_ids", toks(0..8)),
                ("block_size", u(4)),
            ];
            e.extend(extra);
            one(m(e))
        };
        let mut ok = enc(&batch(vec![ref_stored()]));

        // Truncated: every strict prefix of a valid payload.
        for cut in 0..ok.len() {
            let mut out = DecodedBatch::default();
            let e = decode_batch(&ok[..cut], &mut out).unwrap_err();
            assert_eq!(e.kind, K::Truncated, "prefix of {cut} bytes: {e}");
        }
        // Truncated: a length prefix larger than the payload.
        assert_eq!(
            decode_batch(
                &[0xdd, 0xff, 0xff, 0xff, 0xff, 0xcb],
                &mut DecodedBatch::default()
            )
            .unwrap_err()
            .kind,
            K::Truncated
        );
        assert_eq!(
            one(a(vec![s("BlockRemoved"), V::Bin(vec![])])).kind,
            K::FieldType
        );

        // TrailingBytes.
        ok.push(0xc0);
        assert_eq!(
            decode_batch(&ok, &mut DecodedBatch::default())
                .unwrap_err()
                .kind,
            K::TrailingBytes
        );

        // BatchShape.
        assert_eq!(err_kind(&m(vec![("ts", V::F64(1.0))])), K::BatchShape);
        assert_eq!(err_kind(&a(vec![V::F64(1.0)])), K::BatchShape);
        assert_eq!(err_kind(&a(vec![V::F64(1.0), V::Nil])), K::BatchShape);
        assert_eq!(err_kind(&V::Nil), K::BatchShape);

        // EventShape.
        assert_eq!(one(s("BlockStored")).kind, K::EventShape);
        assert_eq!(one(a(vec![])).kind, K::EventShape);
        assert_eq!(one(a(vec![u(0)])).kind, K::EventShape);
        assert_eq!(
            one(m(vec![("block_hashes", a(vec![]))])).kind,
            K::EventShape
        );
        assert_eq!(one(m(vec![("type", u(1))])).kind, K::EventShape);

        // UnknownEventType.
        assert_eq!(
            one(m(vec![("type", s("BlockEvicted"))])).kind,
            K::UnknownEventType
        );
        assert_eq!(one(a(vec![s("blockstored")])).kind, K::UnknownEventType);

        // FieldType: every listed field with a wrong type.
        for (key, bad) in [
            ("block_hashes", V::Nil),
            ("token_ids", V::Nil),
            ("token_ids", a(vec![V::I(-1)])),
            ("token_ids", a(vec![u(1 << 32)])),
            ("token_ids", a(vec![s("1")])),
            ("block_size", V::Nil),
            ("block_size", V::I(-4)),
            ("block_size", u(1 << 32)),
            ("lora_id", s("1")),
            ("lora_id", V::F64(1.0)),
            ("medium", a(vec![])),
            ("lora_name", u(1)),
            ("lora_name", V::Bin(b"x".to_vec())),
            ("extra_keys", s("x")),
            ("extra_keys", a(vec![u(1)])),
            ("group_idx", s("0")),
            ("kv_cache_spec_kind", u(0)),
            ("kv_cache_spec_sliding_window", s("4096")),
            ("locality", V::Bool(true)),
            ("ownership", u(1)),
            ("session_id", u(1)),
            ("lookahead_token_ids", s("x")),
            ("lookahead_token_ids", a(vec![V::Nil])),
            ("lookahead_token_ids", a(vec![a(vec![V::I(-1)])])),
        ] {
            let e = stored_with(vec![(key, bad.clone())]);
            assert_eq!(e.kind, K::FieldType, "{key} = {bad:?}: {e}");
            assert_eq!(e.event_index, Some(0));
        }
        // Invalid UTF-8 in a string field.
        let mut p = enc(&batch(vec![a(vec![
            s("BlockRemoved"),
            a(vec![]),
            s("G\u{e9}"),
        ])]));
        let at = p.len() - 3; // the "é" bytes
        p[at] = 0xff;
        assert_eq!(
            decode_batch(&p, &mut DecodedBatch::default())
                .unwrap_err()
                .kind,
            K::FieldType
        );
        // Reserved marker inside a skipped value.
        let mut p = enc(&batch(vec![m(vec![
            ("type", s("AllBlocksCleared")),
            ("x", V::Nil),
        ])]));
        let at = p.len() - 2; // the nil value of "x"
        p[at] = 0xc1;
        assert_eq!(
            decode_batch(&p, &mut DecodedBatch::default())
                .unwrap_err()
                .kind,
            K::FieldType
        );

        // HashType.
        for bad in [s("h"), V::F64(1.0), V::Nil, a(vec![])] {
            let e = one(a(vec![s("BlockRemoved"), a(vec![u(1), bad])]));
            assert_eq!(e.kind, K::HashType);
        }
        assert_eq!(
            one(a(vec![s("BlockStored"), a(vec![]), s("parent")])).kind,
            K::HashType
        );

        // TokenCount.
        assert_eq!(
            stored_with(vec![("token_ids", toks(0..7))]).kind,
            K::TokenCount
        );
        assert_eq!(
            stored_with(vec![("token_ids", toks(0..9))]).kind,
            K::TokenCount
        );
        assert_eq!(
            stored_with(vec![("block_size", u(0)), ("token_ids", a(vec![]))]).kind,
            K::TokenCount
        );
        assert_eq!(
            one(m(vec![
                ("type", s("BlockStored")),
                ("block_hashes", a(vec![u(1)]))
            ]))
            .kind,
            K::TokenCount
        );
        assert_eq!(
            one(m(vec![
                ("type", s("BlockStored")),
                ("token_ids", toks(0..4)),
                ("block_size", u(4))
            ]))
            .kind,
            K::TokenCount
        );

        // UnknownMedium.
        assert_eq!(
            stored_with(vec![("medium", s("HBM"))]).kind,
            K::UnknownMedium
        );

        // TooLarge.
        let big = vec![0u8; MAX_PAYLOAD_BYTES + 1];
        assert_eq!(
            decode_batch(&big, &mut DecodedBatch::default())
                .unwrap_err()
                .kind,
            K::TooLarge
        );

        // The event index points at the failing event.
        let e = err(&batch(vec![
            m(vec![("type", s("AllBlocksCleared"))]),
            m(vec![("type", s("Nope"))]),
        ]));
        assert_eq!((e.kind, e.event_index), (K::UnknownEventType, Some(1)));
        assert_eq!(err(&a(vec![V::Nil, a(vec![])])).event_index, None);
    }

    #[test]
    fn error_kinds_names_and_display() {
        let names: std::collections::HashSet<_> =
            DecodeErrorKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), DecodeErrorKind::ALL.len());
        assert!(names
            .iter()
            .all(|n| n.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
        let e = DecodeError::new(K::HashType, "block hash is not uint64, int64 or bin").in_event(3);
        assert_eq!(
            e.to_string(),
            "kv event payload: hash_type: block hash is not uint64, int64 or bin (event 3)"
        );
        assert_eq!(K::TooLarge.to_string(), "too_large");
    }

    #[test]
    fn reused_batch_is_cleared_and_stops_allocating() {
        let big = enc(&batch(vec![
            ref_stored(),
            a(vec![
                s("BlockStored"),
                a(vec![u(1)]),
                V::Nil,
                toks(0..16),
                u(16),
                V::Nil,
                V::Nil,
                s("lora"),
            ]),
        ]));
        let small = enc(&a(vec![
            V::F64(9.0),
            a(vec![m(vec![("type", s("AllBlocksCleared"))])]),
        ]));
        let mut out = DecodedBatch::default();
        decode_batch(&big, &mut out).unwrap();
        let caps = |b: &DecodedBatch| {
            (
                b.events.capacity(),
                b.hashes.capacity(),
                b.tokens.capacity(),
                b.text.capacity(),
                b.events.as_ptr(),
                b.hashes.as_ptr(),
                b.tokens.as_ptr(),
                b.text.as_ptr(),
            )
        };
        let warm = caps(&out);
        decode_batch(&small, &mut out).unwrap();
        assert_eq!(out.events, vec![DecodedEvent::Cleared]);
        assert!(out.hashes.is_empty() && out.tokens.is_empty() && out.text.is_empty());
        assert_eq!((out.ts, out.data_parallel_rank), (9.0, None));
        for _ in 0..3 {
            decode_batch(&big, &mut out).unwrap();
            assert_eq!(caps(&out), warm, "a warmed-up batch reallocated");
        }
        // A failed decode leaves no stale events from the previous batch before the failure.
        let bad = enc(&batch(vec![m(vec![("type", s("Nope"))])]));
        assert!(decode_batch(&bad, &mut out).is_err());
        assert!(out.events.is_empty());
    }
}
