package kvr

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// deviceBlocks is worker's device overlap of local (0 when it is not in the answer).
func deviceBlocks(t *testing.T, p *Partition, local []uint64, worker uint64) uint32 {
	t.Helper()
	ov, err := p.FindMatches(local, nil)
	must(t, err)
	for _, o := range ov {
		if o.WorkerID == worker {
			return o.DeviceBlocks
		}
	}
	return 0
}

func TestStateDirRestoresAfterARestart(t *testing.T) {
	dir := t.TempDir()
	tokens := promptTokens(6*testBlock, 7)

	e1, err := New()
	must(t, err)
	p1, err := e1.CreatePartition("m", "g", testBlock, WithStateDir(dir, StateIOPlain))
	must(t, err)
	r, err := p1.StateRestored()
	must(t, err)
	if r.SnapshotFound || r.SnapshotBlocks != 0 {
		t.Fatalf("a new directory restored %+v", r)
	}
	must(t, p1.UpsertWorkerConfig(WorkerConfig{ID: 1}))
	must(t, p1.UpsertWorkerConfig(WorkerConfig{ID: 2}))
	local := storePrefix(t, p1, 1, tokens, 6)
	storePrefix(t, p1, 2, tokens, 3)

	// Another engine of this process cannot write in the same directory meanwhile.
	e2, err := New()
	must(t, err)
	if _, err := e2.CreatePartition("m", "g", testBlock, WithStateDir(dir, StateIOPlain)); !errors.Is(err, ErrIO) {
		t.Fatalf("a second writer in the same directory: %v, want ErrIO", err)
	}
	e2.Close()

	must(t, p1.CloseState())
	st, err := p1.StateStats()
	must(t, err)
	if !st.Closed || st.Uring || st.Snapshots < 2 || st.SnapshotBlocks != 9 || st.EventsDropped != 0 {
		t.Fatalf("stats after CloseState: %+v", st)
	}
	p1.Close()
	e1.Close()

	e3, err := New()
	must(t, err)
	defer e3.Close()
	p3, err := e3.CreatePartition("m", "g", testBlock, WithStateDir(dir, StateIOAuto))
	must(t, err)
	defer p3.Close()
	r, err = p3.StateRestored()
	must(t, err)
	if !r.SnapshotFound || r.SnapshotBlocks != 9 || r.RefusedFiles != 0 || r.StoppedEarly {
		t.Fatalf("restored %+v, want the snapshot's 9 blocks", r)
	}
	must(t, p3.UpsertWorkerConfig(WorkerConfig{ID: 1}))
	must(t, p3.UpsertWorkerConfig(WorkerConfig{ID: 2}))
	if a, b := deviceBlocks(t, p3, local, 1), deviceBlocks(t, p3, local, 2); a != 6 || b != 3 {
		t.Fatalf("after the restart: worker 1 has %d blocks, worker 2 %d; want 6 and 3", a, b)
	}
}

func TestStateDirErrors(t *testing.T) {
	e := newEngine(t)
	// Without the option: no state to read or close.
	p := testPartition(t, e, "none", 0)
	if _, err := p.StateStats(); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("StateStats without a state dir: %v", err)
	}
	if _, err := p.StateRestored(); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("StateRestored without a state dir: %v", err)
	}
	if err := p.CloseState(); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("CloseState without a state dir: %v", err)
	}
	// A directory under a regular file cannot be created: ErrIO, and no partition.
	file := filepath.Join(t.TempDir(), "file")
	must(t, os.WriteFile(file, nil, 0o600))
	if _, err := e.CreatePartition("m", "io", testBlock, WithStateDir(filepath.Join(file, "sub"), StateIOPlain)); !errors.Is(err, ErrIO) {
		t.Fatalf("uncreatable state dir: %v, want ErrIO", err)
	}
	if _, err := e.Partition("m", "io"); !errors.Is(err, ErrUnknownPartition) {
		t.Fatalf("the partition exists after a failed creation: %v", err)
	}
	if _, err := e.CreatePartition("m", "bad", testBlock, WithStateDir("x", StateIO(9))); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("unknown StateIO: %v, want ErrInvalidArgument", err)
	}
	p.Close()
	if _, err := p.StateStats(); !errors.Is(err, ErrClosed) {
		t.Fatalf("StateStats on a closed handle: %v", err)
	}
	if err := p.CloseState(); !errors.Is(err, ErrClosed) {
		t.Fatalf("CloseState on a closed handle: %v", err)
	}
}

// TestStateStructsCarryEveryCField: every field of include/kvr.h's kvr_state_stats and
// kvr_state_restored has its Go field (the C struct itself is checked against kvr-state's
// StateStats at compile time, in ffi/src/state.rs).
func TestStateStructsCarryEveryCField(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "..", "include", "kvr.h"))
	must(t, err)
	for cname, goType := range map[string]reflect.Type{
		"kvr_state_stats":    reflect.TypeOf(StateStats{}),
		"kvr_state_restored": reflect.TypeOf(StateRestored{}),
	} {
		fields := cStructFields(t, string(raw), cname)
		if len(fields) < 8 {
			t.Fatalf("%s: only %d fields found in kvr.h", cname, len(fields))
		}
		for _, f := range fields {
			if !hasGoField(goType, f) {
				t.Errorf("%s.%s has no field in Go's %s", cname, f, goType.Name())
			}
		}
		if goType.NumField() != len(fields) {
			t.Errorf("Go's %s has %d fields, C's %s %d", goType.Name(), goType.NumField(), cname, len(fields))
		}
	}
	// Negative control: a field Go lacks is found.
	if hasGoField(reflect.TypeOf(StateStats{}), "not_a_field") {
		t.Fatal("hasGoField found a field that does not exist")
	}
}

// cStructFields are the member names of `typedef struct name { ... }` in the header.
func cStructFields(t *testing.T, header, name string) []string {
	t.Helper()
	start := strings.Index(header, "typedef struct "+name+" {")
	if start < 0 {
		t.Fatalf("struct %s not in kvr.h", name)
	}
	body := header[start:]
	body = body[strings.Index(body, "{")+1 : strings.Index(body, "}")]
	body = regexp.MustCompile(`(?s)/\*.*?\*/`).ReplaceAllString(body, "")
	member := regexp.MustCompile(`\b([a-z_][a-z0-9_]*)\s*;`)
	var out []string
	for _, m := range member.FindAllStringSubmatch(body, -1) {
		out = append(out, m[1])
	}
	return out
}

// hasGoField: goType has the CamelCase form of the C field c.
func hasGoField(goType reflect.Type, c string) bool {
	var b strings.Builder
	for _, w := range strings.Split(c, "_") {
		if w != "" {
			b.WriteString(strings.ToUpper(w[:1]) + w[1:])
		}
	}
	_, ok := goType.FieldByName(b.String())
	return ok
}
