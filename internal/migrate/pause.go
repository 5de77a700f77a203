package migrate

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// pauseSource pauses the moving requests on the source at a step
// boundary (dropping any that finished meanwhile) and returns how long the
// engine waited for the step in flight.
//
// The engine pauses those it still runs and names the rest in the same
// boundary (IgnoreMissing). An engine that predates that refuses the
// whole call for one ended request: the ended ones are then listed and
// dropped and the pause sent again, a few times.
func (m *migration) pauseSource(ctx context.Context, since uint64) (wait time.Duration, err error) {
	ids := m.ids()
	for attempt := 0; len(ids) > 0; attempt++ {
		cctx, cancel := m.pausedCall(ctx)
		// The final round's inputs and the paused requests' export come
		// with the pause where the source's engine core serves it: the
		// final round then reads nothing itself, and the state move only
		// installs.
		p, err := m.srcA.Engine.Pause(cctx, hooks.PauseRequest{RequestIDs: ids, LeaseMS: int(m.o.cfg.PauseLease / time.Millisecond), IgnoreMissing: true,
			RoundSince: &since, Export: m.exportWithPause(ids), DropInFlight: m.pauseInFlight() == PauseInFlightDrop})
		err = m.slowPausedCall(ctx, cctx, err)
		cancel()
		if err == nil {
			m.pausedSrc = true
			m.pauseExported = p.Exported
			if p.DroppedInFlight > 0 {
				m.log.Debug("paused without waiting for the step in flight: its work for these requests was dropped",
					zap.Int("count", p.DroppedInFlight))
				m.mu.Lock()
				m.st.PauseDroppedInFlight = p.DroppedInFlight
				m.mu.Unlock()
			}
			if len(p.Missing) > 0 {
				// They ended on the source: their clients have every token.
				m.log.Debug("requests ended before the pause; not moved", zap.Int("count", len(p.Missing)))
				m.drop(p.Missing...)
			}
			return time.Duration(p.StepWaitS * float64(time.Second)), nil
		}
		if !errdefs.IsNotFound(err) || attempt > 3 {
			// A pause that timed out may have landed: rolling back resumes
			// whatever is paused.
			m.pausedSrc = true
			return 0, fmt.Errorf("pause the source: %w", err)
		}
		// Some request finished just now: drop it and pause the rest.
		if ids, err = m.liveOnSource(ctx, ids); err != nil {
			return 0, fmt.Errorf("pause the source: %w", err)
		}
	}
	return 0, nil
}

// liveOnSource drops from the migration the ids no longer running on the
// source and returns the rest.
func (m *migration) liveOnSource(ctx context.Context, ids []string) ([]string, error) {
	keep, gone, err := m.splitOnSource(ctx, ids, func(r hooks.RequestInfo) bool { return r.Status == hooks.StatusRunning })
	if err != nil {
		return nil, err
	}
	m.drop(gone...)
	return keep, nil
}

// splitOnSource lists the source's requests and splits ids into those
// there for which ok holds and the rest.
func (m *migration) splitOnSource(ctx context.Context, ids []string, ok func(hooks.RequestInfo) bool) (yes, no []string, err error) {
	cctx, cancel := m.call(ctx)
	defer cancel()
	list, err := m.srcA.Engine.Requests(cctx)
	if err != nil {
		return nil, nil, err
	}
	there := map[string]bool{}
	for _, r := range list.Requests {
		there[r.RequestID] = ok(r)
	}
	for _, id := range ids {
		if there[id] {
			yes = append(yes, id)
		} else {
			no = append(no, id)
		}
	}
	return yes, no, nil
}

// resumeLeftBehind resumes on the source the requests it paused that did
// not move and still run there (a copy round dropped them), so they do
// not wait out the pause lease.
func (m *migration) resumeLeftBehind(ctx context.Context, paused, moved []string) {
	done := map[string]bool{}
	for _, id := range moved {
		done[id] = true
	}
	var rest []string
	for _, id := range paused {
		if !done[id] {
			rest = append(rest, id)
		}
	}
	m.resumeOnSource(ctx, rest)
}

// resumeOnSource resumes those of ids still paused on the source (a client
// may have left meanwhile, and resume refuses unknown ids). What it cannot
// resume, the pause lease will.
func (m *migration) resumeOnSource(ctx context.Context, ids []string) {
	if len(ids) == 0 {
		return
	}
	resume, _, err := m.splitOnSource(ctx, ids, func(r hooks.RequestInfo) bool { return r.Paused })
	if err != nil {
		m.resumeSourceDirectly(ctx, ids, err)
		return
	}
	if len(resume) == 0 {
		return
	}
	cctx, cancel := m.call(ctx)
	defer cancel()
	if _, err := m.srcA.Engine.Resume(cctx, hooks.ResumeRequest{RequestIDs: resume}); err != nil {
		m.resumeSourceDirectly(ctx, resume, err)
	}
}

// resumeSourceDirectly resumes the source's paused requests through its
// engine's own resume hook, from the Host, when its agent failed to (it
// died inside the pause, say): the clients then wait for that failure,
// not for the engine's pause lease. The Host holds the credential the
// engine's hooks take (it reads the engines' streams with it too).
func (m *migration) resumeSourceDirectly(ctx context.Context, ids []string, agentErr error) {
	log := m.log.With(zap.Strings("request_ids", ids), zap.NamedError("agent_error", agentErr))
	c, err := m.o.direct(m.src.Engine.URL)
	if err == nil {
		defer c.Close()
		cctx, cancel := m.call(ctx)
		defer cancel()
		_, err = c.Resume(cctx, hooks.ResumeRequest{RequestIDs: ids})
	}
	if err != nil {
		log.Error("resuming the source failed through its agent and directly (its pause lease will resume the requests)", zap.Error(err))
		return
	}
	log.Warn("resumed the source's requests through its engine directly: its agent could not")
}

// exportWithPause is the export to ask of the pause for the moving
// requests ids: only when the target staged every one of them, so that
// the export is their tokens since the stage alone — one answer of whole
// states for hundreds of long requests could outgrow what one message
// carries (gRPC's 4 MiB between agent and Host), where the chunked
// exports each carry an eighth.
func (m *migration) exportWithPause(ids []string) *hooks.ExportRequest {
	from := m.stagedOutputs(ids)
	if len(ids) == 0 || len(from) != len(ids) {
		return nil
	}
	return &hooks.ExportRequest{OutputFrom: from}
}

// pauseInFlight is what the source's pause does with its engine's step in
// flight: the migration's own choice, else the Host's.
func (m *migration) pauseInFlight() string {
	if m.req.PauseInFlight != "" {
		return m.req.PauseInFlight
	}
	return m.o.cfg.PauseInFlight
}
