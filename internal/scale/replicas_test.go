package scale_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// replicaLoad is a load of seeded streams and its unmigrated truth.
type replicaLoad struct {
	t    *testing.T
	st   *stack.Stack
	reqs []loadgen.Request
	want []loadgen.Stream
}

func newReplicaLoad(t *testing.T, st *stack.Stack, n, tokens int) *replicaLoad {
	l := &replicaLoad{t: t, st: st}
	for i := range n {
		seed := int64(i)
		l.reqs = append(l.reqs, loadgen.Request{Prompt: fmt.Sprintf("replica %d%s", i, strings.Repeat(" more", i%7)),
			MaxTokens: tokens + i%5, Seed: &seed, Temperature: float64(i%3) * 0.4, IgnoreEOS: true})
	}
	l.want = loadgen.Run(context.Background(), loadgen.Config{BaseURL: st.AURL, Model: "m"}, l.reqs)
	return l
}

// start streams the load through the Host and returns once the engines
// run all of it.
func (l *replicaLoad) start() <-chan []loadgen.Stream {
	done := make(chan []loadgen.Stream, 1)
	go func() {
		done <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: l.st.HostURL, Model: "m"}, l.reqs)
	}()
	l.st.WaitRunning(len(l.reqs), 5*time.Second)
	return done
}

func (l *replicaLoad) exact(got []loadgen.Stream) {
	l.t.Helper()
	for i := range l.reqs {
		if got[i].Err != nil || got[i].Text != l.want[i].Text || got[i].Done != 1 {
			l.t.Fatalf("stream %d: %v, equal to its unmigrated run: %v", i, got[i].Err, got[i].Text == l.want[i].Text)
		}
	}
}

func phases(st hostapi.ScaleStatus) string {
	var names []string
	for _, p := range st.Phases {
		if !slices.Contains(names, p.Phase) {
			names = append(names, p.Phase)
		}
	}
	return strings.Join(names, " ")
}

// A dense model's replicas scale out onto a standby — checked by the
// probe, made active, streams moved onto it by migration — and in by a
// drain onto the rest, every stream equal to its unmigrated run; a
// retired replica is woken for the next scale-out. Refusals change
// nothing.
func TestReplicasScaleOutAndInByMigration(t *testing.T) {
	c := simConfig(t)
	c.NumBlocks, c.MaxModelLen = 2048, 512
	st, err := stack.Start(stack.Options{Model: "m", SimA: c, SimB: c})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	ctx := context.Background()
	cl := st.Client()
	for _, bad := range []struct {
		req  hostapi.ScaleRequest
		code int
		want string
	}{
		{hostapi.ScaleRequest{Model: "m", Replicas: intp(3)}, 409, "1 more cannot be found"},
		{hostapi.ScaleRequest{ID: st.AID, Replicas: intp(2)}, 400, "name it by model"},
		{hostapi.ScaleRequest{Model: "m", Replicas: intp(0)}, 400, "at least 1"},
		{hostapi.ScaleRequest{Model: "nope", Replicas: intp(1)}, 404, "no instance serves"},
	} {
		if _, err := cl.Scale(ctx, bad.req); !hostapi.IsStatus(err, bad.code) || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%+v: %v, want %d %q", bad.req, err, bad.code, bad.want)
		}
	}
	if in, _ := cl.Instance(ctx, st.BID); in.Lifecycle != "standby" {
		t.Fatalf("B after the refusals: %s", in.Lifecycle)
	}
	wait := func(id string) hostapi.ScaleStatus {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		res, err := cl.WaitScale(wctx, id, 10*time.Millisecond, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s %d → %d: %s, phases %s, moved %d, downtime %.3f s, total %.3f s %s", res.Kind, res.From, res.To, res.State,
			phases(res), res.Moved, res.DowntimeS, res.TotalS, res.Error)
		return res
	}

	load := newReplicaLoad(t, st, 12, 300)
	done := load.start()
	id, err := cl.Scale(ctx, hostapi.ScaleRequest{Model: "m", Replicas: intp(2)})
	if err != nil {
		t.Fatal(err)
	}
	if again, err := cl.Scale(ctx, hostapi.ScaleRequest{Model: "m", Replicas: intp(2)}); err != nil || again != id {
		t.Fatalf("the same target again: %q %v", again, err)
	}
	if _, err := cl.Scale(ctx, hostapi.ScaleRequest{Model: "m", Replicas: intp(1)}); !hostapi.IsStatus(err, 409) || !strings.Contains(err.Error(), id) {
		t.Fatalf("another target meanwhile: %v", err)
	}
	if _, err := cl.Scale(ctx, hostapi.ScaleRequest{ID: st.AID, DataParallelSize: intp(2)}); !hostapi.IsStatus(err, 409) {
		t.Fatalf("an elastic scale of a replica meanwhile: %v", err)
	}
	out := wait(id)
	load.exact(<-done)
	if out.State != hostapi.StateSucceeded || out.Kind != "replicas" || out.From != 1 || out.To != 2 || !slices.Equal(out.Added, []string{st.BID}) ||
		out.Moved == 0 || phases(out) != "check standby verify activate move" || len(out.Instances) != 2 {
		t.Fatalf("scale-out: %+v", out)
	}
	if in, _ := cl.Instance(ctx, st.BID); in.Lifecycle != "active" {
		t.Fatalf("B after the scale-out: %s", in.Lifecycle)
	}

	done = load.start()
	in, err := cl.Scale(ctx, hostapi.ScaleRequest{Model: "m", Replicas: intp(1)})
	if err != nil {
		t.Fatal(err)
	}
	res := wait(in)
	load.exact(<-done)
	if res.State != hostapi.StateSucceeded || len(res.Removed) != 1 || len(res.Instances) != 1 || res.Moved == 0 || phases(res) != "drain" {
		t.Fatalf("scale-in: %+v", res)
	}
	if v, _ := cl.Instance(ctx, res.Removed[0]); v.Lifecycle != "retired" {
		t.Fatalf("the drained replica is %s", v.Lifecycle)
	}

	// The retired replica is the spare of the next scale-out: woken.
	again := wait(mustScale(t, cl, 2))
	if again.State != hostapi.StateSucceeded || !slices.Equal(again.Added, res.Removed) || !strings.Contains(phases(again), "wake") {
		t.Fatalf("scale-out onto the retired replica: %+v", again)
	}
}

func mustScale(t *testing.T, cl *hostapi.Client, replicas int) string {
	t.Helper()
	id, err := cl.Scale(context.Background(), hostapi.ScaleRequest{Model: "m", Replicas: intp(replicas)})
	if err != nil {
		t.Fatal(err)
	}
	return id
}
