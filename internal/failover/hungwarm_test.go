package failover_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// An engine that hangs (its streams go silent, its hooks and /health stop
// answering) is found unhealthy only after its agent's probes time out —
// seconds, longer than a few warm cycles. Its streams' warm copies on the
// standby must outlast that: the standby's reservations are renewed before
// the hung source is asked anything, and leased for longer than a round
// it holds up. Before, the renewal waited behind the stuck round and the
// copies lapsed: every stream recovered by recompute, none from its copy.
func TestWarmCopiesOutlastTheTimeToFindTheirSourceHung(t *testing.T) {
	var hung atomic.Bool
	hang := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if hung.Load() {
				<-r.Context().Done()
				return
			}
			h.ServeHTTP(w, r)
		})
	}
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 2048, 1024
	c.Step = sim.StepModel{Fixed: 3 * time.Millisecond}
	c.ShmDir = t.TempDir()
	st, err := stack.Start(stack.Options{Model: "m", SimA: c, SimB: c, BActive: true, WrapB: hang,
		Log: zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)),
		TuneHost: func(hc *host.Config) {
			hc.Failover.SnapshotInterval = 200 * time.Millisecond
			hc.Failover.WarmTokens = 1
			hc.Failover.WarmInterval = 100 * time.Millisecond
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hung.Store(false); st.B.HoldTail(0); st.Stop() })
	reqs := seededLoad(8, "hung source", func(i int) int { return 20 + 3*i }, func(int) int { return 700 }, func(int) float64 { return 0.5 })
	ctx := context.Background()
	want := loadgen.Run(ctx, loadgen.Config{BaseURL: st.AURL, Model: "m"}, reqs)
	done := make(chan []loadgen.Stream, 1)
	go func() { done <- loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m"}, reqs) }()
	fo := st.Host.Failover()
	onB := 0
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		b, _ := st.B.Stats(ctx)
		onB = b.NumRunning
		if onB >= 2 && fo.WarmCopies() >= 8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready to hang B: B runs %d, %d warm copies", onB, fo.WarmCopies())
		}
	}
	time.Sleep(300 * time.Millisecond) // a few rounds into the copies
	// B hangs: nothing it runs decodes, nothing it serves answers.
	st.B.HoldTail(1 << 30)
	hung.Store(true)
	hungAt := time.Now()
	got := <-done
	for i := range reqs {
		if got[i].Err != nil || got[i].Text != want[i].Text || got[i].Done != 1 {
			t.Fatalf("stream %d (%s): %v; equal to its run without the hang: %v", i, got[i].ID, got[i].Err, got[i].Text == want[i].Text)
		}
	}
	t.Logf("B ran %d streams when it hung; %d recovered from their warm copies, the last stream ended %v after the hang",
		onB, fo.WarmRecovered(), time.Since(hungAt).Round(time.Millisecond))
	if fo.WarmRecovered() < onB {
		t.Fatalf("%d of the hung engine's %d streams recovered from their warm copies; want all", fo.WarmRecovered(), onB)
	}
}
