//! The field lists of the engine structs that hosts mirror (DESIGN.md §13: every knob and
//! counter is declared once, mirrored by every host, checked by tests).
//!
//! Each list is tied to its struct at compile time: `field_lists!` rebuilds the struct from
//! exactly the listed fields (no `..`), so adding, removing or renaming a field without
//! updating its list here fails to build ("missing field `x` in initializer", "has no field
//! named `x`"). The hosts' checks compare their mirrors with these lists:
//! the Rust tests through [`FieldNames`] and [`FIELD_LISTS`], the Go and Python tests
//! through `ffi/fields.json`, which a test writes from [`FIELD_LISTS`] and checks.

use crate::config::{
    ApproxConfig, BusyThresholds, CostConfig, HintConfig, IndexerConfig, LatencyConfig,
    PartitionConfig, SessionConfig,
};
use crate::stats::{
    ApproxStats, IndexStats, IndexerStats, ReservationStats, SelectionStats, SequenceStats,
    SessionStats, StreamStats,
};
use crate::{ActiveLoad, CostOverrides, RankLoad};

/// A struct whose fields hosts mirror (C structs and setters, the C++ wrapper, Go, Python,
/// `kvr serve`'s flags and metrics); each host's test compares its mirror with
/// [`FIELDS`](FieldNames::FIELDS), so a field one host forgot fails a test.
pub trait FieldNames {
    /// The struct's name, as the hosts' checks and `ffi/fields.json` call it.
    const NAME: &'static str;
    /// Every field, in declaration order.
    const FIELDS: &'static [&'static str];
    /// The fields that hold another listed struct (directly or in an `Option`), with that
    /// struct's [`NAME`](FieldNames::NAME): a host mirrors them through the nested
    /// struct's own fields.
    const NESTED: &'static [(&'static str, &'static str)];
}

/// One struct's lists, as [`FieldNames`] gives them (an entry of [`FIELD_LISTS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldList {
    /// [`FieldNames::NAME`].
    pub name: &'static str,
    /// [`FieldNames::FIELDS`].
    pub fields: &'static [&'static str],
    /// [`FieldNames::NESTED`].
    pub nested: &'static [(&'static str, &'static str)],
}

impl FieldList {
    /// The lists of `T`.
    pub const fn of<T: FieldNames>() -> Self {
        FieldList {
            name: T::NAME,
            fields: T::FIELDS,
            nested: T::NESTED,
        }
    }
}

/// A field that holds `T`, directly or optionally (compile-time check of `NESTED`).
trait Holds<T> {}
impl<T> Holds<T> for T {}
impl<T> Holds<T> for Option<T> {}

#[allow(dead_code)] // only called by the never-called exhaustiveness checks
fn holds<T: FieldNames, H: Holds<T>>(_: &H) {}

/// Implements [`FieldNames`] for each struct and checks each list against its struct: a
/// never-called function rebuilds it from the listed fields, without `..`, and checks that
/// a field marked `field: Nested` holds `Nested`.
macro_rules! field_lists {
    ($($ty:ident { $($field:ident $(: $nested:ident)?),* $(,)? })*) => {
        $(
            impl FieldNames for $ty {
                const NAME: &'static str = stringify!($ty);
                const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
                const NESTED: &'static [(&'static str, &'static str)] =
                    &[$($((stringify!($field), stringify!($nested)),)?)*];
            }

            const _: () = {
                #[allow(dead_code, unused_variables)]
                fn exhaustive(v: $ty) -> $ty {
                    $($(holds::<$nested, _>(&v.$field);)?)*
                    $ty { $($field: v.$field),* }
                }
            };
        )*

        /// Every struct with [`FieldNames`], in the order declared here.
        pub const FIELD_LISTS: &[FieldList] = &[$(FieldList::of::<$ty>()),*];
    };
}

field_lists! {
    PartitionConfig {
        block_size, cache_namespace, cost: CostConfig, busy: BusyThresholds, booking_ttl,
        indexer: IndexerConfig, hints: HintConfig, sessions: SessionConfig, index_dump,
        trust_stale_overlap,
    }
    CostConfig {
        model, latency: LatencyConfig, overlap_score_credit, prefill_load_scale,
        host_cache_hit_weight, disk_cache_hit_weight, shared_cache_multiplier, temperature,
        decode_active_request_weight, credit_decay,
    }
    LatencyConfig {
        prefill_rate_prior, learn_prefill_rate, request_overhead_ms, kv_pressure_threshold,
        kv_pressure_ms, itl_target_ms, itl_base_ms, itl_per_request_ms, queue_externality,
        decode_block_us,
    }
    CostOverrides {
        overlap_score_credit, prefill_load_scale, temperature, shared_cache_multiplier,
    }
    BusyThresholds {
        decode_blocks_fraction, prefill_tokens, prefill_tokens_fraction,
    }
    HintConfig {
        min_advantage_blocks, max_transfer_blocks, source_roles,
    }
    SessionConfig {
        mode, max_entries, idle_ttl, shards, max_session_id_bytes, early_release_memory,
    }
    IndexerConfig {
        use_kv_events, prediction_ttl, remote_url, remote_connect_timeout,
        remote_request_timeout, remote_client, approx: ApproxConfig, retention,
    }
    ApproxConfig {
        ttl, max_blocks, prune_to,
    }
    IndexStats {
        ranks, nodes, holder_blocks, tier_blocks, bytes, table_bytes, holder_set_bytes,
        rank_map_bytes, lineage_bytes, stored_events, removed_events, cleared_events,
        parent_not_found, block_not_found, too_many_ranks,
    }
    SelectionStats {
        selections, busy, no_worker, shared_cache_failures, stale_overlaps_ignored,
    }
    SessionStats {
        entries, leases, bindings_created, rebinds, forced_rebinds, bindings_dropped,
        finals_released, evicted, refused, reaped, leases_released, unknown_lease_releases,
        early_releases, duplicate_leases, invalid_session_ids,
    }
    IndexerStats {
        policy, bookings_recorded, record_failures, approx: ApproxStats, remote_queries,
        remote_failures, events_ignored, ingress_refused,
    }
    ApproxStats {
        records, blocks_recorded, blocks_refreshed, blocks_expired, blocks_pruned,
        record_errors, blocks_over_bound,
    }
    ReservationStats {
        bookings, tracked_ranks, expired_total, counter_underflows, sweeper_started,
        prefill_rate, prefill_rate_observations, decode_drag, decode_drag_observations,
    }
    StreamStats {
        worker_id, stream, messages, bytes, batches, events, blocks_stored, blocks_removed,
        events_rejected, dp_rank_refused, block_size_mismatches, events_skipped_group,
        group_switches, events_skipped_medium, events_skipped_malformed,
        tokenless_blocks_unknown, decode_errors, bad_frames,
        sequence: SequenceStats, last_batch_unix_ms, stale_since_unix_ms, health, health_reason,
        health_since_unix_ms, link_failures,
    }
    SequenceStats {
        gaps, restarts, duplicates, replays_requested, replays_filled, replays_partial,
        replays_failed, idle_probes, clears, batches_lost, last_seq, recovering,
    }
    RankLoad {
        kv_blocks_used, kv_blocks_total, waiting_requests, running_requests,
        pending_prefill_tokens,
    }
    ActiveLoad {
        active_prefill_tokens, active_decode_blocks, active_requests,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_unique_and_nested_names_are_listed() {
        let mut names: Vec<&str> = FIELD_LISTS.iter().map(|l| l.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FIELD_LISTS.len(), "a struct listed twice");
        for l in FIELD_LISTS {
            let mut fields = l.fields.to_vec();
            fields.sort_unstable();
            fields.dedup();
            assert_eq!(
                fields.len(),
                l.fields.len(),
                "{}: a field listed twice",
                l.name
            );
            for (field, nested) in l.nested {
                assert!(
                    l.fields.contains(field),
                    "{}.{field} nested but not a field",
                    l.name
                );
                assert!(
                    names.contains(nested),
                    "{}.{field}: {nested} is not listed",
                    l.name
                );
            }
        }
        assert_eq!(IndexStats::NAME, "IndexStats");
        assert_eq!(CostConfig::NESTED, &[("latency", "LatencyConfig")]);
    }
}
