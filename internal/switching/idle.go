package switching

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// sleepIdle puts to sleep, on g's goroutine between switches, an awake
// model of g whose ttl passed with no request using it (no lease, none
// queued, not pinned by a prewarm, past its minimum awake time), and
// sets the group's idle timer for the next model that may become so.
// While it sleeps the group counts as switching: a request that comes
// meanwhile queues and wakes the model again after.
func (s *Switcher) sleepIdle(ctx context.Context, g *group) {
	s.mu.Lock()
	now := time.Now()
	var due *model
	var next time.Time
	for _, m := range g.members {
		ttl := m.cfg().ttl()
		if ttl <= 0 || m.state != StateAwake || len(m.leases) > 0 || m.queued > 0 || g.switching != nil {
			continue
		}
		at := m.lastUsed
		if m.awakeSince.After(at) {
			at = m.awakeSince
		}
		at = at.Add(ttl)
		if h := m.awakeSince.Add(s.ctl().minAwake()); h.After(at) {
			at = h
		}
		if m.pinnedUntil.After(at) {
			at = m.pinnedUntil
		}
		if !at.After(now) && due == nil {
			due = m
			continue
		}
		if next.IsZero() || at.Before(next) {
			next = at
		}
	}
	if g.idle != nil {
		g.idle.Stop()
		g.idle = nil
	}
	if !next.IsZero() {
		g.idle = time.AfterFunc(time.Until(next), g.kickNow)
	}
	if due == nil {
		s.mu.Unlock()
		return
	}
	g.switching = due // no lease is granted on it from here
	s.notifyLocked()
	s.mu.Unlock()

	rep := &SwitchReport{Model: due.alias, From: due.alias, StartedAt: time.Now()}
	sctx, cancel := context.WithTimeout(ctx, s.ctl().switchTimeout())
	err := s.putToSleep(sctx, due, rep)
	cancel()
	if err != nil {
		s.setState(due, StateError, err)
	}
	s.log.Info("idle sleep", zap.String("model", due.alias), zap.Duration("ttl", due.cfg().ttl()),
		zap.Duration("took", time.Since(rep.StartedAt)), zap.Error(err))
	s.mu.Lock()
	g.switching = nil
	s.notifyLocked()
	s.mu.Unlock()
	g.kickNow() // requests that queued meanwhile, and the next idle model
}
