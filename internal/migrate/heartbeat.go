package migrate

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// The target's heartbeat. A target engine or agent that stops answering
// (a frozen process, a dead agent, a partition) mid-migration would be
// noticed only when the next call to it timed out — a copy round or a
// check can wait on it for the whole migration's deadline (47.7 s in
// issue 44's run, both instances `migrating` meanwhile). So while a
// migration runs, the Host asks the target's engine, through its agent,
// for its stats (answered without a step boundary by a vLLM with the
// core channel, and by the sim) every so often; when none answered for
// the heartbeat timeout — a shorter one while the source is paused, as
// its clients wait — the migration's context ends with errTargetSilent
// as its cause and the migration rolls back. It stops at the commit:
// from there the target owns the requests.

// Migration phases the heartbeat reads.
const (
	phaseCopying    int32 = iota // before the pause
	phasePaused                  // the source paused, before the commit
	phaseCommitting              // the commit was sent: no rollback
)

// errTargetSilent is the cause a heartbeat ends a migration with.
type errTargetSilent struct {
	silent  time.Duration
	limit   time.Duration
	flag    string
	lastErr error
}

func (e *errTargetSilent) Error() string {
	msg := fmt.Sprintf("the target did not answer its heartbeat for %v (%s, %v)", e.silent.Round(time.Millisecond), e.flag, e.limit)
	if e.lastErr != nil {
		msg += ": " + e.lastErr.Error()
	}
	return msg
}

// heartbeatLimit is how long the target may not answer in phase p.
func (m *migration) heartbeatLimit(p int32) (time.Duration, string) {
	if p == phasePaused {
		return m.o.cfg.PauseHeartbeatTimeout, "--migration-pause-heartbeat-timeout"
	}
	return m.o.cfg.HeartbeatTimeout, "--migration-heartbeat-timeout"
}

// watchTarget beats against the target until ctx ends, and ends the
// migration through cancel when the target stays silent past the limit
// of the phase the migration is in.
func (m *migration) watchTarget(ctx context.Context, cancel context.CancelCauseFunc) {
	var lastOK atomic.Int64 // unix nanoseconds of the last answer
	var lastErr atomic.Pointer[error]
	lastOK.Store(time.Now().UnixNano())
	// The beats run apart from the check, so that a beat stuck on a
	// frozen engine does not hold the check past a shorter limit.
	go func() {
		for ctx.Err() == nil {
			bctx, bcancel := context.WithTimeout(ctx, m.o.cfg.HeartbeatTimeout)
			_, err := m.dstA.Engine.Stats(bctx)
			bcancel()
			if err == nil {
				lastOK.Store(time.Now().UnixNano())
			} else if ctx.Err() == nil {
				lastErr.Store(&err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(m.beatEvery()):
			}
		}
	}()
	tick := time.NewTicker(m.beatEvery() / 2)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		p := m.phase.Load()
		if p == phaseCommitting {
			return
		}
		limit, flag := m.heartbeatLimit(p)
		if silent := time.Since(time.Unix(0, lastOK.Load())); silent > limit {
			e := &errTargetSilent{silent: silent, limit: limit, flag: flag}
			if le := lastErr.Load(); le != nil {
				e.lastErr = *le
			}
			cancel(e)
			return
		}
	}
}

// beatEvery is how often the heartbeat asks: a few times within the
// shorter limit.
func (m *migration) beatEvery() time.Duration {
	return max(10*time.Millisecond, min(m.o.cfg.PauseHeartbeatTimeout, m.o.cfg.HeartbeatTimeout)/5)
}

// targetSilence returns the heartbeat's cause when it ended ctx.
func targetSilence(ctx context.Context) error {
	var e *errTargetSilent
	if c := context.Cause(ctx); errors.As(c, &e) {
		return e
	}
	return nil
}
