package store

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/vllm-hi/vllm-hi/internal/etcdtest"
)

func openEtcd(t *testing.T, ep, name string) *Etcd {
	t.Helper()
	s, err := OpenEtcd(context.Background(), EtcdOptions{Endpoints: []string{ep}, Prefix: "/t/", LeaseTTL: time.Second, ID: name, Address: name + ":1"})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Both stores keep the same records the same way: what one Host wrote,
// the next one (after a restart, or taking over) reads back.
func TestStoresKeepTheRecords(t *testing.T) {
	ep := etcdtest.Start(t)
	dir := t.TempDir()
	for name, open := range map[string]func() Store{
		"bolt": func() Store {
			s, err := OpenBolt(dir)
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		"etcd": func() Store { return openEtcd(t, ep, "h1") },
	} {
		t.Run(name, func(t *testing.T) {
			s := open()
			at := time.Date(2026, 12, 5, 1, 0, 0, 0, time.UTC)
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			must(s.PutInstance(Instance{ID: "a", Type: "A", Role: "active", EngineURL: "http://e:1", ServedModels: []string{"m"}, LastSeen: at}))
			must(s.PutInstance(Instance{ID: "b", Type: "B", Role: "standby"}))
			must(s.DeleteInstance("b"))
			must(s.PutMigration("mig-1", json.RawMessage(`{"migration_id":"mig-1","state":"succeeded"}`)))
			must(s.PutMigration("mig-2", json.RawMessage(`{"migration_id":"mig-2"}`)))
			must(s.DeleteMigration("mig-2"))
			must(s.PutLaunched(Launched{ID: "r-1", Model: "m", PID: 41, Start: 9001, At: at}))
			must(s.Close())
			s = open()
			defer s.Close()
			in, err := s.Instances()
			must(err)
			if len(in) != 1 || in[0].ID != "a" || in[0].Role != "active" || in[0].ServedModels[0] != "m" || !in[0].LastSeen.Equal(at) {
				t.Fatalf("instances: %+v", in)
			}
			ms, err := s.Migrations()
			must(err)
			if len(ms) != 1 || string(ms["mig-1"]) != `{"migration_id":"mig-1","state":"succeeded"}` {
				t.Fatalf("migrations: %v", ms)
			}
			ls, err := s.LaunchedEngines()
			must(err)
			if len(ls) != 1 || ls[0].PID != 41 || !ls[0].At.Equal(at) {
				t.Fatalf("launched: %+v", ls)
			}
		})
	}
}

// One Host leads a shared store at a time: a second waits, and takes over
// when the first gives it up or its lease ends; a Host whose lease ended
// (partitioned, say) learns so, and its writes are refused — it cannot
// overwrite what its successor decided.
func TestOneHostLeadsTheSharedStore(t *testing.T) {
	ep := etcdtest.Start(t)
	h1 := openEtcd(t, ep, "h1")
	if err := h1.PutInstance(Instance{ID: "a", Role: "active"}); err != nil {
		t.Fatal(err)
	}
	second := make(chan *Etcd, 1)
	go func() { second <- openEtcd(t, ep, "h2") }()
	select {
	case <-second:
		t.Fatal("a second Host led the store beside the first")
	case <-time.After(1500 * time.Millisecond): // past the lease: h1 renews it
	}
	ms, err := h1.Members(context.Background())
	if err != nil || len(ms) != 2 || ms[0].ID != "h1" || !ms[0].Leader || ms[1].ID != "h2" || ms[1].Leader || ms[1].Address != "h2:1" ||
		time.Since(ms[0].LastSeen) > 2*time.Second {
		t.Fatalf("the store's Hosts: %+v %v", ms, err)
	}
	// h1's lease revoked behind its back, as its expiry would.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	lost := time.Now()
	if _, err := cli.Revoke(context.Background(), h1.sess.Lease()); err != nil {
		t.Fatal(err)
	}
	var h2 *Etcd
	select {
	case h2 = <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("the second Host did not take over")
	}
	defer h2.Close()
	t.Logf("the second Host led %v after the first's lease ended", time.Since(lost).Round(time.Millisecond))
	select {
	case <-h1.Lost():
	case <-time.After(5 * time.Second):
		t.Fatal("the first Host was not told it lost the store")
	}
	if err := h1.PutInstance(Instance{ID: "a", Role: "standby"}); !errors.Is(err, ErrNotLeader) {
		t.Fatalf("a write of the Host that lost the store: %v", err)
	}
	if err := h2.PutInstance(Instance{ID: "b", Role: "active"}); err != nil {
		t.Fatal(err)
	}
	in, err := h2.Instances()
	if err != nil || len(in) != 2 {
		t.Fatalf("%+v %v", in, err)
	}
	for _, i := range in {
		if i.ID == "a" && i.Role != "active" {
			t.Fatalf("the old leader's write landed: %+v", i)
		}
	}
	h1.Close()
}

// A Host that follows and whose lease ends (etcd stalled past it) is told
// so by its campaign, not by Lost — it decided nothing, so it need not
// stop: it takes a new lease, is listed again, and takes over when the
// leader goes; the leader notices nothing.
func TestAFollowerWhoseLeaseEndedTakesANewOne(t *testing.T) {
	ep := etcdtest.Start(t)
	h1 := openEtcd(t, ep, "h1")
	defer h1.Close()
	h2, err := ConnectEtcd(context.Background(), EtcdOptions{Endpoints: []string{ep}, Prefix: "/t/", LeaseTTL: time.Second, ID: "h2", Address: "h2:1"})
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	campaign := func() <-chan error {
		ch := make(chan error, 1)
		go func() { ch <- h2.Campaign(context.Background()) }()
		return ch
	}
	first := campaign()
	waitMembers := func(n int) []Member {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			ms, err := h1.Members(context.Background())
			if err == nil && len(ms) == n {
				return ms
			}
			if time.Now().After(deadline) {
				t.Fatalf("the store's Hosts: %+v %v, want %d", ms, err, n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitMembers(2)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Revoke(context.Background(), h2.lease()); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-first:
		if !errors.Is(err, ErrLeaseEnded) {
			t.Fatalf("the follower's campaign after its lease ended: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the follower's campaign did not end with its lease")
	}
	for name, h := range map[string]*Etcd{"h1": h1, "h2": h2} {
		select {
		case <-h.Lost():
			t.Fatalf("%s's Lost closed: a follower's lease is not the lead", name)
		default:
		}
	}
	if err := h2.Rejoin(context.Background()); err != nil {
		t.Fatal(err)
	}
	second := campaign()
	if ms := waitMembers(2); ms[0].ID != "h1" || ms[1].ID != "h2" {
		t.Fatalf("after the rejoin: %+v", ms)
	}
	if err := h1.Rejoin(context.Background()); err == nil {
		t.Fatal("the leader took a new lease: it may not (another Host may have decided since its own ended)")
	}
	h1.Close()
	select {
	case err := <-second:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the rejoined Host did not take over from the leader that left")
	}
	if err := h2.PutInstance(Instance{ID: "a", Role: "active"}); err != nil {
		t.Fatalf("a write of the rejoined Host that leads: %v", err)
	}
}

// A Host that follows (connected, not leading) cannot write; it sees the
// leader's instance records as they are written, and the two talk over
// the board: a question the leader posts reaches the follower, whose
// answer the leader collects — and a Host that does not answer leaves
// the wait at its deadline with what came.
func TestAFollowerWatchesTheLeaderAndAnswersOnTheBoard(t *testing.T) {
	ep := etcdtest.Start(t)
	leader := openEtcd(t, ep, "h1")
	defer leader.Close()
	f, err := ConnectEtcd(context.Background(), EtcdOptions{Endpoints: []string{ep}, Prefix: "/t/", LeaseTTL: time.Second, ID: "h2", Address: "h2:1"})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.PutInstance(Instance{ID: "x"}); !errors.Is(err, ErrNotLeader) {
		t.Fatalf("a follower's write: %v", err)
	}
	if m, ok, err := f.Leader(context.Background()); err != nil || !ok || m.ID != "h1" || m.Address != "h1:1" {
		t.Fatalf("the leader as a follower sees it: %+v %v %v", m, ok, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	roles := make(chan string, 8)
	go f.WatchInstances(ctx, func(id string, rec *Instance) {
		if rec != nil {
			roles <- id + "=" + rec.Role
		}
	})
	go f.WatchBoard(ctx, BoardCensus, func(id string, v []byte) {
		var c Census
		if json.Unmarshal(v, &c) != nil {
			return
		}
		_ = f.Answer(BoardCensus, id, CensusAnswer{Host: "h2", Streams: map[string]RelayedStream{c.RequestIDs[0]: {Model: "m"}}})
	})
	time.Sleep(200 * time.Millisecond) // the watches start
	if err := leader.PutInstance(Instance{ID: "a", Role: "standby"}); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-roles:
		if got != "a=standby" {
			t.Fatalf("the follower saw %s", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the follower did not see the leader's write")
	}
	if err := leader.Post(BoardCensus, "mig-1", Census{Migration: "mig-1", RequestIDs: []string{"r1", "r2"}}); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer wcancel()
	answers := leader.Answers(wctx, BoardCensus, "mig-1", []string{"h2"})
	var a CensusAnswer
	if len(answers) != 1 || json.Unmarshal(answers["h2"], &a) != nil || a.Streams["r1"].Model != "m" || len(a.Streams) != 1 {
		t.Fatalf("the follower's answer: %s", answers["h2"])
	}
	// A Host that never answers: the wait ends at its deadline.
	short, scancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer scancel()
	start := time.Now()
	if got := leader.Answers(short, BoardCensus, "mig-1", []string{"h2", "h3"}); len(got) != 1 || time.Since(start) > 2*time.Second {
		t.Fatalf("answers with a silent Host: %d after %v", len(got), time.Since(start))
	}
	leader.Unpost(BoardCensus, "mig-1")
	if got := leader.Answers(context.Background(), BoardCensus, "mig-1", nil); len(got) != 0 {
		t.Fatalf("answers left after Unpost: %d", len(got))
	}
}
