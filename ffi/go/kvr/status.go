package kvr

// #include "shim.h"
import "C"

import (
	"errors"
	"strconv"
)

// Status is a kvr_status: 0 is success, 1–9 are outcomes of normal operation, 100 and
// up are errors. Numbers are never reused.
type Status uint32

// The statuses of include/kvr.h.
const (
	StatusOK                   Status = C.KVR_OK
	StatusBusy                 Status = C.KVR_BUSY
	StatusNoWorker             Status = C.KVR_NO_WORKER
	StatusBufferTooSmall       Status = C.KVR_BUFFER_TOO_SMALL
	StatusNull                 Status = C.KVR_ERR_NULL
	StatusInvalidArgument      Status = C.KVR_ERR_INVALID_ARGUMENT
	StatusUnknownPartition     Status = C.KVR_ERR_UNKNOWN_PARTITION
	StatusPartitionExists      Status = C.KVR_ERR_PARTITION_EXISTS
	StatusUnknownSelectionID   Status = C.KVR_ERR_UNKNOWN_SELECTION_ID
	StatusDuplicateSelectionID Status = C.KVR_ERR_DUPLICATE_SELECTION_ID
	StatusUnknownRank          Status = C.KVR_ERR_UNKNOWN_RANK
	StatusUnknownWorker        Status = C.KVR_ERR_UNKNOWN_WORKER
	StatusAlreadyFreed         Status = C.KVR_ERR_ALREADY_FREED
	StatusTooLarge             Status = C.KVR_ERR_TOO_LARGE
	StatusParentNotFound       Status = C.KVR_ERR_PARENT_NOT_FOUND
	StatusTooManyRanks         Status = C.KVR_ERR_TOO_MANY_RANKS
	StatusDecode               Status = C.KVR_ERR_DECODE
	StatusIO                   Status = C.KVR_ERR_IO
	StatusInvalidConfig        Status = C.KVR_ERR_INVALID_CONFIG
	StatusPanic                Status = C.KVR_ERR_PANIC

	// statusNoMem and statusRange come from the binding's C helpers, never from kvr.
	statusNoMem Status = C.KVRGO_ERR_NOMEM
	statusRange Status = C.KVRGO_ERR_RANGE
)

// String is kvr_status_str's message ("unknown status" for a number kvr does not know).
func (s Status) String() string {
	switch s {
	case statusNoMem:
		return "out of memory (Go binding)"
	case statusRange:
		return "event array out of range (Go binding bug)"
	}
	gc()
	msg := C.GoString(C.kvr_status_str(C.kvr_status(s)))
	gc()
	return msg
}

// StatusCount is how many calls in this process returned s (kvr_status_count; StatusOK
// always reads 0).
func StatusCount(s Status) uint64 {
	gc()
	n := uint64(C.kvr_status_count(C.kvr_status(s)))
	gc()
	return n
}

// Error is a failed call: the C status and the C function that returned it.
type Error struct {
	Status Status
	// Op is the C function (e.g. "kvr_engine_free_booking"); empty in the sentinels.
	Op string
	// Reason is kvr's explanation when it gives one (ErrInvalidConfig: why the partition
	// options were refused, from kvr_partition_options_check); empty otherwise.
	Reason string
}

func (e *Error) Error() string {
	msg := "kvr: "
	if e.Op != "" {
		msg += e.Op + ": "
	}
	msg += e.Status.String() + " (status " + strconv.FormatUint(uint64(e.Status), 10) + ")"
	if e.Reason != "" {
		msg += ": " + e.Reason
	}
	return msg
}

// Is reports whether target is an *Error with the same status (so errors.Is(err,
// ErrUnknownSelectionID) matches whatever function returned it).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Status == e.Status
}

// Sentinels for errors.Is, one per status.
var (
	// ErrBusy and ErrNoWorker are never returned as errors by selections (they are
	// Decision outcomes); Decision.Err returns them.
	ErrBusy     = &Error{Status: StatusBusy}
	ErrNoWorker = &Error{Status: StatusNoWorker}
	// ErrBufferTooSmall is handled inside the binding (it grows the buffer).
	ErrBufferTooSmall       = &Error{Status: StatusBufferTooSmall}
	ErrNull                 = &Error{Status: StatusNull}
	ErrInvalidArgument      = &Error{Status: StatusInvalidArgument}
	ErrUnknownPartition     = &Error{Status: StatusUnknownPartition}
	ErrPartitionExists      = &Error{Status: StatusPartitionExists}
	ErrUnknownSelectionID   = &Error{Status: StatusUnknownSelectionID}
	ErrDuplicateSelectionID = &Error{Status: StatusDuplicateSelectionID}
	ErrUnknownRank          = &Error{Status: StatusUnknownRank}
	ErrUnknownWorker        = &Error{Status: StatusUnknownWorker}
	ErrAlreadyFreed         = &Error{Status: StatusAlreadyFreed}
	ErrTooLarge             = &Error{Status: StatusTooLarge}
	ErrParentNotFound       = &Error{Status: StatusParentNotFound}
	ErrTooManyRanks         = &Error{Status: StatusTooManyRanks}
	// ErrDecode: an engine message handed to Partition.Ingest did not decode.
	ErrDecode = &Error{Status: StatusDecode}
	// ErrIO: Partition.Subscribe could not create the ingest thread or its runtime, or
	// CreatePartition could not keep the partition in its state directory (WithStateDir).
	ErrIO = &Error{Status: StatusIO}
	// ErrInvalidConfig: the partition options contradict each other or name something
	// kvr cannot use (CreatePartition, CheckPartitionOptions); the error's Reason says
	// why.
	ErrInvalidConfig = &Error{Status: StatusInvalidConfig}
	ErrPanic         = &Error{Status: StatusPanic}
)

// ErrClosed is returned by a method of a handle after its Close (no C call is made).
var ErrClosed = errors.New("kvr: use of a closed handle")

// check turns a C status into nil or an *Error.
func check(st C.kvr_status, op string) error {
	if st == C.KVR_OK {
		return nil
	}
	return &Error{Status: Status(st), Op: op}
}

func itoa(v uint64) string { return strconv.FormatUint(v, 10) }
