package failover

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// clock is a registry's time, moved by the test.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func register(t *testing.T, r *registry.Registry, id, typ, session string) {
	t.Helper()
	if _, err := r.Register(registry.Registration{ID: id, Type: typ, Session: session,
		Engine: registry.Engine{URL: "http://" + id, ServedModels: []string{"m"}, TP: 1, PP: 1, Migratable: true}}); err != nil {
		t.Fatal(err)
	}
}

// A's engine died while B's agent was registering again (its old
// session's heartbeats missed, the new one not yet taken): the recovery
// waits for B rather than ending the stream, and takes it once it is
// back — within its deadline. With no such instance (the model's other
// instance a standby), it ends at once; with B gone for good, at the
// deadline.
func TestARecoveryWaitsForASurvivorThatIsComingBack(t *testing.T) {
	c := &clock{t: time.Unix(1e9, 0)}
	r := registry.New(registry.Options{HeartbeatInterval: time.Second, MissedHeartbeats: 3, Now: c.now})
	register(t, r, "A", "A", "a1")
	register(t, r, "B", "A", "b1")
	register(t, r, "C", "B", "c1") // a standby: never a failover's target
	c.add(4 * time.Second)
	if err := r.Heartbeat("A", "a1", registry.Stats{Healthy: true}); err != nil {
		t.Fatal(err)
	}
	if err := r.Heartbeat("C", "c1", registry.Stats{Healthy: true}); err != nil {
		t.Fatal(err)
	}
	r.Sweep() // B's agent missed its heartbeats
	m := New(DefaultConfig(), r, nil, nil, nil, zap.NewNop())
	s := &proxy.Stream{ID: "cmpl-1", Instance: "A", Model: "m"}

	back := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		register(t, r, "B", "A", "b2") // B's new agent
		close(back)
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	start := time.Now()
	ts := m.awaitTargets(ctx, s, m.targets)
	if len(ts) != 1 || ts[0].ID != "B" {
		t.Fatalf("targets %v, want B once its agent is back", ts)
	}
	select {
	case <-back:
	default:
		t.Fatalf("B taken before its agent came back (after %v)", time.Since(start))
	}

	// B gone for good: the wait ends with ctx.
	c.add(4 * time.Second)
	if err := r.Heartbeat("A", "a1", registry.Stats{Healthy: true}); err != nil {
		t.Fatal(err)
	}
	r.Sweep()
	short, cancelShort := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancelShort()
	start = time.Now()
	if ts := m.awaitTargets(short, s, m.replayTargets); len(ts) != 0 {
		t.Fatalf("targets %v with B unreachable", ts)
	}
	if took := time.Since(start); took < 150*time.Millisecond {
		t.Fatalf("gave up after %v with B expected back: want the deadline", took)
	}

	// Only a standby besides A: nothing to wait for.
	if err := r.Deregister("B", "b2"); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if ts := m.awaitTargets(ctx, s, m.targets); len(ts) != 0 {
		t.Fatalf("targets %v: a standby is no failover target", ts)
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Fatalf("waited %v with no instance to wait for", took)
	}
}
