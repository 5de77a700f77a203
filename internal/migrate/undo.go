package migrate

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// abort ends the migration before the target committed: roll back. The
// source resumes first (its clients are waiting); the migration is then
// reported aborted, and the target's side is cleaned up last — bounded,
// since a stalled target agent must not hold the report, and with the
// target still claimed, so that no new migration to it starts while its
// old reservations are being dropped.
func (m *migration) abort(err error) {
	m.log.Warn("migration aborted; rolling back", zap.Error(err))
	m.o.met.integrity(err)
	m.step(stepRollback)
	m.undoSource()
	m.finish(hostapi.StateAborted, err.Error())
	m.closeTarget()
	if m.launched != nil {
		// Started for this migration only: the rollback stops it.
		m.launched.Stop(launchStopGrace)
	}
}

// undo undoes everything (a refusal after prepare began).
func (m *migration) undo() {
	m.undoSource()
	m.undoTarget()
}

// undoSource resumes the source's paused requests and closes the source
// agent's mappings of the migration.
func (m *migration) undoSource() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*m.o.cfg.RPCTimeout)
	defer cancel()
	// The held streams go on from the source: what it sent before the
	// pause first, then what it makes once resumed.
	m.releaseHolds()
	if m.pausedSrc {
		m.resumeOnSource(ctx, m.ids())
		m.pausedSrc = false
	}
	if m.srcA.RPC != nil {
		// The source agent keeps its cuda_ipc mappings across rounds.
		rctx, rcancel := m.call(ctx)
		_, _ = m.srcA.RPC.ReleaseTarget(rctx, &v1.ReleaseTargetRequest{MigrationId: m.st.ID})
		rcancel()
	}
}

// undoTarget frees what the target still holds for the migration
// (reservations, uncommitted installs) and ends its data-plane session.
// What it cannot reach, the target's reservation lease frees.
func (m *migration) undoTarget() {
	if m.dstA.RPC == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*m.o.cfg.RPCTimeout)
	defer cancel()
	m.mu.Lock()
	var ids []string
	for id := range m.reserved {
		ids = append(ids, id)
	}
	m.reserved = map[string]bool{}
	m.mu.Unlock()
	if len(ids) > 0 {
		actx, acancel := m.call(ctx)
		if _, err := m.dstA.Engine.Abort(actx, hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true}); err != nil {
			// The target's agent died or restarted: release through the
			// engine itself, so its blocks do not wait for its lease.
			dctx, dcancel := m.call(ctx)
			n, derr := m.o.releaseDirectly(dctx, m.dst.Engine.URL, ids)
			dcancel()
			if derr != nil {
				m.log.Error("rollback: releasing the target's blocks failed through its agent and directly (its reservation lease will)",
					zap.NamedError("agent_error", err), zap.Error(derr))
			} else {
				m.log.Warn("rollback: released the target's reservations through its engine directly: its agent could not",
					zap.NamedError("agent_error", err), zap.Int("released", n))
			}
		}
		acancel()
	}
	rctx, rcancel := m.call(ctx)
	_, _ = m.dstA.RPC.ReleaseTarget(rctx, &v1.ReleaseTargetRequest{MigrationId: m.st.ID})
	rcancel()
}

// closeTarget cleans the target's side up and frees the target instance.
func (m *migration) closeTarget() {
	m.undoTarget()
	m.o.reg.Release(m.op, m.dst.ID)
}

// finish records the end and frees the source instance.
func (m *migration) finish(state, errMsg string) {
	m.mu.Lock()
	now := time.Now().UTC()
	m.endStepLocked(now)
	m.st.State, m.st.Error, m.st.FinishedAt = state, errMsg, now
	m.st.CurrentStep = string(stepDone)
	m.traceEnd(now)
	st := m.st
	m.mu.Unlock()
	if state != hostapi.StateSucceeded {
		m.dropPreAttach()
	}
	m.o.met.ended(st)
	m.o.rec.save(st.ID)
	m.o.reg.Release(m.op, m.src.ID)
	m.o.ends.Ended()
	m.log.Info("migration finished", zap.String("state", state), zap.String("error", errMsg))
}
