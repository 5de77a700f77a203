package scale

import (
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/launch"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/store"
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
	s := New(Config{}, reg, nil, nil, "", NewMetric(), zap.NewNop())
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

// fakeKeep is a LaunchedStore in memory.
type fakeKeep map[string]store.Launched

func (f fakeKeep) PutLaunched(l store.Launched) error { f[l.ID] = l; return nil }
func (f fakeKeep) DeleteLaunched(id string) error     { delete(f, id); return nil }

// A restarted Host adopts the replicas an earlier one launched that still
// run — and stops them when it takes them out — and drops the records of
// those that are gone.
func TestRememberAdoptsWhatAnEarlierHostLaunched(t *testing.T) {
	dir := t.TempDir()
	live, err := launch.Start(launch.Spec{Command: []string{"sleep", "300"}, Cwd: dir}, nil, filepath.Join(dir, "live.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer live.Stop(time.Second)
	gone, err := launch.Start(launch.Spec{Command: []string{"true"}, Cwd: dir}, nil, filepath.Join(dir, "gone.log"))
	if err != nil {
		t.Fatal(err)
	}
	<-gone.Exited()
	keep := fakeKeep{}
	for id, p := range map[string]*launch.Process{"live": live, "gone": gone} {
		pid, start := p.Identity()
		keep[id] = store.Launched{ID: id, Model: "m", PID: pid, Start: start, LogFile: p.LogFile()}
	}
	s := New(Config{}, registry.New(registry.Options{}), nil, nil, "", NewMetric(), zap.NewNop())
	s.Remember(keep, []store.Launched{keep["live"], keep["gone"]})
	if _, ok := keep["gone"]; ok || len(keep) != 1 {
		t.Fatalf("records after adoption: %v, want only live's", keep)
	}
	l, ok := s.launched["live"]
	if !ok || len(s.launched) != 1 || l.Process.Pid() != live.Pid() {
		t.Fatalf("adopted: %+v", s.launched)
	}
	s.stopLaunched(l)
	select {
	case <-live.Exited():
	case <-time.After(5 * time.Second):
		t.Fatal("the adopted replica was not stopped")
	}
	if len(keep) != 0 {
		t.Fatalf("records after the stop: %v", keep)
	}

	// What this Host launches is kept before it is activated.
	p, err := launch.Start(launch.Spec{Command: []string{"sleep", "300"}, Cwd: dir}, nil, filepath.Join(dir, "new.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(time.Second)
	s.keepLaunched("m", migrate.Launched{ID: "new", Process: p, LogFile: p.LogFile()})
	if r, ok := keep["new"]; !ok || r.PID != p.Pid() || r.Start == 0 || r.Model != "m" {
		t.Fatalf("kept: %+v", keep)
	}
}
