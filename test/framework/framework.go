// Package framework runs the same migration tests against two kinds of
// deployment behind one interface, Cluster: everything in this process
// (InProcess, on internal/stack — fast, and the race detector sees every
// component at once) and real processes (test/e2e's runner: the vhi
// binary, its flags and signals, and the GPU machines' devices). A test is
// a Case; Cases lists them; Run runs them against a Runner.
package framework

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// Options vary a deployment.
type Options struct {
	// BBlocks is engine B's KV blocks (0: the runner's default, as A).
	BBlocks int
	// A and B are the engines' TP×PP shapes (zero: 1×1). The reference
	// engine is 1×1: a sim's tokens do not depend on its shape.
	A, B Shape
	// BActive starts B active beside A (both serve the model) instead of
	// standby.
	BActive bool
	// SourceStep is engine A's modelled step (0: the runner's 6 ms). A
	// slower source writes fewer blocks per round and its streams outlast
	// more rounds: the cases whose fault needs the source still writing
	// in the final round run paced.
	SourceStep time.Duration
}

// Shape is an engine's tensor- and pipeline-parallel size.
type Shape struct{ TP, PP int }

// Sizes are the shape's sizes, 1 where unset.
func (s Shape) Sizes() (tp, pp int) { return max(s.TP, 1), max(s.PP, 1) }

func (s Shape) String() string {
	tp, pp := s.Sizes()
	return fmt.Sprintf("TP%d×PP%d", tp, pp)
}

// Cluster is a deployment under test: a Host with fault injection
// allowed, an active engine A and a standby B (or a second active one,
// Options.BActive) with their agents, and a lone reference engine
// configured like A.
type Cluster interface {
	// Host is the typed client of the Host, with the admin token.
	Host() *hostapi.Client
	HostURL() string
	// A and B are the engines' vllm_hi_ids.
	A() string
	B() string
	// Engine is engine A's or B's hooks (by vllm_hi_id), with the agent
	// token.
	Engine(id string) hooks.Engine
	// Reference runs reqs on the reference engine: the unmigrated truth.
	Reference(reqs []loadgen.Request) []loadgen.Stream
	// HoldTail makes engine id (by vllm_hi_id) keep each request with at
	// most tokens output tokens left from decoding further (vhi sim's
	// POST /vhi_sim/hold_tail); 0 lifts the hold. What the streams
	// generate does not change, only when.
	HoldTail(id string, tokens int) error
}

// Runner starts a cluster for one test (stopped at the test's end).
type Runner func(t *testing.T, o Options) Cluster

// Case is one test, run the same way against either runner.
type Case struct {
	Name    string
	Options Options
	Run     func(t *testing.T, c Cluster)
}

// Run runs every case against the runner, each on a cluster of its own.
// A case leaves nothing running behind it: once its cluster has stopped,
// every goroutine it started must have ended (a leaked engine loop, agent
// or relay would slow the cases after it), or the case fails naming them.
func Run(t *testing.T, start Runner, cases []Case) {
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			// Registered first, so it runs after the cluster's own cleanups.
			ignore := goleak.IgnoreCurrent()
			t.Cleanup(func() {
				if err := goleak.Find(ignore); err != nil {
					t.Errorf("the case left goroutines running after its cluster stopped: %v", err)
				}
			})
			c.Run(t, start(t, c.Options))
		})
	}
}

// Load is n streaming requests with fixed seeds, some greedy, some
// sampled, of a few lengths.
func Load(n, tokens int) []loadgen.Request {
	var reqs []loadgen.Request
	for i := 0; i < n; i++ {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("migrate me %d %s", i, strings.Repeat(" story", i%29)),
			MaxTokens: tokens + i%7, Seed: &seed, Temperature: float64(i%3) * 0.4, IgnoreEOS: true})
	}
	return reqs
}

// heldTail is how many output tokens a stream keeps when its engine holds
// it (HoldStreams): a few steps' worth, so that the streams still write
// KV through most of an operation on any machine.
const heldTail = 8

// HoldStreams keeps the streams on engine id alive until the returned
// release is called (and at the test's end, whichever is first): a test
// that asserts a migration or a drain moves every stream makes that true
// by construction, not by the machine's speed. On a fast machine nothing
// reaches the hold before the operation; on a slow one the streams wait
// a few tokens short of their end until the operation moves them to an
// engine that does not hold, or until release.
func HoldStreams(t *testing.T, c Cluster, id string) (release func()) {
	t.Helper()
	if err := c.HoldTail(id, heldTail); err != nil {
		t.Fatalf("hold the streams on %s: %v", id, err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			if err := c.HoldTail(id, 0); err != nil {
				t.Errorf("release the streams on %s: %v", id, err)
			}
		})
	}
	t.Cleanup(release)
	return release
}

// StartLoad streams reqs through the Host in the background and returns
// once engine on (the active one) runs them, their streams under way.
func StartLoad(t *testing.T, c Cluster, reqs []loadgen.Request, on string) <-chan []loadgen.Stream {
	t.Helper()
	ch := make(chan []loadgen.Stream, 1)
	go func() {
		ch <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: c.HostURL(), Model: Model}, reqs)
	}()
	WaitFor(t, "the load to run on "+on, func() bool {
		s, err := c.Engine(on).Stats(context.Background())
		return err == nil && s.NumRunning >= len(reqs)
	})
	time.Sleep(300 * time.Millisecond) // a few hundred tokens each: round 0 has work
	return ch
}

// Model is the served model name every runner's engines serve.
const Model = "m"

// CheckExact fails unless every stream equals its unmigrated run: the
// same text token for token, one [DONE], the same usage.
func CheckExact(t *testing.T, got, want []loadgen.Stream) {
	t.Helper()
	for i := range want {
		switch {
		case got[i].Err != nil:
			t.Fatalf("stream %d broke: %v", i, got[i].Err)
		case want[i].Err != nil:
			t.Fatalf("reference %d broke: %v", i, want[i].Err)
		case got[i].Text != want[i].Text:
			t.Fatalf("stream %d differs from its unmigrated run", i)
		case got[i].Done != 1 || got[i].Usage == nil || want[i].Usage == nil || got[i].Usage.CompletionTokens != len(got[i].Pieces) || *got[i].Usage != *want[i].Usage:
			t.Fatalf("stream %d: %d [DONE], usage %+v want %+v", i, got[i].Done, got[i].Usage, want[i].Usage)
		}
	}
}

// MigrateLoaded streams reqs, migrates mid-stream, waits for the end and
// checks every stream against want. The source holds the streams' last
// tokens until the migration has ended (HoldStreams): every stream is
// there to move however slowly the machine copies.
func MigrateLoaded(t *testing.T, c Cluster, reqs []loadgen.Request, want []loadgen.Stream, req hostapi.MigrateRequest) hostapi.MigrationStatus {
	t.Helper()
	if req.Src == "" {
		req.Src, req.Dst = c.A(), c.B()
	}
	release := HoldStreams(t, c, req.Src)
	running := StartLoad(t, c, reqs, req.Src)
	st := MigrateAndWait(t, c, req)
	release()
	CheckExact(t, <-running, want)
	return st
}

// MigrateAndWait migrates (A → B unless req says) and waits for the end.
func MigrateAndWait(t *testing.T, c Cluster, req hostapi.MigrateRequest) hostapi.MigrationStatus {
	t.Helper()
	if req.Src == "" {
		req.Src, req.Dst = c.A(), c.B()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := c.Host().MigrateAndWait(ctx, req, 20*time.Millisecond)
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	t.Logf("migration %s: %s, %d moved, rounds %s", st.ID, st.State, st.Migrated, RoundsSummary(st))
	return st
}

// RoundsSummary is a migration's rounds in one line (kind, blocks,
// seconds): what a failure needs to say which side was slow.
func RoundsSummary(st hostapi.MigrationStatus) string {
	var b strings.Builder
	for i, r := range st.Rounds {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %d blocks %.3f s", r.Kind, r.BlockCount, r.DurationS)
	}
	return b.String()
}

// WaitFor polls cond for up to 20 s.
func WaitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Instance is one instance as the Host lists it.
func Instance(t *testing.T, c Cluster, id string) hostapi.Instance {
	t.Helper()
	in, err := c.Host().Instance(context.Background(), id)
	if err != nil {
		t.Fatalf("instance %s: %v", id, err)
	}
	return in
}

// Roles checks the two engines' roles.
func Roles(t *testing.T, c Cluster, a, b string) {
	t.Helper()
	if ra, rb := Instance(t, c, c.A()).Role, Instance(t, c, c.B()).Role; ra != a || rb != b {
		t.Fatalf("roles: A %s, B %s; want %s, %s", ra, rb, a, b)
	}
}

// Metrics checks that the Host's /metrics has every line of want.
func Metrics(t *testing.T, c Cluster, want ...string) {
	t.Helper()
	HostMetrics(t, c.HostURL(), want...)
}

// HostMetrics checks that the /metrics of the Host at hostURL has every
// line of want.
func HostMetrics(t *testing.T, hostURL string, want ...string) {
	t.Helper()
	resp, err := http.Get(hostURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	lines := map[string]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		lines[l] = true
	}
	for _, w := range want {
		if !lines[w] {
			t.Errorf("the Host's /metrics lacks %q", w)
		}
	}
}

// TargetHoldsNothing waits until B holds no request and no reservation.
func TargetHoldsNothing(t *testing.T, c Cluster) {
	t.Helper()
	HoldsNothing(t, c, c.B())
}

// HoldsNothing waits until engine id has every block free, none
// reserved and nothing running: no block leaked.
func HoldsNothing(t *testing.T, c Cluster, id string) {
	t.Helper()
	WaitFor(t, id+" to hold nothing", func() bool {
		s, err := c.Engine(id).Stats(context.Background())
		return err == nil && s.FreeBlocks == s.TotalBlocks && s.ReservedBlocks == 0 && s.NumRunning == 0
	})
}
