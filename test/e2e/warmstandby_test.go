package e2e

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/hostmetrics"
)

// With warm standbys on, every stream's KV has a copy on the other active
// instance, refreshed every 100 ms. A migration onto the instance that
// holds copies of the moving streams first frees those copies (its own
// reservations would collide with them) and moves every stream exactly;
// the streams, now on B, get copies on A; then B is killed (SIGKILL) and
// each of its streams goes on from A from its copy — the tokens since the
// copy's last round computed there, nothing repeated or lost, every
// stream equal to its unmigrated run.
func TestWarmStandbysMoveWithAMigrationAndCarryAFailover(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, bActive: true, hostArgs: []string{"--failover-snapshot-interval", "200ms",
		"--failover-warm-standby-tokens", "1", "--failover-warm-standby-interval", "100ms"}})
	reqs := load(24, 400)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	waitUntil(t, "the load to run on A and B", func() bool {
		a, b := d.stats(t, d.aURL), d.stats(t, d.bURL)
		return a.Running > 0 && b.Running > 0 && a.Running+b.Running == len(reqs)
	})
	waitUntil(t, "a warm copy of every stream", func() bool { return hostMetric(t, d.hostURL, "vhi_failover_warm_copies") == float64(len(reqs)) })

	st := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", Type: hostapi.KeepSourceActive})
	if st.State != "succeeded" || st.Migrated == 0 || len(st.Recomputed) > 0 {
		t.Fatalf("migration onto the standby of A's copies: %s (%s), %d moved, %d recomputed", st.State, st.Error, st.Migrated, len(st.Recomputed))
	}
	onB := d.stats(t, d.bURL).Running
	waitUntil(t, "every stream copied from B to A", func() bool {
		return hostMetric(t, d.hostURL, "vhi_failover_warm_copies") == float64(onB) && d.stats(t, d.aURL).Running == 0
	})
	time.Sleep(300 * time.Millisecond) // rounds since the copies began: tokens the failover does not recompute
	d.simB.kill()
	got := <-running
	checkExact(t, got, want)
	if n := hostMetric(t, d.hostURL, `vhi_failovers_total{outcome="warm"}`); n != float64(onB) {
		t.Fatalf("%v of B's %d streams recovered from their warm copies", n, onB)
	}
	if hostMetric(t, d.hostURL, "vhi_failover_warm_tokens_total") <= 0 || hostMetric(t, d.hostURL, "vhi_failover_warm_bytes_total") <= 0 {
		t.Fatal("no KV copied to, or installed from, the warm standbys")
	}
	if n := hostMetric(t, d.hostURL, "vhi_failover_warm_copies_differed_total"); n != 0 {
		t.Fatalf("%v copies differed from their source when checked, with nothing faulty", n)
	}
	waitUntil(t, "A running nothing and holding no reservation", func() bool {
		a := d.stats(t, d.aURL)
		return a.Running == 0 && a.Reserved == 0 && a.Free == a.Total
	})
}

// hostMetric is the Host's metric (name with its labels as the
// exposition writes them), 0 when absent.
func hostMetric(t *testing.T, hostURL, name string) float64 {
	t.Helper()
	v, _ := hostmetrics.Value(hostURL, name)
	return v
}

// vhi bench failover --host runs against a running deployment (what
// hack/gpu-vllm-bench.sh BENCH=failover does with real vLLM): it takes the
// reference through the Host, kills the engine running the most streams
// with the user's command, and checks every stream — here with warm
// standbys on, so it reports the copies and the streams recovered from
// them.
func TestBenchFailoverAgainstADeployment(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, bActive: true, hostArgs: []string{"--failover-snapshot-interval", "200ms",
		"--failover-warm-standby-tokens", "1", "--failover-warm-standby-interval", "100ms"}})
	kill := fmt.Sprintf(`case "$VHI_VICTIM_URL" in %s) kill -KILL %d ;; %s) kill -KILL %d ;; *) exit 3 ;; esac`,
		d.aURL, d.simA.cmd.Process.Pid, d.bURL, d.simB.cmd.Process.Pid)
	out, err := exec.Command(vhiBin, "bench", "failover", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile,
		"--agent-token-file", d.tk.agentFile, "--kill", kill, "--streams", "12", "--max-tokens", "400", "--prompt-words", "20",
		"--delay", "1s").CombinedOutput()
	// The bench killed one of the sims: reap it, so that the deployment's
	// teardown does not take its death for a crash.
	switch {
	case strings.Contains(string(out), "killed A ("):
		d.simA.kill()
	case strings.Contains(string(out), "killed B ("):
		d.simB.kill()
	}
	if err != nil {
		t.Fatalf("vhi bench failover --host: %v\n%s", err, out)
	}
	t.Logf("%s", out)
	for _, want := range []string{"every stream: 0 failed, 0 inexact", "streams recovered from them", "the Host's failovers in the run: warm "} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("the report lacks %q:\n%s", want, out)
		}
	}
}
