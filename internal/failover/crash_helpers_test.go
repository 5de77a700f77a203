package failover_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// simsUnderAHost starts a Host over active tiny sims A, B (and more
// actives) of maxLen tokens, failover tuned by tune; stopped at cleanup.
func simsUnderAHost(t *testing.T, maxLen, more int, log *zap.Logger, tune func(*host.Config)) *stack.Stack {
	t.Helper()
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 2048, maxLen
	c.Step = sim.StepModel{Fixed: 3 * time.Millisecond}
	c.ShmDir = t.TempDir()
	st, err := stack.Start(stack.Options{Model: "m", SimA: c, SimB: c, BActive: true, MoreActives: more, Log: log, TuneHost: tune})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Stop)
	return st
}

// seededLoad is n seeded requests named by name, the i-th with
// words(i) words of prompt and tokens(i) tokens, sampled at temp(i).
func seededLoad(n int, name string, words, tokens func(int) int, temp func(int) float64) []loadgen.Request {
	var reqs []loadgen.Request
	for i := range n {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("%s %d %s", name, i, strings.Repeat(" word", words(i))),
			MaxTokens: tokens(i), Seed: &seed, Temperature: temp(i), IgnoreEOS: true})
	}
	return reqs
}

// crashUnderLoad runs reqs on A alone (their runs without the crash), then
// through the Host; once ready says so and settle passed, it kills A and
// checks that every stream equals its run without the crash.
func crashUnderLoad(t *testing.T, st *stack.Stack, reqs []loadgen.Request, ready func() (bool, string), settle time.Duration) {
	t.Helper()
	ctx := context.Background()
	want := loadgen.Run(ctx, loadgen.Config{BaseURL: st.AURL, Model: "m"}, reqs)
	done := make(chan []loadgen.Stream, 1)
	go func() { done <- loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m"}, reqs) }()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		ok, why := ready()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready to kill A: %s", why)
		}
	}
	time.Sleep(settle)
	st.KillEngine(st.AID)
	got := <-done
	for i := range reqs {
		if got[i].Err != nil || got[i].Text != want[i].Text || got[i].Done != 1 {
			k := 0
			for k < len(got[i].Pieces) && k < len(want[i].Pieces) && got[i].Pieces[k] == want[i].Pieces[k] {
				k++
			}
			t.Fatalf("stream %d (%s): %v; equal to its run without the crash: %v (the same up to token %d of %d)",
				i, got[i].ID, got[i].Err, got[i].Text == want[i].Text, k, len(want[i].Pieces))
		}
	}
}
