package autoscale_test

import (
	"context"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/autoscale"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// A dense model whose one replica cannot keep up: requests queue, the
// autoscaler scales it out onto the standby by the Host's replicas scale
// (streams moved by migration), every request completes, and the
// decision is there with its reason.
func TestAutoscalerScalesOutOnTheQueue(t *testing.T) {
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 1024, 512
	c.Step = sim.StepModel{Fixed: 10 * time.Millisecond}
	c.MaxNumSeqs = 4
	c.ShmDir = t.TempDir()
	st, err := stack.Start(stack.Options{Model: "m", SimA: c, SimB: c, TuneHost: func(hc *host.Config) {
		hc.Autoscale = autoscale.Config{IntervalS: 0.1, Models: map[string]autoscale.Policy{
			"m": {Min: 1, Max: 2, SLOS: 30, QueueHigh: 2, CooldownS: 30},
		}}
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	ctx := context.Background()
	// 4 seats, 0.5 s a request: 8 requests a second; 32 come in 1.6 s.
	reqs := make([]loadgen.Request, 32)
	for i := range reqs {
		reqs[i] = loadgen.Request{Prompt: "autoscale me", MaxTokens: 50, IgnoreEOS: true}
	}
	got := loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m", Stagger: 1600 * time.Millisecond}, reqs)
	for i, s := range got {
		if s.Err != nil || s.Done != 1 {
			t.Fatalf("request %d: %v", i, s.Err)
		}
	}
	var status hostapi.AutoscaleStatus
	deadline := time.Now().Add(10 * time.Second)
	for {
		if status, err = st.Client().Autoscale(ctx); err != nil {
			t.Fatal(err)
		}
		if len(status.Decisions) > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if len(status.Decisions) == 0 {
		t.Fatalf("no decision: %+v", status)
	}
	d := status.Decisions[len(status.Decisions)-1]
	t.Logf("%+v", d)
	if d.Direction != "out" || d.Reason != autoscale.ReasonQueue || d.From != 1 || d.To != 2 || d.ScaleID == "" {
		t.Fatalf("decision %+v", d)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	res, err := st.Client().WaitScale(wctx, d.ScaleID, 20*time.Millisecond, nil)
	if err != nil || res.State != hostapi.StateSucceeded || res.Cause != "autoscaler" || len(res.Instances) != 2 {
		t.Fatalf("the autoscaler's scale: %+v %v", res, err)
	}
	if status.Models[0].Model != "m" || status.Models[0].Samples == 0 {
		t.Fatalf("the view: %+v", status.Models)
	}
}
