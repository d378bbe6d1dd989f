package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// SubscribeConfig says what Partition.Subscribe subscribes the partition to: one engine
// publisher to connect to (the default), or one endpoint kvr binds and many engines
// connect to (Bind; vLLM connects whenever its endpoint has no "*").
//
// Endpoints are "tcp://HOST:PORT" (a HOST of "*" binds every IPv4 interface; binding
// only) or "ipc://PATH"; a malformed one fails Subscribe with ErrInvalidArgument.
type SubscribeConfig struct {
	// Endpoint: the engine's PUB endpoint (connect), or the endpoint kvr binds (Bind).
	Endpoint string
	// Bind: kvr binds Endpoint. Each topic is its own stream: its worker comes from
	// Routes, else from the digits that end the topic ("kv-17" → worker 17, stream 0);
	// messages of a topic that names no worker are counted as bad frames.
	Bind bool

	// Connect mode only (ErrInvalidArgument with Bind):

	// WorkerID and Stream: the batches are this worker's stream Stream (one per
	// publisher socket, e.g. its DP rank). They must be 0 with Bind.
	WorkerID uint64
	Stream   uint32
	// ReplayEndpoint: the engine's replay ROUTER ("" = none). With one, a sequence gap is
	// filled by a replay before newer batches apply; without one, or when the replay
	// fails, the stream's ranks are cleared and rebuild.
	ReplayEndpoint string
	// Topic: subscribe to the topics starting with these bytes only ("" = all).
	Topic string

	// Bind mode only (ErrInvalidArgument without Bind):

	// Routes map topics to workers.
	Routes []TopicRoute
	// MaxUnroutedTopics: at most this many topics no route names get a stream of their
	// own (0 = kvr's default, 256); messages under further unknown topics are dropped
	// and counted (IndexerStats.IngressRefused).
	MaxUnroutedTopics uint32
}

// TopicRoute says whose messages carry a topic, for a bound subscription.
type TopicRoute struct {
	// Topic: the exact topic (may be empty). A later route for the same topic wins.
	Topic    string
	WorkerID uint64
	Stream   uint32
	// ReplayEndpoint: the publisher's replay ROUTER ("" = none). One replay runs at a
	// time per subscription: a stream that needs one while another stream's is in
	// flight is cleared instead.
	ReplayEndpoint string
}

// Subscription is kvr's own ZMQ subscriber feeding a partition (kvr_subscription): a
// task on kvr's ingest thread (one for all subscriptions of the process) that connects
// (or binds), reconnects, sequence-checks, replays or clears on gaps, decodes and
// applies every batch, and counts per stream (Partition.IngressStats). It holds its own reference to the partition, so the
// Partition and Engine handles may be closed before it.
//
// Stop or Close ends it; keep a reference to the Subscription for as long as it should
// run: a Subscription that becomes unreachable is stopped by its finalizer. Its methods
// may be called from many goroutines at once (Stop and Close wait for each other).
type Subscription struct {
	mu  sync.Mutex
	ptr *C.kvr_subscription
}

// Subscribe subscribes the partition to engine KV events as cfg says. Endpoints that
// are well-formed but unreachable (or a port that is taken) are not an error: kvr keeps
// trying until the subscription stops. Errors: ErrInvalidArgument (a malformed endpoint,
// or a field of the other mode), ErrIO (kvr could not start its ingest thread), ErrClosed.
func (p *Partition) Subscribe(cfg SubscribeConfig) (*Subscription, error) {
	if p.ptr == nil {
		return nil, ErrClosed
	}
	opts, err := cfg.options()
	if err != nil {
		return nil, err
	}
	var sp *C.kvr_subscription
	gc()
	st := C.kvr_partition_subscribe(p.ptr, opts, &sp)
	C.kvr_subscribe_options_free(opts)
	gc()
	runtime.KeepAlive(p)
	if err := check(st, "kvr_partition_subscribe"); err != nil {
		return nil, err
	}
	s := &Subscription{ptr: sp}
	runtime.SetFinalizer(s, (*Subscription).finalize)
	return s, nil
}

// options builds the C options of cfg (the caller frees them).
func (cfg *SubscribeConfig) options() (*C.kvr_subscribe_options, error) {
	var opts *C.kvr_subscribe_options
	ep, en := cstr(cfg.Endpoint)
	var st C.kvr_status
	op := "kvr_subscribe_options_new_connect"
	gc()
	if cfg.Bind {
		op = "kvr_subscribe_options_new_bind"
		st = C.kvr_subscribe_options_new_bind(ep, en, &opts)
	} else {
		st = C.kvr_subscribe_options_new_connect(ep, en, C.uint64_t(cfg.WorkerID), C.uint32_t(cfg.Stream), &opts)
	}
	gc()
	runtime.KeepAlive(cfg.Endpoint)
	if err := check(st, op); err != nil {
		return nil, err
	}
	err := cfg.setOptions(opts)
	if err != nil {
		C.kvr_subscribe_options_free(opts)
		return nil, err
	}
	return opts, nil
}

func (cfg *SubscribeConfig) setOptions(opts *C.kvr_subscribe_options) error {
	if cfg.Bind && (cfg.WorkerID != 0 || cfg.Stream != 0) {
		// No C setter to refuse them: the worker of a bound subscription's messages
		// comes from their topics.
		return &Error{Status: StatusInvalidArgument, Op: "kvr_subscribe_options_new_bind"}
	}
	// The C setters refuse the fields of the other mode.
	if cfg.ReplayEndpoint != "" {
		rp, rn := cstr(cfg.ReplayEndpoint)
		gc()
		st := C.kvr_subscribe_options_set_replay_endpoint(opts, rp, rn)
		gc()
		runtime.KeepAlive(cfg.ReplayEndpoint)
		if err := check(st, "kvr_subscribe_options_set_replay_endpoint"); err != nil {
			return err
		}
	}
	if cfg.Topic != "" {
		tp, tn := cstr(cfg.Topic)
		gc()
		st := C.kvr_subscribe_options_set_topic(opts, (*C.uint8_t)(unsafe.Pointer(tp)), tn)
		gc()
		runtime.KeepAlive(cfg.Topic)
		if err := check(st, "kvr_subscribe_options_set_topic"); err != nil {
			return err
		}
	}
	if cfg.MaxUnroutedTopics != 0 {
		gc()
		st := C.kvr_subscribe_options_set_max_unrouted_topics(opts, C.uint32_t(cfg.MaxUnroutedTopics))
		gc()
		if err := check(st, "kvr_subscribe_options_set_max_unrouted_topics"); err != nil {
			return err
		}
	}
	for i := range cfg.Routes {
		r := &cfg.Routes[i]
		tp, tn := cstr(r.Topic)
		rp, rn := cstr(r.ReplayEndpoint)
		gc()
		st := C.kvr_subscribe_options_add_route(opts, (*C.uint8_t)(unsafe.Pointer(tp)), tn,
			C.uint64_t(r.WorkerID), C.uint32_t(r.Stream), rp, rn)
		gc()
		runtime.KeepAlive(r.Topic)
		runtime.KeepAlive(r.ReplayEndpoint)
		if err := check(st, "kvr_subscribe_options_add_route"); err != nil {
			return err
		}
	}
	return nil
}

func (s *Subscription) finalize() {
	finalized.Add(1)
	s.Close()
}

// Stop stops the subscription and waits for it to end: when it returns, no
// event of it is applied any more and its sockets are closed (a bound port is free
// again). Idempotent; a no-op after Close.
func (s *Subscription) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return
	}
	gc()
	C.kvr_subscription_stop(s.ptr)
	gc()
	runtime.KeepAlive(s)
}

// IsRunning reports whether the subscription runs (false after Stop or Close,
// or if it ended on an internal error).
func (s *Subscription) IsRunning() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return false
	}
	var r C.uint32_t
	gc()
	st := C.kvr_subscription_is_running(s.ptr, &r)
	gc()
	runtime.KeepAlive(s)
	return st == C.KVR_OK && r != 0
}

// Close stops the subscription (as Stop) and releases it. Idempotent.
func (s *Subscription) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return
	}
	gc()
	C.kvr_subscription_free(s.ptr)
	gc()
	s.ptr = nil
	runtime.SetFinalizer(s, nil)
}
