package scale_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

func simConfig(t *testing.T) sim.Config {
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 1024, 1024
	c.Step = sim.StepModel{Fixed: 4 * time.Millisecond}
	c.ShmDir = t.TempDir()
	return c
}

func elastic(c sim.Config, mode string) sim.Config {
	c.ElasticEP, c.ElasticMode = true, mode
	c.ElasticPrepareTime, c.ElasticGraphTime, c.ElasticActivateTime = 300*time.Millisecond, 300*time.Millisecond, 50*time.Millisecond
	return c
}

func intp(n int) *int { return &n }

// A scale through the Host under load: prepare while the engine serves,
// the commit's 503s held and the requests sent again — no client sees an
// error — a repeat of the same target answers the same operation, another
// target meanwhile is a 409 naming it, the probe matches after.
func TestElasticScaleUnderLoad(t *testing.T) {
	st, err := stack.Start(stack.Options{Model: "m", SimA: elastic(simConfig(t), sim.ElasticAsync), SimB: simConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	c := st.Client()
	ctx := context.Background()
	// Refusals change nothing.
	for _, bad := range []struct {
		req  hostapi.ScaleRequest
		code int
		want string
	}{
		{hostapi.ScaleRequest{Model: "m"}, 400, "data_parallel_size (elastic EP) or replicas (dense) is required"},
		{hostapi.ScaleRequest{Model: "m", DataParallelSize: intp(0)}, 400, "at least 1"},
		{hostapi.ScaleRequest{Model: "m", ID: st.AID, DataParallelSize: intp(2)}, 400, "one of them"},
		{hostapi.ScaleRequest{Model: "nope", DataParallelSize: intp(2)}, 404, "no instance serves"},
		{hostapi.ScaleRequest{Model: "m", Replicas: intp(2), DataParallelSize: intp(2)}, 400, "not both"},
	} {
		if _, err := c.Scale(ctx, bad.req); !hostapi.IsStatus(err, bad.code) || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%+v: %v, want %d %q", bad.req, err, bad.code, bad.want)
		}
	}
	// An engine without elastic EP: the operation fails with vLLM's
	// answer (its routes exist either way), and nothing changed.
	if id, err := c.Scale(ctx, hostapi.ScaleRequest{ID: st.BID, DataParallelSize: intp(2)}); err != nil {
		t.Fatal(err)
	} else if res, _ := c.WaitScale(ctx, id, 10*time.Millisecond, nil); res.State != hostapi.StateFailed || !strings.Contains(res.Error, "Elastic EP is not enabled") {
		t.Fatalf("scaling an engine without elastic EP: %+v", res)
	}
	if in, _ := c.Instance(ctx, st.BID); in.Lifecycle != "standby" {
		t.Fatalf("B after the failed scale: %s", in.Lifecycle)
	}
	// Streams running, and new requests arriving all through.
	reqs := make([]loadgen.Request, 40)
	for i := range reqs {
		reqs[i] = loadgen.Request{Prompt: "scale me", MaxTokens: 40 + 10*(i%5), IgnoreEOS: true}
	}
	done := make(chan []loadgen.Stream, 1)
	go func() {
		done <- loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m", Stagger: 1200 * time.Millisecond}, reqs)
	}()
	time.Sleep(100 * time.Millisecond)
	id, err := c.Scale(ctx, hostapi.ScaleRequest{Model: "m", DataParallelSize: intp(2)})
	if err != nil {
		t.Fatal(err)
	}
	if again, err := c.Scale(ctx, hostapi.ScaleRequest{ID: st.AID, DataParallelSize: intp(2)}); err != nil || again != id {
		t.Fatalf("the same target again: %q %v, want %q", again, err, id)
	}
	if _, err := c.Scale(ctx, hostapi.ScaleRequest{Model: "m", DataParallelSize: intp(3)}); !hostapi.IsStatus(err, 409) || !strings.Contains(err.Error(), id) {
		t.Fatalf("another target meanwhile: %v", err)
	}
	res, err := c.WaitScale(ctx, id, 20*time.Millisecond, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", res)
	if res.State != hostapi.StateSucceeded || st.A.DataParallelSize() != 2 || res.To != 2 {
		t.Fatalf("scale %+v, engine at %d", res, st.A.DataParallelSize())
	}
	var names []string
	for _, p := range res.Phases {
		names = append(names, p.Phase)
	}
	if got := strings.Join(names, " "); got != "check prepare commit verify" {
		t.Fatalf("phases %s", got)
	}
	if p := res.Phases[1]; p.DurationS < 0.25 {
		t.Fatalf("prepare %v: the engine's async prepare is 300 ms", p.DurationS)
	}
	if res.DowntimeS < 0.25 || res.DowntimeS > 2 {
		t.Fatalf("downtime %v: the engine's commit is 350 ms", res.DowntimeS)
	}
	for i, s := range <-done {
		if s.Err != nil || s.Done != 1 || s.Usage == nil || s.Usage.CompletionTokens != reqs[i].MaxTokens {
			t.Fatalf("stream %d: %v %d %+v", i, s.Err, s.Done, s.Usage)
		}
	}
	if res.HeldRequests == 0 {
		t.Log("no request met the commit (the load missed it): held_requests 0")
	}
	if in, _ := c.Instance(ctx, st.AID); in.Lifecycle != "active" {
		t.Fatalf("after the scale A is %s", in.Lifecycle)
	}
	// The same size again is done at once: vLLM skips it.
	id2, err := c.Scale(ctx, hostapi.ScaleRequest{Model: "m", DataParallelSize: intp(2)})
	if err != nil {
		t.Fatal(err)
	}
	if r2, _ := c.WaitScale(ctx, id2, 10*time.Millisecond, nil); r2.State != hostapi.StateSucceeded || r2.From != 2 || r2.DowntimeS > 0.05 {
		t.Fatalf("the same size again: %+v", r2)
	}
}

// Without the Host a client talking to the engine meets its 503s; with
// it, none (the baseline of the zero-error goal).
func TestCommitHeldRequestsNeverSee503(t *testing.T) {
	st, err := stack.Start(stack.Options{Model: "m", SimA: elastic(simConfig(t), sim.ElasticBlocking), SimB: simConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	ctx := context.Background()
	id, err := st.Client().Scale(ctx, hostapi.ScaleRequest{ID: st.AID, DataParallelSize: intp(4)})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !st.A.Scaling() {
		if time.Now().After(deadline) {
			t.Fatal("the engine never started committing")
		}
		time.Sleep(2 * time.Millisecond)
	}
	direct := loadgen.Run(ctx, loadgen.Config{BaseURL: st.AURL, Model: "m"}, []loadgen.Request{{Prompt: "x", MaxTokens: 4}})[0]
	if direct.Err == nil || !strings.Contains(direct.Err.Error(), "503") {
		t.Fatalf("direct to the engine in its commit: %v", direct.Err)
	}
	through := loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m"}, []loadgen.Request{{Prompt: "x", MaxTokens: 4}})[0]
	if through.Err != nil || through.Done != 1 {
		t.Fatalf("through the Host in the commit: %v", through.Err)
	}
	res, err := st.Client().WaitScale(ctx, id, 10*time.Millisecond, nil)
	if err != nil || res.State != hostapi.StateSucceeded || res.HeldRequests == 0 {
		t.Fatalf("%+v %v", res, err)
	}
}

// A probe that answers otherwise after the scale rolls it back to the
// size before.
func TestAFailedCheckRollsBack(t *testing.T) {
	// Once armed, the engine's completions come out otherwise after its
	// next scale: what a rank that joined with wrong weights would do.
	var armed, corrupt atomic.Bool
	wrap := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/scale_elastic_ep" {
				next.ServeHTTP(w, r)
				corrupt.Store(armed.Load())
				return
			}
			if !corrupt.Load() || r.URL.Path != "/v1/completions" {
				next.ServeHTTP(w, r)
				return
			}
			rec := &recorder{header: http.Header{}}
			next.ServeHTTP(rec, r)
			for k, v := range rec.header {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.code)
			_, _ = w.Write(bytes.Replace(rec.body.Bytes(), []byte(`"text":"`), []byte(`"text":"garbage `), 1))
		})
	}
	st, err := stack.Start(stack.Options{Model: "m", SimA: simConfig(t), SimB: elastic(simConfig(t), sim.ElasticAsyncGraphReuse), BActive: true, WrapB: wrap})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	ctx := context.Background()
	scaleTo := func(n int) hostapi.ScaleStatus {
		id, err := st.Client().Scale(ctx, hostapi.ScaleRequest{ID: st.BID, DataParallelSize: intp(n)})
		if err != nil {
			t.Fatal(err)
		}
		res, err := st.Client().WaitScale(ctx, id, 10*time.Millisecond, nil)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	if res := scaleTo(2); res.State != hostapi.StateSucceeded {
		t.Fatalf("1 → 2: %+v", res)
	}
	armed.Store(true)
	res := scaleTo(3)
	if res.State != hostapi.StateRolledBack || !strings.Contains(res.Error, "probe answered") || st.B.DataParallelSize() != 2 {
		t.Fatalf("2 → 3 with a wrong answer after: %+v, engine at %d", res, st.B.DataParallelSize())
	}
}

// recorder keeps a handler's answer to rewrite it.
type recorder struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }
func (r *recorder) WriteHeader(c int)   { r.code = c }
func (r *recorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = 200
	}
	return r.body.Write(b)
}

var _ io.Writer = (*recorder)(nil)

// A commit that fails in vLLM (its drain of in-flight requests timed
// out): the operation fails saying so, the engine keeps its size and —
// the probe answering as before — keeps serving; the requests held
// through the failed commit are sent again and complete.
func TestCommitFailureLeavesTheEngineServing(t *testing.T) {
	c := elastic(simConfig(t), sim.ElasticBlocking)
	c.ElasticDrain = true
	st, err := stack.Start(stack.Options{Model: "m", SimA: c, SimB: simConfig(t), TuneHost: func(hc *host.Config) {
		hc.Scale.DrainTimeout = time.Second
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	ctx := context.Background()
	// Streams of ~2 s: longer than the 1 s drain timeout.
	long := make([]loadgen.Request, 4)
	for i := range long {
		long[i] = loadgen.Request{Prompt: "drain me", MaxTokens: 500, IgnoreEOS: true}
	}
	done := make(chan []loadgen.Stream, 1)
	go func() { done <- loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m"}, long) }()
	time.Sleep(200 * time.Millisecond)
	id, err := st.Client().Scale(ctx, hostapi.ScaleRequest{ID: st.AID, DataParallelSize: intp(2)})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !st.A.Scaling() && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	held := loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "m"}, []loadgen.Request{{Prompt: "x", MaxTokens: 4}})[0]
	res, err := st.Client().WaitScale(ctx, id, 10*time.Millisecond, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", res)
	if res.State != hostapi.StateFailed || !strings.Contains(res.Error, "drain timeout") || !strings.Contains(res.Error, "keeps serving") || st.A.DataParallelSize() != 1 {
		t.Fatalf("a failed commit: %+v, engine at %d", res, st.A.DataParallelSize())
	}
	if held.Err != nil || held.Done != 1 {
		t.Fatalf("the request held through the failed commit: %v", held.Err)
	}
	for i, s := range <-done {
		if s.Err != nil || s.Done != 1 {
			t.Fatalf("stream %d through the failed commit: %v", i, s.Err)
		}
	}
	if in, _ := st.Client().Instance(ctx, st.AID); in.Lifecycle != "active" {
		t.Fatalf("A after the failed commit: %s", in.Lifecycle)
	}
}
