//! The index's invariants, and what a reader may see because of them.
//!
//! The structures are described in [`super::design`]; the orderings that publish each
//! step are in [`super::ordering`].
//!
//! # Invariants
//!
//! 1. *A published state is immutable, and so is every local below its length.* A run's
//!    writer (under the run's mutex) builds a new `State` and stores its pointer with
//!    `Release`; locals are written only past every published length, before the publish
//!    that shows them. A reader that loads the pointer with `Acquire` reads a length, covers
//!    and locals that were published together. Locals are never rewritten: runs only grow,
//!    and an array outgrown is copied, the old one retired once no state names it.
//! 2. *A place means one prefix for the life of its run.* A `BlockRef` (run, offset) is the
//!    prompt prefix "the run's path to offset 0, then its locals up to the offset"; a run's
//!    locals never change below its length and a run is never split, so a cover's counts
//!    always refer to the same blocks. At each (run, offset) the run's own next local and its
//!    children's first locals are distinct (appends and child creation happen under the run's
//!    mutex after checking both), so each prefix has one place.
//! 3. *A cover counts only blocks its rank holds.* A rank's cover in a run is computed from
//!    its own exact holdings (per-tier bitmaps, under its rank mutex) and published after the
//!    blocks it counts are in the run's array; a lookup credits at most the blocks of the
//!    prompt that equal the run's locals.
//! 4. *A run lives while anything can reach it through a writer.* A run with no holder, no
//!    child and no writer inside (writers pin the runs they enter until they publish) is
//!    marked dead under its mutex, unlinked from the branch table and retired through the
//!    epoch; a writer that finds a dead run retries. A parent is kept while it has children.
//!    Readers that found a run keep reading it until they unpin.
//! 5. *Every probe of the branch table ends inside its table* (its shards' tables keep a
//!    never-filled sentinel; see `crate::table`), *a key is written once per table* (removal
//!    empties the word; so a reader never pairs a key with another entry's word), and *a
//!    rebuilt table is frozen* (copied, swapped, retired through the epoch).
//! 6. *A slot names one rank for the life of any reader that can see it.* A rank is removed
//!    by first publishing every run without its cover, then unpublishing it from the
//!    directory, then handing its slot back to the allocator *through the epoch* (the
//!    deferred step only raises an atomic flag). A slot is published in the directory before
//!    any cover names it.
//! 7. *Writers of one rank serialize on the rank's mutex; writers of one run on the run's*
//!    (lock order: rank, then one run at a time, then a table shard, a leaf). No writer takes
//!    a global lock on the event path: new prompts link root children lock-free (a shard's
//!    mutex), the rank registry is a sharded map, and the index-wide slot-allocator and
//!    directory locks are taken only when ranks come and go.
//!
//! # What a reader may see
//!
//! A query is not a snapshot across runs: each run's state is read atomically, so a reader
//! sees each event wholly or not at all *per run*. It may undercount a chain that is being
//! stored (a later run's cover not yet published) and may still count blocks whose removal is
//! concurrent with it. It never sees a holder that no event put there: covers are built only
//! from the rank's own events (3), places never change meaning (2), slots never change owner
//! under a pinned reader (6), and freed memory is never read (1, 4, 5).
