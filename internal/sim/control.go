package sim

import (
	"context"
	"fmt"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// PauseMode is vLLM's /pause mode.
type PauseMode string

// vLLM's pause modes.
const (
	PauseAbort PauseMode = "abort" // abort everything in flight, admit nothing new
	PauseWait  PauseMode = "wait"  // let in-flight requests finish, admit nothing new
	PauseKeep  PauseMode = "keep"  // freeze everything in place
)

// PauseGeneration is vLLM's POST /pause. New requests queue (they do not
// fail) until ResumeGeneration.
func (e *Engine) PauseGeneration(ctx context.Context, mode PauseMode) error {
	e.lock()
	switch mode {
	case PauseKeep:
		e.pausedAll = true
		e.mu.Unlock()
		return nil
	case PauseAbort:
		e.pausedNew = true
		e.abortAllLocked()
		e.mu.Unlock()
		return nil
	case PauseWait:
		e.pausedNew = true
		e.mu.Unlock()
		return e.waitIdle(ctx, 0)
	}
	e.mu.Unlock()
	return badRequest("mode", "Invalid pause mode: %s", mode)
}

// ResumeGeneration is vLLM's POST /resume.
func (e *Engine) ResumeGeneration() {
	e.lock()
	e.pausedAll, e.pausedNew = false, false
	e.mu.Unlock()
	e.signal()
}

// IsPaused is vLLM's GET /is_paused.
func (e *Engine) IsPaused() bool {
	e.lock()
	defer e.mu.Unlock()
	return e.pausedAll || e.pausedNew
}

func (e *Engine) abortAllLocked() {
	now := time.Now()
	for _, r := range append(append([]*request(nil), e.running...), e.waiting...) {
		e.finish(r, "abort", nil, now)
	}
	e.cursor++
}

// waitIdle waits until no request is running (and, with includeWaiting,
// none waits), up to timeout (0: until ctx ends).
func (e *Engine) waitIdle(ctx context.Context, timeout time.Duration) error {
	var deadline <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		deadline = t.C
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		e.lock()
		idle := len(e.running) == 0 && (e.pausedNew || len(e.waiting) == 0)
		e.mu.Unlock()
		if idle {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return context.DeadlineExceeded
		case <-tick.C:
		}
	}
}

// Retire implements hooks.Engine: once no request is running or waiting —
// they arrived before the Host moved the model's traffic away and finish
// here — the KV is released (as Sleep does). New requests are admitted
// meanwhile (a client may still talk to the engine directly); when the
// engine is not idle within WaitS, nothing is released and the answer
// says why.
func (e *Engine) Retire(ctx context.Context, req hooks.RetireRequest) (hooks.RetireResponse, error) {
	if req.WaitS < 0 {
		return hooks.RetireResponse{}, badRequest("wait_s", "wait_s must not be negative")
	}
	deadline := time.Now().Add(time.Duration(req.WaitS * float64(time.Second)))
	for {
		e.lock()
		if e.sleeping {
			e.mu.Unlock()
			return hooks.RetireResponse{Released: true, Note: "the engine was already sleeping"}, nil
		}
		reserved := false
		for _, r := range e.requests {
			reserved = reserved || r.state == stateReserved
		}
		if len(e.running) == 0 && len(e.waiting) == 0 && !reserved {
			var size int64
			for _, r := range e.kv.regions {
				size += r.layout.Size()
			}
			e.releaseLocked(1)
			e.mu.Unlock()
			return hooks.RetireResponse{Released: true, ReleasedBytes: size}, nil
		}
		busy := len(e.running) + len(e.waiting)
		e.mu.Unlock()
		if time.Now().After(deadline) {
			return hooks.RetireResponse{Note: fmt.Sprintf("%d requests still on the engine after %.0f s: the KV stays allocated", busy, req.WaitS)}, nil
		}
		select {
		case <-ctx.Done():
			return hooks.RetireResponse{}, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Wake implements hooks.Engine.
func (e *Engine) Wake(ctx context.Context) (hooks.WakeResponse, error) {
	if !e.IsSleeping() {
		return hooks.WakeResponse{Note: "the engine was awake"}, nil
	}
	return hooks.WakeResponse{}, e.WakeUp(ctx)
}

// Scaling reports whether an elastic-EP scale is under way.
// The HTTP middleware asks on every request: it must not wait for a step
// (which holds mu), or every hook call would.
func (e *Engine) Scaling() bool {
	return e.scaling.Load()
}
