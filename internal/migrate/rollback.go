package migrate

import (
	"context"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// fail ends the migration before the target committed: roll back. The
// source resumes first (its clients are waiting); the migration is then
// reported aborted, and the target's side is cleaned up last — bounded,
// since a stalled target agent must not hold the report, and with the
// target still marked busy, so that no new migration to it starts while
// its old reservations are being dropped.
func (m *migration) fail(err error) {
	m.log.Warn("migration aborted; rolling back", zap.Error(err))
	m.step(stepRollback)
	m.rollbackSource()
	m.finish(hostapi.StateAborted, err.Error())
	m.closeTarget()
}

// rollback undoes everything (a refusal after prepare began).
func (m *migration) rollback(context.Context) {
	m.rollbackSource()
	m.rollbackTarget()
}

// rollbackSource resumes the source's paused requests and closes the
// source agent's mappings of the migration.
func (m *migration) rollbackSource() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*m.o.cfg.RPCTimeout)
	defer cancel()
	if m.pausedSrc {
		m.resumeOnSource(ctx, m.ids())
		m.pausedSrc = false
	}
	if m.srcA != nil {
		// The source agent keeps its cuda_ipc mappings across rounds.
		rctx, rcancel := m.call(ctx)
		_, _ = m.srcA.ReleaseTarget(rctx, &v1.ReleaseTargetRequest{MigrationId: m.st.ID})
		rcancel()
	}
}

// rollbackTarget frees what the target still holds for the migration
// (reservations, uncommitted installs) and ends its data-plane session.
// What it cannot reach, the target's reservation lease frees.
func (m *migration) rollbackTarget() {
	if m.dstA == nil {
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
		if _, err := hook[hooks.AbortResponse](actx, m.dstA, "abort", hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true}, 0); err != nil {
			m.log.Error("rollback: releasing the target's blocks failed (its reservation lease will)", zap.Error(err))
		}
		acancel()
	}
	rctx, rcancel := m.call(ctx)
	_, _ = m.dstA.ReleaseTarget(rctx, &v1.ReleaseTargetRequest{MigrationId: m.st.ID})
	rcancel()
}

// closeTarget cleans the target's side up and frees the target instance.
func (m *migration) closeTarget() {
	m.rollbackTarget()
	m.o.release(m.dst.ID)
}

// finish records the end and frees the source instance.
func (m *migration) finish(state, errMsg string) {
	m.mu.Lock()
	now := time.Now().UTC()
	m.endStepLocked(now)
	m.st.State, m.st.Error, m.st.FinishedAt = state, errMsg, now
	m.st.CurrentStep = "done"
	st := m.st
	m.mu.Unlock()
	m.o.met.ended(st)
	m.o.rec.save(st.ID)
	m.o.release(m.src.ID)
	m.log.Info("migration finished", zap.String("state", state), zap.String("error", errMsg))
}
