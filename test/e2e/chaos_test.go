package e2e

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/test/framework"
)

// TestChaos runs a steady streaming load on two active sims of one model
// while a seeded sequence of faults hits them one at a time: an engine
// SIGKILLed (its streams fail over to the other), an agent SIGKILLed (the
// streams, relayed by the Host straight from the engine, go on), and a
// rolling restart (the agent stopped: a drain; the engine then killed).
// Each fault's instance is brought back before the next. Every stream must
// complete and equal its unmigrated run, and neither engine may hold a
// block afterwards. VHI_CHAOS_SEED and VHI_CHAOS_EVENTS vary the run (the
// seed is logged, so a failure can be repeated).
func TestChaos(t *testing.T) {
	seed, events := chaosRun(t, 4)
	rng := rand.New(rand.NewPCG(seed, 0))
	d := deployWith(t, deployOptions{bBlocks: 4096, bActive: true, hostArgs: []string{"--failover-snapshot-interval", "200ms"}})

	reqs := load(40*events, 300)
	want := d.reference(reqs)
	got := make([]loadgen.Stream, len(reqs))
	var wg sync.WaitGroup
	stop := make(chan struct{})
	senderDone := make(chan int, 1)
	go func() {
		// Four new streams every 150 ms until the faults are over.
		sent := 0
		defer func() { senderDone <- sent }()
		for i := 0; i+4 <= len(reqs); i += 4 {
			select {
			case <-stop:
				return
			default:
			}
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				copy(got[i:], loadgen.Run(t.Context(), loadgen.Config{BaseURL: d.hostURL, Model: "m"}, reqs[i:i+4]))
			}(i)
			sent = i + 4
			time.Sleep(150 * time.Millisecond)
		}
	}()
	kinds := []string{"engine crash", "agent crash", "rolling restart"}
	for e := 0; e < events; e++ {
		time.Sleep(time.Duration(400+rng.IntN(800)) * time.Millisecond)
		id := []string{"A", "B"}[rng.IntN(2)]
		kind := kinds[rng.IntN(len(kinds))]
		t.Logf("event %d: %s of %s", e+1, kind, id)
		d.fault(t, id, kind)
	}
	close(stop)
	n := <-senderDone
	wg.Wait()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the Host's log:\n%s", grepLines(d.host.stderr.String(), "WARN"))
		}
	})
	checkExact(t, got[:n], want[:n])
	d.waitEnginesHoldNothing(t)
	t.Logf("chaos: %d streams, every one exact", n)
}

// waitEnginesHoldNothing waits until neither engine holds a block, a
// reservation or a running request.
func (d *deployment) waitEnginesHoldNothing(t *testing.T) {
	t.Helper()
	for _, u := range []string{d.aURL, d.bURL} {
		waitUntil(t, u+" to hold nothing", func() bool {
			s := d.stats(t, u)
			return s.Free == s.Total && s.Reserved == 0 && s.Running == 0
		})
	}
}

// chaosRun is a chaos test's seed and number of events: VHI_CHAOS_SEED
// and VHI_CHAOS_EVENTS, else the time and events. The seed is logged, so
// a failure can be repeated.
func chaosRun(t *testing.T, events int) (uint64, int) {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("VHI_CHAOS_SEED"), 10, 64); err == nil {
		seed = v
	}
	if v, err := strconv.Atoi(os.Getenv("VHI_CHAOS_EVENTS")); err == nil && v > 0 {
		events = v
	}
	t.Logf("chaos seed %d, %d events (VHI_CHAOS_SEED=%d to repeat)", seed, events, seed)
	return seed, events
}

// fault hits instance id ("A" or "B") with kind, then brings it back and
// waits until it is active again.
func (d *deployment) fault(t *testing.T, id, kind string) {
	t.Helper()
	i, url, agent, sim := 0, d.aURL, &d.agentA, &d.simA
	if id == "B" {
		i, url, agent, sim = 1, d.bURL, &d.agentB, &d.simB
	}
	before := instance(t, d.hostURL, id).AgentAddress
	switch kind {
	case "engine crash":
		(*sim).kill()
		(*agent).kill()
	case "agent crash":
		(*agent).kill()
	case "rolling restart":
		(*agent).stop(t) // SIGTERM: the Host drains the instance first
		(*sim).kill()
	}
	if kind != "agent crash" {
		*sim = startVHI(t, d.simArgs[i]...)
		waitHealthy(t, url+"/health")
	}
	*agent = d.startAgent(t, id, "A", url)
	// The new agent's registration (it listens on a port of its own), not
	// its predecessor's, which looks active until its heartbeats are
	// missed.
	var last hostapi.Instance
	back, ag := false, *agent
	t.Cleanup(func() {
		if !back {
			t.Logf("%s as the Host at %s last listed it: %+v (its agent before the fault: %s)", id, d.hostURL, last, before)
			t.Logf("the log of %s's agent:\n%s", id, notable(ag.stderr.String()))
		}
	})
	waitUntil(t, id+" to be active again", func() bool {
		last = instance(t, d.hostURL, id)
		return last.Lifecycle == "active" && last.AgentAddress != before
	})
	back = true
}

// A target engine frozen (SIGSTOP) before the pause — in round 0, or the
// check of what it copied — is noticed by the Host's heartbeat within
// --migration-heartbeat-timeout (3 s): the migration rolls back, every
// stream goes on from A exactly, and once the engine runs again its
// reservations are released and both instances are back in their roles.
// (Issue 44: the check waited on it for 47.7 s, both instances
// `migrating` meanwhile.) Round 0 moves ~0.7 GB here, so the stop lands
// well before the pause; the migration usually has not reached the pause
// when the heartbeat misses (when it has, the pause's heartbeat ends it).
func TestChaosTargetEngineFrozenBeforeThePause(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, kvScale: 4})
	reqs := load(48, 400)
	want := d.reference(reqs)
	release := framework.HoldStreams(t, d, "A")
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	id := d.startMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	time.Sleep(50 * time.Millisecond)
	if err := d.simB.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	cont := func() { _ = d.simB.cmd.Process.Signal(syscall.SIGCONT) }
	t.Cleanup(cont)
	st := d.waitEnd(t, id)
	cont()
	release()
	if st.State != hostapi.StateAborted || !strings.Contains(st.Error, "did not answer its heartbeat") {
		t.Fatalf("want aborted by the target's heartbeat: %s: %s", st.State, st.Error)
	}
	took := st.FinishedAt.Sub(frozen)
	got := <-running
	if strings.Contains(st.Error, "--migration-pause-heartbeat-timeout") {
		// The copy rounds and the check need only the agents, and the
		// sim answers their questions while it steps: on a busy machine
		// the migration can reach the pause before the 3 s heartbeat
		// misses, and the pause's own heartbeat (500 ms) ends it there.
		// What clients see is then bounded as in TestChaosFaultsInsideThePause
		// (the rollback's release of the frozen target's blocks is not).
		gap, at := worstGap(got, frozen, st.FinishedAt)
		if gap > 1500*time.Millisecond {
			t.Fatalf("reached the pause; the clients' worst gap was %v (at %s): %s", gap, at, st.Error)
		}
		t.Logf("reached the pause before the heartbeat missed; rolled back %v after B froze, the clients' worst gap %v: %s",
			took.Round(time.Millisecond), gap.Round(time.Millisecond), st.Error)
	} else {
		// Generous for a loaded 2-core machine; the heartbeat timeout is 3 s.
		if took > 8*time.Second {
			t.Fatalf("rolled back %v after B froze: %s", took, st.Error)
		}
		t.Logf("rolled back %v after B froze (at step %s): %s", took.Round(time.Millisecond), lastStep(st), st.Error)
	}
	checkExact(t, got, want)
	var last string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last seen: %s", last)
		}
	})
	waitUntil(t, "B's reservations released and both instances back in their roles", func() bool {
		b := d.stats(t, d.bURL)
		a, bi := instance(t, d.hostURL, "A"), instance(t, d.hostURL, "B")
		last = fmt.Sprintf("B's blocks %+v; A %s %s, B %s %s", b, a.Role, a.Lifecycle, bi.Role, bi.Lifecycle)
		return b.Reserved == 0 && b.Free == b.Total && a.Role == "active" && a.Lifecycle == "active" && bi.Role == "standby" && bi.Lifecycle == "standby"
	})
}

// lastStep is the step a migration ended in before its rollback.
func lastStep(st hostapi.MigrationStatus) string {
	for i := len(st.StepHistory) - 1; i >= 0; i-- {
		if s := st.StepHistory[i].Step; s != "rollback" && s != "done" {
			return s
		}
	}
	return ""
}

// Faults inside the pause, with real processes, each landing there by a
// failpoint (a sim that stops itself on the install hook, an agent that
// exits when it relays a hook) or the Host's injected cut of the final
// round: the migration rolls back, every stream goes on from A exactly,
// and the clients' worst gap stays near the pause heartbeat's 500 ms —
// not the call timeout (2 s) nor the pause lease (issue 44: 8.0 s for a
// frozen target, 10.0 s for a dead source agent).
func TestChaosFaultsInsideThePause(t *testing.T) {
	for _, c := range []struct {
		name  string
		opts  deployOptions
		fault string // the migrate request's inject_fault
		why   string // in the abort's error (one of the |-separated)
	}{
		{name: "the target engine freezes", opts: deployOptions{bArgs: []string{"--failpoint", "stop-on-install"}}, why: "--migration-pause-heartbeat-timeout"},
		// The final round's copy into B runs beside the install: either
		// may fail first.
		{name: "the target agent dies", opts: deployOptions{agentArgs: [2][]string{nil, {"--failpoint", "exit-on-install"}}}, why: "install|final copy round"},
		// Failover's snapshots export through the agent too: off here,
		// so that the export the failpoint meets is the pause's.
		{name: "the source agent dies", opts: deployOptions{agentArgs: [2][]string{{"--failpoint", "exit-on-export"}, nil},
			// The final round's copy from A runs beside the export: either
			// may fail first.
			hostArgs: []string{"--failover-snapshot-interval", "0"}}, why: "export|final copy round"},
		{name: "a data connection is cut", fault: "cut", why: "final copy round"},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.opts.bBlocks = 4096
			d := deployWith(t, c.opts)
			t.Cleanup(func() {
				for i, a := range []*proc{d.agentA, d.agentB} {
					if c.opts.agentArgs[i] != nil {
						a.kill() // its failpoint ended it (or would)
					}
				}
			})
			reqs := load(32, 500)
			want := d.reference(reqs)
			running := d.startLoad(reqs)
			time.Sleep(900 * time.Millisecond)
			began := time.Now()
			st := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", InjectFault: c.fault})
			ended := time.Now()
			_ = d.simB.cmd.Process.Signal(syscall.SIGCONT)
			if st.State != hostapi.StateAborted || !slices.ContainsFunc(strings.Split(c.why, "|"), func(w string) bool { return strings.Contains(st.Error, w) }) {
				t.Fatalf("want aborted (%q): %s: %s", c.why, st.State, st.Error)
			}
			got := <-running
			checkExact(t, got, want)
			gap, at := worstGap(got, began, ended)
			// Generous for a loaded 2-core machine; the call timeout is 2 s.
			if gap > 1500*time.Millisecond {
				t.Fatalf("the clients' worst gap in the migration was %v (at %s): %s", gap, at, st.Error)
			}
			t.Logf("clients' worst gap %v (%s), the migration rolled back at %s: %s", gap.Round(time.Millisecond), at,
				lastStep(st), st.Error)
		})
	}
}

// worstGap is the longest wait between two tokens of one stream that
// overlaps [from, to], and where in the stream it was.
func worstGap(streams []loadgen.Stream, from, to time.Time) (time.Duration, string) {
	var worst time.Duration
	where := ""
	for _, s := range streams {
		prev := s.Start
		for i, a := range s.Arrivals {
			if a.After(from) && prev.Before(to) && a.Sub(prev) > worst {
				worst, where = a.Sub(prev), fmt.Sprintf("stream %d, token event %d", s.Index, i)
			}
			prev = a
		}
	}
	return worst, where
}
