//! Invariants, memory ordering, and why each read path is lock-free.
//!
//! This module holds no code (the pattern of arc-swap's `docs`). Each protocol below has
//! a loom model in `loom_models.rs` and a negative control that must fail.
//!
//! # The index's layout
//!
//! - **Node table** (`index::table`): per shard, an open-addressing array of
//!   `(key: AtomicU64, word: AtomicU64)` slots. The key is the block's sequence hash (the
//!   chain over local hashes, so equal keys mean equal prefixes); the word is the holder
//!   set. Shard = low bits of the key; home slot = high bits (multiply-shift).
//! - **Holder word** (`index::holders`): `0` = nobody; low bit set = up to three
//!   `(slot, tiers)` entries inline; otherwise a pointer to an immutable, slot-sorted heap
//!   set. Heap sets are interned (hash-consed): one set per distinct content, shared by
//!   every node it describes and reference-counted under the interner shard's lock, so
//!   equal holder sets are equal words.
//! - **Rank writer state** (`index::ranks`): per rank, behind that rank's mutex: the
//!   engine's external hash → sequence hash, per tier. Never read by lookups.
//! - **Slot directory**: slot → rank, an immutable array swapped whole.
//!
//! # Invariants
//!
//! 1. *A key is written once per table.* A slot's key goes from empty to `k` and never
//!    changes again in that table. Removal empties the word, not the key ("dead" node); the
//!    same key coming back revives the slot. So a reader that matched `k` at slot `i` reads
//!    `k`'s word, never another node's (no ABA on slots).
//! 2. *Every table has an empty slot.* Writers rebuild before live + dead slots exceed 4/5
//!    of the capacity, so a probe always terminates.
//! 3. *A published holder set is immutable.* Writers find or build the new set and swap
//!    the word; a set whose last node let go of it is removed from the interner and retired
//!    through the epoch collector, freed only after every reader pinned at the time of the
//!    swap has unpinned. So within one pinned walk a set's address names one content, and
//!    two equal words on consecutive blocks mean the same holders.
//! 4. *A rebuilt table is frozen.* The writer copies live nodes into a new table, swaps the
//!    shard's pointer and retires the old table through the epoch. Heap sets move to the
//!    new table (they are freed when replaced, never with a table).
//! 5. *A slot names one rank for the life of any reader that can see it.* A rank is
//!    removed by first clearing all its holder bits, then unpublishing it from the
//!    directory, then handing its slot back to the allocator *through the epoch* (the
//!    deferred step only raises an atomic flag, so a reader that runs it never takes the
//!    allocator's lock). A slot is published in the directory before any holder word
//!    names it.
//! 6. *Writers of one node serialize on its shard's mutex; writers of one rank on the
//!    rank's mutex* (lock order: rank, then shard). No writer takes a global lock: the rank
//!    registry is a sharded map and the directory lock is taken only when ranks come and go.
//!
//! # Memory ordering
//!
//! | step | writer | reader | why |
//! |---|---|---|---|
//! | new node | word `Relaxed`, then key `Release` | key `Acquire`, then word `Acquire` | a matched key carries its first word |
//! | holder set swap | new set built, word `Release` | word `Acquire` | the set's entries are visible before its pointer |
//! | table swap | new table filled, pointer `Release` (swap) | pointer `Acquire` | the copied slots are visible before the table |
//! | directory swap | new array built, pointer `Release` | pointer `Acquire`, loaded *after* the walk | a slot seen in a word is already in the directory |
//!
//! Reclamation is crossbeam-epoch's: a reader pins once per query; a writer defers each
//! free past the current epoch (the seqcst fences are crossbeam's).
//!
//! # What a reader may see
//!
//! A query is not a snapshot across blocks: each block's holder word is read atomically,
//! so a reader sees each event wholly or not at all *per block*. It may undercount a
//! chain that is being stored (later blocks not yet visible) and may still count a block
//! whose removal is concurrent with it. It never sees a holder that no event put there:
//! words are only ever built from the rank's own events (1, 3), slots never change owner
//! under a pinned reader (5), and freed memory is never read (3, 4).
//!
//! # Why the read path is lock-free
//!
//! `find_matches` and the tiered query: one `epoch::pin()` (lock-free: it publishes the
//! thread's epoch and may help advance the global one), then per block an `Acquire` load
//! of the shard's table pointer and a linear probe of atomic loads. No mutex, no spin on
//! a writer's progress, no retry loop: a reader completes in a bounded number of its own
//! steps whatever writers do. (Pinning may run deferred frees that writers queued: that
//! is work, not waiting for a writer; the memory allocator's own internal locking inside
//! `free` is outside this claim, as for every epoch-reclaimed structure.)
//!
//! # Why writers do not serialize globally
//!
//! A `Stored` event takes its rank's mutex, then for each block the mutex of the block's
//! shard (256 shards by default) for a few dozen nanoseconds. Two ranks contend only on
//! the same shard at the same moment. Rank creation and removal take the directory lock,
//! which is off the event path.
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
//! under the rank's lock (lock order: shard, then rank). The full argument is in
//! `reservation.rs`; the loom models `reservation_*` check book/free/sweep races, each with
//! a negative control.
//!
//! # The selection-id index (`idmap`)
//!
//! Selection id → partition number uses the node table's shards with plain words (0 =
//! absent): the same key-then-word publication, rebuild and epoch reclamation as the index
//! (and the same loom models), so a lifecycle call reads it lock-free. An id is claimed
//! with `insert_new` (a caller-supplied duplicate is refused) before its booking is made,
//! and removed when the booking is freed or the selection booked nothing; partitions are
//! found by number in an arc-swapped vector. A miss, or an id whose partition no longer
//! knows it, falls back to scanning the partitions' tables (replica bookings).
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
