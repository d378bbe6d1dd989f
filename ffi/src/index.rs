//! Event → index → lookup through C: typed KV event batches, overlap queries into caller
//! buffers, and tokens → block hashes.

use std::cell::Cell;
use std::os::raw::c_char;

use kvr::hash::HashSalt;
use kvr::hash::{local_block_hash, next_sequence_hash};
use kvr::{IndexError, TieredScores};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

use crate::handles::kvr_partition;
use crate::status::*;

/// A block in GPU memory (vLLM medium "GPU"), the primary tier.
pub const KVR_TIER_DEVICE: u32 = 0;
/// A block in host memory ("CPU").
pub const KVR_TIER_HOST: u32 = 1;
/// A block on disk ("STORAGE").
pub const KVR_TIER_DISK: u32 = 2;

/// `blocks` were stored, extending the chain ending at `parent` (if `has_parent`).
pub const KVR_EVENT_STORED: u32 = 0;
/// The rank evicted `removed` (engine block hashes) from `tier`.
pub const KVR_EVENT_REMOVED: u32 = 1;
/// The rank dropped its whole cache.
pub const KVR_EVENT_CLEARED: u32 = 2;

/// One stored block: the engine's own opaque block hash and kvr's local hash of the
/// block's tokens (`kvr_hash_tokens` / `kvr_partition_hash_tokens`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvr_stored_block {
    pub external_hash: u64,
    pub local_hash: u64,
}

/// One KV event of a rank. Fields a kind does not use are ignored.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_event {
    /// `KVR_EVENT_STORED`, `KVR_EVENT_REMOVED` or `KVR_EVENT_CLEARED`.
    pub kind: u32,
    /// `KVR_TIER_*` (stored, removed).
    pub tier: u32,
    /// Stored: non-zero if `parent` names the block this chain extends.
    pub has_parent: u32,
    /// Must be 0.
    pub reserved: u32,
    /// Stored: the engine hash of the parent block.
    pub parent: u64,
    /// Stored: the blocks, in chain order (`n_blocks` of them).
    pub blocks: *const kvr_stored_block,
    pub n_blocks: usize,
    /// Removed: engine block hashes (`n_removed` of them).
    pub removed: *const u64,
    pub n_removed: usize,
}

/// What one `kvr_partition_apply_events` call did.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_apply_result {
    pub events_applied: u64,
    /// Events refused by the index (unknown parent, rank limit); counted in its stats.
    pub events_rejected: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Removed hashes the rank did not hold.
    pub blocks_not_found: u64,
}

/// One rank's overlap with a prompt, in leading blocks: `device` blocks on the device,
/// then `host` more in host memory, then `disk` more on disk.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_overlap {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
}

fn tier_of(t: u32) -> Result<Tier, kvr_status> {
    match t {
        KVR_TIER_DEVICE => Ok(Tier::Device),
        KVR_TIER_HOST => Ok(Tier::Host),
        KVR_TIER_DISK => Ok(Tier::Disk),
        _ => Err(KVR_ERR_INVALID_ARGUMENT),
    }
}

/// A validated event, borrowing the caller's arrays.
enum Checked<'a> {
    Stored(Tier, Option<u64>, &'a [StoredBlock]),
    Removed(Tier, &'a [u64]),
    Cleared,
}

/// Checks one event's kind, tier and arrays without applying anything.
///
/// # Safety
/// The event's arrays point to their lengths in elements, valid for `'a`.
unsafe fn check<'a>(e: &'a kvr_event) -> Result<Checked<'a>, kvr_status> {
    if e.reserved != 0 {
        return Err(KVR_ERR_INVALID_ARGUMENT);
    }
    Ok(match e.kind {
        KVR_EVENT_STORED => {
            // SAFETY: forwarded caller contract.
            let blocks = unsafe { slice(e.blocks, e.n_blocks) }?;
            // SAFETY: kvr_stored_block and StoredBlock are both two u64s in this order
            // (repr(C) here; StoredBlock's layout is asserted below), so the slice is a
            // valid slice of StoredBlock with the same length and lifetime.
            let blocks = unsafe {
                std::slice::from_raw_parts(blocks.as_ptr().cast::<StoredBlock>(), blocks.len())
            };
            Checked::Stored(
                tier_of(e.tier)?,
                (e.has_parent != 0).then_some(e.parent),
                blocks,
            )
        }
        KVR_EVENT_REMOVED => {
            // SAFETY: forwarded caller contract.
            let hashes = unsafe { slice(e.removed, e.n_removed) }?;
            Checked::Removed(tier_of(e.tier)?, hashes)
        }
        KVR_EVENT_CLEARED => Checked::Cleared,
        _ => return Err(KVR_ERR_INVALID_ARGUMENT),
    })
}

const _: () = {
    assert!(std::mem::size_of::<StoredBlock>() == 16);
    assert!(std::mem::align_of::<StoredBlock>() == 8);
    assert!(std::mem::offset_of!(StoredBlock, external_hash) == 0);
    assert!(std::mem::offset_of!(StoredBlock, local_hash) == 8);
};

/// Applies a batch of one rank's events in order. The whole batch is checked first: a
/// malformed event (unknown kind or tier, `(NULL, n > 0)` array, non-zero `reserved`)
/// fails the call with nothing applied. Then every event is applied; one the index
/// refuses (its parent is unknown, or the rank limit is reached) is skipped and counted,
/// the rest still apply, and the call returns the first refusal's status
/// (`KVR_ERR_PARENT_NOT_FOUND`, `KVR_ERR_TOO_MANY_RANKS`). `out` (may be NULL) gets the
/// counts either way.
///
/// The rank is checked first, and a refused one applies nothing (every event counted in
/// `out->events_rejected` and the batch in `kvr_indexer_stats.ingress_refused`): a
/// registered worker's DP rank must be one of its own (else `KVR_ERR_UNKNOWN_RANK`); a
/// worker not registered yet (engines may publish before the host registers them) is
/// taken only for a DP rank below `KVR_MAX_DP_SIZE` and within the partition's budget of
/// such ranks, `KVR_MAX_PENDING_RANKS` (else `KVR_ERR_UNKNOWN_WORKER`). Writers to one rank
/// serialize; other ranks and all lookups proceed.
///
/// A partition whose indexer policy applies no engine events (KV events off, or a remote
/// primary) ignores a well-formed batch, as `kvr_partition_ingest` does: `KVR_OK`, nothing
/// applied, one batch counted in `kvr_indexer_stats.events_ignored`.
///
/// # Safety
/// `partition` is NULL or live; `events` points to `n` events whose arrays point to their
/// lengths; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_apply_events(
    partition: *const kvr_partition,
    worker_id: u64,
    dp_rank: u32,
    events: *const kvr_event,
    n: usize,
    out: *mut kvr_apply_result,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, events) = unsafe { (handle(partition)?, slice(events, n)?) };
        for e in events {
            // SAFETY: forwarded caller contract.
            unsafe { check(e) }?;
        }
        let mut r = kvr_apply_result::default();
        let rank = RankId::new(worker_id, dp_rank);
        let applied = p.partition.apply_events(
            rank,
            events.iter().filter_map(|e| {
                // SAFETY: checked above; the contract holds for the whole call.
                Some(match unsafe { check(e) }.ok()? {
                    Checked::Stored(tier, parent, blocks) => KvEvent::Stored {
                        tier,
                        parent,
                        blocks,
                    },
                    Checked::Removed(tier, external_hashes) => KvEvent::Removed {
                        tier,
                        external_hashes,
                    },
                    Checked::Cleared => KvEvent::Cleared,
                })
            }),
        );
        if applied.rank_refused {
            r.events_rejected = applied.rejected;
            // SAFETY: forwarded caller contract.
            unsafe { write_opt(out, r) };
            let member = p.partition.workers().get(worker_id).is_some();
            return Err(if member {
                KVR_ERR_UNKNOWN_RANK
            } else {
                KVR_ERR_UNKNOWN_WORKER
            });
        }
        r.events_applied = applied.applied;
        r.events_rejected = applied.rejected;
        r.blocks_stored = applied.blocks_stored;
        r.blocks_removed = applied.blocks_removed;
        r.blocks_not_found = applied.blocks_not_found;
        let first_refusal = applied.first_refusal.map(|err| match err {
            IndexError::ParentNotFound { .. } => KVR_ERR_PARENT_NOT_FOUND,
            IndexError::TooManyRanks => KVR_ERR_TOO_MANY_RANKS,
            _ => KVR_ERR_INVALID_ARGUMENT,
        });
        // SAFETY: forwarded caller contract.
        unsafe { write_opt(out, r) };
        first_refusal.map_or(Ok(()), Err)
    })
}

std::thread_local! {
    static TIERED_SCRATCH: Cell<Option<Box<TieredScores>>> = const { Cell::new(None) };
}

/// Copies `entries` into the caller's buffer, or reports the size needed.
fn deliver(
    n: usize,
    entries: impl Iterator<Item = kvr_overlap>,
    out: &mut [kvr_overlap],
    out_len: *mut usize,
) -> Ret {
    // SAFETY: out_len was checked non-NULL by the caller of `deliver`.
    unsafe { out_len.write(n) };
    if n > out.len() {
        return Err(KVR_BUFFER_TOO_SMALL);
    }
    for (slot, e) in out.iter_mut().zip(entries) {
        *slot = e;
    }
    Ok(())
}

/// The body both lookups share: argument checks, the overlap, and its delivery into the
/// caller's buffer: every rank with its tiers (`tiered`), or the ranks holding a device
/// prefix with their device blocks only.
///
/// # Safety
/// As the exported lookups.
unsafe fn lookup(
    partition: *const kvr_partition,
    local_hashes: *const u64,
    n: usize,
    out: *mut kvr_overlap,
    cap: usize,
    out_len: *mut usize,
    tiered: bool,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, hashes, out) = unsafe {
            (
                handle(partition)?,
                slice(local_hashes, n)?,
                slice_mut(out, cap)?,
            )
        };
        if out_len.is_null() {
            return Err(KVR_ERR_NULL);
        }
        let mut scores = TIERED_SCRATCH.with(|c| c.take()).unwrap_or_default();
        p.partition.overlap(hashes, &mut scores);
        // Untiered, device overlap only: a rank whose prefix starts in host memory or on
        // disk scores 0 there, and is absent.
        let listed = || {
            scores
                .as_slice()
                .iter()
                .filter(move |t| tiered || t.device > 0)
        };
        let r = deliver(
            listed().count(),
            listed().map(|t| kvr_overlap {
                worker_id: t.rank.worker_id,
                dp_rank: t.rank.dp_rank,
                device_blocks: t.device,
                host_blocks: if tiered { t.host } else { 0 },
                disk_blocks: if tiered { t.disk } else { 0 },
            }),
            out,
            out_len,
        );
        TIERED_SCRATCH.with(|c| c.set(Some(scores)));
        r
    })
}

/// Device overlap per rank of a prompt given as local block hashes: ranks holding at least
/// its first block, sorted by (worker, DP rank), `host_blocks`/`disk_blocks` 0. Writes at
/// most `cap` entries to `out` and their number to `*out_len`; if more are needed,
/// returns `KVR_BUFFER_TOO_SMALL` with the number needed in `*out_len` and writes
/// nothing else. The overlap is the one selection scores: the indexer policy's primary
/// (the local index, lock-free; or the remote primary, asked within its timeouts) raised
/// to the prediction side index's per-rank maximum. Allocates nothing once the thread has
/// warmed up (local primaries).
///
/// # Safety
/// `partition` is NULL or live; `local_hashes` points to `n` values; `out` to `cap`
/// writable entries; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_find_matches(
    partition: *const kvr_partition,
    local_hashes: *const u64,
    n: usize,
    out: *mut kvr_overlap,
    cap: usize,
    out_len: *mut usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { lookup(partition, local_hashes, n, out, cap, out_len, false) }
}

/// Tiered overlap per rank (device, then host, then disk), with the buffer rules of
/// `kvr_partition_find_matches`.
///
/// # Safety
/// As `kvr_partition_find_matches`.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_find_matches_tiered(
    partition: *const kvr_partition,
    local_hashes: *const u64,
    n: usize,
    out: *mut kvr_overlap,
    cap: usize,
    out_len: *mut usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { lookup(partition, local_hashes, n, out, cap, out_len, true) }
}

/// Hashes complete blocks of `tokens` into the caller's buffers (either may be NULL).
fn hash_into(
    block_size: usize,
    salt: HashSalt,
    tokens: &[u32],
    local: Option<&mut [u64]>,
    seq: Option<&mut [u64]>,
    out_len: *mut usize,
) -> Ret {
    let blocks = tokens.len() / block_size;
    // SAFETY: out_len was checked non-NULL by the caller of `hash_into`.
    unsafe { out_len.write(blocks) };
    let cap = local
        .as_ref()
        .map_or(usize::MAX, |l| l.len())
        .min(seq.as_ref().map_or(usize::MAX, |s| s.len()));
    if blocks > cap {
        return Err(KVR_BUFFER_TOO_SMALL);
    }
    let (mut local, mut seq) = (local, seq);
    let mut prev = None;
    for (i, chunk) in tokens.chunks_exact(block_size).enumerate() {
        let l = local_block_hash(chunk, salt);
        if let Some(out) = local.as_deref_mut() {
            out[i] = l;
        }
        if let Some(out) = seq.as_deref_mut() {
            let s = next_sequence_hash(prev, l);
            out[i] = s;
            prev = Some(s);
        }
    }
    Ok(())
}

/// Shared argument handling of the two hashing exports.
///
/// # Safety
/// As `kvr_hash_tokens`.
#[allow(clippy::too_many_arguments)]
unsafe fn hash_call(
    block_size: u32,
    salt: impl FnOnce(Option<&str>) -> HashSalt,
    lora: *const c_char,
    lora_len: usize,
    tokens: *const u32,
    n_tokens: usize,
    local_out: *mut u64,
    seq_out: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> Ret {
    if block_size == 0 {
        return Err(KVR_ERR_INVALID_ARGUMENT);
    }
    if out_len.is_null() {
        return Err(KVR_ERR_NULL);
    }
    // SAFETY: forwarded caller contract.
    let (lora, tokens) = unsafe { (str_arg(lora, lora_len)?, slice(tokens, n_tokens)?) };
    let bufs = |p: *mut u64| -> Result<Option<&mut [u64]>, kvr_status> {
        if p.is_null() {
            Ok(None)
        } else {
            // SAFETY: forwarded caller contract: non-NULL buffers hold `cap` values.
            Ok(Some(unsafe { slice_mut(p, cap) }?))
        }
    };
    let (local, seq) = (bufs(local_out)?, bufs(seq_out)?);
    hash_into(
        block_size as usize,
        salt((!lora.is_empty()).then_some(lora)),
        tokens,
        local,
        seq,
        out_len,
    )
}

/// Block hashes of `tokens`, computed as Dynamo computes them: for each complete block of
/// `block_size` tokens (a trailing partial block is not hashed), its local hash into
/// `local_out` and its chained sequence hash into `seq_out`; either may be NULL. `lora`
/// and `cache_namespace` salt the hashes (`(NULL, 0)` = none). `*out_len` receives the
/// number of complete blocks; if that exceeds `cap`, `KVR_BUFFER_TOO_SMALL` and nothing
/// is written. Pure; thread-safe; allocates nothing.
///
/// # Safety
/// The strings point to their lengths in bytes, `tokens` to `n_tokens` values, non-NULL
/// outputs to `cap` writable values each (not overlapping), `out_len` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_hash_tokens(
    block_size: u32,
    lora: *const c_char,
    lora_len: usize,
    cache_namespace: *const c_char,
    cache_namespace_len: usize,
    tokens: *const u32,
    n_tokens: usize,
    local_out: *mut u64,
    seq_out: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let ns = unsafe { str_arg(cache_namespace, cache_namespace_len) }?;
        let ns = (!ns.is_empty()).then_some(ns);
        // SAFETY: forwarded caller contract.
        unsafe {
            hash_call(
                block_size,
                |lora| HashSalt::new(lora, ns),
                lora,
                lora_len,
                tokens,
                n_tokens,
                local_out,
                seq_out,
                cap,
                out_len,
            )
        }
    })
}

/// `kvr_hash_tokens` with the partition's block size and cache namespace: the hashes
/// its events and lookups expect.
///
/// # Safety
/// `partition` is NULL or live; otherwise as `kvr_hash_tokens`.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_hash_tokens(
    partition: *const kvr_partition,
    lora: *const c_char,
    lora_len: usize,
    tokens: *const u32,
    n_tokens: usize,
    local_out: *mut u64,
    seq_out: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        let ns = p.partition.config().cache_namespace.as_deref();
        // SAFETY: forwarded caller contract.
        unsafe {
            hash_call(
                p.partition.block_size(),
                |lora| HashSalt::new(lora, ns),
                lora,
                lora_len,
                tokens,
                n_tokens,
                local_out,
                seq_out,
                cap,
                out_len,
            )
        }
    })
}
