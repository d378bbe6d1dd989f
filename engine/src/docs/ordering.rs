//! Memory ordering of the index's (and the selection-id index's) publication steps.
//!
//! The invariants these orderings serve are in [`super::invariants`].
//!
//! # Memory ordering
//!
//! | step | writer | reader | why |
//! |---|---|---|---|
//! | run state | locals written `Relaxed` past the published length, new state built, pointer `Release` (a load and a store under the run's mutex) | pointer `Acquire`, then its fields and locals | the length, covers and locals a reader sees were published together |
//! | new run (branch link) | run built with its first state, then the table slot: word `Relaxed`, key `Release` | key `Acquire`, then word `Acquire`, then the run's fields | a found child is a whole run |
//! | table swap | new table filled, pointer `Release` (swap) | pointer `Acquire` | the copied slots are visible before the table |
//! | directory swap | new array built, pointer `Release` | pointer `Acquire`, loaded *after* the walk | a slot seen in a cover is already in the directory |
//!
//! Reclamation is crossbeam-epoch's: a reader pins once per query; a writer defers each
//! free past the current epoch (the seqcst fences are crossbeam's).
//!
//! Counters that are statistics (index and indexer counters, the striped selection
//! counter, the booking counters' individual updates) are `Relaxed` read-modify-writes:
//! they order nothing. The booking counters' consistency comes from the shard and rank
//! mutexes that surround their updates, not from the atomics' orderings (see
//! [`super::design`], *Bookings*).
