package agent

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// pacedEngine is a source engine that steps every step while no copy
// runs; a copy starves it (starve) or leaves it alone. It records the
// longest time it went without a step.
type pacedEngine struct {
	step    time.Duration
	starve  bool
	copying atomic.Bool
	steps   atomic.Uint64
	mu      sync.Mutex
	last    time.Time
	longest time.Duration
}

func (e *pacedEngine) run(ctx context.Context) {
	e.mu.Lock()
	e.last = time.Now()
	e.mu.Unlock()
	for ctx.Err() == nil {
		time.Sleep(e.step)
		if e.starve && e.copying.Load() {
			continue
		}
		e.steps.Add(1)
		e.mu.Lock()
		e.longest = max(e.longest, time.Since(e.last))
		e.last = time.Now()
		e.mu.Unlock()
	}
}

// longestWait is the longest the engine went without a step.
func (e *pacedEngine) longestWait() time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.longest
}

func (e *pacedEngine) count(context.Context) (uint64, error) { return e.steps.Load(), nil }

// pacedBackend copies at perMiB per MiB, keeping every copy it was sent.
type pacedBackend struct {
	e      *pacedEngine
	perMiB time.Duration
	sent   []kvlayout.BlockCopy
	sends  int
}

func (b *pacedBackend) Name() string { return "test" }

func (b *pacedBackend) Send(_ context.Context, r transfer.Round) (transfer.Stats, error) {
	bytes := int64(len(r.Copies)) * int64(r.Src.Geometry.BlockBytes())
	b.e.copying.Store(true)
	time.Sleep(time.Duration(bytes>>20) * b.perMiB)
	b.e.copying.Store(false)
	b.sent = append(b.sent, r.Copies...)
	b.sends++
	return transfer.Stats{Runs: len(r.Copies), Bytes: bytes}, nil
}

// pacedRoundOf is a round of n whole 1 MiB blocks.
func pacedRoundOf(n int) transfer.Round {
	g := hooks.Geometry{Layers: 4, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, BlockSize: 64, NumBlocks: n + 1}
	r := transfer.Round{Src: hooks.Layout{Geometry: g}, Dst: hooks.Layout{Geometry: g}}
	for i := range n {
		r.Copies = append(r.Copies, kvlayout.BlockCopy{Src: i + 1, Dst: i + 1, NumSlots: g.BlockSize})
	}
	return r
}

// A copy that starves the source (two busy cores): unpaced, the source
// makes no step for the whole round; paced at half a step per chunk, its
// longest wait is a small part of that, and every block still goes, once,
// in order. A large share grows the chunks to that many steps' worth of
// copying within a few.
func TestRound0PacedByTheSourcesSteps(t *testing.T) {
	const blocks, perMiB = 128, time.Millisecond // 128 MiB in 128 ms
	for _, tc := range []struct {
		name   string
		starve bool
		share  float64
	}{{"the copy starves the source", true, 0.5}, {"a large share of a step", false, 32}} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(paced bool) (*pacedEngine, *pacedBackend, pacedRound) {
				e := &pacedEngine{step: 2 * time.Millisecond, starve: tc.starve}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				go e.run(ctx)
				time.Sleep(20 * time.Millisecond)
				b := &pacedBackend{e: e, perMiB: perMiB}
				r := pacedRoundOf(blocks)
				if !paced {
					e.mu.Lock()
					e.longest = 0
					e.mu.Unlock()
					if _, err := b.Send(ctx, r); err != nil {
						t.Fatal(err)
					}
					time.Sleep(10 * time.Millisecond)
					return e, b, pacedRound{}
				}
				out, err := sendPaced(ctx, e.count, b, r, tc.share)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(b.sent, r.Copies) {
					t.Fatalf("sent %d copies, not the round's %d in order", len(b.sent), len(r.Copies))
				}
				if out.Stats.Bytes != int64(blocks)<<20 || out.Chunks != b.sends {
					t.Fatalf("%+v after %d sends", out, b.sends)
				}
				return e, b, out
			}
			e, b, out := run(true)
			if !tc.starve {
				// Chunks of 32 steps' time (64 MiB here): from 4 MiB,
				// doubling, 4+8+16+32+64 covers 128 MiB in 5–6.
				if b.sends > 8 {
					t.Fatalf("%d chunks for a share of 32 steps", b.sends)
				}
				return
			}
			u, _, _ := run(false)
			paced, unpaced := e.longestWait(), u.longestWait()
			t.Logf("longest wait for a step: paced %v (%d chunks, step %v before, slowest %v), unpaced %v",
				paced, out.Chunks, out.BaseStep, out.MaxStep, unpaced)
			if unpaced < 100*time.Millisecond {
				t.Fatalf("the unpaced copy starved the source only %v: the test does not test", unpaced)
			}
			if paced > unpaced/2 {
				t.Fatalf("paced, the source waited up to %v for a step; unpaced %v", paced, unpaced)
			}
		})
	}
}

// Inside one send the pacer lets a step's budget go at once and holds
// the next bytes until the source's next step.
func TestStepPacerHoldsBytesPastTheBudgetUntilTheNextStep(t *testing.T) {
	e := &pacedEngine{step: 5 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go e.run(ctx)
	p := newStepPacer(ctx, e.count, 0.5)
	if p == nil {
		t.Fatal("no pacer for an engine that steps")
	}
	p.budget = 100
	for round := 0; round < 3; round++ {
		at := e.steps.Load()
		for _, n := range []int64{60, 40} { // the budget: no wait
			if err := p.Take(ctx, n); err != nil {
				t.Fatal(err)
			}
		}
		if now := e.steps.Load(); now > at+1 {
			t.Fatalf("the budget's bytes waited for %d steps", now-at)
		}
		if err := p.Take(ctx, 1); err != nil { // one byte past it
			t.Fatal(err)
		}
		if e.steps.Load() == at {
			t.Fatal("bytes past the step's budget went before the source's next step")
		}
	}
	if r := p.result(transfer.Stats{Bytes: 303}); r.Chunks < 4 || r.BaseStep <= 0 {
		t.Fatalf("%+v", r)
	}
}
