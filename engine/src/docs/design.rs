//! The layout of kvr's concurrent structures.
//!
//! Everything concurrent is named in the one concurrency facade, `sync.rs` (std or loom):
//! atomics, [`std::sync::Mutex`] (poison ignored), crossbeam-epoch, an arc-swap cell
//! (`Snapshot`) and a dashmap (`ShardedMap`). Which path takes which of them is in
//! [`super::locking`].
//!
//! # The index's layout
//!
//! - **Runs** (`index::run`): the prompt trie as runs of blocks. A run has a fixed address;
//!   readers load its `state` word (`Acquire`): a pointer to an immutable `State` holding the
//!   visible length, a pointer to the run's local-hash array, and one 16-byte `Cover` per
//!   holding rank (slot-sorted). The local-hash array is append-only: writers fill slots past
//!   every published length, then publish a state that shows them; an outgrown array is
//!   replaced by a copy. Runs are never split.
//! - **Covers** (`index::hold`): per (rank, run), how far that rank's walk goes in the run
//!   for each tier phase it can enter in (device, host, disk): computed by the rank's writer
//!   from its exact per-tier bitmaps of the run's offsets (`Hold`, writer side only).
//! - **Branch table** (`index::branch` over `crate::table`): children by (parent run,
//!   offset, first local hash) → run address, in the sharded lock-free `u64 → u64` table
//!   (per shard an open-addressing array of `(key: AtomicU64, word: AtomicU64)` slots;
//!   shard = low bits of the key, home slot = high bits). A lookup checks the child it finds
//!   against the triple, so a key collision cannot send a walk down a wrong branch.
//! - **Rank writer state** (`index::ranks`, `index::RankWriter`): per rank, behind that
//!   rank's mutex: per tier the engine's hash → the block's place (`BlockRef`: run address
//!   and offset in one word), in a bucketized cuckoo map (`index::block_map`), and per run
//!   it holds a `Hold`. Never read by lookups.
//! - **Slot directory**: slot → rank, an immutable array swapped whole.
//!
//! The invariants these keep are in [`super::invariants`], the orderings in
//! [`super::ordering`].
//!
//! # The load view (`load`)
//!
//! Host-reported load is one immutable `LoadSnapshot` behind an arc-swap cell: publishers
//! serialize on a mutex, copy the map, apply the batch and swap the whole snapshot in;
//! readers load it once per selection. The atomic step is arc-swap's own (loom cannot see
//! it; under loom the cell is a mutex stand-in), so kvr adds no atomic protocol of its own
//! here. What kvr must get right is the *use*: one snapshot per selection. The loom model
//! `load_snapshot_swap_vs_selection` races a batch that swaps which rank is busy against a
//! whole selection (it must never see both busy), and its negative control, which reloads
//! the snapshot per candidate, must fail; `readers_never_see_half_a_batch` checks the
//! whole-batch property of arc-swap itself on real threads.
//!
//! # Bookings (`reservation`)
//!
//! Bookings live in a table sharded by selection id; per-rank counters (active prefill
//! tokens, decode blocks, requests) are atomics read lock-free by selection. A booking's
//! counters are added under its shard lock before it becomes visible, and only whoever
//! removes it from its shard (free, sweep or `remove_rank`) subtracts them, so each is
//! subtracted exactly once; prompt-block refcounts and the decode counter change together
//! under the rank's lock (lock order: shard, then rank). The refcounts are also *read*
//! under the rank's lock: a selection's decode term asks, for a candidate with active
//! prompt blocks, how many of the prompt's blocks are not active on it yet (see
//! [`super::locking`]). The full argument is in `reservation.rs`; the loom models
//! `reservation_*` check book/free/sweep races, each with a negative control.
//!
//! # The selection-id index (`idmap`)
//!
//! Selection id → partition number uses the sharded table (`crate::table`) with plain
//! words (0 = absent): the same key-then-word publication, rebuild and epoch reclamation as
//! the branch table (and the same loom models), so a lifecycle call reads it lock-free. An id is claimed
//! with `insert_new` (a caller-supplied duplicate is refused) before its booking is made,
//! and removed when the booking is freed or the selection booked nothing; partitions are
//! found by number in an arc-swapped vector. A miss, or an id whose partition no longer
//! knows it, falls back to scanning the partitions' tables (replica bookings). Writers of
//! the id index (claim, remove) serialize on the table shard's mutex, like the branch
//! table's writers.
//!
//! # Session affinity (`session`)
//!
//! Session id → entry (binding, revision, leases, idle clock, final request) in session
//! shards, and lease (selection id) → session id in lease shards, each behind a mutex; no
//! atomics of its own. **Lock order: session shard, then lease shard**; a lease shard is
//! taken alone or nested in one session shard, never the reverse, and never two shards
//! of a kind at once, so there is no deadlock. Everything about one entry — its leases,
//! their index entries, and its removal — changes in one critical section of its session
//! shard, so the index and the entries agree and no entry is ever left final without
//! leases (which nothing would release). `release_lease` reads the lease's owner under
//! the lease shard alone, then drops the lease and, if it was a final session's last
//! one, the entry, in *one* critical section of the owner's shard; the next turn's `bind`
//! runs wholly under that same lock, so it either adds its lease before the release (the
//! entry survives with it) or after (it finds the entry lease-less, or gone and starts a
//! fresh one): its lease is never lost. A lease released before its bind is remembered
//! briefly under the lease shard's lock, which the bind also takes, so a late bind does
//! not hold a lease that already ended. The full argument is in `session.rs`; loom models
//! `session_release_races_next_turn` (negative control: "last lease" decided and the
//! entry removed in two critical sections) and `session_early_release_vs_bind` (negative
//! control: the bind ignores the memory).
