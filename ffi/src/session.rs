//! Session affinity through C: a partition keeps a session's turns on the
//! rank its first turn was booked on (hard: pinned; soft: preferred by a cost penalty).
//! The session fields travel on the request (`kvr_request_set_session`); how a selection
//! was steered comes back in `kvr_decision.flags`; the table's counters are read here.

use std::time::Duration;

use kvr::config::{AffinityMode, SessionConfig};

use crate::handles::{kvr_partition, kvr_partition_options};
use crate::status::*;

/// No session affinity (the default): session fields only travel with the booking.
pub const KVR_AFFINITY_OFF: u32 = 0;
/// Hard affinity (Dynamo's default when on): a turn goes to its session's rank unless that
/// rank left or cannot take it (then it rebinds, counted).
pub const KVR_AFFINITY_HARD: u32 = 1;
/// Soft affinity: the session's rank has its cost lowered by a penalty, in blocks.
pub const KVR_AFFINITY_SOFT: u32 = 2;

/// Session affinity for the partition. `mode` is `KVR_AFFINITY_*`; `soft_penalty_blocks`
/// (finite, ≥ 0) is used by soft mode only; `max_entries` bounds the sessions held (0 =
/// 65,536); `idle_ttl_ms` drops a session with no live booking that long after its last
/// turn (0 = 600,000). Unknown modes and a bad penalty are `KVR_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_session_affinity(
    opts: *mut kvr_partition_options,
    mode: u32,
    soft_penalty_blocks: f64,
    max_entries: u64,
    idle_ttl_ms: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        let mode = match mode {
            KVR_AFFINITY_OFF => {
                o.config.sessions = None;
                return Ok(());
            }
            KVR_AFFINITY_HARD => AffinityMode::Hard,
            KVR_AFFINITY_SOFT => {
                if !(soft_penalty_blocks.is_finite() && soft_penalty_blocks >= 0.0) {
                    return Err(KVR_ERR_INVALID_ARGUMENT);
                }
                AffinityMode::Soft {
                    penalty_blocks: soft_penalty_blocks,
                }
            }
            _ => return Err(KVR_ERR_INVALID_ARGUMENT),
        };
        let d = SessionConfig::default();
        o.config.sessions = Some(SessionConfig {
            mode,
            max_entries: match max_entries {
                0 => d.max_entries,
                n => usize::try_from(n).unwrap_or(usize::MAX),
            },
            idle_ttl: match idle_ttl_ms {
                0 => d.idle_ttl,
                ms => Duration::from_millis(ms),
            },
            ..d
        });
        Ok(())
    })
}

/// The session table's figures (counters are totals since the partition was created).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_session_stats {
    /// 1 if the partition has session affinity on; every other field is 0 if not.
    pub enabled: u32,
    /// Always 0.
    pub reserved: u32,
    /// Sessions held now (including idle-expired ones not yet reaped), and their live
    /// leases (bookings).
    pub entries: u64,
    pub leases: u64,
    /// Sessions bound by a first booking.
    pub bindings_created: u64,
    /// Bindings moved to another rank, and of those the ones forced because the bound
    /// rank left or could not take the turn.
    pub rebinds: u64,
    pub forced_rebinds: u64,
    /// Bindings dropped because their rank left.
    pub bindings_dropped: u64,
    /// Sessions released because a final turn's last booking ended.
    pub finals_released: u64,
    /// Idle sessions evicted to make room, and new sessions refused because the table was
    /// full of sessions with live bookings.
    pub evicted: u64,
    pub refused: u64,
    /// Idle-expired sessions removed.
    pub reaped: u64,
    /// Session ids refused (empty, or longer than 256 bytes).
    pub invalid_session_ids: u64,
    /// Leases released (bookings of a session freed or expired).
    pub leases_released: u64,
    /// Releases of leases no session held.
    pub unknown_lease_releases: u64,
    /// Bookings bound to their session after their lease was already released (recorded
    /// without the lease).
    pub early_releases: u64,
    /// Binds refused because the booking's lease belonged to another session.
    pub duplicate_leases: u64,
}

/// The partition's session-affinity statistics (all 0, `enabled` 0, without affinity).
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_session_stats(
    partition: *const kvr_partition,
    out: *mut kvr_session_stats,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        let stats = match p.partition.session_stats() {
            None => kvr_session_stats::default(),
            Some(s) => kvr_session_stats {
                enabled: 1,
                reserved: 0,
                entries: s.entries as u64,
                leases: s.leases as u64,
                bindings_created: s.bindings_created,
                rebinds: s.rebinds,
                forced_rebinds: s.forced_rebinds,
                bindings_dropped: s.bindings_dropped,
                finals_released: s.finals_released,
                evicted: s.evicted,
                refused: s.refused,
                reaped: s.reaped,
                invalid_session_ids: s.invalid_session_ids,
                leases_released: s.leases_released,
                unknown_lease_releases: s.unknown_lease_releases,
                early_releases: s.early_releases,
                duplicate_leases: s.duplicate_leases,
            },
        };
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, stats) }
    })
}
