package sim

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// A held request stops short of its last tokens, keeps its seat and
// blocks, and once the hold is lifted ends with exactly the output an
// unheld run produces.
func TestHoldTailKeepsRequestsAliveAndChangesNoToken(t *testing.T) {
	c := testConfig(t)
	p := hooks.SamplingParams{MaxTokens: 40, Temperature: 0.7, Seed: 3, IgnoreEOS: true}
	want := run(t, startEngine(t, c), "r", prompt(20, 1), p)

	e := startEngine(t, c)
	e.HoldTail(5)
	if err := e.Submit(NewRequest{ID: "r", Prompt: prompt(20, 1), Params: p, SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []int
	for len(got) < 35 {
		o, err := e.Watch(ctx, "r", len(got))
		if err != nil {
			t.Fatal(err)
		}
		if o.Finished {
			t.Fatalf("finished at %d tokens under a hold of 5", len(got)+len(o.Tokens))
		}
		got = append(got, o.Tokens...)
	}
	time.Sleep(50 * time.Millisecond) // fifty steps' time: still held
	if s, _ := e.Stats(ctx); s.NumRunning != 1 || s.FreeBlocks == s.TotalBlocks {
		t.Fatalf("a held request must keep its seat and blocks: %+v", s)
	}
	short, scancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer scancel()
	if o, err := e.Watch(short, "r", 35); err == nil && (len(o.Tokens) > 0 || o.Finished) {
		t.Fatalf("held past 35 tokens: %+v", o)
	}
	e.HoldTail(0)
	if o := waitFinished(t, e, "r"); !slices.Equal(o.Tokens, want.Tokens) {
		t.Fatalf("a held run differs from an unheld one:\n%v\n%v", o.Tokens, want.Tokens)
	}
}

// The hold is behind the agent's credential and refuses a bad body.
func TestHoldTailRoute(t *testing.T) {
	c := testConfig(t)
	c.HookToken = "tok"
	e := startEngine(t, c)
	_, ts := startServer(t, e)
	post := func(body, token string) int {
		req, _ := http.NewRequest("POST", ts.URL+"/vhi_sim/hold_tail", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		body, token string
		want        int
	}{
		{`{"tokens":4}`, "", 401},
		{`{}`, "tok", 400},
		{`{"tokens":-1}`, "tok", 400},
		{`{"tokens":4}`, "tok", 200},
	} {
		if got := post(tc.body, tc.token); got != tc.want {
			t.Errorf("%s (token %q): %d, want %d", tc.body, tc.token, got, tc.want)
		}
	}
	e.lock()
	defer e.mu.Unlock()
	if e.holdTail != 4 {
		t.Fatalf("hold %d after the accepted call, want 4", e.holdTail)
	}
}
