package scale

import (
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// A replicas scale-out takes standbys, then retired engines, as spares —
// never an engine another controller owns (model switching's).
func TestSparesLeaveOwnedEnginesAlone(t *testing.T) {
	reg := registry.New(registry.Options{})
	for _, r := range []registry.Registration{
		{ID: "standby", Type: "B", Engine: registry.Engine{URL: "http://e1", ServedModels: []string{"m"}, Migratable: true, TP: 1, PP: 1}, Session: "s"},
		{ID: "switched", Type: "B", Engine: registry.Engine{URL: "http://e2", ServedModels: []string{"m"}, Migratable: true, TP: 1, PP: 1}, Session: "s"},
		{ID: "retired", Type: "B", Engine: registry.Engine{URL: "http://e3", ServedModels: []string{"m"}, Migratable: true, TP: 1, PP: 1}, Session: "s"},
		{ID: "other", Type: "B", Engine: registry.Engine{URL: "http://e4", ServedModels: []string{"x"}, Migratable: true, TP: 1, PP: 1}, Session: "s"},
	} {
		if _, err := reg.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := reg.SetRetired("retired", true); err != nil {
		t.Fatal(err)
	}
	s := New(Config{}, reg, nil, nil, "", NewMetric(), nil)
	ids := func() (out []string) {
		for _, in := range s.spares("m") {
			out = append(out, in.ID)
		}
		return out
	}
	if got := ids(); len(got) != 3 || got[0] != "standby" || got[1] != "switched" || got[2] != "retired" {
		t.Fatalf("spares: %v, want standby, switched (standbys first), retired", got)
	}
	s.NotSpare(func(in registry.Instance) bool { return in.Engine.URL == "http://e2" })
	if got := ids(); len(got) != 2 || got[0] != "standby" || got[1] != "retired" {
		t.Fatalf("spares with switched owned elsewhere: %v, want standby, retired", got)
	}
}
