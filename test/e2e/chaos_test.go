package e2e

import (
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
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
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("VHI_CHAOS_SEED"), 10, 64); err == nil {
		seed = v
	}
	events := 4
	if v, err := strconv.Atoi(os.Getenv("VHI_CHAOS_EVENTS")); err == nil && v > 0 {
		events = v
	}
	t.Logf("chaos seed %d, %d events (VHI_CHAOS_SEED=%d to repeat)", seed, events, seed)
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
	for _, u := range []string{d.aURL, d.bURL} {
		waitUntil(t, u+" to hold nothing", func() bool {
			s := d.stats(t, u)
			return s.Free == s.Total && s.Reserved == 0 && s.Running == 0
		})
	}
	t.Logf("chaos: %d streams, every one exact", n)
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
	waitUntil(t, id+" to be active again", func() bool {
		in := instance(t, d.hostURL, id)
		return in.Lifecycle == "active" && in.AgentAddress != before
	})
}
