package migrate

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// applyRoles flips the roles as the migration type says, right after the
// commit, while the streams switch (a Host that dies from here on restarts
// with them).
func (m *migration) applyRoles() {
	reg := m.o.reg
	switch m.req.Type {
	case hostapi.DestroySource:
		_ = reg.SetRole(m.dst.ID, registry.RoleActive)
		_ = reg.SetRole(m.src.ID, registry.RoleStandby)
		_, _ = reg.SetRetired(m.src.ID, true)
		m.setNewActive(m.dst.ID)
	case hostapi.PreserveSource:
		_ = reg.SetRole(m.dst.ID, registry.RoleActive)
		_ = reg.SetRole(m.src.ID, registry.RoleStandby)
		m.setNewActive(m.dst.ID)
	case hostapi.KeepSourceActive:
		m.setNewActive(m.src.ID)
	}
}

// applyType does what the migration type asks of the source: a
// destroy_source source releases its KV once the requests left on it
// finish — in the background, and the status says what came of it.
func (m *migration) applyType() {
	if m.req.Type != hostapi.DestroySource {
		m.setSourceKV(hostapi.SourceKVKept, "")
		return
	}
	m.setSourceKV(hostapi.SourceKVReleasing, "")
	o := m.o
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		m.setSourceKV(o.Retire(o.ctx, m.src))
	}()
}

// Retire asks an instance's engine to release its KV once the
// requests left on it finish (at most RetireWait), and says what came of
// it: a source_kv state and its note.
func (o *Orchestrator) Retire(ctx context.Context, inst registry.Instance) (state, note string) {
	a, err := o.agents.Get(inst.AgentAddress, inst.TLS)
	if err != nil {
		return hostapi.SourceKVNotReleased, "reaching its agent failed: " + err.Error()
	}
	ctx, cancel := context.WithTimeout(ctx, o.cfg.RetireWait+time.Minute)
	defer cancel()
	resp, err := a.Engine.Retire(ctx, hooks.RetireRequest{WaitS: o.cfg.RetireWait.Seconds()})
	switch {
	case err != nil && o.ctx.Err() != nil:
		return hostapi.SourceKVNotReleased, "the Host stopped before the source's remaining requests finished"
	case err != nil:
		return hostapi.SourceKVNotReleased, "retiring the source failed: " + err.Error()
	case resp.Released:
		return hostapi.SourceKVReleased, resp.Note
	}
	return hostapi.SourceKVNotReleased, resp.Note
}

func (m *migration) setSourceKV(state, note string) {
	m.mu.Lock()
	m.st.SourceKV, m.st.SourceKVNote = state, note
	m.mu.Unlock()
	m.o.rec.save(m.st.ID)
	if state == hostapi.SourceKVNotReleased {
		m.log.Warn("the source kept its KV", zap.String("note", note))
	}
}

func (m *migration) setNewActive(id string) {
	m.mu.Lock()
	m.st.NewActiveInstance = id
	m.mu.Unlock()
}
