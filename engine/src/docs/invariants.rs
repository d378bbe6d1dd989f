//! The index's invariants, and what a reader may see because of them.
//!
//! The structures are described in [`super::design`]; the orderings that publish each
//! step are in [`super::ordering`].
//!
//! # Invariants
//!
//! 1. *A key is written once per table.* A slot's key goes from empty to `k` and never
//!    changes again in that table. Removal empties the word, not the key ("dead" node); the
//!    same key coming back revives the slot. So a reader that matched `k` at slot `i` reads
//!    `k`'s word, never another node's (no ABA on slots).
//! 2. *Every probe ends inside its table.* A table has `capacity + tail` slots (tail =
//!    `max(capacity / 64, 32)`) and the very last one, the sentinel, is never filled, so a
//!    probe, which only moves up, meets its key or an empty slot before running off the
//!    end. A writer whose probe reaches the sentinel grows the table first (the tail grows
//!    with it, so this terminates). Independently, writers rebuild a table when live +
//!    dead slots exceed 85 % of its capacity (`MAX_LOAD_PCT`), which keeps probes short.
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
//!    rank's mutex* (lock order: rank, then shard, then holder-interner shard). No writer
//!    takes a global lock on the event path: the rank registry is a sharded map, and the
//!    index-wide slot-allocator and directory locks are taken only when ranks come and go.
//!
//! # What a reader may see
//!
//! A query is not a snapshot across blocks: each block's holder word is read atomically,
//! so a reader sees each event wholly or not at all *per block*. It may undercount a
//! chain that is being stored (later blocks not yet visible) and may still count a block
//! whose removal is concurrent with it. It never sees a holder that no event put there:
//! words are only ever built from the rank's own events (1, 3), slots never change owner
//! under a pinned reader (5), and freed memory is never read (3, 4).
