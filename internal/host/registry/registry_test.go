package registry

import (
	"errors"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func reg(id, typ, session string, models ...string) Registration {
	return Registration{ID: id, Type: typ, Session: session, AgentAddress: "10.0.0.1:1",
		Engine: Engine{URL: "http://e-" + id, ServedModels: models, TP: 1, PP: 1}}
}

func newTestRegistry() (*Registry, *clock) {
	c := &clock{t: time.Unix(1000, 0)}
	return New(Options{HeartbeatInterval: time.Second, MissedHeartbeats: 3, Now: c.now}), c
}

func TestLifecycle(t *testing.T) {
	r, c := newTestRegistry()
	a, err := r.Register(reg("a", "A", "s1", "m"))
	if err != nil || a.Role != RoleActive || a.EffectiveState() != StateActive {
		t.Fatalf("register A: %+v %v", a, err)
	}
	b, _ := r.Register(reg("b", "B", "s2", "m"))
	if b.Role != RoleStandby || b.State != StateStandby {
		t.Fatalf("B: %+v", b)
	}
	// Same session again (a retry): accepted, state kept.
	if _, err := r.SetState("a", StateDraining, StateActive); err != nil {
		t.Fatal(err)
	}
	if a2, err := r.Register(reg("a", "A", "s1", "m")); err != nil || a2.State != StateDraining {
		t.Fatalf("re-register same session: %+v %v", a2, err)
	}
	// Another live session with the same id: refused.
	if _, err := r.Register(reg("a", "A", "other", "m")); !errors.Is(err, ErrAlreadyExists) {
		t.Fatalf("duplicate: %v", err)
	}
	// Missed heartbeats: unreachable, then a new session may take over.
	c.advance(2 * time.Second)
	_ = r.Heartbeat("b", "s2", Stats{Healthy: true})
	c.advance(2 * time.Second)
	r.Sweep()
	if i, _ := r.Get("a"); i.EffectiveState() != StateUnreachable {
		t.Fatalf("a should be unreachable: %+v", i)
	}
	if i, _ := r.Get("b"); i.EffectiveState() != StateStandby {
		t.Fatalf("b heartbeated and must stay: %+v", i)
	}
	if n := r.CountByState(); n[StateUnreachable] != 1 || n[StateStandby] != 1 {
		t.Fatalf("counts %v", n)
	}
	if _, err := r.Register(reg("a", "A", "s3", "m")); err != nil {
		t.Fatalf("takeover after the old session died: %v", err)
	}
	// Heartbeats from the old session are unknown now.
	if err := r.Heartbeat("a", "s1", Stats{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("stale session heartbeat: %v", err)
	}
	// A heartbeat brings an unreachable instance back.
	c.advance(5 * time.Second)
	r.Sweep()
	if err := r.Heartbeat("a", "s3", Stats{Running: 4}); err != nil {
		t.Fatal(err)
	}
	if i, _ := r.Get("a"); i.EffectiveState() != StateActive || i.Stats.Running != 4 {
		t.Fatalf("after heartbeat: %+v", i)
	}
	if err := r.Deregister("a", "wrong"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("deregister with another session: %v", err)
	}
	if err := r.Deregister("a", "s3"); err != nil {
		t.Fatal(err)
	}
	if len(r.List()) != 1 {
		t.Fatal("deregistered instance still listed")
	}
}

// A restarted Host has an empty registry: heartbeats are NOT_FOUND, and the
// agent's registration brings the instance back with its role.
func TestHostRestartForgetsAndRelearns(t *testing.T) {
	r, _ := newTestRegistry()
	if err := r.Heartbeat("a", "s1", Stats{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("heartbeat to a fresh registry: %v", err)
	}
	if i, err := r.Register(reg("a", "A", "s1", "m")); err != nil || i.Role != RoleActive {
		t.Fatalf("%+v %v", i, err)
	}
}

func TestInvalidRegistrations(t *testing.T) {
	r, _ := newTestRegistry()
	for name, mod := range map[string]func(*Registration){
		"no id":      func(g *Registration) { g.ID = "" },
		"bad type":   func(g *Registration) { g.Type = "C" },
		"no session": func(g *Registration) { g.Session = "" },
		"no url":     func(g *Registration) { g.Engine.URL = "" },
		"no models":  func(g *Registration) { g.Engine.ServedModels = nil },
		"empty name": func(g *Registration) { g.Engine.ServedModels = []string{""} },
		"tp 0":       func(g *Registration) { g.Engine.TP = 0 },
	} {
		g := reg("x", "A", "s", "m")
		mod(&g)
		if _, err := r.Register(g); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if len(r.List()) != 0 {
		t.Fatal("an invalid registration was stored")
	}
}

func TestRoute(t *testing.T) {
	r, c := newTestRegistry()
	if _, known, ok := r.Route("m"); known || ok {
		t.Fatal("empty registry routed")
	}
	r.Register(reg("b", "B", "s", "m"))
	if _, known, ok := r.Route("m"); !known || ok {
		t.Fatal("a standby must not receive traffic (503, not 404)")
	}
	r.Register(reg("a1", "A", "s", "m", "alias"))
	r.Register(reg("a2", "A", "s", "m"))
	seen := map[string]int{}
	for i := 0; i < 10; i++ {
		inst, _, ok := r.Route("m")
		if !ok {
			t.Fatal("no route")
		}
		seen[inst.ID]++
	}
	if seen["a1"] != 5 || seen["a2"] != 5 {
		t.Fatalf("round robin: %v", seen)
	}
	if inst, _, ok := r.Route("alias"); !ok || inst.ID != "a1" {
		t.Fatal("second served name not routed")
	}
	r.SetState("a1", StateDraining, StateActive)
	for i := 0; i < 4; i++ {
		if inst, _, _ := r.Route("m"); inst.ID != "a2" {
			t.Fatal("draining instance got a request")
		}
	}
	c.advance(10 * time.Second)
	r.Sweep()
	if _, known, ok := r.Route("m"); !known || ok {
		t.Fatal("unreachable instances must not be routed to")
	}
	if _, err := r.SetState("a2", StateActive, StateDraining); !errors.Is(err, ErrConflict) {
		t.Fatalf("undrain of a non-draining instance: %v", err)
	}
	if models := r.Models(); len(models) != 2 || models[0].Engine.ServedModels[0] != "alias" || models[1].Role != RoleActive {
		t.Fatalf("models %+v", models)
	}
}
