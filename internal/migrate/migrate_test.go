package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

func TestFilters(t *testing.T) {
	reqs := []Candidate{
		{RequestInfo: hooks.RequestInfo{RequestID: "a", NumPromptTokens: 10, NumOutputTokens: 5, MaxTokens: 100}, Model: "m", Tag: "batch", AgeS: 30},
		{RequestInfo: hooks.RequestInfo{RequestID: "b", NumPromptTokens: 100, NumOutputTokens: 50, MaxTokens: 60, BlockIDs: []int{1, 2, 3}}, Model: "m", AgeS: 2},
		{RequestInfo: hooks.RequestInfo{RequestID: "c", NumPromptTokens: 40, NumOutputTokens: 0, MaxTokens: 400}, Model: "other", AgeS: 9.5},
	}
	ids := func(rs []Candidate) (out []string) {
		for _, r := range rs {
			out = append(out, r.RequestID)
		}
		return out
	}
	for spec, want := range map[string][]string{
		"": {"a", "b", "c"}, "all": {"a", "b", "c"}, "longest:2": {"b", "c"}, "longest:9": {"b", "c", "a"},
		"min_context:40": {"b", "c"}, "ids:c,a,zz": {"a", "c"},
		"expr:true": {"a", "b", "c"}, "expr: context_tokens >= 40 ": {"b", "c"},
		`expr:tag == "batch" || (model == "other" && age_s > 9.0)`: {"a", "c"},
		"expr:remaining_tokens < 20 && blocks == 3":                {"b"}, `expr:id.startsWith("c")`: {"c"},
		"expr:prompt_tokens + output_tokens == context_tokens && computed_tokens == 0 && max_tokens > 0": {"a", "b", "c"},
	} {
		f, err := ParseFilter(spec)
		if err != nil {
			t.Fatalf("%q: %v", spec, err)
		}
		sel, err := f.Select(reqs)
		if err != nil {
			t.Fatalf("%q: %v", spec, err)
		}
		got := ids(sel)
		if len(got) != len(want) {
			t.Fatalf("%q: %v, want %v", spec, got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%q: %v, want %v", spec, got, want)
			}
		}
	}
	for _, bad := range []string{"longest:0", "longest:x", "min_context:-1", "ids:", "shortest:3", "expr:", "expr:context_tokens",
		"expr:context_tokens > ", `expr:priority > 1`, `expr:tag > 3`} {
		if _, err := ParseFilter(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	// A compile error says where: line:column and a caret under the spot.
	_, err := ParseFilter("expr:context_tokens > 10 && nope")
	if err == nil || !strings.Contains(err.Error(), "1:24") || !strings.Contains(err.Error(), "undeclared reference to 'nope'") {
		t.Fatalf("want the error's position: %v", err)
	}
	// An expression that fails on a request selects nothing and says which.
	f, err := ParseFilter("expr:context_tokens / (output_tokens - output_tokens) > 1")
	if err != nil {
		t.Fatal(err)
	}
	if sel, err := f.Select(reqs); err == nil || sel != nil || !strings.Contains(err.Error(), "request a") {
		t.Fatalf("a failing expression: %v %v", sel, err)
	}
}

// Requests that can be refused are refused before anything starts, with
// the contract's status codes.
func TestStartRefusals(t *testing.T) {
	reg := registry.New(registry.Options{HeartbeatInterval: time.Hour})
	add := func(id, typ string, migratable bool, models ...string) {
		if _, err := reg.Register(registry.Registration{ID: id, Type: typ, Session: "s", AgentAddress: "127.0.0.1:1",
			Engine: registry.Engine{URL: "http://e", ServedModels: models, TP: 1, PP: 1, Migratable: migratable}}); err != nil {
			t.Fatal(err)
		}
	}
	add("A", "A", true, "m")
	add("B", "B", true, "m")
	add("B2", "B", true, "other")
	add("P", "B", false, "m")
	// A target whose KV geometry differs is refused before anything starts
	// (it used to be found in round 0, as an abort).
	if _, err := reg.Register(registry.Registration{ID: "G", Type: "B", Session: "s", AgentAddress: "127.0.0.1:1",
		Engine: registry.Engine{URL: "http://g", ServedModels: []string{"m"}, TP: 1, PP: 1, Migratable: true,
			Geometry: registry.Geometry{Layers: 2, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, BlockSize: 16}}}); err != nil {
		t.Fatal(err)
	}
	o, err := New(DefaultConfig(), reg, proxy.New(proxy.Options{}, nil, zap.NewNop()), agentclient.NewPool("", nil), nil, nil, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	two := 2
	for _, c := range []struct {
		req  hostapi.MigrateRequest
		code int
	}{
		{hostapi.MigrateRequest{Src: "A"}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "A"}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", Type: "x"}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", FinalGranularity: "page"}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", PauseInFlight: "later"}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", TN: 99}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", RequestFilter: "nope"}, 400},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", InjectFault: "corrupt"}, 400}, // not allowed on this Host
		{hostapi.MigrateRequest{Src: "X", Dst: "B"}, 404},
		{hostapi.MigrateRequest{Src: "A", Dst: "X"}, 404},
		{hostapi.MigrateRequest{Src: "B", Dst: "A"}, 409},
		{hostapi.MigrateRequest{Src: "A", Dst: "P"}, 409},
		{hostapi.MigrateRequest{Src: "A", Dst: "B2"}, 409},
		{hostapi.MigrateRequest{Src: "A", Dst: "B", TargetTP: &two}, 409},
		{hostapi.MigrateRequest{Src: "A", Dst: "G"}, 409},
	} {
		_, err := o.Start(c.req)
		if err == nil || errdefs.HTTPStatus(err) != c.code {
			t.Errorf("%+v: %v, want %d", c.req, err, c.code)
		}
	}
	for _, id := range []string{"A", "B", "G"} {
		if i, _ := reg.Get(id); i.Busy != (registry.Operation{}) {
			t.Fatalf("a refused migration left %s claimed by %s", id, i.Busy)
		}
	}
	if len(o.List()) != 0 {
		t.Fatal("a refused migration left state behind")
	}
}

// memRecords is a RecordStore in memory.
type memRecords struct {
	mu sync.Mutex
	m  map[string]json.RawMessage
}

func (s *memRecords) PutMigration(id string, r json.RawMessage) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[id] = r
	return nil
}

func (s *memRecords) DeleteMigration(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, id)
	return nil
}

func (s *memRecords) Migrations() (map[string]json.RawMessage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]json.RawMessage{}
	for k, v := range s.m {
		out[k] = v
	}
	return out, nil
}

// Records of earlier Hosts come back; migrations a Host died in are
// closed with what happened to them; the history is bounded, in memory
// and in the store.
func TestRecordsSurviveAndStayBounded(t *testing.T) {
	store := &memRecords{m: map[string]json.RawMessage{}}
	t0 := time.Unix(1000, 0).UTC()
	for i, st := range []hostapi.MigrationStatus{
		{ID: "mig-1", State: hostapi.StateSucceeded},
		{ID: "mig-2", State: hostapi.StateAborted},
		{ID: "mig-3", State: hostapi.StateSucceeded},
		{ID: "mig-4", State: hostapi.StateRunning, CurrentStep: string(stepRound0)},
		{ID: "mig-5", State: hostapi.StateRunning, CurrentStep: string(stepSwitch), Committed: true},
	} {
		st.CreatedAt = t0.Add(time.Duration(i) * time.Second)
		b, _ := json.Marshal(st)
		store.m[st.ID] = b
	}
	cfg := DefaultConfig()
	cfg.MaxHistory = 3
	reg := registry.New(registry.Options{})
	o, err := New(cfg, reg, proxy.New(proxy.Options{}, nil, zap.NewNop()), agentclient.NewPool("", nil), nil, store, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	list := o.List()
	if len(list) != 3 || list[0].ID != "mig-5" || list[2].ID != "mig-3" {
		t.Fatalf("history: %+v", list)
	}
	if st, _ := o.Get("mig-4"); st.State != hostapi.StateAborted || !strings.Contains(st.Error, "rolled it back") {
		t.Fatalf("a migration its Host died in before the commit: %+v", st)
	}
	if st, _ := o.Get("mig-5"); st.State != hostapi.StateFailed {
		t.Fatalf("a migration its Host died in after the commit: %+v", st)
	}
	o.Close(context.Background())
	if len(store.m) != 3 {
		t.Fatalf("the store keeps %d records, want 3", len(store.m))
	}
	var st hostapi.MigrationStatus
	_ = json.Unmarshal(store.m["mig-4"], &st)
	if st.State != hostapi.StateAborted {
		t.Fatalf("the closed record was not written back: %+v", st)
	}
}

// pick takes n distinct indices below k at random, or all of them.
func TestVerifyPicks(t *testing.T) {
	for k := 0; k < 40; k++ {
		for _, n := range []int{0, 2, k} {
			got := pick(k, n)
			seen := map[int]bool{}
			for _, i := range got {
				if i < 0 || i >= k || seen[i] {
					t.Fatalf("k=%d n=%d: %v", k, n, got)
				}
				seen[i] = true
			}
			if len(got) != min(k, n) {
				t.Fatalf("k=%d n=%d: %v", k, n, got)
			}
		}
	}
}

// sampleRange keeps both ends of a catch-up's range and n blocks between,
// in order, the three lists alike; a short range stays whole.
func TestSampleRangeKeepsBothEnds(t *testing.T) {
	for k := 0; k < 30; k++ {
		src, dst, at := make([]int, k), make([]string, k), make([]int, k)
		for i := range k {
			src[i], dst[i], at[i] = i, fmt.Sprint(i), i
		}
		for _, n := range []int{0, 2, 5} {
			s, d, w := sampleRange(src, dst, at, n)
			want := min(k, n+2)
			if len(s) != want || len(d) != want || len(w) != want {
				t.Fatalf("k=%d n=%d: kept %d, want %d", k, n, len(s), want)
			}
			if k > 0 && (s[0] != 0 || s[len(s)-1] != k-1) {
				t.Fatalf("k=%d n=%d: %v lost an end", k, n, s)
			}
			for i := range s {
				if d[i] != fmt.Sprint(s[i]) || w[i] != s[i] || i > 0 && s[i] <= s[i-1] {
					t.Fatalf("k=%d n=%d: %v %v %v", k, n, s, d, w)
				}
			}
		}
	}
}
