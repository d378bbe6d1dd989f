package kvr

// #include "shim.h"
import "C"

import "runtime"

// StateIO says how a partition's state files are written (WithStateDir).
type StateIO uint32

const (
	// StateIOAuto: io_uring when the kernel and the sandbox allow it, pwrite/fdatasync
	// otherwise; the KVR_STATE_IO environment variable (auto, uring, plain) replaces it
	// when set.
	StateIOAuto StateIO = C.KVR_STATE_IO_AUTO
	// StateIOUring: io_uring, or ErrIO from CreatePartition when it cannot be used.
	StateIOUring StateIO = C.KVR_STATE_IO_URING
	// StateIOPlain: pwrite and fdatasync; io_uring is not tried.
	StateIOPlain StateIO = C.KVR_STATE_IO_PLAIN
)

// WithStateDir keeps the partition's index on disk for a warm restart
// (kvr_partition_options_set_state_dir): CreatePartition restores it from its own
// directory under dir (created if missing) before returning, and every event it applies
// afterwards is journaled. It fails with ErrIO when the directory cannot be created, io
// is StateIOUring and io_uring cannot be used, or another partition of this process keeps
// its state there. A restored KV-event stream resumes from the last batch applied when its
// worker subscribes again. The state is closed (a final snapshot) by CloseState or when
// the partition's last handle is closed. An empty dir turns the option off.
func WithStateDir(dir string, io StateIO) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		p, n := cstr(dir)
		st := C.kvr_partition_options_set_state_dir(o, p, n, C.kvr_state_io(io))
		runtime.KeepAlive(dir)
		return check(st, "kvr_partition_options_set_state_dir")
	}
}

// StateRestored is what the restore at the partition's creation found
// (kvr_state_restored).
type StateRestored struct {
	// SnapshotFound: a snapshot was restored (false: the partition started empty).
	SnapshotFound bool
	// StoppedEarly: reading stopped before the end of the journal (a torn or corrupt
	// record, a writer's gap, a missing segment); what came before was applied.
	StoppedEarly   bool
	SnapshotBlocks uint64
	// Records and Events replayed from the journal after the snapshot.
	Records uint64
	Events  uint64
	// Refused blocks or events (as for live ones) and RefusedFiles (corrupt, truncated,
	// foreign files).
	Refused      uint64
	RefusedFiles uint64
	// Streams that resume from their last applied batch.
	Streams uint64
	Seconds float64
}

// StateStats are the journal writer's figures (kvr_state_stats).
type StateStats struct {
	EventsQueued     uint64
	EventsDropped    uint64
	RecordsWritten   uint64
	BytesWritten     uint64
	Syncs            uint64
	WriteFailures    uint64
	Snapshots        uint64
	SnapshotFailures uint64
	SnapshotBlocks   uint64
	JournalBytes     uint64
	// Uring: the files are written through io_uring (false: pwrite/fdatasync).
	Uring bool
	// Closed: the state is closed, its final snapshot written.
	Closed bool
}

// StateRestored returns what the restore at creation found (ErrInvalidConfig for a
// partition created without WithStateDir).
func (p *Partition) StateRestored() (StateRestored, error) {
	return readStats(p, "kvr_partition_state_restored",
		func(p *C.kvr_partition, c *C.kvr_state_restored) C.kvr_status {
			return C.kvr_partition_state_restored(p, c)
		},
		func(c *C.kvr_state_restored) StateRestored {
			return StateRestored{
				SnapshotFound:  c.snapshot_found != 0,
				StoppedEarly:   c.stopped_early != 0,
				SnapshotBlocks: uint64(c.snapshot_blocks),
				Records:        uint64(c.records),
				Events:         uint64(c.events),
				Refused:        uint64(c.refused),
				RefusedFiles:   uint64(c.refused_files),
				Streams:        uint64(c.streams),
				Seconds:        float64(c.seconds),
			}
		})
}

// StateStats returns the journal writer's figures (ErrInvalidConfig for a partition
// created without WithStateDir); readable after CloseState.
func (p *Partition) StateStats() (StateStats, error) {
	return readStats(p, "kvr_partition_state_stats",
		func(p *C.kvr_partition, c *C.kvr_state_stats) C.kvr_status {
			return C.kvr_partition_state_stats(p, c)
		},
		func(c *C.kvr_state_stats) StateStats {
			return StateStats{
				EventsQueued:     uint64(c.events_queued),
				EventsDropped:    uint64(c.events_dropped),
				RecordsWritten:   uint64(c.records_written),
				BytesWritten:     uint64(c.bytes_written),
				Syncs:            uint64(c.syncs),
				WriteFailures:    uint64(c.write_failures),
				Snapshots:        uint64(c.snapshots),
				SnapshotFailures: uint64(c.snapshot_failures),
				SnapshotBlocks:   uint64(c.snapshot_blocks),
				JournalBytes:     uint64(c.journal_bytes),
				Uring:            c.uring != 0,
				Closed:           c.closed != 0,
			}
		})
}

// CloseState writes what is queued and a final snapshot, then stops the journal (a
// graceful shutdown: the next start replays nothing). The partition keeps serving; what
// it applies afterwards is not kept. Calling it again does nothing. Not concurrent with
// other calls on p.
func (p *Partition) CloseState() error {
	if p.ptr == nil {
		return ErrClosed
	}
	gc()
	st := C.kvr_partition_close_state(p.ptr)
	gc()
	runtime.KeepAlive(p)
	return check(st, "kvr_partition_close_state")
}
