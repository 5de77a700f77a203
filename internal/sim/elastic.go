package sim

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
)

// Elastic EP as vLLM 0.32 runs it (AsyncLLM._scale_elastic_ep): POST
// /scale_elastic_ep first prepares the target topology while the engine
// keeps serving, then sets the scaling flag — every HTTP request is
// answered 503 — and commits: in-flight requests stop advancing (or, with
// VLLM_ELASTIC_EP_DRAIN_REQUESTS, finish first), the new size takes
// effect, the flag clears. What runs where follows the seed's table:
//
//	                                 blocking   async     async_graph_reuse
//	start workers, comm, weights     commit     prepare   prepare
//	warm-up and graph capture        commit     commit    prepare (joining ranks only)
//	activate the topology            commit     commit    commit
const (
	ElasticBlocking        = "blocking"
	ElasticAsync           = "async"
	ElasticAsyncGraphReuse = "async_graph_reuse"
)

// ErrScaleDrainTimeout reports that in-flight requests did not drain.
var ErrScaleDrainTimeout = errors.New("scale failed due to request drain timeout")

// phases are a reconfiguration's prepare (serving) and commit (503, paused)
// durations in the engine's mode.
func (e *Engine) phases() (prepare, commit time.Duration) {
	c := e.cfg
	switch c.ElasticMode {
	case ElasticBlocking:
		return 0, c.ElasticPrepareTime + c.ElasticGraphTime + c.ElasticActivateTime
	case ElasticAsyncGraphReuse:
		return c.ElasticPrepareTime + c.ElasticGraphTime, c.ElasticActivateTime
	default:
		return c.ElasticPrepareTime, c.ElasticGraphTime + c.ElasticActivateTime
	}
}

// ScaleElasticEP is vLLM's POST /scale_elastic_ep.
func (e *Engine) ScaleElasticEP(ctx context.Context, newDP int, drain time.Duration) error {
	if !e.cfg.ElasticEP {
		return badRequest("new_data_parallel_size", "Elastic EP is not enabled: start the engine with --enable-elastic-ep")
	}
	if !e.scaleMu.TryLock() {
		return conflict("A scale operation is already in progress.")
	}
	defer e.scaleMu.Unlock()
	e.lock()
	old := e.dpSize
	e.mu.Unlock()
	if newDP == old {
		return nil // vLLM: "Data parallel size is already N, skipping scale"
	}
	prepare, commit := e.phases()
	t0 := time.Now()
	if err := waitFor(ctx, prepare); err != nil {
		return err
	}
	e.lock()
	e.scaling.Store(true)
	e.pausedNew = true
	e.mu.Unlock()
	defer func() {
		e.lock()
		e.scaling.Store(false)
		e.pausedNew, e.elasticPaused = false, false
		e.mu.Unlock()
		e.signal()
	}()
	if e.cfg.ElasticDrain {
		if err := e.waitIdle(ctx, drain); err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				return ErrScaleDrainTimeout
			}
			return err
		}
	}
	e.lock()
	e.elasticPaused = true
	e.mu.Unlock()
	tc := time.Now()
	if err := waitFor(ctx, commit); err != nil {
		return err
	}
	e.lock()
	e.dpSize = newDP
	e.lastScale = [2]time.Duration{tc.Sub(t0), time.Since(tc)}
	e.mu.Unlock()
	e.log.Info("elastic EP scaled", zap.Int("from", old), zap.Int("to", newDP), zap.String("mode", e.cfg.ElasticMode),
		zap.Duration("prepare", tc.Sub(t0)), zap.Duration("commit", time.Since(tc)))
	return nil
}

// LastScale is the last scale's prepare and commit as the engine ran them
// (what a benchmark compares the Host's view with).
func (e *Engine) LastScale() (prepare, commit time.Duration) {
	e.lock()
	defer e.mu.Unlock()
	return e.lastScale[0], e.lastScale[1]
}

// DataParallelSize is the current DP size.
func (e *Engine) DataParallelSize() int {
	e.lock()
	defer e.mu.Unlock()
	return e.dpSize
}
