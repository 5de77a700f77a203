package e2e

import (
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/etcdtest"
)

// Two Hosts on one etcd (issue 31's first step: one leads, the other
// waits). The second does not serve while the first leads; the first
// killed (SIGKILL), the second takes over within the store's lease, knows
// every instance, role and migration the first decided (from etcd), the
// agents (naming both Hosts) register with it by themselves, and
// streams and migrations go on through it exactly.
func TestASecondHostTakesOverTheSharedStore(t *testing.T) {
	ep := etcdtest.Start(t)
	second := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	store := []string{"--store", "etcd://" + ep, "--store-lease", "2s"}
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: store, moreHosts: []string{second}})

	// The first Host decides something: a migration, B active after it.
	reqs := load(16, 300)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(600 * time.Millisecond)
	first := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", Type: hostapi.PreserveSource})
	if first.State != hostapi.StateSucceeded {
		t.Fatalf("the first Host's migration: %s %s", first.State, first.Error)
	}
	checkExact(t, <-running, want)

	args := slices.Clone(d.hostArgs)
	for i := range args {
		if args[i] == "--listen" {
			args[i+1] = second
		}
		if args[i] == "--data-dir" {
			args[i+1] = t.TempDir()
		}
	}
	h2 := startVHI(t, args...)
	h2URL := "http://" + second
	time.Sleep(1500 * time.Millisecond)
	if resp, err := http.Get(h2URL + "/health"); err == nil {
		resp.Body.Close()
		t.Fatal("the second Host serves while the first leads the store")
	}

	d.host.kill()
	killed := time.Now()
	waitHealthy(t, h2URL+"/health")
	serving := time.Since(killed)
	d.hostURL, d.hostAddr = h2URL, second
	waitUntil(t, "both agents registered with the second Host", func() bool {
		a, b := instance(t, h2URL, "A"), instance(t, h2URL, "B")
		return a.AgentAddress != "" && a.Lifecycle == "standby" && b.Lifecycle == "active"
	})
	registered := time.Since(killed)
	t.Logf("the second Host served %v after the first was killed (store lease 2 s), both agents registered with it %v after",
		serving.Round(time.Millisecond), registered.Round(time.Millisecond))
	if a, b := roleOf(t, h2URL, "A"), roleOf(t, h2URL, "B"); a != "standby" || b != "active" {
		t.Fatalf("the roles the first Host decided: A %s, B %s", a, b)
	}
	if st := d.status(t, first.ID); st.State != hostapi.StateSucceeded {
		t.Fatalf("the first Host's migration, read from the second: %+v", st)
	}

	// Streams and a migration through the second Host.
	reqs = load(16, 300)
	want = d.reference(reqs)
	running = d.startLoad(reqs)
	time.Sleep(600 * time.Millisecond)
	back := d.waitMigration(t, hostapi.MigrateRequest{Src: "B", Dst: "A", Type: hostapi.PreserveSource})
	if back.State != hostapi.StateSucceeded || back.Migrated == 0 {
		t.Fatalf("a migration through the second Host: %s (%d moved) %s", back.State, back.Migrated, back.Error)
	}
	checkExact(t, <-running, want)
	h2.stop(t)
}
