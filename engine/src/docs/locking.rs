//! Which paths are lock-free, and which locks the others take.
//!
//! kvr is not lock-free as a whole. Its index lookups are: [`Index::find_matches`] and
//! the tiered queries take no lock and never wait for a writer. Everything that changes
//! state takes mutexes (short and sharded on the frequent paths), and a few reads do too (a booked rank's
//! prompt-block refcounts, a session's entry, a booking's shard). No path takes an
//! engine-wide lock on the selection or event path; the locks that span a whole index,
//! table or partition are taken only when ranks, workers or partitions come and go, to
//! publish load (one mutex per partition, never taken by readers), or by maintenance off
//! the selection path (the approximate recorder's expiry and prune, on the sweep thread).
//! With events off or a prediction index, a booking records under its rank's own
//! recorder mutex; no booking takes a lock shared by all ranks of its partition (shown by
//! `engine/tests/approx_rank_locks.rs`).
//!
//! "Lock-free" below means: no mutex, no reader-writer lock, no spin on another thread's
//! progress, no retry loop; the path completes in a bounded number of its own steps
//! whatever other threads do. Two things sit outside every such claim, as for every
//! epoch-reclaimed or arc-swap structure: the memory allocator's own internal locking
//! (lookups allocate their result, and a pin may run frees that writers deferred) and
//! arc-swap's internals, which its documentation states are lock-free for readers and
//! writers. Host hooks (shared cache, overload, prefill estimator) are the host's code,
//! called with no kvr lock held; whatever they do, the selection waits for it.
//!
//! # The locks
//!
//! Every lock is a `sync::Mutex` (std's, poisoning ignored) or a dashmap shard's
//! reader-writer lock (`sync::ShardedMap`); the ZMQ transport's stop signal also uses
//! std's `Mutex` directly. There is no other blocking primitive on the engine's paths
//! (the sweep thread sleeps in `park_timeout` between sweeps). The locks, by owner:
//!
//! | lock | scope | guards |
//! |---|---|---|
//! | rank writer | one index rank | its engine-hash → place maps and its holds (`index::RankWriter`) |
//! | run writer | one run of the index | appends, children, holder and writer counts, publishing its state (`index::run`) |
//! | branch-table shard writer | one of the index's 64 shards (default) | linking and unlinking runs, rebuilds |
//! | rank registry | dashmap, per shard | rank id → rank entry |
//! | slot allocator, directory writer | one index | rank slots; in-place writes and doubling growth of the slot directory |
//! | id-index shard writer | one of the engine's 64 id shards | selection id → partition number |
//! | booking shard | one of a table's 64 shards (default) | live bookings, recently freed ids |
//! | booking rank | one rank of one partition | prompt-block refcounts |
//! | booking registry writer | one partition | copy-on-write of the rank → counters map |
//! | approximate recorder: rank records | one rank of one partition (events off, or prediction) | that rank's records and expiry queue |
//! | approximate recorder: registry writer | one partition | copy-on-write of the rank → records map (a rank's first recording, `forget_rank`) |
//! | approximate recorder: maintenance | one partition | serializes expiry-and-prune passes (the sweep); never taken by a booking |
//! | load publish | one partition | copy-on-write of the load snapshot |
//! | membership | one partition | copy-on-write of the worker set |
//! | session shard, lease shard | one of 64 each per session table | entries; lease → session |
//! | ingress streams | per partition (dashmap) and per stream | a host-fed stream's sequence state and counters |
//! | engine numbering, partitions | one engine (mutex, dashmap) | creating and removing partitions |
//!
//! Lock orders (each a chain, never reversed): index rank → one run at a time →
//! branch-table shard (a leaf); index rank → rank registry shard (removal) and rank registry
//! shard → slot allocator, directory writer (creation), never the registry before a rank;
//! booking shard → booking rank; session shard → lease shard; recorder maintenance →
//! recorder rank → the index's write locks (the recorder's registry writer alone). The booking registry writer, membership and load-publish mutexes
//! are each taken with no other lock held. No path holds two shards of one kind at once,
//! except [`ReservationTable::audit`], which locks every booking shard of its table (a
//! checking tool, not a serving path).
//!
//! # Per path
//!
//! | path | lock-free? | locks taken / what may wait | why that is acceptable |
//! |---|---|---|---|
//! | [`Index::find_matches`], [`Index::find_matches_tiered`] and their `_into` forms; C `kvr_partition_find_matches[_tiered]` | **yes** | none: one `epoch::pin()`, per run reached one branch-table probe (`Acquire` loads of the shard's table and slot) and one `Acquire` load of the run's state, one load of the slot directory ([`super::invariants`], [`super::ordering`]) | — |
//! | [`Index::apply`] / [`Index::store`] / [`Index::remove`] / [`Index::clear`] (engine events) | no | rank registry shard lock (read; write on a rank's first event), the rank's writer mutex for the whole event, per run the event places blocks in or changes the rank's cover in: that run's mutex (one at a time, nested in the rank's), and a branch-table shard mutex (nested) when a run is linked or unlinked; a new rank also takes the index's slot-allocator and directory-writer mutexes | one writer per rank is the design; ranks contend only when they change the same run at the same moment (once per event and run, not per block); rank creation is rare; readers never take these |
//! | [`Partition::ingest`] (C `kvr_partition_ingest`) | no | the partition's stream map (dashmap shard, write lock to find-or-create), the stream's mutex for the whole message (and its counters' mutex), then [`Index::apply`]'s locks | messages of one stream are ordered anyway; streams proceed in parallel |
//! | ZMQ subscriber (`kvr-zmq`: its transport, over an `ingress::EventSource`) | no | its own thread waits on the socket (tokio, current-thread) and applies each message through the source it owns (its counters' mutex, then [`Index::apply`]'s locks); a waker mutex links the thread and its handle | off every host thread |
//! | [`Index::remove_worker`] / [`Index::remove_rank`] | no | per rank: writer mutex, each of its runs' mutexes in turn (withdrawing its cover; retiring runs left empty, with a branch-table shard mutex), rank registry shard (write), directory-writer and slot-allocator mutexes; the slot's reuse is deferred through the epoch | membership changes are rare |
//! | advisory [`Partition::select`] / [`Engine::select`] through a handle (C `kvr_partition_select`) | **no**; lock-free only when no candidate rank has active booked prompt blocks, the request names no session (or the partition keeps no session table) and the primary is not remote | the index query (lock-free), worker set, hooks, load snapshot, booking counters and the prediction index (lock-free: arc-swap loads, atomics, an index query); but, for each candidate with active booked prompt blocks whose cost can still win, **that rank's booking mutex** (prompt-block refcounts: how many of the prompt's blocks are not active there yet); with session affinity, **one or two session-shard mutexes** (the session's and its parent's entry); a remote primary: a blocking HTTP query (below) | the rank mutex is held for at most `log n` lookups and is contended only by bookings and frees of that rank; the session shard for one map lookup |
//! | [`Engine::select`] (by key) | no | as above, plus the engine's partition map (dashmap shard, read lock) to find the partition | hosts on a hot path pass a handle ([`PartitionRef::Handle`]) |
//! | [`Partition::select_and_reserve`] / [`Engine::select_and_reserve`] (C `kvr_partition_select_and_reserve[_with_hint]`) | no | the engine's id-index shard mutex (claiming the id; again to drop it if nothing was booked); the decision's locks (above); then the booking: the booking registry writer mutex on the rank's first booking only (alone), the id's **booking shard mutex** with the **rank's booking mutex** nested in it; with events off or a prediction index, the **chosen rank's recorder mutex** with the index's write locks for that rank nested (recording after the booking stands; the recorder's registry writer mutex on the rank's first recording only, alone); with sessions, the session shard then lease shard mutexes (bind); the first booking of a table also spawns its sweep thread | each lock is sharded by id, rank or session, or held for one map update; none is shared by all ranks of the partition |
//! | [`Partition::reserve`] / [`Engine::reserve`] (C `kvr_partition_reserve`) | no | as booked selection without scoring: id-index shard, an index query (lock-free), the rank's booking mutex (new blocks), booking shard → rank mutexes, the rank's recorder mutex when it records | as above |
//! | [`Engine::mark_prefill_complete`] (C `kvr_engine_mark_prefill_complete`) | no | id index read (lock-free); the booking's **shard mutex** (to find which partition still knows it, then to flip the flag and subtract, an atomic) | one shard of 64 |
//! | [`Engine::add_output_blocks`] (C `kvr_engine_add_output_blocks`) | no | as `mark_prefill_complete`: the booking's shard mutex, an atomic add | as above |
//! | [`Engine::free`] (C `kvr_engine_free_booking`) | no | id index read (lock-free); the booking's shard mutex (status, then taking it out); after dropping it, the rank's booking mutex (refcounts); with sessions, the lease shard then session shard (lease release); the id-index shard mutex (removing the id) | none nested but session → lease; all sharded |
//! | lifecycle call for a replica booking or an unknown id | no | as above, plus a scan: the engine's partition map (dashmap, every shard read-locked in turn) and one booking shard per partition | replica bookings are the rare case |
//! | TTL sweep ([`ReservationTable::sweep_expired`], the table's sweep thread) | no | each booking shard mutex in turn (skipped by its earliest-expiry bound), then per expired booking its rank's mutex; the id-index shard mutex per freed id; session lease/session shards; then the approximate recorder's maintenance pass ([`ApproxRecorder::expire`]: its maintenance mutex, then each rank's recorder mutex in turn with the index's write locks nested: expiry, and the prune when a booking found the records at their bound) | runs on its own thread, shard by shard and rank by rank, never holding two shards or two ranks |
//! | [`Partition::upsert_worker`] (C `kvr_partition_upsert_worker`) | no | the partition's membership mutex; the worker set is then swapped whole (arc-swap) | membership changes are rare; selections read the set without the lock |
//! | [`Partition::remove_worker`] (C `kvr_partition_remove_worker`) | no | membership mutex, then (not nested) [`Index::remove_worker`]'s locks, the load-publish mutex, per rank [`ReservationTable::remove_rank`] (registry writer, each booking shard in turn, rank mutexes) and every session shard in turn | as above |
//! | [`LoadView::publish`] (C `kvr_partition_publish_load`) | no | the partition's load-publish mutex (copy, apply, swap) | publishers only wait for each other; readers never take it |
//! | [`LoadView::snapshot`] | **yes** | arc-swap load | — |
//! | [`ReservationTable::loads`] / [`ReservationTable::rank_load`] | **yes** | arc-swap load of the rank registry, three atomic loads per rank | — |
//! | [`ReservationTable::new_blocks_not_active`] | no (unless the rank has no active prompt blocks) | the rank's booking mutex | see advisory selection |
//! | [`SessionTable::lookup`] | no | the session's shard mutex (and the parent's, one after the other) | one hash lookup; sharded by session |
//! | [`SessionTable::bind`] | no | session shard mutex, lease shard mutex nested | as above |
//! | [`SessionTable::release_lease`] | no | lease shard, then (not nested) the owner's session shard with the lease shard nested | as above |
//! | [`ApproxRecorder::record`] (events off, prediction) | no | the rank's recorder mutex, nested in it [`Index::store`]'s locks (and [`Index::remove`]'s for the rank's own expiry); the size bound is one atomic count (a compare-and-swap loop); the rank → records map is read lock-free (arc-swap), written under the registry mutex on a rank's first recording | only booked paths record, after the booking stands; bookings of different ranks share no lock here |
//! | [`ApproxRecorder::expire`] (the maintenance pass) | no | the maintenance mutex, then each rank's recorder mutex in turn (index write locks nested) | off the selection path: the sweep thread |
//! | prediction-index query (inside selection) | **yes** | an index query on the side index | — |
//! | remote primary query ([`RemoteIndex`], feature `remote`) | no | a blocking HTTP request on the calling thread, bounded by the connect and request timeouts ([`super::limits`]); the client's connection pool | the policy is opt-in; a failure or timeout means no overlap, never a failed selection |
//! | engine: [`Engine::create_partition`] / [`Engine::remove_partition`] | no | the engine's numbering mutex, the partition map (dashmap write lock); removal then each booking shard in turn (its live ids) and the id-index shard mutex per live booking | rare |
//! | C ABI wrappers | adds none | the wrapped call's locks; the ABI itself adds atomics (status counters), thread-local scratch and `catch_unwind` | — |
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
//! [`Index::find_matches`]: crate::index::Index::find_matches
//! [`Index::find_matches_tiered`]: crate::index::Index::find_matches_tiered
//! [`Index::apply`]: crate::index::Index::apply
//! [`Index::store`]: crate::index::Index::store
//! [`Index::remove`]: crate::index::Index::remove
//! [`Index::clear`]: crate::index::Index::clear
//! [`Index::remove_worker`]: crate::index::Index::remove_worker
//! [`Index::remove_rank`]: crate::index::Index::remove_rank
//! [`Partition::ingest`]: crate::partition::Partition::ingest
//! [`Partition::select`]: crate::partition::Partition::select
//! [`Partition::select_and_reserve`]: crate::partition::Partition::select_and_reserve
//! [`Partition::reserve`]: crate::partition::Partition::reserve
//! [`Partition::upsert_worker`]: crate::partition::Partition::upsert_worker
//! [`Partition::remove_worker`]: crate::partition::Partition::remove_worker
//! [`Engine::select`]: crate::engine::Engine::select
//! [`PartitionRef::Handle`]: crate::engine::PartitionRef::Handle
//! [`Engine::select_and_reserve`]: crate::engine::Engine::select_and_reserve
//! [`Engine::reserve`]: crate::engine::Engine::reserve
//! [`Engine::mark_prefill_complete`]: crate::engine::Engine::mark_prefill_complete
//! [`Engine::add_output_blocks`]: crate::engine::Engine::add_output_blocks
//! [`Engine::free`]: crate::engine::Engine::free
//! [`Engine::create_partition`]: crate::engine::Engine::create_partition
//! [`Engine::remove_partition`]: crate::engine::Engine::remove_partition
//! [`ReservationTable::sweep_expired`]: crate::reservation::ReservationTable::sweep_expired
//! [`ReservationTable::remove_rank`]: crate::reservation::ReservationTable::remove_rank
//! [`ReservationTable::loads`]: crate::reservation::ReservationTable::loads
//! [`ReservationTable::rank_load`]: crate::reservation::ReservationTable::rank_load
//! [`ReservationTable::new_blocks_not_active`]: crate::reservation::ReservationTable::new_blocks_not_active
//! [`LoadView::publish`]: crate::load::LoadView::publish
//! [`LoadView::snapshot`]: crate::load::LoadView::snapshot
//! [`SessionTable::lookup`]: crate::session::SessionTable::lookup
//! [`SessionTable::bind`]: crate::session::SessionTable::bind
//! [`SessionTable::release_lease`]: crate::session::SessionTable::release_lease
//! [`ApproxRecorder::record`]: crate::index::ApproxRecorder::record
//! [`ApproxRecorder::expire`]: crate::index::ApproxRecorder::expire
//! [`RemoteIndex`]: crate::index::RemoteIndex
//! [`ReservationTable::audit`]: crate::reservation::ReservationTable::audit
