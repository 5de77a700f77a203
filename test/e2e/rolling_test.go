package e2e

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/test/framework"
)

// A rolling restart under a steady streaming load: each instance of the
// model in turn has its agent stopped (SIGTERM: the agent has the Host
// drain it, its streams move to the other instance), then its engine is
// killed, and both start again. No stream fails or breaks, every stream equals its
// unmigrated run, and each instance comes back active.
func TestRollingRestartUnderLoad(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, bActive: true})
	ctx := context.Background()
	reqs := load(96, 300)
	want := d.reference(reqs)
	// Both engines hold their streams' last tokens, so a drain has
	// streams to move however slowly the machine runs; a restarted engine
	// holds nothing, so the streams moved onto it finish there.
	releaseA := framework.HoldStreams(t, d, "A")
	releaseB := framework.HoldStreams(t, d, "B")
	got := make([]loadgen.Stream, len(reqs))
	var wg sync.WaitGroup
	sent := make(chan struct{})
	go func() {
		// Four new streams every 150 ms, for as long as the restarts take.
		defer close(sent)
		for i := 0; i < len(reqs); i += 4 {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				copy(got[i:], loadgen.Run(ctx, loadgen.Config{BaseURL: d.hostURL, Model: "m"}, reqs[i:i+4]))
			}(i)
			time.Sleep(150 * time.Millisecond)
		}
	}()
	for i, id := range []string{"A", "B"} {
		url := d.aURL
		if id == "B" {
			url = d.bURL
		}
		waitUntil(t, id+" to run streams", func() bool { return d.stats(t, url).Running > 0 })
		agent, sim := &d.agentA, &d.simA
		if id == "B" {
			agent, sim = &d.agentB, &d.simB
		}
		(*agent).stop(t) // SIGTERM: drains first
		if in := instance(t, d.hostURL, id); in.ID != "" {
			t.Fatalf("%s still listed (%s) after its agent stopped", id, in.Lifecycle)
		}
		// Killed, not stopped: the sim would finish its streams on SIGTERM,
		// and nothing left on the engine may be what makes the test pass.
		(*sim).kill()
		*sim = startVHI(t, d.simArgs[i]...)
		waitHealthy(t, url+"/health")
		*agent = d.startAgent(t, id, "A", url)
		waitUntil(t, id+" to be active again", func() bool {
			return instance(t, d.hostURL, id).Lifecycle == "active"
		})
	}
	// The restarted engines hold nothing; lift the holds while they are up
	// (the restarts' own cleanups stop them before the test's end).
	releaseA()
	releaseB()
	<-sent
	wg.Wait()
	checkExact(t, got, want)
	c := hostClient(t, d.hostURL, d.tk.admin)
	drains, err := c.Drains(ctx)
	if err != nil || len(drains) != 2 {
		t.Fatalf("drains: %+v %v", drains, err)
	}
	moved := 0
	for _, dr := range drains {
		if dr.Cause != hostapi.DrainCauseStop || dr.State != hostapi.StateSucceeded || dr.Remaining != 0 {
			t.Fatalf("drain %+v", dr)
		}
		moved += dr.Moved
	}
	if moved == 0 {
		t.Fatal("the restarts moved no stream")
	}
	t.Logf("rolling restart: %d streams, %d moved by the two drains", len(reqs), moved)
}
