//! What a payload decodes into: the caller-owned, reusable [`DecodedBatch`] whose events
//! ([`DecodedEvent`]) refer to ranges of its shared buffers, the block [`Medium`], and the
//! payload size cap.

use std::ops::Range;

/// Payloads larger than this are rejected ([`DecodeErrorKind::TooLarge`]) before any
/// decoding: decoded hashes can take up to 8× the payload's bytes, so the cap bounds the
/// memory one hostile payload can make a [`DecodedBatch`] grow to. Real batches are far
/// smaller (a 128k-token prefill is ~400 KiB of `token_ids`).
///
/// [`DecodeErrorKind::TooLarge`]: super::DecodeErrorKind::TooLarge
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// Where a block lives (vLLM `medium`, SGLang HiCache, LMCache and connector names seen
/// in the field, REFERENCE.md §9; ASCII case-insensitive):
///
/// | medium | names |
/// |---|---|
/// | [`Medium::Gpu`] (device tier) | absent, nil, `GPU`, `DEVICE` |
/// | [`Medium::Cpu`] (host tier) | `CPU`, `CPU_PINNED`, `CPU_TIER1` |
/// | [`Medium::Storage`] (disk tier) | `CPU_TIER2`, `DISK`, `NVME`, `STORAGE`, and the shared or remote stores `EXTERNAL`, `NETWORK`, `REMOTE`, `SHARED` (the slowest tier kvr knows) |
/// | [`Medium::Unknown`] | any other string: that event is skipped and counted, the rest of the batch applies |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Medium {
    /// GPU memory: the device tier.
    #[default]
    Gpu,
    /// Host memory: the host tier.
    Cpu,
    /// Disk or a shared store: the disk tier.
    Storage,
    /// A name kvr does not know.
    Unknown,
}

impl Medium {
    /// The medium a wire name stands for.
    pub fn from_name(name: &str) -> Medium {
        const NAMES: [(&str, Medium); 13] = [
            ("GPU", Medium::Gpu),
            ("DEVICE", Medium::Gpu),
            ("CPU", Medium::Cpu),
            ("CPU_PINNED", Medium::Cpu),
            ("CPU_TIER1", Medium::Cpu),
            ("CPU_TIER2", Medium::Storage),
            ("DISK", Medium::Storage),
            ("NVME", Medium::Storage),
            ("STORAGE", Medium::Storage),
            ("EXTERNAL", Medium::Storage),
            ("NETWORK", Medium::Storage),
            ("REMOTE", Medium::Storage),
            ("SHARED", Medium::Storage),
        ];
        NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map_or(Medium::Unknown, |&(_, m)| m)
    }
}

/// What a KV-cache group holds (vLLM `kv_cache_spec_kind`): hybrid-attention models
/// publish one event per group (REFERENCE.md §9), and routing follows the full-attention
/// group (see `ingress::translate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SpecKind {
    /// Absent or nil (engines without hybrid groups).
    #[default]
    Unspecified,
    /// A group holding every block of the prefix: `"full_attention"`, `"mla_attention"`,
    /// `"sink_full_attention"`.
    FullAttention,
    /// A recurrent (Mamba, linear-attention) group, `"mamba"`: it holds a state at some
    /// block boundaries, named by the attention blocks' hashes (`index::KvEvent::StatesStored`).
    Recurrent,
    /// Anything else: `"sliding_window"`, `"chunked_local_attention"`, ...
    Other,
}

/// One decoded event. Ranges index the owning [`DecodedBatch`]'s buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodedEvent {
    /// `BlockStored`: `hashes` are the engine's block hashes (`batch.hashes[hashes]`),
    /// chained after `parent`; `tokens` (`batch.tokens[tokens]`) holds exactly
    /// `hashes.len() * block_size` token ids; `block_size >= 1` whenever there are blocks
    /// (it is whatever the engine sent, possibly 0, when `hashes` is empty).
    /// `lora_name` (`&batch.text[range]`) is `None` for nil, absent or empty. `group` is
    /// `group_idx` (`None` for nil or absent; an int outside u32 reads as `u32::MAX`).
    /// `extras` indexes `batch.block_extras`: one range of `batch.extra_keys` per block,
    /// the block's extra-key values (`crate::hash::extra`); empty when no block has any.
    Stored {
        /// The engine's hashes of the stored blocks, in `batch.hashes`.
        hashes: Range<usize>,
        /// The engine's hash of the block they extend, if any.
        parent: Option<u64>,
        /// Their token ids, in `batch.tokens`.
        tokens: Range<usize>,
        /// Tokens per block, as the engine sent it.
        block_size: u32,
        /// The LoRA adapter's name, in `batch.text`.
        lora_name: Option<Range<usize>>,
        /// Where the blocks live.
        medium: Medium,
        /// The KV-cache group (`group_idx`).
        group: Option<u32>,
        /// What the group holds (`kv_cache_spec_kind`).
        spec: SpecKind,
        /// Per-block extra keys, in `batch.block_extras`.
        extras: Range<usize>,
        /// Per-block lookahead tokens (vLLM's `lookahead_token_ids`: the tokens after each
        /// block that its engine hash also covers), in `batch.block_lookahead`; empty
        /// when the engine hashes without lookahead.
        lookahead: Range<usize>,
    },
    /// `BlockStored` that names its blocks only by engine hash: `token_ids` is empty
    /// while `block_hashes` is not, or the store is a recurrent group's (`SpecKind::
    /// Recurrent`, whose token ids span blocks it left out). vLLM's offloading connector
    /// announces host and disk copies this way (a placeholder, `block_size` 0); a
    /// recurrent (Mamba) group announces states so (its device stores, and its state
    /// checkpoints: one hash, kind "mamba"). kvr can apply it only to blocks the rank
    /// already holds on some tier (their tokens are known).
    Tokenless {
        /// The engine's hashes of the blocks, in `batch.hashes`.
        hashes: Range<usize>,
        /// Where the blocks now live.
        medium: Medium,
        /// The KV-cache group (`group_idx`).
        group: Option<u32>,
        /// What the group holds (`kv_cache_spec_kind`).
        spec: SpecKind,
    },
    /// A `BlockStored` kvr cannot use (its token ids do not fill its blocks, or a
    /// per-block list has the wrong length): skipped and counted, the batch's other
    /// events still apply. A missing store can only make the index hold less.
    Malformed {
        /// What was wrong, in words.
        detail: &'static str,
    },
    /// `BlockRemoved`: the engine's hashes of the evicted blocks (`batch.hashes[hashes]`).
    Removed {
        /// The engine's hashes of the evicted blocks, in `batch.hashes`.
        hashes: Range<usize>,
        /// Where they were evicted from.
        medium: Medium,
        /// The KV-cache group (`group_idx`).
        group: Option<u32>,
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
///
/// [`decode_batch`]: super::decode_batch
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodedBatch {
    /// The engine's wall-clock timestamp (seconds); ints and f32 are widened to f64.
    pub ts: f64,
    /// The batch's DP rank; `None` when nil or absent (older payloads have 2 elements).
    pub data_parallel_rank: Option<u32>,
    /// The batch's events, in order.
    pub events: Vec<DecodedEvent>,
    /// Engine block hashes of all events (uint64 as is, int64 as its bits, bin folded to
    /// its last 8 bytes big-endian).
    pub hashes: Vec<u64>,
    /// Token ids of all `Stored` events.
    pub tokens: Vec<u32>,
    /// LoRA names of all `Stored` events.
    pub text: String,
    /// Extra-key values of all `Stored` events' blocks (`crate::hash::extra`).
    pub extra_keys: Vec<u64>,
    /// Per block with extra keys: its range of `extra_keys`.
    pub block_extras: Vec<Range<usize>>,
    /// Lookahead token ids of all `Stored` events' blocks.
    pub lookahead: Vec<u32>,
    /// Per block with lookahead tokens: its range of `lookahead`.
    pub block_lookahead: Vec<Range<usize>>,
}

impl DecodedBatch {
    pub(super) fn reset(&mut self) {
        self.ts = 0.0;
        self.data_parallel_rank = None;
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.text.clear();
        self.extra_keys.clear();
        self.block_extras.clear();
        self.lookahead.clear();
        self.block_lookahead.clear();
    }

    /// The extra-key values of block `i` of a store whose `extras` is `extras` (empty
    /// when the store has none).
    pub fn block_extra_keys(&self, extras: &Range<usize>, i: usize) -> &[u64] {
        match self.block_extras.get(extras.clone()).and_then(|b| b.get(i)) {
            Some(r) => &self.extra_keys[r.clone()],
            None => &[],
        }
    }

    /// The lookahead tokens of block `i` of a store whose `lookahead` is `lookahead`
    /// (empty when the store has none).
    pub fn block_lookahead_tokens(&self, lookahead: &Range<usize>, i: usize) -> &[u32] {
        match self
            .block_lookahead
            .get(lookahead.clone())
            .and_then(|b| b.get(i))
        {
            Some(r) => &self.lookahead[r.clone()],
            None => &[],
        }
    }
}
