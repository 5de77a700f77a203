package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/etcdtest"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// Two Hosts on one etcd: both serve, the first leads. The agents
// (naming both Hosts) register with each, so the second lists every
// instance with its load and relays its own clients' streams; it forwards
// what only the leader decides (a migration, its status) to the first.
// A migration that the first runs moves the streams the second relays as
// exactly as its own (the switch board), and the second follows the
// roles it decided. Then the first is killed (SIGKILL): the second leads
// within the store's lease, keeps every decision of the first (from
// etcd), and streams and migrations go on through it exactly.
func TestTwoHostsServeAndOneDecides(t *testing.T) {
	d, h2, h2URL := twoHosts(t)
	h1URL, second := d.hostURL, strings.TrimPrefix(h2URL, "http://")
	if hs := hostsOf(t, h2URL); len(hs) != 2 || !hs[0].Leader || hs[0].Address != d.hostAddr || hs[1].Leader || hs[1].Address != second {
		t.Fatalf("the Hosts in the second Host's status: %+v", hs)
	}

	// Streams through both Hosts; the migration asked of the second (it
	// forwards it to the leader, which runs it).
	viaFirst, viaSecond := marked(h1URL, 12, 400), marked(h2URL, 12, 400)
	wantFirst, wantSecond := d.reference(viaFirst), d.reference(viaSecond)
	runFirst, runSecond := streamVia(h1URL, viaFirst), streamVia(h2URL, viaSecond)
	time.Sleep(700 * time.Millisecond)
	d.hostURL = h2URL
	first := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", Type: hostapi.PreserveSource})
	d.hostURL = h1URL
	if first.State != hostapi.StateSucceeded || first.Migrated != len(wantFirst)+len(wantSecond) {
		t.Fatalf("the migration asked of the second Host: %s, %d of %d moved: %s", first.State, first.Migrated, len(wantFirst)+len(wantSecond), first.Error)
	}
	checkExact(t, <-runFirst, wantFirst)
	gotSecond := <-runSecond
	checkExact(t, gotSecond, wantSecond)
	// They switched at the commit, as the first Host's did: not resumed
	// on A when its pause lease (2 s) ended.
	if gap, at := worstGap(gotSecond, time.Time{}, time.Now()); gap > 1500*time.Millisecond {
		t.Fatalf("a stream through the second Host waited %v for a token (%s): it did not switch with the migration", gap, at)
	}
	hostMetrics(t, h2URL, "vhi_host_leader 0", fmt.Sprintf(`vhi_host_switched_streams_total{outcome="switched"} %d`, len(wantSecond)))
	hostMetrics(t, h1URL, "vhi_host_leader 1")
	waitUntil(t, "the second Host to follow the roles the first decided", func() bool {
		return roleOf(t, h2URL, "A") == "standby" && roleOf(t, h2URL, "B") == "active"
	})
	if st := d.stats(t, d.aURL); st.Running != 0 {
		t.Fatalf("A still runs %d requests after the migration", st.Running)
	}

	d.host.kill()
	killed := time.Now()
	d.hostURL, d.hostAddr = h2URL, second
	waitUntil(t, "the second Host to lead", func() bool {
		hs := hostsOf(t, h2URL)
		return len(hs) == 1 && hs[0].Leader && hs[0].Address == second
	})
	t.Logf("the second Host led %v after the first was killed (store lease 2 s)", time.Since(killed).Round(time.Millisecond))
	if a, b := roleOf(t, h2URL, "A"), roleOf(t, h2URL, "B"); a != "standby" || b != "active" {
		t.Fatalf("the roles the first Host decided: A %s, B %s", a, b)
	}
	// The store shows the second Host elected a moment before it has read
	// the records the first left (its takeover); meanwhile it answers what
	// only the leader knows with 503 and Retry-After, as documented: read
	// until it answers (CI once read in that moment).
	waitUntil(t, "the first Host's migration, read from the second, to be there and succeeded", func() bool {
		return d.status(t, first.ID).State == hostapi.StateSucceeded
	})

	// Streams and a migration through the second Host, which leads now.
	reqs := load(16, 300)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(600 * time.Millisecond)
	back := d.waitMigration(t, hostapi.MigrateRequest{Src: "B", Dst: "A", Type: hostapi.PreserveSource})
	if back.State != hostapi.StateSucceeded || back.Migrated == 0 {
		t.Fatalf("a migration through the second Host: %s (%d moved) %s", back.State, back.Migrated, back.Error)
	}
	checkExact(t, <-running, want)
	h2.stop(t)
}

// twoHosts deploys sims A and B with a Host leading an etcd store (a 2 s
// lease) and a second Host on it, and waits until both agents registered
// with the second.
func twoHosts(t *testing.T) (d *deployment, h2 *proc, h2URL string) {
	t.Helper()
	return twoHostsOn(t, "--store", "etcd://"+etcdtest.Start(t))
}

// twoHostsOn is twoHosts on the store these flags name.
func twoHostsOn(t *testing.T, storeArgs ...string) (d *deployment, h2 *proc, h2URL string) {
	t.Helper()
	return twoHostsWith(t, deployOptions{bBlocks: 4096}, storeArgs...)
}

// twoHostsWith is twoHostsOn with the deployment's options.
func twoHostsWith(t *testing.T, o deployOptions, storeArgs ...string) (d *deployment, h2 *proc, h2URL string) {
	t.Helper()
	second := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	o.hostArgs, o.moreHosts = append(storeArgs, "--store-lease", "2s"), []string{second}
	d = deployWith(t, o)
	h2, h2URL = d.secondHost(t, second), "http://"+second
	waitHealthy(t, h2URL+"/health")
	waitUntil(t, "both agents registered with the second Host", func() bool {
		a, b := instance(t, h2URL, "A"), instance(t, h2URL, "B")
		want := "standby"
		if o.bActive {
			want = "active"
		}
		return a.AgentAddress != "" && b.AgentAddress != "" && a.Lifecycle == "active" && b.Lifecycle == want
	})
	waitLeads(t, d.hostURL)
	return d, h2, h2URL
}

// marked is n requests of tokens each whose prompts say they go through
// the Host at url (streams through two Hosts differ).
func marked(url string, n, tokens int) []loadgen.Request {
	reqs := load(n, tokens)
	for i := range reqs {
		reqs[i].Prompt += " (via " + url + ")"
	}
	return reqs
}

// streamVia streams reqs through the Host at url in the background.
func streamVia(url string, reqs []loadgen.Request) <-chan []loadgen.Stream {
	ch := make(chan []loadgen.Stream, 1)
	go func() { ch <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: url, Model: "m"}, reqs) }()
	return ch
}

// waitLeads waits until the Host at url says it leads the store.
func waitLeads(t *testing.T, url string) {
	t.Helper()
	addr := strings.TrimPrefix(url, "http://")
	waitUntil(t, addr+" to lead", func() bool {
		hs := hostsOf(t, url)
		return len(hs) >= 1 && hs[0].Leader && hs[0].Address == addr
	})
}

// hostsOf reads the Hosts of a shared store from a Host's status.
func hostsOf(t *testing.T, hostURL string) []hostapi.HostInfo {
	t.Helper()
	resp, err := http.Get(hostURL + "/vllm_hi/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st hostapi.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st.Hosts
}

// secondHost starts another Host on the deployment's store at addr: it
// serves, and follows the one that leads.
func (d *deployment) secondHost(t *testing.T, addr string) *proc {
	t.Helper()
	args := slices.Clone(d.hostArgs)
	for i := range args {
		switch args[i] {
		case "--listen":
			args[i+1] = addr
		case "--data-dir":
			args[i+1] = t.TempDir()
		}
	}
	return startVHI(t, args...)
}

// The leading Host dies inside a migration's pause: the Host that takes
// over closes the migration's record (aborted), releases the target's
// reservations at once from it, and keeps exactly one of A and B active;
// A resumes at its pause lease, and its direct streams and those the
// second Host relays (which the migration was moving too) finish exactly.
func TestTheNextHostEndsAMigrationItsLeaderDiedIn(t *testing.T) {
	d, h2, h2URL := twoHosts(t)
	defer h2.stop(t)
	// Streams through the second Host, which the migration moves too.
	viaSecond := marked(h2URL, 8, 400)
	wantSecond := d.reference(viaSecond)
	runSecond := streamVia(h2URL, viaSecond)
	direct, viaHost := d.hostDiesInThePause(t) // the leader
	died := time.Now()
	d.host.kill()
	d.hostURL = h2URL
	waitUntil(t, "B's reservations released", func() bool { return d.stats(t, d.bURL).Reserved == 0 })
	waitLeads(t, h2URL)
	freed := time.Since(died)
	list := listMigrations(t, h2URL)
	if len(list) != 1 || list[0].State != hostapi.StateAborted || !strings.Contains(list[0].Error, "released the target's reservations") {
		t.Fatalf("the migration the leader died in, as the next Host has it: %+v", list)
	}
	if a, b := roleOf(t, h2URL, "A"), roleOf(t, h2URL, "B"); a != "active" || b != "standby" {
		t.Fatalf("roles after the takeover: A %s, B %s", a, b)
	}
	t.Logf("the next Host released B's reservations %v after the leader died (store lease 2 s, B's reservation lease 10 s)", freed.Round(time.Millisecond))
	// The second Host's streams were paused with A, and went on when A's
	// pause lease resumed it: none broke.
	checkExact(t, <-runSecond, wantSecond)
	<-viaHost // those streams ended with the leader
	for i, s := range <-direct {
		if s.Err != nil || s.Done != 1 {
			t.Fatalf("stream %d to A did not finish after the leader died: %v", i, s.Err)
		}
	}
}

// A rolling upgrade of the Hosts: the leader stopped with SIGTERM hands
// the store over before it drains its streams, so the other Host leads at
// once — not when the leader's drain or lease ends —
// while every stream the old leader relays finishes exactly.
func TestALeaderHandsOverOnSIGTERM(t *testing.T) {
	ep := etcdtest.Start(t)
	second := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--store", "etcd://" + ep, "--store-lease", "10s"}, moreHosts: []string{second}})
	h2 := d.secondHost(t, second)
	defer h2.stop(t)
	reqs := load(16, 700) // ~4 s at 6 ms a step: still running at the hand-over
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(500 * time.Millisecond)
	if err := d.host.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	h2URL := "http://" + second
	waitUntil(t, "the second Host to lead", func() bool {
		hs := hostsOf(t, h2URL)
		return len(hs) >= 1 && hs[0].Leader && hs[0].Address == second
	})
	serving := time.Since(stopped)
	waitUntil(t, "both agents registered with the second Host", func() bool {
		return instance(t, h2URL, "A").Lifecycle == "active" && instance(t, h2URL, "B").Lifecycle == "standby"
	})
	registered := time.Since(stopped)
	// New requests through the second Host while the first drains.
	fresh := load(2, 20)
	if got := loadgen.Run(context.Background(), loadgen.Config{BaseURL: h2URL, Model: "m"}, fresh); got[0].Err != nil || got[1].Err != nil {
		t.Fatalf("a request through the new leader during the old one's drain: %v %v", got[0].Err, got[1].Err)
	}
	got := <-running
	drained := time.Since(stopped)
	checkExact(t, got, want)
	if serving >= drained || serving > 5*time.Second {
		t.Fatalf("the second Host led %v after the SIGTERM, the first drained in %v (its lease: 10 s)", serving, drained)
	}
	t.Logf("SIGTERM to the leader: the next Host led %v after, the agents registered with it %v after; the old leader's %d streams finished exactly %v after",
		serving.Round(time.Millisecond), registered.Round(time.Millisecond), len(got), drained.Round(time.Millisecond))
	d.host.stop(t) // exits 0 after its drain
}

// The leading Host dies inside a migration that moves streams another
// Host relays — after its copy rounds (the target holding their KV), or
// after the commit (before any stream switched): the other Host's
// streams go on, exactly (from A, which resumes at its pause lease); the
// Host that takes over ends the migration's record in a terminal state;
// exactly one of A and B is active; and neither engine holds a block
// once the streams are over. After the commit, the Host that takes over
// also aborts the target's copies that no client reads (the target ran
// every moved request), while the other Host's streams still run on A.
func TestTheOtherHostsStreamsOutliveTheLeaderInAMigration(t *testing.T) {
	for _, tc := range []struct {
		fault, state string
		tokens       int
	}{
		{"crash_before_pause", hostapi.StateAborted, 400},
		{"crash_after_commit", hostapi.StateFailed, 900}, // running past the takeover
	} {
		t.Run(tc.fault, func(t *testing.T) {
			d, h2, h2URL := twoHosts(t)
			defer h2.stop(t)
			viaSecond := marked(h2URL, 8, tc.tokens)
			wantSecond := d.reference(viaSecond)
			runSecond := streamVia(h2URL, viaSecond)
			viaFirst := d.startLoad(load(8, 400))
			time.Sleep(300 * time.Millisecond)
			if code, body := d.migrate(t, fmt.Sprintf(`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","inject_fault":%q}`, tc.fault)); code != 200 {
				t.Fatalf("%d %s", code, body)
			}
			_ = d.host.cmd.Wait() // the leader exits inside the migration
			d.host.kill()
			d.hostURL = h2URL
			if tc.fault == "crash_after_commit" {
				waitLeads(t, h2URL)
				waitUntil(t, "the target to run none of the moved requests", func() bool { return d.stats(t, d.bURL).Running == 0 })
				select {
				case got := <-runSecond:
					t.Fatalf("the second Host's streams ended (the first: %v) before the target's copies went: nothing was shown", got[0].Err)
				default: // they still run, on A
				}
			}
			checkExact(t, <-runSecond, wantSecond)
			<-viaFirst // those streams ended with the leader
			waitUntil(t, "the second Host to lead", func() bool {
				hs := hostsOf(t, h2URL)
				return len(hs) == 1 && hs[0].Leader
			})
			list := listMigrations(t, h2URL)
			if len(list) != 1 || list[0].State != tc.state {
				t.Fatalf("the migration the leader died in, as the next Host has it: %+v", list)
			}
			if tc.fault == "crash_after_commit" && !strings.Contains(list[0].Error, "left 8 moved streams on the source and 0 on the target") {
				t.Fatalf("the record does not say what the next Host settled: %s", list[0].Error)
			}
			if a, b := roleOf(t, h2URL, "A"), roleOf(t, h2URL, "B"); a != "active" || b != "standby" {
				t.Fatalf("roles after the takeover: A %s, B %s", a, b)
			}
			d.waitEnginesHoldNothing(t)
			t.Logf("%s: the record ended %s: %s", tc.fault, list[0].State, list[0].Error)
		})
	}
}

// The recommended layout: two Hosts on a three-member etcd that serves
// its clients over TLS and requires a client certificate. The member that
// leads the etcd cluster goes down under both Hosts' streams: they go on,
// exactly; once the two members left have elected a leader, a migration
// moves new streams of both Hosts exactly, and the Hosts still agree on
// which of them leads.
func TestHostsOnAThreeMemberEtcdOverTLS(t *testing.T) {
	p := newPKI(t)
	srvCert, srvKey := p.issue(t, "etcd")
	cliCert, cliKey := p.issue(t, "host-etcd")
	members := etcdtest.StartCluster(t, 3, &etcdtest.TLS{CAFile: p.ca, CertFile: srvCert, KeyFile: srvKey})
	var eps []string
	for _, m := range members {
		eps = append(eps, m.Endpoint)
	}
	d, h2, h2URL := twoHostsOn(t, "--store", "etcd://"+strings.Join(eps, ","),
		"--etcd-ca-file", p.ca, "--etcd-cert-file", cliCert, "--etcd-key-file", cliKey)
	defer h2.stop(t)
	both := func(tokens int) (run func() ([]loadgen.Stream, []loadgen.Stream), n int) {
		viaSecond, viaFirst := marked(h2URL, 8, tokens), load(8, tokens)
		wantSecond, wantFirst := d.reference(viaSecond), d.reference(viaFirst)
		second, first := streamVia(h2URL, viaSecond), d.startLoad(viaFirst)
		return func() ([]loadgen.Stream, []loadgen.Stream) {
			gotFirst, gotSecond := <-first, <-second
			checkExact(t, gotFirst, wantFirst)
			checkExact(t, gotSecond, wantSecond)
			return gotFirst, gotSecond
		}, 16
	}
	before, _ := both(400)
	time.Sleep(300 * time.Millisecond)
	down := time.Now()
	stopped := ""
	for _, m := range members {
		if m.IsLeader() {
			go m.Stop() // a member's shutdown takes seconds
			stopped = m.Endpoint
			break
		}
	}
	if stopped == "" {
		t.Fatal("no etcd member leads")
	}
	before()
	waitUntil(t, "the two members left to elect a leader", func() bool {
		for _, m := range members {
			if m.Endpoint != stopped && m.IsLeader() {
				return true
			}
		}
		return false
	})
	elected := time.Since(down)
	after, n := both(900)
	time.Sleep(300 * time.Millisecond)
	st := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", Type: hostapi.PreserveSource})
	if st.State != hostapi.StateSucceeded || st.Migrated != n {
		t.Fatalf("a migration after the etcd leader %s went down: %s (%s), %d of %d moved", stopped, st.State, st.Error, st.Migrated, n)
	}
	after()
	for _, url := range []string{d.hostURL, h2URL} {
		hs := hostsOf(t, url)
		if len(hs) != 2 || !hs[0].Leader || hs[0].Address != strings.TrimPrefix(d.hostURL, "http://") {
			t.Fatalf("the Hosts as %s lists them: %+v", url, hs)
		}
	}
	t.Logf("etcd member %s (the raft leader) went down under 16 streams, all exact; the others elected a leader %v after; a migration of %d streams of both Hosts then: downtime %.1f ms, all exact",
		stopped, elected.Round(time.Millisecond), n, st.DowntimeS*1000)
}

// The leader dies inside a drain: the Host that takes over drains the
// instance again from where it stands (the records say it is draining) and
// retires it once empty, as the operator asked. B's drain waits for
// requests sent to B directly (they cannot move), so the leader dies while
// it runs; the streams the second Host relays from B move to A, exactly.
func TestTheNextHostFinishesADrainItsLeaderLeft(t *testing.T) {
	d, h2, h2URL := twoHostsWith(t, deployOptions{bBlocks: 4096, bActive: true}, "--store", "etcd://"+etcdtest.Start(t))
	defer h2.stop(t)
	direct := make(chan []loadgen.Stream, 1)
	go func() {
		direct <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.bURL, Model: "m"}, load(2, 900))
	}()
	viaSecond := marked(h2URL, 8, 900)
	wantSecond := d.reference(viaSecond)
	runSecond := streamVia(h2URL, viaSecond)
	time.Sleep(500 * time.Millisecond)
	if _, err := hostClient(t, d.hostURL, d.tk.admin).Drain(context.Background(), "B", hostapi.DrainRequest{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if in := instance(t, h2URL, "B"); in.Lifecycle != "draining" {
		t.Fatalf("B is %s 300 ms into its drain, which waits for its direct requests", in.Lifecycle)
	}
	d.host.kill()
	d.hostURL = h2URL
	waitLeads(t, h2URL)
	c := hostClient(t, h2URL, d.tk.admin)
	var resumed hostapi.DrainStatus
	waitUntil(t, "the next Host to drain B again", func() bool {
		list, err := c.Drains(context.Background())
		if err != nil || len(list) == 0 {
			return false
		}
		resumed = list[0]
		return resumed.Instance == "B"
	})
	for i, s := range <-direct {
		if s.Err != nil || s.Done != 1 {
			t.Fatalf("direct request %d to B: %v", i, s.Err)
		}
	}
	checkExact(t, <-runSecond, wantSecond)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := c.WaitDrain(ctx, resumed.ID, 50*time.Millisecond, nil)
	if err != nil || st.State != hostapi.StateSucceeded {
		t.Fatalf("the drain the next Host resumed: %+v %v", st, err)
	}
	if in := instance(t, h2URL, "B"); in.Lifecycle != "retired" {
		t.Fatalf("B is %s after the resumed drain", in.Lifecycle)
	}
	t.Logf("the resumed drain: %d moved, %d finished there", st.Moved, st.Finished)
}

// A Host that follows and whose lease on the store ends behind its back —
// etcd stalled or out of reach past --store-lease, as a loaded machine
// made it in a CI run — goes on: the streams it relays finish exactly, it
// takes a new lease (listed again, ready, vhi_host_store_rejoins_total 1)
// and still takes over when the leader dies. (Before, it stopped and
// exited, and its clients' streams ended with it.)
func TestAFollowingHostOutlivesItsLease(t *testing.T) {
	ep := etcdtest.Start(t)
	d, h2, h2URL := twoHostsOn(t, "--store", "etcd://"+ep)
	defer h2.stop(t)
	via := marked(h2URL, 8, 400)
	want := d.reference(via)
	run := streamVia(h2URL, via)
	time.Sleep(300 * time.Millisecond)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	keys, err := cli.Get(ctx, "/vllm-hi/election/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	second := strings.TrimPrefix(h2URL, "http://")
	var lease clientv3.LeaseID
	for _, kv := range keys.Kvs {
		if strings.Contains(string(kv.Value), `"address":"`+second+`"`) {
			lease = clientv3.LeaseID(kv.Lease)
		}
	}
	if lease == 0 {
		t.Fatalf("no election key of the second Host among %d", len(keys.Kvs))
	}
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	checkExact(t, <-run, want)
	waitUntil(t, "the second Host listed again, under a new lease", func() bool {
		hs := hostsOf(t, h2URL)
		return len(hs) == 2 && hs[1].Address == second
	})
	resp, err := http.Get(h2URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the second Host's /readyz after its new lease: %d", resp.StatusCode)
	}
	hostMetrics(t, h2URL, "vhi_host_store_rejoins_total 1")
	d.host.kill()
	waitLeads(t, h2URL)
}
