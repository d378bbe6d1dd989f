package kvr

// The Go package's mirror of the engine's structs against their field lists
// (engine/src/fields.rs, read from ../../fields.json, which ffi/tests/fields_json.rs
// checks against the engine): every stats and load field needs its Go struct field, every
// config field its With* option (or a parameter of a grouped one), every cost override its
// Overrides field. Naming rule: CamelCase with Go's initialisms (KV, ITL, TTL, ID, DP,
// URL), a duration's unit suffix dropped (time.Duration / time.Time carry it); parameters
// in lowerCamelCase. The exception table says where Go differs, each with its reason.

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// mirrorPlace is where Go mirrors an engine struct: names in location loc, as prefix +
// the rule's name of the field without strip.
type mirrorPlace struct{ loc, prefix, strip string }

// mirrorPlaces: engine struct -> its places. Locations: "struct T" (T's exported fields),
// "options" (the With* functions returning PartitionOption, without "With"), "params F"
// (the parameters of function or method F, as "Recv.Method" for a method).
var mirrorPlaces = map[string][]mirrorPlace{
	"PartitionConfig":  {{loc: "options"}, {loc: "params Engine.CreatePartition"}},
	"CostConfig":       {{loc: "options"}},
	"LatencyConfig":    {{loc: "options"}},
	"CostOverrides":    {{loc: "struct Overrides"}},
	"BusyThresholds":   {{loc: "options", prefix: "Busy"}},
	"HintConfig":       {{loc: "params WithKVHints"}},
	"SessionConfig":    {{loc: "params WithSessionAffinity"}},
	"IndexerConfig":    {{loc: "options"}, {loc: "params WithRemoteIndexer", strip: "remote_"}},
	"ApproxConfig":     {{loc: "params WithApproxIndex"}},
	"IndexStats":       {{loc: "struct IndexStats"}},
	"SelectionStats":   {{loc: "struct SelectionStats"}},
	"SessionStats":     {{loc: "struct SessionStats"}},
	"IndexerStats":     {{loc: "struct IndexerStats"}},
	"ApproxStats":      {{loc: "struct IndexerStats", prefix: "Approx"}},
	"ReservationStats": {{loc: "struct BookingStats"}},
	"StreamStats":      {{loc: "struct StreamStats"}},
	"SequenceStats":    {{loc: "struct StreamStats"}},
	"RankLoad":         {{loc: "struct RankLoad"}},
	"ActiveLoad":       {{loc: "struct ActiveLoad"}},
}

// mirrorException is one place where Go legitimately differs: an engine field Go omits
// (name == ""), mirrors under another name (name in loc), or a Go name that mirrors no
// engine field (strukt == "").
type mirrorException struct{ strukt, field, loc, name, why string }

var mirrorExceptions = []mirrorException{
	{strukt: "PartitionConfig", field: "index_dump", why: "as C: no index dump to read (kvr serve's GET /dump turns it on)"},
	{loc: "options", name: "StateDir", why: "as C: the state directory is kvr-state's, not the engine's (libkvr restores and journals the partition)"},
	{loc: "params Engine.CreatePartition", name: "model", why: "the partition's key, not a config field"},
	{loc: "params Engine.CreatePartition", name: "group", why: "the partition's key, not a config field"},
	{loc: "params Engine.CreatePartition", name: "opts", why: "the options themselves"},
	{strukt: "CostConfig", field: "model", loc: "options", name: "CostModel", why: "as C: `model` alone would not say which model"},
	{strukt: "LatencyConfig", field: "kv_pressure_ms", loc: "options", name: "KVPressureCharge", why: "a time.Duration: named for the charge, its unit in the type"},
	{strukt: "LatencyConfig", field: "decode_block_us", loc: "options", name: "DecodeBlockCharge", why: "a time.Duration: named for the charge, its unit in the type"},
	{strukt: "IndexerConfig", field: "use_kv_events", loc: "options", name: "KVEvents", why: "reads WithKVEvents(on)"},
	{strukt: "IndexerConfig", field: "remote_client", why: "as C: libkvr builds the HTTP client from the URL"},
	{strukt: "IndexerConfig", field: "retention", loc: "options", name: "ApproxRetention", why: "as C: named with the approximate index's options"},
	{strukt: "ApproxConfig", field: "prune_to", why: "as C: fixed at its default (80 %)"},
	{strukt: "SessionConfig", field: "shards", why: "as C: internal sharding"},
	{strukt: "SessionConfig", field: "max_session_id_bytes", why: "as C: fixed at KVR_MAX_SESSION_ID_BYTES"},
	{strukt: "SessionConfig", field: "early_release_memory", why: "as C: internal bound of the lease shards"},
	{loc: "params WithSessionAffinity", name: "softPenaltyBlocks", why: "the payload of SessionConfig.mode's Soft variant"},
	{strukt: "IndexStats", field: "table_bytes", why: "as C: a breakdown of Bytes for Rust diagnostics"},
	{strukt: "IndexStats", field: "holder_set_bytes", why: "as C: a breakdown of Bytes; always 0 in the run index"},
	{strukt: "IndexStats", field: "rank_map_bytes", why: "as C: a breakdown of Bytes for Rust diagnostics"},
	{strukt: "IndexStats", field: "lineage_bytes", why: "as C: a breakdown of Bytes; always 0 in the run index"},
	{loc: "struct SessionStats", name: "Enabled", why: "whether affinity is on (Rust has Option<SessionStats>)"},
	{strukt: "ReservationStats", field: "prefill_rate", loc: "struct PrefillRate", name: "TokensPerSecond", why: "read lock-free by Partition.PrefillRate, not with the booking table's figures"},
	{strukt: "ReservationStats", field: "prefill_rate_observations", loc: "struct PrefillRate", name: "Observations", why: "read with the rate by Partition.PrefillRate"},
	{strukt: "ReservationStats", field: "decode_drag", loc: "struct DecodeDrag", name: "SecondsPerBlock", why: "read lock-free by Partition.DecodeDrag, not with the booking table's figures"},
	{strukt: "ReservationStats", field: "decode_drag_observations", loc: "struct DecodeDrag", name: "Observations", why: "read with the drag by Partition.DecodeDrag"},
	{loc: "struct StreamStats", name: "HasLastSeq", why: "whether LastSeq holds one (Rust: Option, C: UINT64_MAX for none)"},
	{loc: "struct StreamStats", name: "ReplaysIncomplete", why: "as C: ReplaysPartial + ReplaysFailed, kept from ABI 1"},
	{loc: "struct RankLoad", name: "WorkerID", why: "as C: the rank the figures are for (Rust keys RankLoad by RankId)"},
	{loc: "struct RankLoad", name: "DPRank", why: "as C: the rank the figures are for (Rust keys RankLoad by RankId)"},
}

// engineList is one struct of fields.json.
type engineList struct {
	Name   string            `json:"name"`
	Fields []string          `json:"fields"`
	Nested map[string]string `json:"nested"`
}

func engineLists(t *testing.T) []engineList {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "fields.json"))
	if err != nil {
		t.Fatalf("ffi/fields.json: %v", err)
	}
	var doc struct {
		Structs []engineList `json:"structs"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil || len(doc.Structs) == 0 {
		t.Fatalf("ffi/fields.json: %v (%d structs)", err, len(doc.Structs))
	}
	return doc.Structs
}

var goInitialisms = map[string]string{"kv": "KV", "itl": "ITL", "ttl": "TTL", "id": "ID", "ids": "IDs", "dp": "DP", "url": "URL"}

// goNames are the names a field may have in Go: CamelCase (lowerCamelCase for a
// parameter), with and without its unit suffix.
func goNames(field string, param bool) []string {
	camel := func(f string) string {
		var b strings.Builder
		for i, w := range strings.Split(f, "_") {
			switch {
			case i == 0 && param:
				b.WriteString(w)
			case goInitialisms[w] != "":
				b.WriteString(goInitialisms[w])
			case w != "":
				b.WriteString(strings.ToUpper(w[:1]) + w[1:])
			}
		}
		return b.String()
	}
	names := []string{camel(field)}
	for _, unit := range []string{"_unix_ms", "_ms", "_us"} {
		if base := strings.TrimSuffix(field, unit); base != field {
			names = append(names, camel(base))
			break
		}
	}
	return names
}

// goLocations reads the package's sources (file name -> text) into the locations.
func goLocations(t *testing.T, sources map[string]string) map[string]map[string]bool {
	t.Helper()
	locs := map[string]map[string]bool{"options": {}}
	add := func(loc, name string) {
		if locs[loc] == nil {
			locs[loc] = map[string]bool{}
		}
		locs[loc][name] = true
	}
	fset := token.NewFileSet()
	for name, src := range sources {
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatalf("parsing %s: %v", name, err)
		}
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					ts, ok := spec.(*ast.TypeSpec)
					if !ok {
						continue
					}
					st, ok := ts.Type.(*ast.StructType)
					if !ok {
						continue
					}
					locs["struct "+ts.Name.Name] = map[string]bool{}
					for _, field := range st.Fields.List {
						for _, n := range field.Names {
							if n.IsExported() {
								add("struct "+ts.Name.Name, n.Name)
							}
						}
					}
				}
			case *ast.FuncDecl:
				fn := d.Name.Name
				if d.Recv != nil && len(d.Recv.List) == 1 {
					recv := d.Recv.List[0].Type
					if star, ok := recv.(*ast.StarExpr); ok {
						recv = star.X
					}
					if id, ok := recv.(*ast.Ident); ok {
						fn = id.Name + "." + fn
					}
				}
				locs["params "+fn] = map[string]bool{}
				for _, p := range d.Type.Params.List {
					for _, n := range p.Names {
						add("params "+fn, n.Name)
					}
				}
				res := d.Type.Results
				if d.Recv == nil && strings.HasPrefix(fn, "With") && res != nil && len(res.List) == 1 {
					if id, ok := res.List[0].Type.(*ast.Ident); ok && id.Name == "PartitionOption" {
						add("options", strings.TrimPrefix(fn, "With"))
					}
				}
			}
		}
	}
	return locs
}

// mirrorDifferences lists every difference between the Go mirror and the engine's lists.
func mirrorDifferences(lists []engineList, locs map[string]map[string]bool) []string {
	var errs []string
	claimed := map[string]map[string]bool{}
	var claim func(loc, name string)
	claim = func(loc, name string) {
		if claimed[loc] == nil {
			claimed[loc] = map[string]bool{}
		}
		claimed[loc][name] = true
		// A grouped option (params WithX) accounts for the option X itself.
		if fn := strings.TrimPrefix(loc, "params With"); fn != loc {
			claim("options", fn)
		}
	}
	checked := map[string]bool{}
	known := map[string]bool{}
	for _, l := range lists {
		known[l.Name] = true
		places, ok := mirrorPlaces[l.Name]
		if !ok {
			errs = append(errs, fmt.Sprintf("Go: engine struct %s has no place in this check (where does Go mirror it?)", l.Name))
			continue
		}
		for _, p := range places {
			checked[p.loc] = true
			if locs[p.loc] == nil {
				errs = append(errs, fmt.Sprintf("Go: %s's location %q is not there", l.Name, p.loc))
			}
		}
	fields:
		for _, field := range l.Fields {
			for _, e := range mirrorExceptions {
				if e.strukt != l.Name || e.field != field {
					continue
				}
				if e.name == "" {
					continue fields // omitted, with its reason
				}
				if locs[e.loc][e.name] {
					claim(e.loc, e.name)
				} else {
					errs = append(errs, fmt.Sprintf("Go: %s.%s is missing (looked for %s in %s)", l.Name, field, e.name, e.loc))
				}
				continue fields
			}
			var looked []string
			for _, p := range places {
				base := strings.TrimPrefix(field, p.strip)
				for _, n := range goNames(base, strings.HasPrefix(p.loc, "params ")) {
					if locs[p.loc][p.prefix+n] {
						claim(p.loc, p.prefix+n)
						continue fields
					}
					looked = append(looked, p.prefix+n+" in "+p.loc)
				}
			}
			if _, nested := l.Nested[field]; !nested {
				errs = append(errs, fmt.Sprintf("Go: %s.%s is missing (looked for %s)", l.Name, field, strings.Join(looked, "; ")))
			}
		}
	}
	for s := range mirrorPlaces {
		if !known[s] {
			errs = append(errs, fmt.Sprintf("Go: mirrorPlaces names %s, not an engine struct", s))
		}
	}
	for loc := range checked {
		for name := range locs[loc] {
			excused := false
			for _, e := range mirrorExceptions {
				excused = excused || (e.strukt == "" && e.loc == loc && e.name == name)
			}
			if !claimed[loc][name] && !excused {
				errs = append(errs, fmt.Sprintf("Go: %s in %s is extra: it mirrors no engine field", name, loc))
			}
		}
	}
	for _, e := range mirrorExceptions {
		if e.strukt == "" && !locs[e.loc][e.name] {
			errs = append(errs, fmt.Sprintf("Go: exception for %s in %s, which is not there: drop it", e.name, e.loc))
		}
	}
	sort.Strings(errs)
	return errs
}

// packageSources reads the package's non-test Go files.
func packageSources(t *testing.T) map[string]string {
	t.Helper()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") {
			continue
		}
		b, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		out[n] = string(b)
	}
	return out
}

func TestGoMirrorsEveryEngineField(t *testing.T) {
	if errs := mirrorDifferences(engineLists(t), goLocations(t, packageSources(t))); len(errs) > 0 {
		t.Fatalf("%d Go mirror(s) differ from the engine's field lists (ffi/fields.json):\n  %s",
			len(errs), strings.Join(errs, "\n  "))
	}
}

// The negative control: a stats field and an option taken out of a copy of the sources
// must be reported as missing.
func TestGoMirrorCheckCatchesRemovals(t *testing.T) {
	for _, c := range []struct{ file, from, to, want string }{
		{"types.go", "\tTooManyRanks uint64\n", "", "IndexStats.too_many_ranks is missing"},
		{"cost.go", "func WithITLBase(", "func WithITLBasis(", "LatencyConfig.itl_base_ms is missing"},
		{"session.go", "\tDuplicateLeases      uint64\n", "", "SessionStats.duplicate_leases is missing"},
	} {
		src := packageSources(t)
		mutated := strings.Replace(src[c.file], c.from, c.to, 1)
		if mutated == src[c.file] {
			t.Fatalf("%s has no %q to remove", c.file, c.from)
		}
		src[c.file] = mutated
		errs := mirrorDifferences(engineLists(t), goLocations(t, src))
		found := false
		for _, e := range errs {
			found = found || strings.Contains(e, c.want)
		}
		if !found {
			t.Fatalf("removing %q from %s was not caught (want %q); got:\n  %s", c.from, c.file, c.want, strings.Join(errs, "\n  "))
		}
	}
}
