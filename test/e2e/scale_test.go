package e2e

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// vhi bench scale runs each elastic-EP mode through the Host end to end
// (tiny costs): every request through the Host completes in every mode.
func TestBenchScaleSmoke(t *testing.T) {
	out, err := vhiRun(t, "bench", "scale", "--prepare-time", "150ms", "--graph-time", "200ms", "--activate-time", "20ms",
		"--interval", "50ms", "--direct-interval", "50ms", "--log-level", "warn")
	if err != nil {
		t.Fatalf("vhi bench scale: %v\n%s", err, out)
	}
	t.Log(out)
	for _, mode := range []string{"blocking", "async", "async_graph_reuse"} {
		if !strings.Contains(out, mode) || strings.Count(out, ", 0 errors, longest stall") != 3 {
			t.Fatalf("the report lacks %s or shows client errors through the Host:\n%s", mode, out)
		}
	}
}

// A dense model scaled by the CLI: out to three replicas — the standby B
// and one launched from the model's launch command, each checked by the
// probe, streams moved onto them — and, after a Host restart, back in to
// one by drains, the launched replica's process stopped by the restarted
// Host (which adopted it from its state); every stream exact.
func TestReplicasByLaunchAndDrain(t *testing.T) {
	d := deploy(t, 4096)
	d.withLaunchers(t, "")
	scale := func(n int) string {
		t.Helper()
		out, err := exec.Command(vhiBin, "scale", "--model", "m", "--replicas", fmt.Sprint(n), "--wait", "--host", d.hostURL,
			"--admin-token-file", d.tk.adminFile).CombinedOutput()
		if err != nil {
			t.Fatalf("vhi scale --replicas %d: %v\n%s", n, err, out)
		}
		t.Logf("vhi scale --replicas %d:\n%s", n, out)
		return string(out)
	}
	reqs := load(16, 400)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(700 * time.Millisecond)
	out := scale(3)
	checkExact(t, <-running, want)
	for _, w := range []string{"succeeded: m replicas 1 → 3", "standby B", "launch r-", "move B", "added [B r-"} {
		if !strings.Contains(out, w) {
			t.Fatalf("the scale-out's output lacks %q", w)
		}
	}
	var launched string
	for _, in := range listInstances(t, d.hostURL) {
		if strings.HasPrefix(in.ID, "r-") {
			launched = in.ID
			if in.Lifecycle != "active" {
				t.Fatalf("the launched replica is %s", in.Lifecycle)
			}
		}
	}
	d.host.kill()
	d.host = d.startHost(t)
	waitUntil(t, "the three replicas back with the restarted Host", func() bool {
		for _, id := range []string{"A", "B", launched} {
			if in := instance(t, d.hostURL, id); in.State != "active" || in.Lifecycle != "active" {
				return false
			}
		}
		return true
	})
	running = d.startLoad(reqs)
	time.Sleep(700 * time.Millisecond)
	out = scale(1)
	checkExact(t, <-running, want)
	for _, w := range []string{"succeeded: m replicas 3 → 1", "drain " + launched, "stop " + launched} {
		if !strings.Contains(out, w) {
			t.Fatalf("the scale-in's output lacks %q", w)
		}
	}
	// The launched replica's agent went away with its process.
	waitUntil(t, "the launched replica gone", func() bool {
		in := instance(t, d.hostURL, launched)
		return in.ID == "" || in.Lifecycle == "unhealthy"
	})
	hostMetrics(t, d.hostURL, `vhi_scales_total{kind="replicas",state="succeeded"} 1`) // counted since the restart
}

// vhi bench autoscale end to end at a small scale: the elastic
// deployment's autoscaler scales the engine while the load rises, no
// request through the Host fails, and the restarted deployment's
// requests fail while it is down. (Whether the SLO held is the
// benchmark's figure, not this test's: CI machines are noisy.)
func TestBenchAutoscaleSmoke(t *testing.T) {
	out, err := vhiRun(t, "bench", "autoscale", "--duration", "14s", "--rate-from", "4", "--rate-to", "14", "--tokens", "64", "--max-num-seqs", "4",
		"--step", "20ms", "--prepare-time", "300ms", "--graph-time", "300ms", "--activate-time", "20ms", "--restart-time", "1s",
		"--window", "2s", "--deployments", "elastic,restart", "--log-level", "warn")
	t.Log(out)
	if err != nil && !strings.Contains(out, "over the SLO") {
		t.Fatalf("vhi bench autoscale: %v", err)
	}
	for _, w := range []string{" 0 failed;", "the autoscaler decided at", "DP 4 → 5 succeeded", "restarted at DP 5"} {
		if !strings.Contains(out, w) {
			t.Fatalf("the report lacks %q", w)
		}
	}
	if strings.Contains(out, "restart  ") && strings.Contains(out, "restart  0 completed") {
		t.Fatal("the restarted deployment completed nothing")
	}
}
