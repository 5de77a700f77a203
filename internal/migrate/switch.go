package migrate

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// switchOver runs after the commit: every moved stream switches to the
// target, the source's copies go, the migration type is applied, and the
// migration ends — failed if a stream could not switch (its client got an
// error event), succeeded otherwise.
func (m *migration) switchOver(c committed) {
	m.step(stepSwitch)
	// The roles flip (and are stored) while the relays switch: neither
	// waits for the other.
	roles := make(chan struct{})
	go func() {
		defer close(roles)
		m.applyRoles()
	}()
	spliced, failed, firstErr := m.switchStreams(c.states)
	m.releaseHolds() // the held streams that did not move (their clients left)
	<-roles
	m.step(stepApply)
	m.dropSourceCopies(c)
	m.applyType()
	m.measureClientGap(spliced, c.pauseCall)
	m.countPreAttached(spliced)
	// The target is freed before the end is recorded: a caller that sees
	// the migration ended may move the same streams on from the target at
	// once, and must not find it still claimed by this one.
	m.closeTarget()
	if len(failed) > 0 {
		m.finish(hostapi.StateFailed, fmt.Sprintf("the target runs the moved requests, but %d of %d streams could not switch to it (their clients got an error event): %v",
			len(failed), len(c.states), firstErr))
	} else {
		m.finish(hostapi.StateSucceeded, "")
	}
}

// dropSourceCopies aborts the moved requests on the source (a spliced
// stream already closed its source connection, which aborted some) and
// resumes the paused ones that did not move.
func (m *migration) dropSourceCopies(c committed) {
	ctx, cancel := context.WithTimeout(context.Background(), m.o.cfg.RPCTimeout)
	defer cancel()
	moved := c.moved()
	if len(moved) > 0 {
		if _, err := m.srcA.Engine.Abort(ctx, hooks.AbortRequest{RequestIDs: moved, Silent: true, IgnoreMissing: true}); err != nil {
			m.log.Warn("dropping the source's copies failed (their pause lease will resume them, and the Host's relay drops their tokens)", zap.Error(err))
		}
	}
	m.resumeLeftBehind(ctx, c.paused, moved)
	m.pausedSrc = false
}

// switchStreams splices each moved stream onto the target and waits (up
// to the splice timeout) for every one to switch. Requests nobody listens
// to any more are aborted on the target.
func (m *migration) switchStreams(states []movedState) (spliced []*proxy.Stream, failed []string, firstErr error) {
	var waits []<-chan error
	var orphans []string
	var remote []movedState
	for _, st := range states {
		if m.o.streams.Get(st.RequestID) == nil {
			remote = append(remote, st) // relayed by another Host, or its client left meanwhile
		}
	}
	// The other Hosts switch theirs meanwhile (a shared store's).
	remoteWait := m.switchRemote(remote)
	for _, st := range states {
		s := m.o.streams.Get(st.RequestID)
		if s == nil {
			if remoteWait == nil {
				orphans = append(orphans, st.RequestID) // the client left meanwhile
			}
			continue
		}
		spliced = append(spliced, s)
		if st.visible >= 0 {
			// The target derived the text: the relay cuts the source now
			// and the target sends what its client still lacked.
			waits = append(waits, s.Cut(m.dst.Engine.URL, m.dst.ID, st.outputs(), st.visible, st.armed))
		} else {
			waits = append(waits, s.Splice(m.dst.Engine.URL, m.dst.ID, st.outputs(), visibleText(st)))
		}
	}
	deadline := time.Now().Add(m.o.cfg.SpliceTimeout)
	timeout := time.After(m.o.cfg.SpliceTimeout)
wait:
	for i, w := range waits {
		select {
		case err := <-w:
			if err != nil {
				m.log.Warn("a stream could not move", zap.String("request_id", spliced[i].ID), zap.Error(err))
				failed = append(failed, spliced[i].ID)
				if firstErr == nil {
					firstErr = err
				}
			}
		case <-timeout:
			// Their clients read slowly: the relay switches each once it
			// has written everything the source produced.
			m.log.Warn("streams still moving at the splice timeout", zap.Int("streams", len(waits)-i))
			m.logStuckSplices(spliced[i:])
			break wait
		}
	}
	if remoteWait != nil {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		switched, remoteFailed := remoteWait(ctx)
		cancel()
		for _, st := range remote {
			switch err, bad := remoteFailed[st.RequestID]; {
			case bad:
				m.log.Warn("a stream another Host relays could not move", zap.String("request_id", st.RequestID), zap.String("error", err))
				failed = append(failed, st.RequestID)
				if firstErr == nil {
					firstErr = fmt.Errorf("another Host's stream %s: %s", st.RequestID, err)
				}
			case !switched[st.RequestID]:
				orphans = append(orphans, st.RequestID) // no Host relays it: its client left
			}
		}
	}
	// A stream that could not switch has no client on the target: its
	// request there only holds blocks.
	orphans = append(orphans, failed...)
	if len(orphans) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), m.o.cfg.RPCTimeout)
		_, _ = m.dstA.Engine.Abort(ctx, hooks.AbortRequest{RequestIDs: orphans, Silent: true, IgnoreMissing: true})
		cancel()
	}
	return spliced, failed, firstErr
}

// logStuckSplices says, for a few streams whose switch is still pending,
// how far the source's stream got against the cut it waits for.
func (m *migration) logStuckSplices(streams []*proxy.Stream) {
	logged := 0
	for _, s := range streams {
		tokens, text, wantTokens, wantText, ok := s.SpliceProgress()
		if !ok {
			continue
		}
		m.log.Warn("a stream's switch waits for its source", zap.String("request_id", s.ID),
			zap.Int("tokens_relayed", tokens), zap.Int("tokens_exported", wantTokens),
			zap.Int("text_relayed", text), zap.Int("text_at_cut", wantText))
		if logged++; logged == 4 {
			return
		}
	}
}

// measureClientGap records the longest gap a moved stream's client saw
// across the switch, from its last token from the source to its first
// event from the target.
func (m *migration) measureClientGap(spliced []*proxy.Stream, pauseStart time.Time) {
	deadline := time.Now().Add(2 * time.Second)
	var worst time.Duration
	for _, s := range spliced {
		for {
			last, first := s.SwitchGap()
			if last.IsZero() {
				last = pauseStart // no token from the source yet
			}
			if !first.IsZero() {
				worst = max(worst, first.Sub(last))
				break
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	m.mu.Lock()
	m.st.ClientDowntimeS = worst.Seconds()
	m.mu.Unlock()
}
