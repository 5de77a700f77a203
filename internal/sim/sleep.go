package sim

import (
	"context"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
)

// The sleep mode, as vLLM's (--enable-sleep-mode): POST /sleep?level=1
// offloads the weights to host memory and discards the KV cache; level 2
// discards both. POST /wake_up brings back the parts its tags name
// (weights, kv_cache; none: both). After a level-2 sleep the woken
// weights hold nothing until they are reloaded (POST /collective_rpc
// {"method": "reload_weights"}): an engine that serves before that
// answers with wrong tokens, as vLLM does — the wake corruption a
// controller's probe must catch. The sim has no weights; what it models is
// the state, the times (--sleep-time, --wake-up-time, --weights-load-time)
// and that corruption.

// Wake-up tags.
const (
	TagWeights = "weights"
	TagKVCache = "kv_cache"
)

// Sleep is vLLM's POST /sleep. Mode abort aborts in-flight requests; wait
// lets them finish first; keep preempts them so they recompute after
// wake-up.
func (e *Engine) Sleep(ctx context.Context, level int, mode PauseMode) error {
	if !e.cfg.SleepMode {
		return badRequest("level", "Sleep mode is not enabled: start the engine with --enable-sleep-mode")
	}
	if level < 1 || level > 2 {
		return badRequest("level", "level must be 1 or 2, got %d", level)
	}
	switch mode {
	case PauseAbort, PauseKeep:
	case PauseWait:
		e.lock()
		e.pausedNew = true
		e.mu.Unlock()
		err := e.waitIdle(ctx, 0)
		e.lock()
		e.pausedNew = false
		e.mu.Unlock()
		if err != nil {
			return err
		}
	default:
		return badRequest("mode", "Invalid pause mode: %s", mode)
	}
	e.lock()
	if e.weightsAsleep {
		e.mu.Unlock()
		return nil
	}
	if mode == PauseKeep {
		for len(e.running) > 0 {
			e.preempt(e.running[len(e.running)-1])
		}
		e.cursor++
	} else {
		e.abortAllLocked()
	}
	if e.kv != nil {
		e.releaseLocked(level)
	}
	e.weightsAsleep, e.sleeping, e.sleepLevel = true, true, level
	e.mu.Unlock()
	// The weights' copy to host memory (level 1) or their release.
	return waitFor(ctx, e.cfg.SleepTime)
}

// releaseLocked drops reservations and releases the KV memory (e.mu held;
// nothing may be running). Level is what the metrics report.
func (e *Engine) releaseLocked(level int) {
	for _, r := range e.requests {
		if r.state == stateReserved {
			e.pool.release(r.blocks, e.cursor+1)
			delete(e.requests, r.id)
		}
	}
	e.cursor++
	if e.kv != nil {
		e.kv.close()
		e.kv = nil
	}
	e.sleeping, e.sleepLevel = true, max(level, e.sleepLevel, 1)
	e.log.Info("engine sleeping: KV cache released")
}

// WakeUp is vLLM's POST /wake_up: after the configured wake-up time the
// parts tags name (none: all) are back — the KV memory recreated, empty;
// the engine takes requests again once nothing is asleep (until then they
// are answered 503, as vLLM's sleep mode answers them).
func (e *Engine) WakeUp(ctx context.Context, tags ...string) error {
	for _, t := range tags {
		if t != TagWeights && t != TagKVCache {
			return badRequest("tags", "unknown wake-up tag %q (known: %s, %s)", t, TagWeights, TagKVCache)
		}
	}
	all := len(tags) == 0
	weights, kv := all || slices.Contains(tags, TagWeights), all || slices.Contains(tags, TagKVCache)
	e.lock()
	asleep := (weights && e.weightsAsleep) || (kv && e.kv == nil)
	e.mu.Unlock()
	if !asleep {
		return nil
	}
	if err := waitFor(ctx, e.cfg.WakeUpTime); err != nil {
		return err
	}
	e.lock()
	defer e.mu.Unlock()
	if weights && e.weightsAsleep {
		// Level 2 discarded them: the memory is back, its contents are not.
		e.weightsAsleep, e.weightsStale = false, e.sleepLevel == 2
	}
	if kv && e.kv == nil {
		mem, err := newKV(e.cfg, e.cuda, e.geo, e.par)
		if err != nil {
			return fmt.Errorf("wake up: %w", err)
		}
		e.kv = mem
		e.kvGen++
		e.pool = e.newPool()
	}
	if !e.weightsAsleep && e.kv != nil {
		e.sleeping, e.sleepLevel = false, 0
		e.signal()
		e.log.Info("engine awake", zap.Bool("weights_stale", e.weightsStale))
	}
	return nil
}

// ReloadWeights is vLLM's collective_rpc reload_weights: the weights are
// loaded again (after --weights-load-time), so a level-2 sleep's wake-up
// answers correctly.
func (e *Engine) ReloadWeights(ctx context.Context) error {
	e.lock()
	asleep := e.weightsAsleep
	e.mu.Unlock()
	if asleep {
		return conflict("The weights are asleep: wake them up (tags=weights) before reloading them.")
	}
	if err := waitFor(ctx, e.cfg.WeightsLoadTime); err != nil {
		return err
	}
	e.lock()
	e.weightsStale = false
	e.mu.Unlock()
	return nil
}

// IsSleeping is vLLM's GET /is_sleeping.
func (e *Engine) IsSleeping() bool {
	e.lock()
	defer e.mu.Unlock()
	return e.sleeping
}

// waitFor waits d, or less if ctx ends.
func waitFor(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
