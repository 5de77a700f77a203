package failover_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// Three active sims; A dies under load. Its streams, gathered, are spread
// over both survivors (with each placed alone, all went to the one that
// had the most free KV at its last heartbeat), and every stream equals its
// run without the crash.
func TestADeadEnginesStreamsAreSpreadOverTheSurvivors(t *testing.T) {
	to, installs := crashOneOfThree(t, 10*time.Millisecond, 0)
	if to["sim-b"] == 0 || to["sim-c"] == 0 {
		t.Fatalf("A's streams went to %v: want some on each survivor", to)
	}
	if installs != 2 {
		t.Fatalf("%d installs, want one per survivor", installs)
	}
}

// Paced, each survivor gets its share in installs of a few hundred tokens
// of context, each once the last one's prefill is done, and every stream
// still equals its run without the crash.
func TestAPacedRecoveryFeedsEachSurvivorInParts(t *testing.T) {
	to, installs := crashOneOfThree(t, 10*time.Millisecond, 200)
	if n := int64(to["sim-b"] + to["sim-c"]); installs <= 2 || installs > n {
		t.Fatalf("%d installs for %d streams (%v): want more than one per survivor, at most one per stream", installs, n, to)
	}
}

// crashOneOfThree runs 15 streams over sims A, B and C, kills A once each
// runs some, checks every stream against its unmigrated run and returns
// how many of A's streams each survivor took, and in how many installs.
func crashOneOfThree(t *testing.T, window time.Duration, perStep int) (map[string]int, int64) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	st := simsUnderAHost(t, 512, 1, zap.New(core), func(hc *host.Config) {
		hc.Failover.SnapshotInterval = 200 * time.Millisecond
		hc.Failover.GatherWindow = window
		hc.Failover.RecomputePerStep = perStep
	})
	reqs := seededLoad(15, "spread", func(i int) int { return 3 * i }, func(i int) int { return 300 + i%5 },
		func(i int) float64 { return float64(i%3) * 0.4 })
	engines := []*sim.Engine{st.A, st.B, st.More[0].Engine}
	onA := 0
	crashUnderLoad(t, st, reqs, func() (bool, string) {
		running := 0
		for _, e := range engines {
			s, _ := e.Stats(context.Background())
			running += s.NumRunning
		}
		a, _ := st.A.Stats(context.Background())
		onA = a.NumRunning
		return running == len(reqs) && onA >= 2, fmt.Sprintf("the load did not spread over the three engines (A runs %d)", onA)
	}, 300*time.Millisecond) // a snapshot, and tokens since
	to := map[string]int{}
	for _, e := range logs.FilterMessage("stream recovered on another instance").All() {
		to[e.ContextMap()["to"].(string)]++
	}
	if n := to["sim-b"] + to["sim-c"]; n != onA {
		t.Fatalf("%d of A's %d streams recovered (%v)", n, onA, to)
	}
	var installs int64
	for _, e := range logs.FilterMessage("a dead engine's streams placed together").All() {
		installs += e.ContextMap()["installs"].(int64)
	}
	t.Logf("A's %d streams went to %v in %d installs", onA, to, installs)
	return to, installs
}
