package agent

import (
	"context"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// Round 0 copies every moving request's KV while the source keeps
// decoding, and the copy competes with that decode — and, where they
// share the machine, with the relay and the clients — for the CPU: on two
// cores tcp_shm's memmoves took both of them for round 0, and the
// source's clients waited 76–94 ms between tokens (p99) against 14–18 ms
// before. Paced, the round goes in chunks of about share × the source's
// step time of copying, one per source step: after each chunk the copy
// waits for the source's next step, and a chunk during which the source's
// steps slowed by more than pacedSlowdown halves the next. The chunks are
// sized by time, so a fast data plane (GPU copy engines) moves as much
// per step as it copies in that time.
const (
	// pacedSlowdown is the source's step time during a chunk, against its
	// step time before the round, above which the next chunk halves.
	pacedSlowdown = 1.2
	// pacedFirstChunk and pacedMinChunk bound the chunks from below; the
	// first is small enough to cost one step little anywhere.
	pacedFirstChunk = 4 << 20
	pacedMinChunk   = 256 << 10
	// pacedBaseSteps and pacedBaseWait bound the measure of the source's
	// step time before the round.
	pacedBaseSteps = 3
	pacedBaseWait  = 500 * time.Millisecond
)

// pacedRound is what a paced round did.
type pacedRound struct {
	Stats  transfer.Stats
	Chunks int
	// BaseStep is the source's step time before the round; MaxStep the
	// slowest a chunk saw it (0: not measured).
	BaseStep, MaxStep time.Duration
}

// stepCount reads the source engine's step counter (hooks.Stats.Steps).
type stepCount func(ctx context.Context) (uint64, error)

// engineSteps is this agent's engine's step counter.
func (a *Agent) engineSteps(ctx context.Context) (uint64, error) {
	st, err := a.eng.Stats(ctx)
	return st.Steps, err
}

// sendPaced sends round r in chunks of about share × the source's step
// time, one per source step (see above). An engine that makes no steps
// (nothing to decode) or whose steps cannot be read gets the round at
// once.
func sendPaced(ctx context.Context, count stepCount, backend transfer.Backend, r transfer.Round, share float64) (pacedRound, error) {
	base, steps, ok := stepTime(ctx, count)
	if !ok || len(r.Copies) < 2 || share <= 0 {
		st, err := backend.Send(ctx, r)
		return pacedRound{Stats: st, Chunks: 1}, err
	}
	out := pacedRound{BaseStep: base}
	slotBytes := int64(r.Src.Geometry.BlockBytes()) / int64(max(1, r.Src.Geometry.BlockSize))
	budget, target := int64(pacedFirstChunk), time.Duration(share*float64(base))
	start := time.Now()
	for rest := r.Copies; len(rest) > 0; {
		n := chunkOf(rest, budget, slotBytes, r.Src.Geometry.BlockSize, r.SlotGranular)
		chunk := r
		chunk.Copies = rest[:n]
		rest = rest[n:]
		t0 := time.Now()
		st, err := backend.Send(ctx, chunk)
		if err != nil {
			return out, err
		}
		took := max(time.Since(t0), time.Microsecond)
		out.Stats.Runs += st.Runs
		out.Stats.Bytes += st.Bytes
		out.Chunks++
		now, err := count(ctx)
		if err != nil || now < steps {
			budget = 1 << 50 // the steps cannot be followed: the rest at once
			continue
		}
		made := now - steps
		steps = now
		out.MaxStep = max(out.MaxStep, took/time.Duration(max(made, 1)))
		// The next chunk takes about target: the data plane's speed now.
		budget = int64(float64(budget) * min(2, max(0.5, float64(target)/float64(took))))
		// The steps are counted whole: a chunk slowed the source when even
		// one step more than counted leaves them slower than
		// pacedSlowdown × base.
		if float64(took) > pacedSlowdown*float64(base)*float64(made+1) {
			budget /= 2
		}
		budget = min(max(budget, pacedMinChunk), 1<<50)
		if len(rest) > 0 {
			// One chunk per source step: its clients get a token between
			// any two chunks.
			if steps, err = nextStep(ctx, count, steps, 2*base); err != nil {
				return out, err
			}
		}
	}
	out.Stats.Duration = time.Since(start)
	return out, nil
}

// chunkOf is how many of copies make a chunk of about budget bytes (at
// least one copy).
func chunkOf(copies []kvlayout.BlockCopy, budget, slotBytes int64, blockSize int, slotGranular bool) int {
	n, bytes := 0, int64(0)
	for n < len(copies) && (n == 0 || bytes < budget) {
		slots := blockSize
		if slotGranular && copies[n].NumSlots > 0 {
			slots = copies[n].NumSlots
		}
		bytes += int64(slots) * slotBytes
		n++
	}
	return n
}

// stepTime measures the source's step time: from one step's end, the
// steps it makes within pacedBaseWait, at least pacedBaseSteps of them.
// ok is false when it made too few (idle, or steps too slow to pace by)
// or its stats cannot be read.
func stepTime(ctx context.Context, count stepCount) (step time.Duration, steps uint64, ok bool) {
	first, err := count(ctx)
	if err != nil {
		return 0, 0, false
	}
	deadline := time.Now().Add(pacedBaseWait)
	var from uint64
	var t0 time.Time
	for time.Now().Before(deadline) {
		if !sleep(ctx, time.Millisecond) {
			return 0, 0, false
		}
		now, err := count(ctx)
		if err != nil || now < first {
			return 0, 0, false
		}
		switch {
		case t0.IsZero() && now > first:
			from, t0 = now, time.Now() // a step just ended
		case !t0.IsZero() && now-from >= pacedBaseSteps:
			return time.Since(t0) / time.Duration(now-from), now, true
		}
	}
	return 0, 0, false
}

// nextStep waits until the source made a step past steps, at most
// within; it returns the step count then.
func nextStep(ctx context.Context, count stepCount, steps uint64, within time.Duration) (uint64, error) {
	deadline := time.Now().Add(within)
	for {
		now, err := count(ctx)
		if err != nil {
			return steps, nil // pacing is a courtesy: the copy goes on
		}
		if now > steps || time.Now().After(deadline) {
			return now, nil
		}
		// Each look is a call to the engine, which shares the machine.
		if !sleep(ctx, max(time.Millisecond, within/16)) {
			return steps, ctx.Err()
		}
	}
}

// stepPacer paces a round inside one send (transfer.Round.Pace, which
// tcp_shm honours frame by frame): each source step, the round may send
// about share × the step time of bytes; then its frames wait for the
// source's next step. The budget is the data plane's speed end to end,
// measured on a first chunk sent on its own (the sender alone cannot
// see it: the target still receives, checks and writes what the kernel
// took from the sender). The connections of a round take from it in
// turn.
type stepPacer struct {
	count  stepCount
	base   time.Duration // the source's step time before the round
	target time.Duration // a burst's time: share × base

	mu      sync.Mutex
	budget  int64  // bytes per source step
	used    int64  // sent since the step began
	steps   uint64 // the source's step count the budget is for
	burstAt time.Time
	out     pacedRound
}

// newStepPacer measures the source's step time and returns a pacer of
// share × that per step, or nil where the source makes no steps to pace
// by (its round goes at once).
func newStepPacer(ctx context.Context, count stepCount, share float64) *stepPacer {
	base, steps, ok := stepTime(ctx, count)
	if !ok || share <= 0 {
		return nil
	}
	return &stepPacer{count: count, base: base, target: time.Duration(share * float64(base)), budget: pacedMinChunk,
		steps: steps, out: pacedRound{BaseStep: base}}
}

// Take implements transfer.Pacer.
func (p *stepPacer) Take(ctx context.Context, n int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.used > 0 && p.used+n > p.budget {
		before := p.steps
		steps, err := nextStep(ctx, p.count, p.steps, 2*p.base)
		if err != nil {
			return err
		}
		waited := time.Since(p.burstAt)
		if steps > before {
			p.out.MaxStep = max(p.out.MaxStep, waited/time.Duration(steps-before))
		}
		p.steps, p.used = steps, 0
		p.out.Chunks++
	}
	if p.used == 0 {
		p.burstAt = time.Now()
	}
	p.used += n
	return nil
}

// sendStepPaced sends round r paced by a stepPacer of share of the
// source's step: a first chunk on its own, whose time end to end sets the
// budget per step, then the rest in one send that takes its frames'
// bytes from the pacer. Without a measurable source step it sends r whole.
func sendStepPaced(ctx context.Context, count stepCount, backend transfer.Backend, r transfer.Round, share float64) (pacedRound, error) {
	p := newStepPacer(ctx, count, share)
	if p == nil {
		st, err := backend.Send(ctx, r)
		return pacedRound{Stats: st, Chunks: 1}, err
	}
	slotBytes := int64(r.Src.Geometry.BlockBytes()) / int64(max(1, r.Src.Geometry.BlockSize))
	n := chunkOf(r.Copies, pacedFirstChunk, slotBytes, r.Src.Geometry.BlockSize, r.SlotGranular)
	first, rest := r, r
	first.Copies, rest.Copies = r.Copies[:n], r.Copies[n:]
	t0 := time.Now()
	st, err := backend.Send(ctx, first)
	if err != nil || len(rest.Copies) == 0 {
		return pacedRound{Stats: st, Chunks: 1, BaseStep: p.base}, err
	}
	rate := float64(st.Bytes) / max(time.Since(t0).Seconds(), 1e-6) // bytes per second
	p.budget = max(int64(rate*p.target.Seconds()), pacedMinChunk/4)
	steps, err := nextStep(ctx, p.count, p.steps, 2*p.base)
	if err != nil {
		return pacedRound{}, err
	}
	p.steps, p.out.Chunks = steps, 1
	rest.Pace = p
	st2, err := backend.Send(ctx, rest)
	st.Runs += st2.Runs
	st.Bytes += st2.Bytes
	return p.result(st), err
}

// result is what the pacer did: its bursts as the round's chunks.
func (p *stepPacer) result(st transfer.Stats) pacedRound {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.out
	out.Chunks++ // the last burst
	out.Stats = st
	return out
}
