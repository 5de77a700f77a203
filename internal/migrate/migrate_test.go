package migrate

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

func TestFilters(t *testing.T) {
	reqs := []hooks.RequestInfo{
		{RequestID: "a", NumPromptTokens: 10, NumOutputTokens: 5},
		{RequestID: "b", NumPromptTokens: 100, NumOutputTokens: 50},
		{RequestID: "c", NumPromptTokens: 40, NumOutputTokens: 0},
	}
	ids := func(rs []hooks.RequestInfo) (out []string) {
		for _, r := range rs {
			out = append(out, r.RequestID)
		}
		return out
	}
	for spec, want := range map[string][]string{
		"": {"a", "b", "c"}, "all": {"a", "b", "c"}, "longest:2": {"b", "c"}, "longest:9": {"b", "c", "a"},
		"min_context:40": {"b", "c"}, "ids:c,a,zz": {"a", "c"},
	} {
		f, err := ParseFilter(spec)
		if err != nil {
			t.Fatalf("%q: %v", spec, err)
		}
		got := ids(f.Select(reqs))
		if len(got) != len(want) {
			t.Fatalf("%q: %v, want %v", spec, got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%q: %v, want %v", spec, got, want)
			}
		}
	}
	for _, bad := range []string{"longest:0", "longest:x", "min_context:-1", "ids:", "shortest:3"} {
		if _, err := ParseFilter(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
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
	o, err := New(DefaultConfig(), reg, proxy.New(proxy.Options{}, nil, zap.NewNop()), nil, nil, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	two := 2
	for _, c := range []struct {
		req  Request
		code int
	}{
		{Request{Src: "A"}, 400},
		{Request{Src: "A", Dst: "A"}, 400},
		{Request{Src: "A", Dst: "B", Type: "x"}, 400},
		{Request{Src: "A", Dst: "B", FinalGranularity: "page"}, 400},
		{Request{Src: "A", Dst: "B", TN: 99}, 400},
		{Request{Src: "A", Dst: "B", RequestFilter: "nope"}, 400},
		{Request{Src: "A", Dst: "B", InjectFault: "corrupt"}, 400}, // not allowed on this Host
		{Request{Src: "X", Dst: "B"}, 404},
		{Request{Src: "A", Dst: "X"}, 404},
		{Request{Src: "B", Dst: "A"}, 409},
		{Request{Src: "A", Dst: "P"}, 409},
		{Request{Src: "A", Dst: "B2"}, 409},
		{Request{Src: "A", Dst: "B", TargetTP: &two}, 409},
	} {
		_, err := o.Start(c.req)
		var me *Error
		if !errors.As(err, &me) || me.Status != c.code {
			t.Errorf("%+v: %v, want %d", c.req, err, c.code)
		}
	}
	if len(o.List()) != 0 || o.Busy("A") || o.Busy("B") {
		t.Fatal("a refused migration left state behind")
	}
}
