package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/etcdtest"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
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

	h2 := d.secondHost(t, second)
	h2URL := "http://" + second
	time.Sleep(1500 * time.Millisecond)
	if resp, err := http.Get(h2URL + "/health"); err == nil {
		resp.Body.Close()
		t.Fatal("the second Host serves while the first leads the store")
	}
	if hs := hostsOf(t, d.hostURL); len(hs) != 2 || !hs[0].Leader || hs[0].Address != d.hostAddr || hs[1].Leader || hs[1].Address != second {
		t.Fatalf("the Hosts in the leader's status: %+v", hs)
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
	if hs := hostsOf(t, h2URL); len(hs) != 1 || !hs[0].Leader || hs[0].Address != second {
		t.Fatalf("the Hosts in the new leader's status: %+v", hs)
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

// hostsOf reads the Hosts of a shared store from a Host's status.
func hostsOf(t *testing.T, hostURL string) []hostapi.HostInfo {
	t.Helper()
	resp, err := http.Get(hostURL + "/vllm_hi/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st hostapi.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st.Hosts
}

// secondHost starts another Host on the deployment's store at addr: it
// waits to lead.
func (d *deployment) secondHost(t *testing.T, addr string) *proc {
	t.Helper()
	args := slices.Clone(d.hostArgs)
	for i := range args {
		switch args[i] {
		case "--listen":
			args[i+1] = addr
		case "--data-dir":
			args[i+1] = t.TempDir()
		}
	}
	return startVHI(t, args...)
}

// The leading Host dies inside a migration's pause: the Host that takes
// over closes the migration's record (aborted), releases the target's
// reservations at once from it, and keeps exactly one of A and B active;
// A resumes at its pause lease and its direct streams finish.
func TestTheNextHostEndsAMigrationItsLeaderDiedIn(t *testing.T) {
	ep := etcdtest.Start(t)
	second := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--store", "etcd://" + ep, "--store-lease", "2s"}, moreHosts: []string{second}})
	h2 := d.secondHost(t, second)
	defer h2.stop(t)
	direct, viaHost := d.hostDiesInThePause(t) // the leader
	died := time.Now()
	d.host.kill()
	h2URL := "http://" + second
	waitHealthy(t, h2URL+"/health")
	d.hostURL = h2URL
	waitUntil(t, "B's reservations released", func() bool { return d.stats(t, d.bURL).Reserved == 0 })
	freed := time.Since(died)
	list := listMigrations(t, h2URL)
	if len(list) != 1 || list[0].State != hostapi.StateAborted || !strings.Contains(list[0].Error, "released the target's reservations") {
		t.Fatalf("the migration the leader died in, as the next Host has it: %+v", list)
	}
	if a, b := roleOf(t, h2URL, "A"), roleOf(t, h2URL, "B"); a != "active" || b != "standby" {
		t.Fatalf("roles after the takeover: A %s, B %s", a, b)
	}
	t.Logf("the next Host released B's reservations %v after the leader died (store lease 2 s, B's reservation lease 10 s)", freed.Round(time.Millisecond))
	<-viaHost // those streams ended with the leader
	for i, s := range <-direct {
		if s.Err != nil || s.Done != 1 {
			t.Fatalf("stream %d to A did not finish after the leader died: %v", i, s.Err)
		}
	}
}

// A rolling upgrade of the Hosts: the leader stopped with SIGTERM hands
// the store over before it drains its streams, so the waiting Host serves
// new requests at once — not when the leader's drain or lease ends —
// while every stream the old leader relays finishes exactly.
func TestALeaderHandsOverOnSIGTERM(t *testing.T) {
	ep := etcdtest.Start(t)
	second := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--store", "etcd://" + ep, "--store-lease", "10s"}, moreHosts: []string{second}})
	h2 := d.secondHost(t, second)
	defer h2.stop(t)
	reqs := load(16, 700) // ~4 s at 6 ms a step: still running at the hand-over
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(500 * time.Millisecond)
	if err := d.host.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	h2URL := "http://" + second
	waitHealthy(t, h2URL+"/health")
	serving := time.Since(stopped)
	waitUntil(t, "both agents registered with the second Host", func() bool {
		return instance(t, h2URL, "A").Lifecycle == "active" && instance(t, h2URL, "B").Lifecycle == "standby"
	})
	registered := time.Since(stopped)
	// New requests through the second Host while the first drains.
	fresh := load(2, 20)
	if got := loadgen.Run(context.Background(), loadgen.Config{BaseURL: h2URL, Model: "m"}, fresh); got[0].Err != nil || got[1].Err != nil {
		t.Fatalf("a request through the new leader during the old one's drain: %v %v", got[0].Err, got[1].Err)
	}
	got := <-running
	drained := time.Since(stopped)
	checkExact(t, got, want)
	if serving >= drained || serving > 5*time.Second {
		t.Fatalf("the second Host served %v after the SIGTERM, the first drained in %v (its lease: 10 s)", serving, drained)
	}
	t.Logf("SIGTERM to the leader: the next Host served %v after, the agents registered with it %v after; the old leader's %d streams finished exactly %v after",
		serving.Round(time.Millisecond), registered.Round(time.Millisecond), len(got), drained.Round(time.Millisecond))
	d.host.stop(t) // exits 0 after its drain
}
