package migrate_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// loadThroughHost streams the rig's load through the Host in the
// background, started when this returns.
func (r *rig) loadThroughHost() <-chan []loadgen.Stream {
	done := make(chan []loadgen.Stream, 1)
	go func() {
		done <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: r.st.HostURL, Model: "m"}, r.reqs)
	}()
	r.waitRunning()
	return done
}

func (r *rig) exact(got []loadgen.Stream) {
	r.t.Helper()
	for i := range r.reqs {
		if got[i].Err != nil || got[i].Text != r.want[i].Text || got[i].Done != 1 {
			r.t.Fatalf("stream %d: %v, equal to its unmigrated run: %v", i, got[i].Err, got[i].Text == r.want[i].Text)
		}
	}
}

// A drain of the last active instance of a model is a 409 unless forced
// (the model would go offline); a forced drain of an instance whose
// requests nothing can take (the only other instance is a standby) is a
// 409 that says so. Neither changes anything.
func TestDrainWithNowhereToGoIsRefused(t *testing.T) {
	r := newRig(t, rigOptions{})
	done := r.loadThroughHost()
	_, err := r.st.Client().Drain(context.Background(), r.st.AID, hostapi.DrainRequest{})
	if !hostapi.IsStatus(err, 409) || !strings.Contains(err.Error(), "last active instance of model m") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("drain of the model's last active instance: %v", err)
	}
	_, err = r.st.Client().Drain(context.Background(), r.st.AID, hostapi.DrainRequest{Force: true})
	if !hostapi.IsStatus(err, 409) || !strings.Contains(err.Error(), "no instance can take them") {
		t.Fatalf("forced drain with no target: %v", err)
	}
	if _, err := r.st.Client().Drain(context.Background(), r.st.AID, hostapi.DrainRequest{To: []string{r.st.BID}, Force: true}); !hostapi.IsStatus(err, 409) ||
		!strings.Contains(err.Error(), "not active") {
		t.Fatalf("drain onto a standby: %v", err)
	}
	r.exact(<-done)
	if in, _ := r.st.Client().Instance(context.Background(), r.st.AID); in.Lifecycle != "active" {
		t.Fatalf("a refused drain left A %s", in.Lifecycle)
	}
	if list, _ := r.st.Client().Drains(context.Background()); len(list) != 0 {
		t.Fatalf("refused drains were recorded: %+v", list)
	}
	r.unchanged()
}

// A drain whose migrations keep failing ends failed after three in a row:
// every migration rolled back (streams exact), the instance stays
// draining — no new requests, its own finish there — until undrained.
func TestAFailingDrainLeavesTheInstanceDraining(t *testing.T) {
	r := newRig(t, rigOptions{bActive: true})
	release := r.hold(r.st.AID) // streams left to move for all three tries
	defer release()
	done := r.loadThroughHost()
	r.faults.mu.Lock()
	r.faults.list = []*fault{{side: "src", method: "CopyRound", code: codes.Internal}}
	r.faults.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, err := r.st.Client().Drain(ctx, r.st.AID, hostapi.DrainRequest{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := r.st.Client().WaitDrain(ctx, id, 10*time.Millisecond, nil)
	release()
	if err != nil {
		t.Fatal(err)
	}
	r.exact(<-done)
	if st.State != hostapi.StateFailed || !strings.Contains(st.Error, "migrations in a row failed") || len(st.Migration) != 3 || st.Moved != 0 {
		t.Fatalf("drain %+v", st)
	}
	for _, mid := range st.Migration {
		if m, _ := r.st.Client().Migration(ctx, mid); m.State != hostapi.StateAborted {
			t.Fatalf("migration %s %s", mid, m.State)
		}
	}
	if in, _ := r.st.Client().Instance(ctx, r.st.AID); in.Lifecycle != "draining" {
		t.Fatalf("after a failed drain A is %s", in.Lifecycle)
	}
	if in, err := r.st.Client().Undrain(ctx, r.st.AID); err != nil || in.Lifecycle != "active" {
		t.Fatalf("undrain: %+v %v", in, err)
	}
}

// An active instance takes requests by keep_source_active (a rebalance
// between two serving instances); the types that hand the source's role
// over are refused for it.
func TestActiveTargetsTakeKeepSourceActiveOnly(t *testing.T) {
	r := newRig(t, rigOptions{bActive: true})
	_, err := r.st.Client().Migrate(context.Background(), hostapi.MigrateRequest{Src: r.st.AID, Dst: r.st.BID})
	if !hostapi.IsStatus(err, 409) || !strings.Contains(err.Error(), "keep_source_active only") {
		t.Fatalf("destroy_source onto an active target: %v", err)
	}
	st, err := r.migrate(hostapi.MigrateRequest{Type: hostapi.KeepSourceActive, RequestFilter: "longest:2"})
	if err != nil || st.State != hostapi.StateSucceeded || st.Migrated != 2 {
		t.Fatalf("keep_source_active onto an active target: %+v %v", st, err)
	}
	for _, id := range []string{r.st.AID, r.st.BID} {
		if in, _ := r.st.Client().Instance(context.Background(), id); in.Lifecycle != "active" {
			t.Fatalf("%s is %s", id, in.Lifecycle)
		}
	}
}

// The Host's balancer, turned on, moves the longest sequences off an
// instance that carries the whole load onto an idle one of the same model
// (a kv_spread decision, or waiting_queue when a request is queued), by a migration whose streams stay exact; it
// shows the decision at GET /vllm_hi/rebalance.
func TestTheBalancerEvensOutTwoInstances(t *testing.T) {
	r := newRig(t, rigOptions{bActive: true, streams: 12, tokens: 450, tune: func(hc *host.Config) {
		hc.Rebalance.Interval, hc.Rebalance.Spread, hc.Rebalance.Cooldown = 100*time.Millisecond, 0.02, time.Hour
	}})
	ctx := context.Background()
	// B takes no new requests while the load starts: it all lands on A.
	if _, err := r.st.Host.Registry().SetState(r.st.BID, registry.StateDraining, registry.StateActive); err != nil {
		t.Fatal(err)
	}
	release := r.hold(r.st.AID) // A's streams are there when the balancer moves them
	defer release()
	done := r.loadThroughHost()
	if _, err := r.st.Client().Undrain(ctx, r.st.BID); err != nil {
		t.Fatal(err)
	}
	var d hostapi.RebalanceDecision
	deadline := time.Now().Add(10 * time.Second)
	for d.Migration == "" {
		if time.Now().After(deadline) {
			t.Fatal("the balancer decided nothing")
		}
		time.Sleep(20 * time.Millisecond)
		st, err := r.st.Client().Rebalance(ctx)
		if err != nil || !st.Enabled {
			t.Fatalf("rebalance status: %+v %v", st, err)
		}
		if len(st.Decisions) > 0 {
			d = st.Decisions[0]
		}
	}
	t.Logf("decision %+v", d)
	// kv_spread is the decision this load makes; on a starved machine a
	// request can be queued on A when the balancer looks, and the queue
	// rule (threshold 0) decides the same move first. Either is right.
	if d.Src != r.st.AID || d.Dst != r.st.BID || (d.Reason != "kv_spread" && d.Reason != "waiting_queue") || d.Filter != "longest:4" {
		t.Fatalf("decision %+v", d)
	}
	st, err := r.st.Client().WaitMigration(ctx, d.Migration, 10*time.Millisecond, nil)
	release()
	if err != nil || st.State != hostapi.StateSucceeded || st.Migrated == 0 || st.Type != hostapi.KeepSourceActive {
		t.Fatalf("the balancer's migration: %+v %v", st, err)
	}
	r.exact(<-done)
}

// Failover, in process: engine A stops at once mid-stream (its
// connections cut); every stream it carried goes on from B exactly.
func TestFailoverInProcess(t *testing.T) {
	r := newRig(t, rigOptions{bActive: true, streams: 16, tokens: 400, tune: func(hc *host.Config) {
		hc.Failover.SnapshotInterval = 100 * time.Millisecond
	}})
	done := r.loadThroughHost()
	time.Sleep(400 * time.Millisecond)
	onA, _ := r.st.A.Stats(context.Background())
	r.st.KillEngine(r.st.AID)
	r.exact(<-done)
	resp, err := http.Get(r.st.HostURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := fmt.Sprintf(`vhi_failovers_total{outcome="recovered"} %d`, onA.NumRunning); onA.NumRunning == 0 || !strings.Contains(string(b), want) {
		t.Fatalf("A ran %d streams; the metrics lack %q", onA.NumRunning, want)
	}
}
