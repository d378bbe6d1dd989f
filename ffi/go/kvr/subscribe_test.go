package kvr

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// freePort is a TCP port of 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	must(t, l.Close())
	return port
}

// listening reports whether something accepts connections on 127.0.0.1:port.
func listening(port int) bool {
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// eventually polls cond every 10 ms for up to 30 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestSubscribeErrors(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "sub-errors", 0)

	for _, cfg := range []SubscribeConfig{
		{Endpoint: ""},
		{Endpoint: "tcp://127.0.0.1"},
		{Endpoint: "127.0.0.1:5557"},
		{Endpoint: "tcp://*:5557"}, // "*" can only be bound
		{Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: "tcp://127.0.0.1"},
		{Endpoint: "tcp://127.0.0.1:70000", Bind: true},
		{Endpoint: "tcp://127.0.0.1:1", Bind: true, Routes: []TopicRoute{{Topic: "kv", WorkerID: 1, ReplayEndpoint: "x"}}},
	} {
		s, err := p.Subscribe(cfg)
		var kerr *Error
		if s != nil || !errors.Is(err, ErrInvalidArgument) || !errors.As(err, &kerr) || kerr.Op != "kvr_partition_subscribe" {
			t.Errorf("Subscribe(%+v) = %v, %v; want ErrInvalidArgument from kvr_partition_subscribe", cfg, s, err)
		}
	}
	// Fields of the other mode.
	for _, c := range []struct {
		cfg SubscribeConfig
		op  string
	}{
		{SubscribeConfig{Endpoint: "tcp://127.0.0.1:1", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:2"}, "kvr_subscribe_options_set_replay_endpoint"},
		{SubscribeConfig{Endpoint: "tcp://127.0.0.1:1", Bind: true, Topic: "kv"}, "kvr_subscribe_options_set_topic"},
		{SubscribeConfig{Endpoint: "tcp://127.0.0.1:1", Bind: true, WorkerID: 3}, "kvr_subscribe_options_new_bind"},
		{SubscribeConfig{Endpoint: "tcp://127.0.0.1:1", Routes: []TopicRoute{{Topic: "kv"}}}, "kvr_subscribe_options_add_route"},
	} {
		s, err := p.Subscribe(c.cfg)
		var kerr *Error
		if s != nil || !errors.As(err, &kerr) || kerr.Status != StatusInvalidArgument || kerr.Op != c.op {
			t.Errorf("Subscribe(%+v) = %v, %v; want ErrInvalidArgument from %s", c.cfg, s, err, c.op)
		}
	}
	// A refused subscription leaves no stream behind.
	if all, err := p.IngressStats(); err != nil || len(all) != 0 {
		t.Fatalf("IngressStats after refused subscriptions = %+v, %v", all, err)
	}

	// An engine that is not there: kvr keeps trying until stopped.
	port := freePort(t)
	s, err := p.Subscribe(SubscribeConfig{
		Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", port),
		ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port),
		Topic:          "kv",
		WorkerID:       4,
		Stream:         1,
	})
	must(t, err)
	if !s.IsRunning() {
		t.Fatal("a new subscription is not running")
	}
	s.Stop()
	if s.IsRunning() {
		t.Fatal("running after Stop")
	}
	s.Stop() // idempotent
	s.Close()
	s.Close() // idempotent
	s.Stop()  // a no-op after Close
	if s.IsRunning() {
		t.Fatal("running after Close")
	}
	// Its stream's counters stay.
	if st, ok := streamOf(t, p, 4); !ok || st.Stream != 1 || st.Messages != 0 || st.HasLastSeq {
		t.Fatalf("the stopped subscription's stream: %+v, %v", st, ok)
	}

	p.Close()
	if s, err := p.Subscribe(SubscribeConfig{Endpoint: "tcp://127.0.0.1:1"}); s != nil || err != ErrClosed {
		t.Fatalf("Subscribe on a closed partition: %v, %v", s, err)
	}
}

// A bound subscription holds its port until Stop, Close or its finalizer; Stop and
// IsRunning may race.
func TestSubscribeBindLifetime(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "sub-bind", 0)

	port := freePort(t)
	s, err := p.Subscribe(SubscribeConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port), Bind: true})
	must(t, err)
	eventually(t, "kvr to bind", func() bool { return listening(port) })
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 100; i++ {
			s.IsRunning()
		}
	}()
	s.Stop()
	<-done
	if listening(port) {
		t.Fatal("port still bound after Stop")
	}
	s.Close()

	// Closed without Stop.
	s, err = p.Subscribe(SubscribeConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port), Bind: true})
	must(t, err)
	eventually(t, "kvr to bind again", func() bool { return listening(port) })
	s.Close()
	if listening(port) {
		t.Fatal("port still bound after Close")
	}

	// Dropped: the finalizer stops it.
	base := finalized.Load()
	func() {
		s, err := p.Subscribe(SubscribeConfig{Endpoint: fmt.Sprintf("tcp://*:%d", port), Bind: true})
		must(t, err)
		eventually(t, "kvr to bind a third time", func() bool { return listening(port) })
		_ = s
	}()
	eventually(t, "the finalizer to release the port", func() bool {
		runtime.GC()
		return finalized.Load() > base && !listening(port)
	})
}

// pyzmqReady reports whether python3 with pyzmq can run testdata/publisher.py; without
// it the test is skipped, unless KVR_REQUIRE_PYZMQ=1 (CI) makes that a failure.
func pyzmqReady(t *testing.T) {
	t.Helper()
	if exec.Command("python3", "-c", "import zmq").Run() == nil {
		return
	}
	if os.Getenv("KVR_REQUIRE_PYZMQ") == "1" {
		t.Fatal("KVR_REQUIRE_PYZMQ=1 but python3 with pyzmq is missing")
	}
	t.Skip("python3 with pyzmq not found")
}

// publisher is testdata/publisher.py running (see its docstring for the protocol).
type publisher struct {
	stdin    io.WriteCloser
	lines    chan string
	endpoint string
}

func startPublisher(t *testing.T, mode, endpoint, topic string, first, blocks int) *publisher {
	t.Helper()
	cmd := exec.Command("python3", "testdata/publisher.py", mode, endpoint, topic,
		strconv.Itoa(testBlock), strconv.Itoa(first), strconv.Itoa(blocks))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	must(t, err)
	stdout, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	pub := &publisher{stdin: stdin, lines: make(chan string, 4)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			pub.lines <- sc.Text()
		}
		close(pub.lines)
	}()
	t.Cleanup(func() {
		stdin.Close()
		waited := make(chan error, 1)
		go func() { waited <- cmd.Wait() }()
		select {
		case err := <-waited:
			if err != nil {
				t.Errorf("publisher.py: %v", err)
			}
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			t.Errorf("publisher.py did not exit")
		}
	})
	ready := pub.line(t)
	if !strings.HasPrefix(ready, "READY ") {
		t.Fatalf("publisher.py said %q, want READY", ready)
	}
	pub.endpoint = strings.TrimPrefix(ready, "READY ")
	return pub
}

func (pub *publisher) line(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-pub.lines:
		if !ok {
			t.Fatal("publisher.py ended early")
		}
		return l
	case <-time.After(30 * time.Second):
		t.Fatal("publisher.py is silent")
	}
	return ""
}

// The Go package subscribes a partition to a real libzmq publisher (pyzmq) sending
// vLLM-encoded batches, as kvr connects to an engine's PUB and as engines connect to
// kvr's bound endpoint; the blocks arrive in the index.
func TestSubscribePublisher(t *testing.T) {
	pyzmqReady(t)
	const blocks = 4
	for _, c := range []struct {
		name   string
		bind   bool
		topic  string
		route  bool
		worker uint64
	}{
		{name: "connect", topic: "kv", worker: 5},
		{name: "bind-route", bind: true, topic: "vllm", route: true, worker: 6},
		{name: "bind-topic-digits", bind: true, topic: "kv-7", worker: 7},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEngine(t)
			p := testPartition(t, e, c.name, 0)
			first := 1000 * int(c.worker)
			tokens := make([]uint32, blocks*testBlock)
			for i := range tokens {
				tokens[i] = uint32(first + i)
			}
			local, _, err := p.HashTokens("", tokens, nil, nil)
			must(t, err)

			var pub *publisher
			var s *Subscription
			if c.bind {
				cfg := SubscribeConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t)), Bind: true}
				if c.route {
					cfg.Routes = []TopicRoute{{Topic: c.topic, WorkerID: c.worker}}
				}
				s, err = p.Subscribe(cfg)
				must(t, err)
				pub = startPublisher(t, "connect", cfg.Endpoint, c.topic, first, blocks)
			} else {
				pub = startPublisher(t, "bind", "tcp://127.0.0.1:*", c.topic, first, blocks)
				s, err = p.Subscribe(SubscribeConfig{Endpoint: pub.endpoint, Topic: c.topic, WorkerID: c.worker})
				must(t, err)
			}
			defer s.Close()
			if got := pub.line(t); got != "SENT" {
				t.Fatalf("publisher.py said %q, want SENT", got)
			}

			// Read through another handle of the partition: the subscription does not
			// need the one it was made from.
			q, err := e.Partition("m", c.name)
			must(t, err)
			defer q.Close()
			p.Close()
			var st StreamStats
			eventually(t, "both batches", func() bool {
				st, _ = streamOf(t, q, c.worker)
				return st.Batches == 2
			})
			if st.Stream != 0 || st.Messages != 2 || st.BlocksStored != blocks || st.BlocksRemoved != 1 ||
				!st.HasLastSeq || st.LastSeq != 1 || st.Gaps != 0 || st.DecodeErrorTotal() != 0 || st.BadFrames != 0 {
				t.Fatalf("stream: %+v", st)
			}
			ov, err := q.FindMatches(local, nil)
			must(t, err)
			if len(ov) != 1 || ov[0].WorkerID != c.worker || ov[0].DPRank != 0 || ov[0].DeviceBlocks != blocks-1 {
				t.Fatalf("FindMatches = %+v; want worker %d with %d device blocks", ov, c.worker, blocks-1)
			}
			if !s.IsRunning() {
				t.Fatal("not running")
			}
			s.Stop()
			if s.IsRunning() {
				t.Fatal("running after Stop")
			}
		})
	}
}
