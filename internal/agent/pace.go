package agent

import (
	"context"
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
