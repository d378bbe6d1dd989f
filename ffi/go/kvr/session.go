package kvr

// #include "shim.h"
import "C"

import "time"

// AffinityMode is a partition's session affinity (KVR_AFFINITY_*): how a session's turns
// (requests with Request.SetSession or SetLegacySessionID) follow the rank its first
// booked turn went to.
type AffinityMode uint32

// The affinity modes.
const (
	// AffinityOff: no session affinity (the default); session fields only travel with
	// the booking.
	AffinityOff AffinityMode = C.KVR_AFFINITY_OFF
	// AffinityHard: a turn goes to its session's rank unless that rank left or cannot
	// take it (then the session is rebound, counted).
	AffinityHard AffinityMode = C.KVR_AFFINITY_HARD
	// AffinitySoft: the session's rank has its cost lowered by a penalty, in blocks.
	AffinitySoft AffinityMode = C.KVR_AFFINITY_SOFT
)

func (m AffinityMode) String() string {
	switch m {
	case AffinityOff:
		return "off"
	case AffinityHard:
		return "hard"
	case AffinitySoft:
		return "soft"
	}
	return "AffinityMode(" + itoa(uint64(m)) + ")"
}

// WithSessionAffinity turns session affinity on (or off with AffinityOff).
// softPenaltyBlocks (finite, ≥ 0) is the soft mode's preference for the session's rank,
// in blocks of cost; maxEntries bounds the sessions held (0 = 65,536); idleTTL drops a
// session with no live booking that long after its last turn (0 = 10 min). A booking
// binds its session; how each selection was steered is Decision.SessionRoute.
// ErrInvalidArgument for an unknown mode, a negative or non-finite penalty in soft mode,
// or a negative idleTTL.
func WithSessionAffinity(mode AffinityMode, softPenaltyBlocks float64, maxEntries uint64, idleTTL time.Duration) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		const op = "kvr_partition_options_set_session_affinity"
		ms, err := millis(idleTTL, op)
		if err != nil {
			return err
		}
		return check(C.kvr_partition_options_set_session_affinity(o, C.uint32_t(mode),
			C.double(softPenaltyBlocks), C.uint64_t(maxEntries), ms), op)
	}
}

// SessionRoute is how session affinity took part in a selection (the session bits of
// Decision.Flags).
type SessionRoute uint8

// The session routes.
const (
	// SessionNone: session affinity took no part (it is off, or the request has no
	// session).
	SessionNone SessionRoute = iota
	// SessionUnbound: the session had no binding: chosen by cost (a booking binds it).
	SessionUnbound
	// SessionPinned: hard affinity: sent to the session's bound rank.
	SessionPinned
	// SessionPreferred: soft affinity: chosen by cost with the session's rank preferred
	// (it may not have won).
	SessionPreferred
	// SessionRebound: the session's rank could not take the turn (left, unavailable,
	// overloaded, not allowed): chosen by cost, and a booking rebinds the session
	// (counted in SessionStats.ForcedRebinds).
	SessionRebound
)

func (r SessionRoute) String() string {
	switch r {
	case SessionNone:
		return "none"
	case SessionUnbound:
		return "unbound"
	case SessionPinned:
		return "pinned"
	case SessionPreferred:
		return "preferred"
	case SessionRebound:
		return "rebound"
	}
	return "SessionRoute(" + itoa(uint64(r)) + ")"
}

// SessionStats are a partition's session-table figures (counters are totals since the
// partition was created; all zero when affinity is off).
type SessionStats struct {
	// Enabled: the partition has session affinity on.
	Enabled bool
	// Entries: sessions held now (including idle-expired ones not yet reaped); Leases:
	// their live bookings.
	Entries uint64
	Leases  uint64
	// BindingsCreated: sessions bound by a first booking.
	BindingsCreated uint64
	// Rebinds: bindings moved to another rank; ForcedRebinds: those forced because the
	// bound rank left or could not take the turn.
	Rebinds       uint64
	ForcedRebinds uint64
	// BindingsDropped: bindings dropped because their rank left.
	BindingsDropped uint64
	// FinalsReleased: sessions released because a final turn's last booking ended.
	FinalsReleased uint64
	// Evicted: idle sessions evicted to make room; Refused: new sessions refused because
	// the table was full of sessions with live bookings.
	Evicted uint64
	Refused uint64
	// Reaped: idle-expired sessions removed.
	Reaped uint64
	// InvalidSessionIDs: session ids refused (empty, or longer than 256 bytes).
	InvalidSessionIDs uint64
	// LeasesReleased: leases (a session's bookings) released; UnknownLeaseReleases:
	// releases of leases no session held; EarlyReleases: bookings bound to their session
	// after their lease was already released; DuplicateLeases: binds refused because the
	// lease belonged to another session.
	LeasesReleased       uint64
	UnknownLeaseReleases uint64
	EarlyReleases        uint64
	DuplicateLeases      uint64
}

// SessionStats returns the partition's session-affinity statistics.
func (p *Partition) SessionStats() (SessionStats, error) {
	return readStats(p, "kvr_partition_session_stats",
		func(p *C.kvr_partition, c *C.kvr_session_stats) C.kvr_status {
			return C.kvr_partition_session_stats(p, c)
		},
		func(c *C.kvr_session_stats) SessionStats {
			return SessionStats{
				Enabled:              c.enabled != 0,
				Entries:              uint64(c.entries),
				Leases:               uint64(c.leases),
				BindingsCreated:      uint64(c.bindings_created),
				Rebinds:              uint64(c.rebinds),
				ForcedRebinds:        uint64(c.forced_rebinds),
				BindingsDropped:      uint64(c.bindings_dropped),
				FinalsReleased:       uint64(c.finals_released),
				Evicted:              uint64(c.evicted),
				Refused:              uint64(c.refused),
				Reaped:               uint64(c.reaped),
				InvalidSessionIDs:    uint64(c.invalid_session_ids),
				LeasesReleased:       uint64(c.leases_released),
				UnknownLeaseReleases: uint64(c.unknown_lease_releases),
				EarlyReleases:        uint64(c.early_releases),
				DuplicateLeases:      uint64(c.duplicate_leases),
			}
		})
}
