//! Memory ordering of the index's (and the selection-id index's) publication steps.
//!
//! The invariants these orderings serve are in [`super::invariants`].
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
//! Counters that are statistics (index and indexer counters, the striped selection
//! counter, the booking counters' individual updates) are `Relaxed` read-modify-writes:
//! they order nothing. The booking counters' consistency comes from the shard and rank
//! mutexes that surround their updates, not from the atomics' orderings (see
//! [`super::design`], *Bookings*).
