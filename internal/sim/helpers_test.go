package sim

import (
	"context"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// testConfig is a small, fast engine: the tiny profile, a 1 ms step.
func testConfig(t testing.TB) Config {
	t.Helper()
	c := DefaultConfig()
	c.Model = "test-model"
	c.Profile, c.KVScale = "tiny", 1
	c.BlockSize = 4
	c.NumBlocks = 512
	c.MaxNumSeqs = 32
	c.MaxNumBatchedTokens = 256
	c.MaxModelLen = 512
	c.Step = StepModel{Fixed: time.Millisecond}
	c.ShmDir = t.TempDir()
	c.ShmPrefix = "test"
	c.WakeUpTime = 20 * time.Millisecond
	c.ElasticPrepareTime, c.ElasticGraphTime, c.ElasticActivateTime = 20*time.Millisecond, 20*time.Millisecond, 5*time.Millisecond
	return c
}

// startEngine runs an engine for the test's lifetime.
func startEngine(t *testing.T, c Config) *Engine {
	t.Helper()
	e, err := NewEngine(c, zap.NewNop())
	if err != nil {
		t.Fatalf("NewEngine: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); e.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; e.Close() })
	return e
}

// startServer serves e over httptest with deterministic ids and times.
func startServer(t *testing.T, e *Engine) (*Server, *httptest.Server) {
	t.Helper()
	s := NewServer(e, zap.NewNop())
	s.created = 1700000000
	s.now = func() time.Time { return time.Unix(1700000000, 0) }
	var mu sync.Mutex
	n := 0
	s.newID = func() string {
		mu.Lock()
		defer mu.Unlock()
		n++
		return "test" + string(rune('a'+n-1))
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(ts.Close)
	return s, ts
}

// run submits a request and waits for its whole output.
func run(t *testing.T, e *Engine, id string, prompt []int, p hooks.SamplingParams) Output {
	t.Helper()
	if err := e.Submit(NewRequest{ID: id, Prompt: prompt, Params: p, SeedSet: true}); err != nil {
		t.Fatalf("submit %s: %v", id, err)
	}
	return waitFinished(t, e, id)
}

func waitFinished(t *testing.T, e *Engine, id string) Output {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var all []int
	for {
		o, err := e.Watch(ctx, id, len(all))
		if err != nil {
			t.Fatalf("watch %s: %v", id, err)
		}
		all = append(all, o.Tokens...)
		if o.Finished {
			o.Tokens, o.From = all, 0
			return o
		}
	}
}

func prompt(n, salt int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = 300 + (i*31+salt*17)%2000
	}
	return p
}
