package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// grepLines are the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// notable are the lines of a process's log at WARN or above.
func notable(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, "WARN") || strings.Contains(l, "ERROR") || strings.Contains(l, "FATAL") || strings.Contains(l, "panic") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// An engine killed mid-stream (SIGKILL): every stream it carried goes on
// from the other active instance, from the client's next token, each
// equal to its unmigrated run — nothing repeated, nothing lost, no error.
//
// With snapshots every 200 ms the streams are reinstalled from them
// (recovered); with none taken yet (an interval of an hour, and no
// snapshot of new streams) they are replayed on B, the tokens the client
// has skipped (replayed: the sim replays exactly). With snapshots an hour
// apart the streams still get one each soon after they begin
// (--failover-new-stream-snapshot, 100 ms), and are recovered from it.
func TestEngineCrashFailover(t *testing.T) {
	for _, c := range []struct{ name, interval, newSnapshot, outcome string }{
		{"recovered", "200ms", "100ms", "recovered"}, {"replayed", "1h", "0", "replayed"}, {"recovered from a new stream's snapshot", "1h", "100ms", "recovered"},
	} {
		t.Run(c.name, func(t *testing.T) { crashFailover(t, c.interval, c.newSnapshot, c.outcome) })
	}
}

// loadOnTwoActives deploys A and B, both active, with failover snapshots
// every interval, and starts n streams of 400 tokens through the Host:
// their unmigrated runs, the load's result, and how many run on A once
// all run.
func loadOnTwoActives(t *testing.T, n int, interval string, more ...string) (d *deployment, want []loadgen.Stream, running <-chan []loadgen.Stream, onA int) {
	t.Helper()
	d = deployWith(t, deployOptions{bBlocks: 4096, bActive: true, hostArgs: append([]string{"--failover-snapshot-interval", interval}, more...)})
	reqs := load(n, 400)
	want = d.reference(reqs)
	running = d.startLoad(reqs)
	waitUntil(t, "the load to run on A and B", func() bool {
		a, b := d.stats(t, d.aURL), d.stats(t, d.bURL)
		return a.Running > 0 && b.Running > 0 && a.Running+b.Running == len(reqs)
	})
	return d, want, running, d.stats(t, d.aURL).Running
}

func crashFailover(t *testing.T, interval, newSnapshot, outcome string) {
	d, want, running, onA := loadOnTwoActives(t, 32, interval, "--failover-new-stream-snapshot", newSnapshot)
	time.Sleep(700 * time.Millisecond) // a few snapshots, and tokens since the last
	killed := time.Now()
	d.simA.kill()
	// New requests meanwhile: those the Host still routes to the dead
	// engine (its agent has not yet said it is unhealthy) go to B.
	more := load(8, 40)
	if late := loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.hostURL, Model: "m"}, more); true {
		checkExact(t, late, d.reference(more))
	}
	got := <-running
	checkExact(t, got, want)
	hostMetrics(t, d.hostURL, fmt.Sprintf(`vhi_failovers_total{outcome=%q} %d`, outcome, onA))
	// The longest pause a client saw across the crash.
	var worst time.Duration
	for _, s := range got {
		for i := 1; i < len(s.Arrivals); i++ {
			if s.Arrivals[i].After(killed) && s.Arrivals[i-1].Before(killed.Add(2*time.Second)) {
				worst = max(worst, s.Arrivals[i].Sub(s.Arrivals[i-1]))
			}
		}
	}
	t.Logf("%d streams on the killed engine %s; the worst client gap after the kill %v", onA, outcome, worst)
	resp, err := http.Get(d.hostURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// A late request the Host still sent to the dead engine was rerouted
	// to B (checked exact above). Whether any was sent there is a race
	// with the Host learning of the death from the broken streams, which
	// it often wins on a loaded machine: then none needed rerouting. The
	// reroute itself is tested without the race in internal/proxy.
	if !strings.Contains(string(b), "vhi_requests_rerouted_total ") {
		t.Fatalf("the Host exports no vhi_requests_rerouted_total:\n%s", grepLines(string(b), "rerouted"))
	}
	if strings.Contains(string(b), "vhi_requests_rerouted_total 0") {
		t.Logf("no late request went to the dead engine: the Host had stopped routing to it")
	}
}

// An engine that hangs mid-stream (SIGSTOP: its connections stay open,
// nothing comes) is failed over on its agent's word, not after the
// relay's idle timeout (2 minutes here): the agent reports it unhealthy,
// the Host fails its silent streams over to B, and every stream equals
// its unmigrated run.
func TestAHungEngineFailsOverOnItsAgentsWord(t *testing.T) {
	d, want, running, onA := loadOnTwoActives(t, 16, "200ms")
	time.Sleep(500 * time.Millisecond)
	pid := d.simA.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Kill(pid, syscall.SIGCONT) }()
	hung := time.Now()
	select {
	case got := <-running:
		checkExact(t, got, want)
	case <-time.After(60 * time.Second):
		t.Fatal("the hung engine's streams did not go on within a minute")
	}
	hostMetrics(t, d.hostURL, fmt.Sprintf(`vhi_failovers_total{outcome="recovered"} %d`, onA))
	t.Logf("%d streams on the hung engine went on from B; the load ended %v after the hang", onA, time.Since(hung).Round(time.Millisecond))
}

// An engine that hangs while no other instance of its model could take
// its streams keeps them: the Host holds it unhealthy, but cutting the
// streams would only end them with an error, and the engine may just be
// slow (a loaded machine starves its agent's heartbeats too: the chaos
// test's source once lost all 48 streams so, with the only other
// instance frozen). Once the engine runs again every stream goes on
// exactly. (Without the survivor check the failover sweep cut them all
// within an interval of the engine turning unhealthy.)
func TestAHungEngineWithNowhereToGoKeepsItsStreams(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--failover-snapshot-interval", "200ms"}})
	reqs := load(16, 400)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	waitUntil(t, "the load to run on A", func() bool { return d.stats(t, d.aURL).Running == len(reqs) })
	pid := d.simA.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	cont := func() { _ = syscall.Kill(pid, syscall.SIGCONT) }
	defer cont()
	waitUntil(t, "the Host to hold A unhealthy", func() bool { return instance(t, d.hostURL, "A").Lifecycle == "unhealthy" })
	// Several failover sweeps with A unhealthy and every stream silent.
	time.Sleep(time.Second)
	cont()
	checkExact(t, <-running, want)
}
