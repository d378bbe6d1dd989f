package kvr

import (
	"errors"
	"math"
	"testing"
	"time"
)

func sessionStats(t *testing.T, p *Partition) SessionStats {
	t.Helper()
	s, err := p.SessionStats()
	must(t, err)
	return s
}

// sessionRequest is a request of session id (closed at the end of the test).
func sessionRequest(t *testing.T, s Session) *Request {
	t.Helper()
	req, err := NewRequest()
	must(t, err)
	t.Cleanup(req.Close)
	must(t, req.SetSession(s))
	return req
}

// booked books prompt through req and checks the session route.
func booked(t *testing.T, p *Partition, req *Request, tokens []uint32, route SessionRoute) Decision {
	t.Helper()
	d, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected || d.SessionRoute() != route {
		t.Fatalf("booking = %+v (route %v), want route %v", d, d.SessionRoute(), route)
	}
	return d
}

func free(t *testing.T, e *Engine, d Decision) {
	t.Helper()
	_, err := e.FreeBooking(d.SelectionID)
	must(t, err)
}

// otherWorker is a worker of 1..4 other than w.
func otherWorker(w uint64) uint64 { return w%4 + 1 }

func TestSessionAffinityHard(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "hard", 4, WithSessionAffinity(AffinityHard, 0, 0, 0))
	req := sessionRequest(t, Session{ID: "s"})
	p1, p2 := promptTokens(8*testBlock, 60), promptTokens(8*testBlock, 61)

	first := booked(t, p, req, p1, SessionUnbound)
	if first.Flags != FlagSessionUnbound {
		t.Fatalf("flags %#x", first.Flags)
	}
	s := sessionStats(t, p)
	if !s.Enabled || s.Entries != 1 || s.Leases != 1 || s.BindingsCreated != 1 {
		t.Fatalf("after the first turn: %+v", s)
	}
	free(t, e, first)
	if s := sessionStats(t, p); s.Entries != 1 || s.Leases != 0 || s.LeasesReleased != 1 || s.UnknownLeaseReleases != 0 {
		t.Fatalf("after freeing the first turn: %+v", s)
	}

	// Another worker now holds the whole next prompt; the session still goes home.
	other := otherWorker(first.WorkerID)
	storePrefix(t, p, other, p2, 8)
	second := booked(t, p, req, p2, SessionPinned)
	if second.Rank != first.Rank || second.Flags != FlagSessionPinned {
		t.Fatalf("second turn %+v, want pinned to %+v", second, first.Rank)
	}
	// Advisory selection follows the binding too; without a session the cache wins.
	if d, err := p.Select(req, Tokens(p2)); err != nil || d.Rank != first.Rank || d.SessionRoute() != SessionPinned {
		t.Fatalf("advisory Select in the session = %+v, %v", d, err)
	}
	if d, err := p.Select(nil, Tokens(p2)); err != nil || d.WorkerID != other || d.SessionRoute() != SessionNone {
		t.Fatalf("Select without a session = %+v, %v", d, err)
	}
	if s := sessionStats(t, p); s.Leases != 1 || s.BindingsCreated != 1 {
		t.Fatalf("during the second turn: %+v", s)
	}

	// The bound worker leaves (its booking with it): the next turn is rebound, counted.
	must(t, p.RemoveWorker(first.WorkerID))
	if how, err := e.FreeBooking(second.SelectionID); err != nil || how != FreedRankRemoved {
		t.Fatalf("FreeBooking after the worker left: %v, %v", how, err)
	}
	third := booked(t, p, req, p2, SessionRebound)
	if third.WorkerID == first.WorkerID || third.WorkerID != other || third.Flags != FlagSessionRebound {
		t.Fatalf("third turn %+v, want rebound to worker %d", third, other)
	}
	s = sessionStats(t, p)
	if s.ForcedRebinds != 1 || s.Rebinds != 1 || s.Leases != 1 {
		t.Fatalf("after the rebind: %+v", s)
	}
	free(t, e, third)
	// The session now lives on its new rank.
	fourth := booked(t, p, req, p1, SessionPinned)
	if fourth.Rank != third.Rank {
		t.Fatalf("fourth turn %+v, want %+v", fourth, third.Rank)
	}
	free(t, e, fourth)
	if s := sessionStats(t, p); s.Leases != 0 || s.Entries != 1 {
		t.Fatalf("at the end: %+v", s)
	}
}

// A session whose rank is unavailable is rebound (the availability hook).
func TestSessionRebindUnavailable(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "unavailable", 4, WithSessionAffinity(AffinityHard, 0, 0, 0))
	req := sessionRequest(t, Session{ID: "s"})
	tokens := promptTokens(8*testBlock, 62)
	first := booked(t, p, req, tokens, SessionUnbound)
	free(t, e, first)
	must(t, p.SetHooks(&Hooks{Available: func(r Rank) bool { return r != first.Rank }}))
	second := booked(t, p, req, tokens, SessionRebound)
	if second.Rank == first.Rank {
		t.Fatalf("rebound to the unavailable rank %+v", second)
	}
	free(t, e, second)
	must(t, p.SetHooks(nil))
	if d := booked(t, p, req, tokens, SessionPinned); d.Rank != second.Rank {
		t.Fatalf("after the rebind: %+v, want %+v", d, second.Rank)
	} else {
		free(t, e, d)
	}
	if s := sessionStats(t, p); s.Rebinds != 1 || s.ForcedRebinds != 1 {
		t.Fatalf("%+v", s)
	}
}

func TestSessionAffinitySoft(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "soft", 4, WithSessionAffinity(AffinitySoft, 4, 0, time.Minute))
	req := sessionRequest(t, Session{ID: "s"})
	first := booked(t, p, req, promptTokens(8*testBlock, 63), SessionUnbound)
	free(t, e, first)
	// Equal costs elsewhere: the preference decides.
	for i := uint32(0); i < 4; i++ {
		d := booked(t, p, req, promptTokens(8*testBlock, 64+i), SessionPreferred)
		if d.Rank != first.Rank || d.Flags != FlagSessionPreferred {
			t.Fatalf("turn %d = %+v, want preferred %+v", i, d, first.Rank)
		}
		free(t, e, d)
	}
	// A rank holding the whole prompt (8 blocks of credit) beats a 4-block preference.
	other := otherWorker(first.WorkerID)
	tokens := promptTokens(8*testBlock, 70)
	storePrefix(t, p, other, tokens, 8)
	d := booked(t, p, req, tokens, SessionPreferred)
	if d.WorkerID != other {
		t.Fatalf("soft preference beat 8 cached blocks: %+v", d)
	}
	free(t, e, d)
}

func TestSessionLeasesAndFinalTurn(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "leases", 4, WithSessionAffinity(AffinityHard, 0, 16, 0))
	req := sessionRequest(t, Session{ID: "s"})
	tokens := promptTokens(8*testBlock, 71)
	a := booked(t, p, req, tokens, SessionUnbound)
	b := booked(t, p, req, tokens, SessionPinned)
	if s := sessionStats(t, p); s.Entries != 1 || s.Leases != 2 {
		t.Fatalf("two live turns: %+v", s)
	}
	free(t, e, a)
	if s := sessionStats(t, p); s.Leases != 1 {
		t.Fatalf("one freed: %+v", s)
	}
	free(t, e, b)
	if s := sessionStats(t, p); s.Leases != 0 || s.Entries != 1 {
		t.Fatalf("both freed: %+v", s)
	}
	// A final turn releases the session when its booking ends.
	final := sessionRequest(t, Session{ID: "s", Final: true})
	c := booked(t, p, final, tokens, SessionPinned)
	if s := sessionStats(t, p); s.Entries != 1 || s.Leases != 1 {
		t.Fatalf("during the final turn: %+v", s)
	}
	free(t, e, c)
	if s := sessionStats(t, p); s.Entries != 0 || s.Leases != 0 || s.FinalsReleased != 1 {
		t.Fatalf("after the final turn: %+v", s)
	}
	// A legacy session id is a session too; a child session starts on its parent's rank.
	legacy, err := NewRequest()
	must(t, err)
	defer legacy.Close()
	must(t, legacy.SetLegacySessionID("flat"))
	parent := booked(t, p, legacy, tokens, SessionUnbound)
	free(t, e, parent)
	storePrefix(t, p, otherWorker(parent.WorkerID), tokens, 8)
	child := sessionRequest(t, Session{ID: "child", ParentID: "flat"})
	if d := booked(t, p, child, tokens, SessionPinned); d.Rank != parent.Rank {
		t.Fatalf("child session %+v, want its parent's %+v", d, parent.Rank)
	} else {
		free(t, e, d)
	}
}

func TestSessionAffinityOff(t *testing.T) {
	e := newEngine(t)
	tokens := promptTokens(8*testBlock, 72)
	for group, opts := range map[string][]PartitionOption{
		"off-default":  nil,
		"off-explicit": {WithSessionAffinity(AffinityHard, 0, 0, 0), WithSessionAffinity(AffinityOff, 0, 0, 0)},
	} {
		p := testPartition(t, e, group, 2, opts...)
		req := sessionRequest(t, Session{ID: "s"})
		d := booked(t, p, req, tokens, SessionNone)
		if d.Flags != 0 {
			t.Fatalf("%s: flags %#x", group, d.Flags)
		}
		free(t, e, d)
		if s := sessionStats(t, p); s != (SessionStats{}) {
			t.Fatalf("%s: %+v", group, s)
		}
	}
	p := testPartition(t, e, "closed", 0)
	p.Close()
	if _, err := p.SessionStats(); err != ErrClosed {
		t.Fatalf("SessionStats on a closed partition: %v", err)
	}
}

func TestSessionAffinityInvalidArguments(t *testing.T) {
	for name, opt := range map[string]PartitionOption{
		"unknown mode":     WithSessionAffinity(AffinityMode(7), 0, 0, 0),
		"negative penalty": WithSessionAffinity(AffinitySoft, -1, 0, 0),
		"NaN penalty":      WithSessionAffinity(AffinitySoft, math.NaN(), 0, 0),
		"infinite penalty": WithSessionAffinity(AffinitySoft, math.Inf(1), 0, 0),
		"negative idle":    WithSessionAffinity(AffinityHard, 0, 0, -time.Second),
	} {
		_, err := CheckPartitionOptions(testBlock, opt)
		var ke *Error
		if !errors.Is(err, ErrInvalidArgument) || !errors.As(err, &ke) || ke.Op != "kvr_partition_options_set_session_affinity" {
			t.Errorf("%s: %v, want ErrInvalidArgument from the setter", name, err)
		}
	}
	names := map[string]string{
		AffinityOff.String(): "off", AffinityHard.String(): "hard", AffinitySoft.String(): "soft",
		AffinityMode(7).String(): "AffinityMode(7)", SessionRebound.String(): "rebound",
		SessionNone.String(): "none", SessionRoute(9).String(): "SessionRoute(9)",
	}
	for got, want := range names {
		if got != want {
			t.Errorf("String() = %q, want %q", got, want)
		}
	}
}
