//! The one concurrency facade.
//!
//! Every atomic, lock, shared cell, epoch guard, snapshot cell and sharded map the engine
//! uses comes from here, so that under `RUSTFLAGS="--cfg loom --cfg crossbeam_loom"` the
//! whole engine runs on loom's model-checked primitives (the pattern of crossbeam's
//! `primitive` module and tokio's `loom` module). No other module imports
//! `crossbeam_epoch`, `arc_swap` or `dashmap` directly, and only three use std's atomics
//! outside this facade, none in a protocol a loom model checks: the engine-uid and stripe
//! counters (`engine.rs`, `counter.rs`: plain unique-number dispensers) and the ZMQ
//! transport (`ingress/transport.rs`, not built under loom; it also uses std's `Mutex`).
//!
//! Under loom:
//! - atomics, `Arc`, `Mutex`, `UnsafeCell` are loom's;
//! - `epoch` is still crossbeam-epoch, built with its own loom support, so the real
//!   reclamation code is what the models explore;
//! - arc-swap and dashmap are invisible to loom, so [`Snapshot`] and [`ShardedMap`] become
//!   a mutex-guarded stand-in with the same API. Neither is on the index's read path.

#![allow(clippy::disallowed_types)]

#[cfg(all(loom, not(crossbeam_loom)))]
compile_error!("build loom models with RUSTFLAGS=\"--cfg loom --cfg crossbeam_loom\"");

// The facade names each primitive as a type alias, not a re-export: clippy's
// `disallowed-types` (engine/clippy.toml) sees through a `use` re-export to the std type
// but not through an alias, so only this file may name the std and loom types.

/// Atomics: std's, or loom's under `--cfg loom`.
pub(crate) mod atomic {
    #[cfg(loom)]
    use loom::sync::atomic as imp;
    #[cfg(not(loom))]
    use std::sync::atomic as imp;

    pub(crate) use imp::Ordering;
    pub(crate) type AtomicBool = imp::AtomicBool;
    pub(crate) type AtomicI64 = imp::AtomicI64;
    pub(crate) type AtomicU64 = imp::AtomicU64;
    pub(crate) type AtomicUsize = imp::AtomicUsize;
}

/// std's atomics even under loom, for process-wide statics that no model checks (loom's
/// atomics have no `const` constructor): id counters, stripe assignment.
pub(crate) mod std_atomic {
    pub(crate) use std::sync::atomic::Ordering;
    pub(crate) type AtomicU64 = std::sync::atomic::AtomicU64;
    pub(crate) type AtomicUsize = std::sync::atomic::AtomicUsize;
}

/// Shared ownership: std's, or loom's under `--cfg loom`.
#[cfg(loom)]
#[allow(dead_code)]
pub(crate) type Arc<T> = loom::sync::Arc<T>;
#[cfg(not(loom))]
#[allow(dead_code)]
pub(crate) type Arc<T> = std::sync::Arc<T>;
/// The standard `Arc` even under loom: for shared ownership that no model checks (host
/// hooks and listeners as `dyn` callbacks, a partition shared with its subscriptions).
pub(crate) type StdArc<T> = std::sync::Arc<T>;

/// A value set once and read after: std's even under loom, for a partition's journal
/// hook (set at start, before events flow; no model checks it).
pub(crate) type StdOnceLock<T> = std::sync::OnceLock<T>;

/// Epoch-based reclamation (crossbeam-epoch; loom-aware under `crossbeam_loom`).
pub(crate) use crossbeam_epoch as epoch;

/// A lookup's epoch guard: the index's queries pin through this, so that a loom model can
/// remove the pin (the `unpinned_query` fault) and show that the pin is what keeps a
/// retired run alive under a walking reader. Outside loom it is exactly `epoch::pin()`.
pub(crate) struct QueryGuard {
    #[cfg(not(loom))]
    guard: epoch::Guard,
    #[cfg(loom)]
    guard: Option<epoch::Guard>,
}

/// Pins the current thread for one lookup.
#[inline]
pub(crate) fn query_pin() -> QueryGuard {
    #[cfg(not(loom))]
    {
        QueryGuard {
            guard: epoch::pin(),
        }
    }
    #[cfg(loom)]
    {
        QueryGuard {
            guard: (!faults::get().unpinned_query).then(epoch::pin),
        }
    }
}

impl core::ops::Deref for QueryGuard {
    type Target = epoch::Guard;

    #[inline]
    fn deref(&self) -> &epoch::Guard {
        #[cfg(not(loom))]
        {
            &self.guard
        }
        #[cfg(loom)]
        {
            match &self.guard {
                Some(g) => g,
                // SAFETY: only under loom, with the `unpinned_query` fault a negative
                // control sets on purpose: the model then *expects* the use after free
                // this allows to be reported by loom (it is the mutation under test).
                None => unsafe { epoch::unprotected() },
            }
        }
    }
}

/// A mutex whose poisoning is ignored: every critical section in kvr leaves its data
/// consistent before any call that could panic, so a panic elsewhere must not wedge a rank.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(
    #[cfg(not(loom))] std::sync::Mutex<T>,
    #[cfg(loom)] loom::sync::Mutex<T>,
);

#[cfg(not(loom))]
pub(crate) type MutexGuard<'a, T> = std::sync::MutexGuard<'a, T>;
#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(loom))]
        return Self(std::sync::Mutex::new(value));
        #[cfg(loom)]
        return Self(loom::sync::Mutex::new(value));
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        match self.0.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// `UnsafeCell` with loom's closure API, so loom can see every access.
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(
    #[cfg(not(loom))] core::cell::UnsafeCell<T>,
    #[cfg(loom)] loom::cell::UnsafeCell<T>,
);

impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(loom))]
        return Self(core::cell::UnsafeCell::new(value));
        #[cfg(loom)]
        return Self(loom::cell::UnsafeCell::new(value));
    }

    /// Reads through a shared raw pointer. The caller upholds the aliasing rules.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        #[cfg(not(loom))]
        return f(self.0.get());
        #[cfg(loom)]
        return self.0.with(f);
    }

    /// Writes through a unique raw pointer. The caller upholds the aliasing rules.
    #[inline(always)]
    #[allow(dead_code)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(not(loom))]
        return f(self.0.get());
        #[cfg(loom)]
        return self.0.with_mut(f);
    }
}

/// An immutable value swapped atomically as a whole; readers load it once and keep using
/// that one version (arc-swap in production).
pub(crate) struct Snapshot<T>(
    #[cfg(not(loom))] arc_swap::ArcSwap<T>,
    #[cfg(loom)] loom::sync::Mutex<Arc<T>>,
);

#[allow(dead_code)]
impl<T> Snapshot<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(loom))]
        return Self(arc_swap::ArcSwap::from_pointee(value));
        #[cfg(loom)]
        return Self(loom::sync::Mutex::new(Arc::new(value)));
    }

    /// The current version; never blocks a writer and never sees a torn value.
    pub(crate) fn load(&self) -> Arc<T> {
        #[cfg(not(loom))]
        return self.0.load_full();
        #[cfg(loom)]
        return self.0.lock().unwrap().clone();
    }

    /// A cheap read guard of the current version (no reference-count traffic in
    /// production: arc-swap's per-thread debt slots), for reads within one call.
    pub(crate) fn guard(&self) -> SnapshotGuard<T> {
        #[cfg(not(loom))]
        return self.0.load();
        #[cfg(loom)]
        return self.0.lock().unwrap().clone();
    }

    pub(crate) fn store(&self, value: T) {
        #[cfg(not(loom))]
        self.0.store(Arc::new(value));
        #[cfg(loom)]
        {
            *self.0.lock().unwrap() = Arc::new(value);
        }
    }
}

/// What [`Snapshot::guard`] returns; derefs to the value.
#[cfg(not(loom))]
pub(crate) type SnapshotGuard<T> = arc_swap::Guard<Arc<T>>;
#[cfg(loom)]
pub(crate) type SnapshotGuard<T> = Arc<T>;

/// A concurrent map sharded by key (dashmap in production). Used on writer and
/// bookkeeping paths, never on the index's lock-free read path.
pub(crate) struct ShardedMap<K, V>(
    #[cfg(not(loom))] dashmap::DashMap<K, V>,
    #[cfg(loom)] loom::sync::Mutex<std::collections::HashMap<K, V>>,
);

#[allow(dead_code)]
impl<K: Eq + std::hash::Hash + Clone, V: Clone> ShardedMap<K, V> {
    pub(crate) fn new() -> Self {
        #[cfg(not(loom))]
        return Self(dashmap::DashMap::new());
        #[cfg(loom)]
        return Self(loom::sync::Mutex::new(std::collections::HashMap::new()));
    }

    pub(crate) fn get(&self, key: &K) -> Option<V> {
        #[cfg(not(loom))]
        return self.0.get(key).map(|v| v.value().clone());
        #[cfg(loom)]
        return self.0.lock().unwrap().get(key).cloned();
    }

    /// Returns the value for `key`, inserting `make()` first if absent.
    pub(crate) fn get_or_insert_with(&self, key: K, make: impl FnOnce() -> V) -> V {
        #[cfg(not(loom))]
        return self.0.entry(key).or_insert_with(make).value().clone();
        #[cfg(loom)]
        return self
            .0
            .lock()
            .unwrap()
            .entry(key)
            .or_insert_with(make)
            .clone();
    }

    pub(crate) fn remove(&self, key: &K) -> Option<V> {
        #[cfg(not(loom))]
        return self.0.remove(key).map(|(_, v)| v);
        #[cfg(loom)]
        return self.0.lock().unwrap().remove(key);
    }

    /// A point-in-time copy of the entries (not atomic across shards).
    pub(crate) fn entries(&self) -> Vec<(K, V)> {
        #[cfg(not(loom))]
        return self
            .0
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect();
        #[cfg(loom)]
        return self
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
    }

    pub(crate) fn len(&self) -> usize {
        #[cfg(not(loom))]
        return self.0.len();
        #[cfg(loom)]
        return self.0.lock().unwrap().len();
    }
}

/// Fault injection for the loom models' negative controls: each flag weakens one step of
/// one protocol, and the matching model must then fail. Compiled only under loom.
#[cfg(loom)]
pub(crate) mod faults {
    use std::cell::Cell;

    #[derive(Clone, Copy, Default, Debug)]
    pub struct Faults {
        /// Table: publish a new slot's key with `Relaxed` instead of `Release`.
        pub relaxed_slot_key: bool,
        /// Table: store a word over a slot that has its key (a dead slot revived) with
        /// `Relaxed` instead of `Release`.
        pub relaxed_slot_word: bool,
        /// Table: swap a rebuilt table in with `Relaxed` instead of `Release`.
        pub relaxed_table_swap: bool,
        /// Table: a reader loads a slot's key with `Relaxed` instead of `Acquire`.
        pub relaxed_key_load: bool,
        /// Table: a reader loads a found slot's word with `Relaxed` instead of `Acquire`.
        pub relaxed_word_load: bool,
        /// Table: a reader loads the shard's table word with `Relaxed` instead of
        /// `Acquire`.
        pub relaxed_table_load: bool,
        /// Free a replaced table at once instead of deferring it.
        pub free_table_now: bool,
        /// Hand a removed rank's slot back for reuse at once instead of after readers' epochs.
        pub reuse_slot_now: bool,
        /// Lifecycle calls trust the selection-id index alone (no partition scan).
        pub skip_partition_scan: bool,
        /// Reservations: subtract a freed booking's counters while it is still in its
        /// shard, then remove it, instead of removing it first (the remover releases).
        pub release_before_remove: bool,
        /// Reservations: `mark_prefill_complete` subtracts the prefill tokens outside the
        /// shard lock and sets the booking's flag afterwards.
        pub prefill_flag_after_release: bool,
        /// Reservations: update a rank counter by load-then-store instead of an atomic
        /// read-modify-write.
        pub split_counter_rmw: bool,
        /// Reservations: a booking adds to the rank state it looked up even when it finds
        /// that state retired (its rank removed meanwhile) instead of retrying.
        pub book_ignores_retired: bool,
        /// Reservations: a booking counts itself in its rank's group (`idle.rs`) after
        /// adding to the rank's counters instead of before.
        pub group_booking_late: bool,
        /// Reservations: a release uncounts the booking in its group before subtracting
        /// from the rank's counters instead of after.
        pub group_unbooking_early: bool,
        /// Approximate recorder: reserve room for new records by load-then-store instead
        /// of a compare-and-swap loop.
        pub split_room_reservation: bool,
        /// Approximate recorder: a recording adds to the rank's records it looked up even
        /// when it finds them retired (the rank forgotten meanwhile) instead of retrying.
        pub record_ignores_retired: bool,
        /// Selection: re-load the reported-load snapshot for every candidate instead of
        /// once per selection.
        pub reload_load_per_rank: bool,
        /// Load view: publish a batch as one snapshot swap per entry, in order, instead of
        /// one swap for the whole batch.
        pub load_publish_per_entry: bool,
        /// Load view: publish without the publisher mutex (copy, apply and swap of two
        /// publishers may interleave).
        pub load_publish_unlocked: bool,
        /// Ingress: unlist a stale stream's ranks before performing the step's actions
        /// (the clear) instead of after.
        pub unlist_before_repair: bool,
        /// Reservations: fold a prefill-rate observation by load-then-store instead of a
        /// compare-and-swap loop.
        pub lossy_rate_update: bool,
        /// Reservations: advance a rank's last prefill completion by load-then-store
        /// instead of `fetch_max`.
        pub split_last_prefill_max: bool,
        /// Run index: publish a run's new state with `Relaxed` instead of `Release`.
        pub relaxed_run_state: bool,
        /// Run index: free an outgrown local-hash array at once instead of deferring it.
        pub free_locals_now: bool,
        /// Run index: free an unlinked run at once instead of deferring it.
        pub free_run_now: bool,
        /// Rank directory: free an outgrown slot → rank array at once instead of deferring
        /// it.
        pub free_directory_now: bool,
        /// Queries: `find_matches` and the tiered query walk without pinning the epoch
        /// (crossbeam's unprotected guard), so a retired run may be freed under them.
        pub unpinned_query: bool,
        /// Recurrent states: a block the rank stops holding keeps its state (the
        /// writer's `finish` skips dropping the event's orphaned states).
        pub keep_orphaned_states: bool,
        /// Recurrent states: a removed rank's slot is handed back before its hybrid mark
        /// and states are cleared, not after.
        pub unmark_after_free: bool,
        /// Recurrent states: a writer's `finish` drops the event's orphaned states after
        /// republishing covers and retiring runs, not before.
        pub drop_orphans_late: bool,
        /// Load floors: a lower that changes no bound leaves the word as it is (no `gen`
        /// step), so a raise that read the word before the member's decrement succeeds.
        pub floor_lower_keeps_gen: bool,
        /// Load floors: a raise does not check the membership version its snapshot saw.
        pub floor_raise_ignores_version: bool,
        /// Load floors: after a decrement, the other counter of the combined figure is
        /// read with a plain load, not a read-modify-write.
        pub floor_combined_reads_with_load: bool,
    }

    std::thread_local! {
        static FAULTS: Cell<Faults> = Cell::new(Faults::default());
    }

    pub fn set(f: Faults) {
        FAULTS.with(|c| c.set(f));
    }

    pub fn get() -> Faults {
        FAULTS.with(|c| c.get())
    }

    std::thread_local! {
        static FREES: Cell<usize> = const { Cell::new(0) };
    }

    /// Counts a real free of a retired object, so a model can prove reclamation happened.
    pub fn note_free() {
        FREES.with(|c| c.set(c.get() + 1));
    }

    pub fn frees() -> usize {
        FREES.with(|c| c.get())
    }

    std::thread_local! {
        static DIRECTORY_FREES: Cell<usize> = const { Cell::new(0) };
    }

    /// Counts a real free of an outgrown rank-directory array.
    pub fn note_directory_free() {
        DIRECTORY_FREES.with(|c| c.set(c.get() + 1));
    }

    pub fn directory_frees() -> usize {
        DIRECTORY_FREES.with(|c| c.get())
    }

    std::thread_local! {
        static RECLAIMING_RUNS: Cell<usize> = const { Cell::new(0) };
    }

    /// Counts a model execution in which a retired object was really freed.
    pub fn note_reclaiming_run() {
        RECLAIMING_RUNS.with(|c| c.set(c.get() + 1));
    }

    pub fn reclaiming_runs() -> usize {
        RECLAIMING_RUNS.with(|c| c.get())
    }
}
