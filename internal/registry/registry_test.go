package registry

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/store"
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
	if _, err := r.Register(reg("a", "A", "other", "m")); !errors.Is(err, errdefs.ErrAlreadyExists) {
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
	if err := r.Heartbeat("a", "s1", Stats{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("stale session heartbeat: %v", err)
	}
	// A heartbeat brings an unreachable instance back.
	c.advance(5 * time.Second)
	r.Sweep()
	if err := r.Heartbeat("a", "s3", Stats{Running: 4}); err != nil {
		t.Fatal(err)
	}
	// The new session kept what the Host decided (draining): an agent
	// restart changes nothing an operator or a migration set.
	if i, _ := r.Get("a"); i.EffectiveState() != StateDraining || i.Role != RoleActive || i.Stats.Running != 4 {
		t.Fatalf("after heartbeat: %+v", i)
	}
	if err := r.Deregister("a", "wrong"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deregister with another session: %v", err)
	}
	if err := r.Deregister("a", ""); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deregister with an empty session bypassed the session check: %v", err)
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
	if err := r.Heartbeat("a", "s1", Stats{}); !errors.Is(err, errdefs.ErrNotFound) {
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
		if _, err := r.Register(g); !errors.Is(err, errdefs.ErrInvalidArgument) {
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
	if _, err := r.SetState("a2", StateActive, StateDraining); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("undrain of a non-draining instance: %v", err)
	}
	if models := r.Models(); len(models) != 2 || models[0].Engine.ServedModels[0] != "alias" || models[1].Role != RoleActive {
		t.Fatalf("models %+v", models)
	}
}

// memStore is a Persister in memory.
type memStore struct{ m map[string]store.Instance }

func (s *memStore) PutInstance(i store.Instance) error { s.m[i.ID] = i; return nil }
func (s *memStore) DeleteInstance(id string) error     { delete(s.m, id); return nil }

func (s *memStore) records() []store.Instance {
	var out []store.Instance
	for _, i := range s.m {
		out = append(out, i)
	}
	return out
}

// Roles survive restarts of the Host (through the store) and of agents
// (whose new session keeps the role, and whose clean stop is remembered);
// an agent of another engine cannot take the id over.
func TestRolesSurviveRestarts(t *testing.T) {
	st := &memStore{m: map[string]store.Instance{}}
	c := &clock{t: time.Unix(1000, 0)}
	opts := Options{HeartbeatInterval: time.Second, MissedHeartbeats: 3, Now: c.now, Persist: st}
	r := New(opts)
	r.Register(reg("a", "A", "s1", "m"))
	r.Register(reg("b", "B", "s2", "m"))
	// A migration made B active and retired A.
	_ = r.SetRole("b", RoleActive)
	_ = r.SetRole("a", RoleStandby)
	_, _ = r.SetRetired("a", true)

	// The Host restarts: the instances are known, unreachable, not routed.
	r2 := New(opts)
	r2.Restore(st.records())
	if i, err := r2.Get("b"); err != nil || i.Role != RoleActive || i.Reachable {
		t.Fatalf("restored b: %+v %v", i, err)
	}
	if _, known, ok := r2.Route("m"); !known || ok {
		t.Fatal("a restored instance was routed to before its agent registered")
	}
	// The agents register again with their start-up types: the Host keeps
	// what it decided.
	b, _ := r2.Register(reg("b", "B", "s3", "m"))
	a, _ := r2.Register(reg("a", "A", "s4", "m"))
	if b.Role != RoleActive || a.Role != RoleStandby || !a.Retired || a.Lifecycle() != LifecycleRetired {
		t.Fatalf("after re-registration: a %+v, b %+v", a, b)
	}
	if inst, _, ok := r2.Route("m"); !ok || inst.ID != "b" {
		t.Fatalf("routed to %+v", inst)
	}
	// An agent of another engine cannot take b's id, even once b is gone.
	c.advance(10 * time.Second)
	r2.Sweep()
	other := reg("b", "B", "s5", "m")
	other.Engine.URL = "http://elsewhere"
	if _, err := r2.Register(other); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("takeover by another engine: %v", err)
	}
	// A clean stop is remembered: b comes back active.
	r2.Register(reg("b", "B", "s6", "m"))
	if err := r2.Deregister("b", "s6"); err != nil {
		t.Fatal(err)
	}
	if len(r2.List()) != 1 {
		t.Fatal("a departed instance is still listed")
	}
	if b, _ := r2.Register(reg("b", "B", "s7", "m")); b.Role != RoleActive {
		t.Fatalf("b after a clean agent restart: %+v", b)
	}
	// A Host with no record takes the role the agent reports.
	r3 := New(Options{HeartbeatInterval: time.Second, Now: c.now})
	g := reg("b", "B", "s8", "m")
	g.Role = RoleActive
	if b, _ := r3.Register(g); b.Role != RoleActive {
		t.Fatalf("role from the agent: %+v", b)
	}
	// Forget frees an id once its agent is gone; a live one is refused.
	if err := r3.Forget("b"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("forget a live instance: %v", err)
	}
	c.advance(10 * time.Second)
	r3.Sweep()
	if err := r3.Forget("b"); err != nil {
		t.Fatal(err)
	}
	if _, err := r3.Register(other); err != nil {
		t.Fatalf("the freed id: %v", err)
	}
}

// Unhealthy, sleeping and retired engines get no traffic; what the
// registry forgets after the retention, the store forgets too.
func TestRoutingSkipsUnhealthyAndRetention(t *testing.T) {
	st := &memStore{m: map[string]store.Instance{}}
	c := &clock{t: time.Unix(1000, 0)}
	r := New(Options{HeartbeatInterval: time.Second, MissedHeartbeats: 3, Now: c.now, Persist: st, Retention: time.Minute})
	r.Register(reg("a1", "A", "s1", "m"))
	r.Register(reg("a2", "A", "s2", "m"))
	_ = r.Heartbeat("a1", "s1", Stats{Healthy: false})
	_ = r.Heartbeat("a2", "s2", Stats{Healthy: true, Sleeping: true})
	if _, known, ok := r.Route("m"); !known || ok {
		t.Fatal("an unhealthy or sleeping engine got a request")
	}
	if i, _ := r.Get("a1"); i.Lifecycle() != LifecycleUnhealthy {
		t.Fatalf("a1: %s", i.Lifecycle())
	}
	_ = r.Heartbeat("a1", "s1", Stats{Healthy: true})
	if inst, _, ok := r.Route("m"); !ok || inst.ID != "a1" {
		t.Fatal("a healthy engine got nothing")
	}
	c.advance(2 * time.Minute)
	r.Sweep()
	if len(r.List()) != 0 || len(st.m) != 0 {
		t.Fatalf("not forgotten after the retention: %d listed, %d stored", len(r.List()), len(st.m))
	}
}

// The registry is the one source of "busy": a claim is all or nothing,
// survives the agent registering again, shows as the migrating state
// (and is counted so), and blocks Forget.
func TestClaims(t *testing.T) {
	r := New(Options{})
	for _, id := range []string{"a", "b", "c"} {
		if _, err := r.Register(reg(id, "A", "s-"+id, "m")); err != nil {
			t.Fatal(err)
		}
	}
	mig := Operation{Kind: OpMigration, ID: "mig-1"}
	if err := r.Claim(mig, "a", "b"); err != nil {
		t.Fatal(err)
	}
	if err := r.Claim(Operation{Kind: OpWake}, "c", "b"); !errors.Is(err, errdefs.ErrConflict) || !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "is busy with migration mig-1") {
		t.Fatalf("a second claim: %v", err)
	}
	if err := r.Claim(Operation{Kind: OpWake}, "c"); err != nil {
		t.Fatalf("c was claimed by the refused call: %v", err)
	}
	if err := r.Claim(Operation{Kind: OpWake}, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an unknown id: %v", err)
	}
	a, _ := r.Get("a")
	if a.EffectiveState() != StateMigrating || a.Busy != mig {
		t.Fatalf("a claimed instance: %s %+v", a.EffectiveState(), a.Busy)
	}
	if c, _ := r.Get("c"); c.EffectiveState() != StateActive {
		t.Fatalf("a wake is not a migration: %s", c.EffectiveState())
	}
	if n := r.CountByState()[StateMigrating]; n != 2 {
		t.Fatalf("%d migrating, want 2", n)
	}
	if _, err := r.Register(reg("a", "A", "s-a", "m")); err != nil {
		t.Fatal(err)
	}
	if a, _ := r.Get("a"); a.Busy != mig {
		t.Fatal("re-registering dropped the claim")
	}
	if err := r.Forget("a"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("forgetting a busy instance: %v", err)
	}
	r.Release(Operation{Kind: OpMigration, ID: "other"}, "a")
	if a, _ := r.Get("a"); a.Busy != mig {
		t.Fatal("another operation released the claim")
	}
	r.Release(mig, "a", "b")
	if a, _ := r.Get("a"); a.EffectiveState() != StateActive || a.Busy != (Operation{}) {
		t.Fatalf("released: %s", a.EffectiveState())
	}
}

func TestNotReadySaysWhichAndWhy(t *testing.T) {
	now := time.Unix(1000, 0)
	ok := Instance{Registration: Registration{ID: "a"}, Reachable: true, Stats: Stats{Healthy: true}, LastHeartbeat: now}
	if w := ok.NotReady(now); w != "" {
		t.Fatalf("a reachable, healthy instance: %q", w)
	}
	gone := ok
	gone.Reachable, gone.LastHeartbeat = false, now.Add(-4200*time.Millisecond)
	if w := gone.NotReady(now); w != "a is unreachable (its last heartbeat 4.2s ago)" {
		t.Fatalf("unreachable: %q", w)
	}
	sick := ok
	sick.Stats.Healthy = false
	if w := sick.NotReady(now); w != "a's engine failed its last health check" {
		t.Fatalf("unhealthy: %q", w)
	}
}

// A heartbeat collected before a wake landed still says the engine
// sleeps; within a heartbeat interval of the wake it does not put the
// instance back to sleep, and a sleep that is real shows after that.
func TestAHeartbeatFromBeforeAWakeDoesNotPutItBackToSleep(t *testing.T) {
	r, c := newTestRegistry()
	if _, err := r.Register(reg("b", "B", "s", "m")); err != nil {
		t.Fatal(err)
	}
	if err := r.Heartbeat("b", "s", Stats{Healthy: true, Sleeping: true}); err != nil {
		t.Fatal(err)
	}
	if i, _ := r.Get("b"); i.Lifecycle() != LifecycleSleeping {
		t.Fatalf("before the wake: %s, want sleeping", i.Lifecycle())
	}
	if _, err := r.Woken("b"); err != nil {
		t.Fatal(err)
	}
	c.advance(300 * time.Millisecond)
	if err := r.Heartbeat("b", "s", Stats{Healthy: true, Sleeping: true}); err != nil {
		t.Fatal(err)
	}
	if i, _ := r.Get("b"); i.Lifecycle() == LifecycleSleeping || !i.Serves("m") {
		t.Fatalf("a heartbeat 300 ms after the wake put it back to sleep: %s", i.Lifecycle())
	}
	c.advance(time.Second)
	if err := r.Heartbeat("b", "s", Stats{Healthy: true, Sleeping: true}); err != nil {
		t.Fatal(err)
	}
	if i, _ := r.Get("b"); i.Lifecycle() != LifecycleSleeping {
		t.Fatalf("a sleep reported 1.3 s after the wake: %s, want sleeping", i.Lifecycle())
	}
}
