package rebalance

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// fakeMigrator records what the balancer starts; its migrations end when
// the test says.
type fakeMigrator struct {
	mu      sync.Mutex
	started []hostapi.MigrateRequest
	ended   map[string]bool
	refuse  error
}

func (f *fakeMigrator) Start(req hostapi.MigrateRequest) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse != nil {
		return "", f.refuse
	}
	f.started = append(f.started, req)
	return fmt.Sprint("mig-", len(f.started)), nil
}

func (f *fakeMigrator) Get(id string) (hostapi.MigrationStatus, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := hostapi.MigrationStatus{ID: id, State: hostapi.StateRunning}
	if f.ended[id] {
		st.State = hostapi.StateSucceeded
	}
	return st, true
}

// fleet registers instances of model m with the given (free, total,
// running, waiting) and returns the registry.
func fleet(t *testing.T, loads map[string][4]int) *registry.Registry {
	t.Helper()
	reg := registry.New(registry.Options{HeartbeatInterval: time.Hour, MissedHeartbeats: 3, Log: zap.NewNop()})
	for id, l := range loads {
		r := registry.Registration{ID: id, Type: "A", Session: "s-" + id, AgentAddress: "x:1"}
		r.Engine.URL, r.Engine.ServedModels, r.Engine.Migratable, r.Engine.TP, r.Engine.PP = "http://"+id, []string{"m"}, true, 1, 1
		if _, err := reg.Register(r); err != nil {
			t.Fatal(err)
		}
		if err := reg.Heartbeat(id, "s-"+id, registry.Stats{Healthy: true, FreeBlocks: l[0], TotalBlocks: l[1], Running: l[2], Waiting: l[3]}); err != nil {
			t.Fatal(err)
		}
	}
	return reg
}

func balancer(reg *registry.Registry, mig Migrator, c Config) (*Balancer, *time.Time) {
	b := New(c, reg, mig, func(string) int { return 1 }, nil, zap.NewNop())
	now := time.Unix(1000, 0)
	b.now = func() time.Time { return now }
	return b, &now
}

func TestTheBalancersDecisions(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Interval = time.Second
	for _, c := range []struct {
		name   string
		loads  map[string][4]int
		reason string // "" for no decision
		src    string
		dst    string
	}{
		{"a waiting queue moves the longest to the emptiest", map[string][4]int{"a": {10, 100, 8, 3}, "b": {60, 100, 2, 0}, "c": {90, 100, 1, 0}}, ReasonWaiting, "a", "c"},
		{"KV past the threshold", map[string][4]int{"a": {10, 100, 8, 0}, "b": {80, 100, 2, 0}}, ReasonKVHigh, "a", "b"},
		{"a spread past the threshold", map[string][4]int{"a": {30, 100, 8, 0}, "b": {95, 100, 1, 0}}, ReasonSpread, "a", "b"},
		{"balanced enough", map[string][4]int{"a": {40, 100, 6, 0}, "b": {60, 100, 4, 0}}, "", "", ""},
		{"no room anywhere: nothing moves", map[string][4]int{"a": {5, 100, 9, 2}, "b": {10, 100, 9, 1}}, "", "", ""},
		{"one instance", map[string][4]int{"a": {5, 100, 9, 2}}, "", "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			mig := &fakeMigrator{ended: map[string]bool{}}
			b, _ := balancer(fleet(t, c.loads), mig, cfg)
			got := b.Step()
			if c.reason == "" {
				if len(got) != 0 || len(mig.started) != 0 {
					t.Fatalf("decided %+v", got)
				}
				return
			}
			if len(got) != 1 || got[0].Reason != c.reason || got[0].Src != c.src || got[0].Dst != c.dst || got[0].Migration != "mig-1" {
				t.Fatalf("decided %+v, want %s %s → %s", got, c.reason, c.src, c.dst)
			}
			if r := mig.started[0]; r.Type != hostapi.KeepSourceActive || r.RequestFilter != "longest:4" || r.Src != c.src || r.Dst != c.dst {
				t.Fatalf("started %+v", r)
			}
		})
	}
}

// One migration per instance at a time, then a cooldown from its end;
// a dry run decides the same but starts nothing; a refusal is recorded.
func TestTheBalancerRestsAndRecords(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Interval, cfg.Cooldown = time.Second, 10*time.Second
	loads := map[string][4]int{"a": {10, 100, 8, 3}, "b": {90, 100, 1, 0}}
	mig := &fakeMigrator{ended: map[string]bool{}}
	b, now := balancer(fleet(t, loads), mig, cfg)
	if got := b.Step(); len(got) != 1 {
		t.Fatalf("first pass: %+v", got)
	}
	*now = now.Add(time.Minute)
	if got := b.Step(); len(got) != 0 {
		t.Fatalf("a second move while the first runs: %+v", got)
	}
	mig.ended["mig-1"] = true
	if got := b.Step(); len(got) != 0 {
		t.Fatalf("a move right after the first ended (cooldown): %+v", got)
	}
	*now = now.Add(11 * time.Second)
	if got := b.Step(); len(got) != 1 || got[0].Migration != "mig-2" {
		t.Fatalf("after the cooldown: %+v", got)
	}
	if d := b.Decisions(); len(d) != 2 || d[0].Migration != "mig-2" {
		t.Fatalf("decisions newest first: %+v", d)
	}

	dry := &fakeMigrator{ended: map[string]bool{}}
	cfg.DryRun = true
	b, _ = balancer(fleet(t, loads), dry, cfg)
	if got := b.Step(); len(got) != 1 || !got[0].DryRun || got[0].Migration != "" || len(dry.started) != 0 {
		t.Fatalf("dry run: %+v, started %d", got, len(dry.started))
	}

	cfg.DryRun = false
	refusing := &fakeMigrator{ended: map[string]bool{}, refuse: fmt.Errorf("busy")}
	b, _ = balancer(fleet(t, loads), refusing, cfg)
	if got := b.Step(); len(got) != 1 || !strings.Contains(got[0].Error, "busy") {
		t.Fatalf("refused: %+v", got)
	}
}

// Load the Host does not relay (clients talking to the engine directly)
// cannot move: no decision is spent on it.
func TestOnlyRelayedStreamsAreMoved(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Interval = time.Second
	mig := &fakeMigrator{ended: map[string]bool{}}
	reg := fleet(t, map[string][4]int{"a": {10, 100, 8, 3}, "b": {90, 100, 1, 0}})
	b := New(cfg, reg, mig, func(string) int { return 0 }, nil, zap.NewNop())
	if got := b.Step(); len(got) != 0 {
		t.Fatalf("decided %+v", got)
	}
}

func TestConfigCheck(t *testing.T) {
	c := DefaultConfig()
	if err := c.Check(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []func(*Config){
		func(c *Config) { c.KVHigh = 1.5 }, func(c *Config) { c.Spread = 0 }, func(c *Config) { c.MaxRequests = 0 },
		func(c *Config) { c.Interval = -time.Second },
	} {
		c := DefaultConfig()
		bad(&c)
		if c.Check() == nil {
			t.Errorf("%+v passed", c)
		}
	}
}
