//! The mutation list: every step of an atomic protocol that a loom negative control
//! weakens, and the model that catches it.
//!
//! Each row is one fault flag (`crate::sync::faults::Faults`, or the session table's
//! `SessionFaults`; both compiled under loom only): the flag weakens exactly one step (an
//! ordering, a deferral, an atomic read-modify-write, a re-check under a lock, the order
//! of two steps), and
//! the negative control runs the named model with it and passes only if loom then
//! *rejects* the model, with the failure given. The positive model (the same function,
//! no fault) runs in the suite's loom run and must pass. A flag may have several rows
//! when several models catch it.
//!
//! One command runs every negative control of this table and prints what it caught:
//!
//! ```text
//! bash tests/loom-mutations.sh
//! ```
//!
//! It also fails if a fault flag has no row here, if a `*_negative_*` loom test is not
//! listed, or if a listed test does not exist, so the list cannot drift from the code.
//! (`tests/run-all.sh` runs the same controls as part of `cargo test ... loom_models`,
//! then `bash tests/loom-mutations.sh --check`, the drift check alone; the script's full
//! run is the per-step table.)
//!
//! The audit that asked for this list found seven single-step mutations no model caught;
//! each now has its row: a new slot's key `Release` (`relaxed_slot_key`) and the reader's
//! key `Acquire` (`relaxed_key_load`); the epoch pin removed from `find_matches` and from
//! the tiered query (`unpinned_query`, two rows); the retired-rank check dropped from a
//! booking (`book_ignores_retired`); a load batch published as per-entry swaps in order
//! (`load_publish_per_entry`); the load publisher's mutex removed
//! (`load_publish_unlocked`). Its one flag that weakened three orderings at once is now six
//! flags, one per step (`relaxed_slot_key` … `relaxed_table_load`).
//!
//! | fault flag | weakened step | model | negative control | loom's verdict |
//! |---|---|---|---|---|
//! | `relaxed_slot_key` | table: a new slot's key stored `Relaxed`, not `Release` (a new run linked into the branch table) | `runs::run_link_publication` | `loom_models::runs::run_link_publication_negative_relaxed_key` | causality violation |
//! | `relaxed_key_load` | table: a reader loads a slot's key `Relaxed`, not `Acquire` | `runs::run_link_publication` | `loom_models::runs::run_link_publication_negative_relaxed_key_load` | causality violation |
//! | `relaxed_slot_word` | table: a word stored over a published key (a dead branch key revived by a new run) `Relaxed`, not `Release` | `runs::run_link_revival` | `loom_models::runs::run_link_revival_negative_relaxed_word` | causality violation |
//! | `relaxed_word_load` | table: a reader loads a found slot's word `Relaxed`, not `Acquire` | `runs::run_link_revival` | `loom_models::runs::run_link_revival_negative_relaxed_word_load` | causality violation |
//! | `relaxed_table_swap` | table: a rebuilt table swapped in `Relaxed`, not `Release` | `table_rebuild_reclamation` | `loom_models::table_rebuild_publication_negative_relaxed_swap` | causality violation |
//! | `relaxed_table_load` | table: a reader loads the shard's table word `Relaxed`, not `Acquire` | `table_rebuild_reclamation` | `loom_models::table_rebuild_publication_negative_relaxed_table_load` | causality violation |
//! | `free_table_now` | table: a replaced table freed at once, not deferred through the epoch | `table_rebuild_reclamation` | `loom_models::table_rebuild_reclamation_negative_free_now` | causality violation |
//! | `relaxed_run_state` | run index: a run's new state published `Relaxed`, not `Release` | `runs::run_state_publication` | `loom_models::runs::run_state_publication_negative_relaxed_state` | causality violation |
//! | `free_locals_now` | run index: an outgrown local-hash array freed at once, not deferred | `runs::run_locals_reclamation` | `loom_models::runs::run_locals_reclamation_negative_free_now` | causality violation |
//! | `free_run_now` | run index: an unlinked run freed at once, not deferred (`find_matches` walking it) | `runs::run_retirement` | `loom_models::runs::run_retirement_negative_free_now` | causality violation |
//! | `free_run_now` | run index: the same, the tiered query (what selection calls) walking it | `runs::run_retirement_tiered` | `loom_models::runs::run_retirement_tiered_negative_free_now` | causality violation |
//! | `unpinned_query` | queries: `find_matches` walks without pinning the epoch | `runs::run_retirement` | `loom_models::runs::run_retirement_negative_unpinned_query` | causality violation |
//! | `unpinned_query` | queries: the tiered query (what selection calls) walks without pinning the epoch | `runs::run_retirement_tiered` | `loom_models::runs::run_retirement_tiered_negative_unpinned_query` | causality violation |
//! | `reuse_slot_now` | ranks: a removed rank's slot reusable at once, not after the readers' epoch | `rank_slot_reuse` | `loom_models::rank_slot_reuse_negative_reuse_now` | overcount (a new rank credited with the old rank's block) |
//! | `free_directory_now` | ranks: an outgrown slot → rank directory freed at once, not deferred | `directory::rank_directory_growth` | `loom_models::directory::rank_directory_growth_negative_free_now` | causality violation |
//! | `skip_partition_scan` | engine: a lifecycle call trusts the selection-id index alone (no partition scan for replica bookings) | `selection_id_index_and_partition_scan` | `loom_models::selection_id_index_negative_no_scan_fallback` | a replica booking not found |
//! | `release_before_remove` | reservations: a freed booking subtracted while still in its shard, then removed (two removers both subtract) | `reservations::reservation_free_races_sweep` | `loom_models::reservations::reservation_free_races_sweep_negative_release_before_remove` | counter would go negative |
//! | `prefill_flag_after_release` | reservations: mark-prefill-complete subtracts outside the shard lock and sets the flag after | `reservations::reservation_mark_prefill_races_free` | `loom_models::reservations::reservation_mark_prefill_races_free_negative_flag_after_release` | counter would go negative |
//! | `split_counter_rmw` | reservations: a rank counter updated by load-then-store, not an atomic read-modify-write | `reservations::reservation_book_races_free` | `loom_models::reservations::reservation_book_races_free_negative_split_rmw` | lost counter update |
//! | `book_ignores_retired` | reservations: a booking adds to the rank state it looked up although the rank was removed meanwhile (the retired check dropped) | `reservations::reservation_book_races_remove_rank` | `loom_models::reservations::reservation_book_races_remove_rank_negative_ignore_retired` | a live booking not counted on its rank |
//! | `group_booking_late` | reservations: a booking counted in its rank's group after it raised the rank's counters, not before | `idle::idle_group_count_spans_the_booking` | `loom_models::idle::idle_group_count_spans_the_booking_negative_booking_late` | a raised counter beside a zero group count |
//! | `group_unbooking_early` | reservations: a release uncounted from its group before it lowered the rank's counters, not after | `idle::idle_group_count_spans_the_release` | `loom_models::idle::idle_group_count_spans_the_release_negative_unbooking_early` | a booked counter beside a zero group count |
//! | `lossy_rate_update` | reservations: a prefill-rate observation (one `EwmaPair` fold) folded by load-then-store, not a compare-and-swap loop | `prefill_rate::prefill_rate_completions_race` | `loom_models::prefill_rate::prefill_rate_completions_race_negative_lossy_update` | an observation lost |
//! | `lossy_rate_update` | reservations: a decode-drag observation's pair folded by load-then-store, not a compare-and-swap loop | `prefill_rate::decode_drag_observations_race` | `loom_models::prefill_rate::decode_drag_observations_race_negative_lossy_update` | an observation lost |
//! | `split_last_prefill_max` | reservations: a rank's last prefill completion advanced by load-then-store, not `fetch_max` | `prefill_rate::prefill_rate_completions_race` | `loom_models::prefill_rate::prefill_rate_completions_race_negative_split_max` | an observation lost (overlapping service windows) |
//! | `split_room_reservation` | approximate recorder: room for new records reserved by load-then-store, not a compare-and-swap loop | `approx::approx_bound_two_ranks` | `loom_models::approx::approx_bound_two_ranks_negative_split_reservation` | over the bound or miscounted |
//! | `record_ignores_retired` | approximate recorder: a recording adds to the rank's records it looked up although the rank was forgotten meanwhile | `approx::approx_record_races_forget` | `loom_models::approx::approx_record_races_forget_negative_ignore_retired` | leaked record |
//! | `reload_load_per_rank` | selection: the reported-load snapshot re-loaded per candidate, not once per selection | `load::load_snapshot_swap_vs_selection` | `loom_models::load::load_snapshot_negative_reload_per_rank` | torn load view |
//! | `load_publish_per_entry` | load view: a batch published as one swap per entry (in order), not one swap | `load::load_snapshot_batches` | `loom_models::load::load_snapshot_batches_negative_per_entry` | torn batch |
//! | `load_publish_unlocked` | load view: two publishers' copy-apply-swap without the publisher mutex | `load::load_snapshot_batches` | `loom_models::load::load_snapshot_batches_negative_unlocked` | lost batch |
//! | `unlist_before_repair` | ingress: a stale stream's ranks unlisted before the step's clear, not after | `freshness::freshness_unlist_after_repair` | `loom_models::freshness::freshness_unlist_after_repair_negative_unlist_first` | stale overlap credited |
//! | `split_last_lease_release` | sessions: "last lease of a final session" decided in one critical section, the entry removed in another | `sessions::session_release_races_next_turn` | `loom_models::sessions::session_release_races_next_turn_negative_split_release` | lost lease |
//! | `split_last_lease_release` | sessions: the same, three threads (a release, the next turn's lookup and bind, its own release) | `sessions::session_turns_race` | `loom_models::sessions::session_turns_race_negative_split_release` | leaked lease |
//! | `ignore_early_release` | sessions: a bind ignores the memory of a lease released before it | `sessions::session_early_release_vs_bind` | `loom_models::sessions::session_early_release_vs_bind_negative_ignore_memory` | leaked lease |
//! | `ignore_early_release` | sessions: the same, three threads | `sessions::session_turns_race` | `loom_models::sessions::session_turns_race_negative_ignore_memory` | leaked lease |
//! | `keep_orphaned_states` | recurrent states: a block the rank stops holding keeps its state (`finish` skips the drop) | `states::state_dropped_with_block` | `loom_models::states::state_dropped_with_block_negative_keep_orphans` | overcount (the state credited when the block comes back) |
//! | `keep_orphaned_states` | recurrent states: the same, the tiered query | `states::state_dropped_with_block_tiered` | `loom_models::states::state_dropped_with_block_tiered_negative_keep_orphans` | overcount (the state credited when the block comes back) |
//! | `drop_orphans_late` | recurrent states: orphaned states dropped after the covers are republished and the run retired, not before | `states::state_run_retirement` | `loom_models::states::state_run_retirement_negative_drop_late` | a state names a run already unlinked |
//! | `unmark_after_free` | recurrent states: a removed rank's slot handed back before its hybrid mark is cleared | `states::hybrid_slot_reuse` (preemption bound 2) | `loom_models::states::hybrid_slot_reuse_negative_unmark_after_free` | a new rank in the slot inherits the hybrid mark (its score cut to 0) |
//! | `floor_lower_keeps_gen` | load floors: a decrement that changes no bound leaves the word as it is (no generation step) | `floors::floor_lower_races_raise` | `loom_models::floors::floor_lower_races_raise_negative_keeps_gen` | a floor above a member's counter |
//! | `floor_raise_ignores_version` | load floors: a selection raises a group's floor without checking the membership version its snapshot recorded | `floors::floor_join_races_raise` | `loom_models::floors::floor_join_races_raise_negative_ignores_version` | a floor above a member's counter |
//! | `floor_combined_reads_with_load` | load floors: after a decrement, the other counter of the combined figure read with a plain load, not a read-modify-write | `floors::floor_combined_decrements_race` | `loom_models::floors::floor_combined_decrements_race_negative_reads_with_load` | a combined floor above the rank's figure |
//!
//! Model names are under `loom_models::`. The models run with loom's preemption bound
//! 3; `model()` prints how many executions each explored (`--nocapture`).
