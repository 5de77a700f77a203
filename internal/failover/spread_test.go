package failover_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
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
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 2048, 512
	c.Step = sim.StepModel{Fixed: 3 * time.Millisecond}
	c.ShmDir = t.TempDir()
	core, logs := observer.New(zap.InfoLevel)
	st, err := stack.Start(stack.Options{Model: "m", SimA: c, SimB: c, BActive: true, MoreActives: 1, Log: zap.New(core),
		TuneHost: func(hc *host.Config) {
			hc.Failover.SnapshotInterval = 200 * time.Millisecond
			hc.Failover.GatherWindow = window
			hc.Failover.RecomputePerStep = perStep
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Stop)
	var reqs []loadgen.Request
	for i := range 15 {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("spread %d %s", i, strings.Repeat(" word", 3*i)),
			MaxTokens: 300 + i%5, Seed: &seed, Temperature: float64(i%3) * 0.4, IgnoreEOS: true})
	}
	ctx := context.Background()
	want := loadgen.Run(ctx, loadgen.Config{BaseURL: st.AURL, Model: "m"}, reqs)
	done := make(chan []loadgen.Stream, 1)
	go func() { done <- loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m"}, reqs) }()
	engines := []*sim.Engine{st.A, st.B, st.More[0].Engine}
	onA := 0
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		running := 0
		for _, e := range engines {
			s, _ := e.Stats(ctx)
			running += s.NumRunning
		}
		a, _ := st.A.Stats(ctx)
		if onA = a.NumRunning; running == len(reqs) && onA >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the load did not spread over the three engines (A runs %d)", onA)
		}
	}
	time.Sleep(300 * time.Millisecond) // a snapshot, and tokens since
	st.KillEngine(st.AID)
	got := <-done
	for i := range reqs {
		if got[i].Err != nil || got[i].Text != want[i].Text || got[i].Done != 1 {
			t.Fatalf("stream %d: %v; equal to its run without the crash: %v", i, got[i].Err, got[i].Text == want[i].Text)
		}
	}
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
