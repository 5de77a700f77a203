package e2e

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/etcdtest"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// chaosHost is one of the Hosts of TestChaosWithThreeHosts.
type chaosHost struct {
	addr string
	args []string
	p    *proc
	// gen counts the Host's kills: a stream whose Host's gen changed
	// while it ran went through a Host that died.
	gen int
	up  bool
}

// TestChaosWithThreeHosts is TestChaos on three Hosts sharing an etcd:
// the clients' streams go to any of them, and among the faults (an
// engine SIGKILLed, an agent SIGKILLed, a rolling restart) a Host is
// SIGKILLed — the leader or another — and restarted. The streams of a
// Host that dies end with it (its clients' connections were to that
// process); every other stream must complete and equal its unmigrated
// run, neither engine may hold a block afterwards, and every Host must
// list both instances active (no role decided twice). The Hosts hold
// the store under the default lease (5 s): the etcd runs in this test's
// process, and on a loaded 2-core machine a stall of 2 s (the lease the
// other Hosts tests take) ended every Host's lease at once.
func TestChaosWithThreeHosts(t *testing.T) {
	seed, events := chaosRun(t, 5)
	rng := rand.New(rand.NewPCG(seed, 1))
	ep := etcdtest.Start(t)
	more := []string{fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t))}
	d := deployWith(t, deployOptions{bBlocks: 4096, bActive: true, moreHosts: more,
		hostArgs: []string{"--failover-snapshot-interval", "200ms", "--store", "etcd://" + ep}})
	var mu sync.Mutex // guards hosts' gen and up
	hosts := []*chaosHost{{addr: d.hostAddr, args: d.hostArgs, p: d.host, up: true}}
	for _, addr := range more {
		h := &chaosHost{addr: addr, p: d.secondHost(t, addr), up: true}
		h.args = slices.Clone(d.hostArgs)
		for i := range h.args {
			if h.args[i] == "--listen" {
				h.args[i+1] = addr
			}
		}
		h.args = append(h.args[:len(h.args):len(h.args)], "--data-dir", t.TempDir()) // the last --data-dir wins
		hosts = append(hosts, h)
	}
	t.Cleanup(func() {
		for _, h := range hosts {
			h.p.kill()
		}
	})
	for _, h := range hosts {
		waitHealthy(t, "http://"+h.addr+"/health")
		waitUntil(t, "both agents registered with "+h.addr, func() bool {
			return instance(t, "http://"+h.addr, "A").Lifecycle == "active" && instance(t, "http://"+h.addr, "B").Lifecycle == "active"
		})
	}
	liveURL := func(except int) string {
		mu.Lock()
		defer mu.Unlock()
		for i, h := range hosts {
			if h.up && i != except {
				return "http://" + h.addr
			}
		}
		t.Fatal("no Host up")
		return ""
	}

	reqs := load(40*events, 300)
	want := d.reference(reqs)
	got := make([]loadgen.Stream, len(reqs))
	survived := make([]bool, len(reqs)) // through a Host that did not die meanwhile
	var wg sync.WaitGroup
	stop := make(chan struct{})
	senderDone := make(chan int, 1)
	go func() {
		sent := 0
		defer func() { senderDone <- sent }()
		pick := rand.New(rand.NewPCG(seed, 2))
		for i := 0; i+4 <= len(reqs); i += 4 {
			select {
			case <-stop:
				return
			default:
			}
			mu.Lock()
			var up []int
			for k, h := range hosts {
				if h.up {
					up = append(up, k)
				}
			}
			k := up[pick.IntN(len(up))]
			url, gen := "http://"+hosts[k].addr, hosts[k].gen
			mu.Unlock()
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				copy(got[i:], loadgen.Run(t.Context(), loadgen.Config{BaseURL: url, Model: "m"}, reqs[i:i+4]))
				mu.Lock()
				ok := hosts[k].gen == gen
				mu.Unlock()
				for j := i; j < i+4; j++ {
					survived[j] = ok
				}
			}(i)
			sent = i + 4
			time.Sleep(150 * time.Millisecond)
		}
	}()
	// Registered before the faults: a fault's own wait may end the test.
	t.Cleanup(func() {
		if t.Failed() {
			mu.Lock()
			defer mu.Unlock()
			for _, h := range hosts {
				t.Logf("the log of the Host at %s:\n%s", h.addr, notable(h.p.stderr.String()))
			}
		}
	})
	kinds := []string{"engine crash", "agent crash", "rolling restart", "host crash"}
	for e := 0; e < events; e++ {
		time.Sleep(time.Duration(400+rng.IntN(800)) * time.Millisecond)
		kind := kinds[rng.IntN(len(kinds))]
		if kind == "host crash" {
			k := rng.IntN(len(hosts))
			h := hosts[k]
			role := "another Host"
			if hs := hostsOf(t, liveURL(-1)); len(hs) > 0 && hs[0].Address == h.addr {
				role = "the leader"
			}
			t.Logf("event %d: host crash of %s (%s)", e+1, h.addr, role)
			mu.Lock()
			h.up = false
			h.gen++
			mu.Unlock()
			h.p.kill()
			time.Sleep(time.Duration(300+rng.IntN(1500)) * time.Millisecond)
			h.p = startVHI(t, h.args...)
			url := "http://" + h.addr
			waitHealthy(t, url+"/health")
			waitUntil(t, "both agents registered with the restarted "+h.addr, func() bool {
				return instance(t, url, "A").Lifecycle == "active" && instance(t, url, "B").Lifecycle == "active"
			})
			mu.Lock()
			h.up = true
			mu.Unlock()
			continue
		}
		id := []string{"A", "B"}[rng.IntN(2)]
		t.Logf("event %d: %s of %s", e+1, kind, id)
		d.hostURL = liveURL(-1)
		d.fault(t, id, kind)
	}
	close(stop)
	n := <-senderDone
	wg.Wait()
	var gotKept, wantKept []loadgen.Stream
	broken := 0
	for i := range n {
		if survived[i] {
			gotKept, wantKept = append(gotKept, got[i]), append(wantKept, want[i])
		} else if got[i].Err != nil {
			broken++
		}
	}
	checkExact(t, gotKept, wantKept)
	d.waitEnginesHoldNothing(t)
	for _, h := range hosts {
		url := "http://" + h.addr
		if a, b := roleOf(t, url, "A"), roleOf(t, url, "B"); a != "active" || b != "active" {
			t.Fatalf("the roles at the Host at %s: A %s, B %s", h.addr, a, b)
		}
	}
	t.Logf("chaos with three Hosts: %d streams, %d through Hosts that did not die meanwhile, every one of those exact; %d of the others ended with their Host",
		n, len(gotKept), broken)
}
