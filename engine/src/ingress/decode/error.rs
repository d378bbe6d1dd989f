//! Why a payload was rejected: [`DecodeErrorKind`] (one counter label per kind) and
//! [`DecodeError`] (kind, event index, fixed detail).

use std::fmt;

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
    /// Retired: no longer produced (a store whose token ids do not fill its blocks now
    /// skips only itself, counted in `StreamStats::events_skipped_malformed`, and a store
    /// without token ids applies to the blocks kvr knows). Kept so that every kind keeps
    /// its number in the C ABI's per-kind counters.
    TokenCount,
    /// Retired: no longer produced (an unknown `medium` now skips its event, counted in
    /// `StreamStats::events_skipped_medium`, and the batch applies). Kept so that every
    /// kind keeps its number in the C ABI's per-kind counters.
    UnknownMedium,
    /// The payload is larger than [`MAX_PAYLOAD_BYTES`].
    ///
    /// [`MAX_PAYLOAD_BYTES`]: super::MAX_PAYLOAD_BYTES
    TooLarge,
    /// Bytes follow the batch array.
    TrailingBytes,
}

impl DecodeErrorKind {
    /// Every cause, in a fixed order (counters list them all).
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
    /// The cause.
    pub kind: DecodeErrorKind,
    /// The event it was found in (`None`: the batch envelope).
    pub event_index: Option<usize>,
    /// What was wrong, in words.
    pub detail: &'static str,
}

impl DecodeError {
    #[cold]
    pub(super) fn new(kind: DecodeErrorKind, detail: &'static str) -> Self {
        Self {
            kind,
            event_index: None,
            detail,
        }
    }

    #[cold]
    pub(super) fn truncated() -> Self {
        Self::new(DecodeErrorKind::Truncated, "payload ends inside a value")
    }

    #[cold]
    pub(super) fn in_event(mut self, index: usize) -> Self {
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

pub(super) type Result<T> = std::result::Result<T, DecodeError>;
