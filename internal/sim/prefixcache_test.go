package sim

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// blocksOf is a live request's block table.
func blocksOf(t *testing.T, e *Engine, id string) []int {
	t.Helper()
	list, err := e.Requests(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range list.Requests {
		if r.RequestID == id {
			return r.BlockIDs
		}
	}
	t.Fatalf("%s is not live", id)
	return nil
}

// waitOutput waits until id has produced n tokens.
func waitOutput(t *testing.T, e *Engine, id string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		o, err := e.Watch(context.Background(), id, 0)
		if err == nil && o.NumOutput >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never produced %d tokens", id, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// Two prompts with a common three-block start: with the cache the second
// maps the first's blocks instead of computing them, and each still
// generates what it generates alone on a fresh engine; the shared blocks
// stay while either holds them. Without the cache nothing is shared.
func TestPrefixCacheSharesAPromptsFullBlocks(t *testing.T) {
	common := prompt(12, 1) // three blocks of 4
	pa := append(slices.Clone(common), prompt(5, 2)...)
	pb := append(slices.Clone(common), prompt(7, 3)...)
	// Seeds of their own: the shared KV must not depend on whose it was.
	params := func(n int) hooks.SamplingParams {
		return hooks.SamplingParams{Temperature: 0.8, MaxTokens: n, IgnoreEOS: true, Seed: int64(n)}
	}
	for _, on := range []bool{true, false} {
		c := testConfig(t)
		c.EnablePrefixCaching = on
		c.Step.Fixed = 3 * time.Millisecond
		alone := startEngine(t, c)
		wantA := run(t, alone, "a", pa, params(120)).Tokens
		wantB := run(t, alone, "b", pb, params(40)).Tokens

		e := startEngine(t, c)
		total := e.pool.total()
		if err := e.Submit(NewRequest{ID: "a", Prompt: pa, Params: params(120), SeedSet: true}); err != nil {
			t.Fatal(err)
		}
		waitOutput(t, e, "a", 2)
		if err := e.Submit(NewRequest{ID: "b", Prompt: pb, Params: params(40), SeedSet: true}); err != nil {
			t.Fatal(err)
		}
		waitOutput(t, e, "b", 1)
		ta, tb := blocksOf(t, e, "a"), blocksOf(t, e, "b")
		shared := 0
		for i := 0; i < min(len(ta), len(tb)) && ta[i] == tb[i]; i++ {
			shared++
		}
		if want := map[bool]int{true: 3, false: 0}[on]; shared != want {
			t.Fatalf("cache %v: a %v and b %v share %d leading blocks, want %d", on, ta, tb, shared, want)
		}
		e.lock()
		used := total - e.pool.numFree()
		e.mu.Unlock()
		if used != len(ta)+len(tb)-shared {
			t.Fatalf("cache %v: %d blocks in use for tables of %d and %d sharing %d", on, used, len(ta), len(tb), shared)
		}
		if on {
			// a leaves: b keeps the shared blocks, a's own are free.
			if _, err := e.Abort(context.Background(), hooks.AbortRequest{RequestIDs: []string{"a"}}); err != nil {
				t.Fatal(err)
			}
			e.lock()
			used, held := total-e.pool.numFree(), e.pool.allocated[tb[0]] && e.pool.refs[tb[0]] == 1
			e.mu.Unlock()
			if tb = blocksOf(t, e, "b"); used != len(tb) || !held {
				t.Fatalf("after a left: %d blocks in use for b's %d (shared block held once: %v)", used, len(tb), held)
			}
		}
		if got := waitFinished(t, e, "b").Tokens; !slices.Equal(got, wantB) {
			t.Fatalf("cache %v: b generated %v beside a, %v alone", on, got, wantB)
		}
		if !on {
			if got := waitFinished(t, e, "a").Tokens; !slices.Equal(got, wantA) {
				t.Fatalf("a generated %v beside b, %v alone", got, wantA)
			}
		}
		s, _ := e.Stats(context.Background())
		if s.FreeBlocks != s.TotalBlocks {
			t.Fatalf("cache %v: %d of %d blocks free at the end", on, s.FreeBlocks, s.TotalBlocks)
		}
		if !on {
			continue
		}
		// Free, the prompt's blocks stay cached (as vLLM keeps them until
		// their memory is needed): a later request with the same start
		// takes them back and still generates what it does alone.
		pc := append(slices.Clone(common), prompt(6, 4)...)
		wantC := run(t, alone, "c", pc, params(30)).Tokens
		if err := e.Submit(NewRequest{ID: "c", Prompt: pc, Params: params(30), SeedSet: true}); err != nil {
			t.Fatal(err)
		}
		waitOutput(t, e, "c", 1)
		if tc := blocksOf(t, e, "c"); !slices.Equal(tc[:3], tb[:3]) {
			t.Fatalf("c's table %v does not begin with the cached blocks %v", tc, tb[:3])
		}
		if got := waitFinished(t, e, "c").Tokens; !slices.Equal(got, wantC) {
			t.Fatalf("c generated %v from the cache, %v alone", got, wantC)
		}
		// Handed out again, a cached block leaves the cache.
		e.lock()
		all, _ := e.pool.allocate(e.pool.numFree(), "x")
		cached := len(e.pool.cache)
		e.pool.release(all, e.cursor+1)
		e.mu.Unlock()
		if cached != 0 {
			t.Fatalf("%d blocks still cached after every block was handed out", cached)
		}
	}
}

// An allocation may map an item's first blocks to an earlier item's (a
// migration's shared prefix): one set of blocks, freed when the last of
// the two lets it go. A reference the call cannot honour is refused and
// changes nothing.
func TestAllocateSharesAPrefix(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	s0, _ := e.Stats(ctx)
	for _, bad := range [][]hooks.AllocateItem{
		{{RequestID: "y", NumTokens: 40, SharedPrefix: &hooks.SharedPrefix{RequestID: "x", Blocks: 3}}, {RequestID: "x", NumTokens: 40}},
		{{RequestID: "x", NumTokens: 40}, {RequestID: "y", NumTokens: 40, SharedPrefix: &hooks.SharedPrefix{RequestID: "x", Blocks: 10}}},
		{{RequestID: "x", NumTokens: 8}, {RequestID: "y", NumTokens: 40, SharedPrefix: &hooks.SharedPrefix{RequestID: "x", Blocks: 3}}},
		{{RequestID: "x", NumTokens: 40, Recompute: true}, {RequestID: "y", NumTokens: 40, SharedPrefix: &hooks.SharedPrefix{RequestID: "x", Blocks: 3}}},
	} {
		_, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: bad})
		var se *Error
		if !errors.As(err, &se) || se.Status != http.StatusBadRequest {
			t.Fatalf("%+v: %v, want a 400", bad, err)
		}
		if s, _ := e.Stats(ctx); s.FreeBlocks != s0.FreeBlocks {
			t.Fatalf("a refused allocation took blocks: %d free of %d", s.FreeBlocks, s0.FreeBlocks)
		}
	}
	alloc, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{
		{RequestID: "x", NumTokens: 40},
		{RequestID: "y", NumTokens: 40, SharedPrefix: &hooks.SharedPrefix{RequestID: "x", Blocks: 3}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	x, y := alloc.Requests[0].BlockIDs, alloc.Requests[1].BlockIDs
	if len(x) != 10 || len(y) != 10 || !slices.Equal(x[:3], y[:3]) || slices.Contains(x, y[3]) {
		t.Fatalf("x %v y %v: want y to begin with x's first three blocks and hold seven of its own", x, y)
	}
	if alloc.FreeBlocks != s0.FreeBlocks-17 {
		t.Fatalf("%d free after allocating 17 blocks of %d", alloc.FreeBlocks, s0.FreeBlocks)
	}
	if _, err := e.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{"x"}}); err != nil {
		t.Fatal(err)
	}
	if s, _ := e.Stats(ctx); s.FreeBlocks != s0.FreeBlocks-10 {
		t.Fatalf("after x left: %d free, want y's 10 held", s.FreeBlocks)
	}
	if _, err := e.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{"y"}}); err != nil {
		t.Fatal(err)
	}
	if s, _ := e.Stats(ctx); s.FreeBlocks != s0.FreeBlocks {
		t.Fatalf("after both left: %d free of %d", s.FreeBlocks, s0.FreeBlocks)
	}
}
