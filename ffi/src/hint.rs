//! Transfer hints through C (`kv_hint`): a booked selection may name a peer
//! rank that holds more of the prompt on its device, with the control endpoint to pull it
//! from. Configured on the partition options; read with
//! `kvr_partition_select_and_reserve_with_hint`.
//!
//! The hint is a plain struct with the endpoint inline (at most
//! `KVR_CONTROL_ENDPOINT_MAX_LEN` bytes, enforced when a worker's endpoint is set), so a
//! Go host can pass it through cgo without a C-side buffer and nothing is allocated for it.

use std::os::raw::c_char;

use kvr::BackendRole;

use kvr::config::HintConfig;
use kvr::KvHint;

use crate::handles::kvr_partition_options;
use crate::status::*;
use crate::workers::{
    KVR_CONTROL_ENDPOINT_MAX_LEN, KVR_ROLE_AGGREGATED, KVR_ROLE_DECODE, KVR_ROLE_PREFILL,
};

/// Size of `kvr_kv_hint.control_endpoint`: the longest endpoint and its NUL.
pub const KVR_CONTROL_ENDPOINT_CAP: usize = 512;
const _: () = assert!(KVR_CONTROL_ENDPOINT_CAP == KVR_CONTROL_ENDPOINT_MAX_LEN + 1);

/// Bit of a role in a role mask (`1 << KVR_ROLE_*`).
pub const KVR_ROLE_MASK_AGGREGATED: u32 = 1 << KVR_ROLE_AGGREGATED;
pub const KVR_ROLE_MASK_PREFILL: u32 = 1 << KVR_ROLE_PREFILL;
pub const KVR_ROLE_MASK_DECODE: u32 = 1 << KVR_ROLE_DECODE;

/// A transfer hint: the chosen rank may pull prompt blocks `[block_start, block_end)`
/// from rank `(source_worker_id, source_dp_rank)` through `control_endpoint` instead of
/// computing them.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_kv_hint {
    pub source_worker_id: u64,
    pub source_dp_rank: u32,
    pub block_start: u32,
    pub block_end: u32,
    /// Bytes of `control_endpoint` (≤ `KVR_CONTROL_ENDPOINT_MAX_LEN`).
    pub control_endpoint_len: u32,
    /// The source engine's block hashes written to the request's hint-names buffer
    /// (`kvr_request_set_hint_names_buffer`; 0 without one): the first
    /// `n_block_hashes` blocks of the range, by the source's own names.
    pub n_block_hashes: u32,
    /// The source rank's control endpoint, UTF-8 and NUL-terminated.
    pub control_endpoint: [c_char; KVR_CONTROL_ENDPOINT_CAP],
}

impl kvr_kv_hint {
    pub(crate) fn of(h: &KvHint) -> Self {
        let mut out = kvr_kv_hint {
            source_worker_id: h.source.worker_id,
            source_dp_rank: h.source.dp_rank,
            block_start: h.block_range.0,
            block_end: h.block_range.1,
            control_endpoint_len: 0,
            n_block_hashes: 0,
            control_endpoint: [0; KVR_CONTROL_ENDPOINT_CAP],
        };
        // Endpoints registered through C are never longer; one registered through Rust
        // is cut at a character boundary rather than overflow.
        let ep = h.control_endpoint.as_str();
        let mut n = ep.len().min(KVR_CONTROL_ENDPOINT_MAX_LEN);
        while !ep.is_char_boundary(n) {
            n -= 1;
        }
        for (d, &b) in out.control_endpoint.iter_mut().zip(&ep.as_bytes()[..n]) {
            *d = b as c_char;
        }
        out.control_endpoint_len = n as u32;
        out
    }
}

/// Transfer hints on booked selections. A hint is attached when an eligible rank holds a
/// device prefix at least `min_advantage_blocks` longer than the chosen rank's; it asks for
/// at most `max_transfer_blocks` blocks (0 turns hints off, the default). Eligible: a role
/// in `source_roles` (a mask of `KVR_ROLE_MASK_*`, not 0), a control endpoint for that
/// rank, and not overloaded or busy. Defaults as Dynamo: 4, 4,096, prefill | aggregated.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_kv_hints(
    opts: *mut kvr_partition_options,
    min_advantage_blocks: u32,
    max_transfer_blocks: u32,
    source_roles: u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        if max_transfer_blocks == 0 {
            o.config.hints = None;
            return Ok(());
        }
        let all = KVR_ROLE_MASK_AGGREGATED | KVR_ROLE_MASK_PREFILL | KVR_ROLE_MASK_DECODE;
        if source_roles == 0 || source_roles & !all != 0 {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        let roles = [
            (KVR_ROLE_MASK_AGGREGATED, BackendRole::Aggregated),
            (KVR_ROLE_MASK_PREFILL, BackendRole::Prefill),
            (KVR_ROLE_MASK_DECODE, BackendRole::Decode),
        ];
        o.config.hints = Some(HintConfig {
            min_advantage_blocks,
            max_transfer_blocks,
            source_roles: roles
                .iter()
                .filter(|(bit, _)| source_roles & bit != 0)
                .map(|&(_, r)| r)
                .collect(),
        });
        Ok(())
    })
}
