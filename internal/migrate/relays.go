package migrate

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"

	"github.com/vllm-hi/vllm-hi/internal/store"
)

// RemoteRelays are the other Hosts of a shared store: each relays its own
// clients' streams, some of them of requests a migration here moves.
type RemoteRelays interface {
	// Census asks which of the requests ids the other Hosts relay (a
	// migration moves relayed streams only), until ctx ends at most.
	Census(ctx context.Context, migration string, ids []string) map[string]store.RelayedStream
	// Switch tells them a migration committed, with the cut of each
	// moved request that no stream here relays, and returns how to wait
	// for their answers: which of those streams switched, which could
	// not (with why); a stream neither lists has no client on any Host.
	Switch(sw store.Switch) (wait func(context.Context) (switched map[string]bool, failed map[string]string))
}

// SetRelays makes migrations switch the streams other Hosts relay too.
func (o *Orchestrator) SetRelays(r RemoteRelays) {
	o.mu.Lock()
	o.relays = r
	o.mu.Unlock()
}

// switchRemote asks the other Hosts to switch the moved requests no
// stream here relays; nil when there are none or no other Host.
func (m *migration) switchRemote(remote []movedState) func(context.Context) (map[string]bool, map[string]string) {
	m.o.mu.Lock()
	relays := m.o.relays
	m.o.mu.Unlock()
	if relays == nil || len(remote) == 0 {
		return nil
	}
	sw := store.Switch{Migration: m.st.ID, Instance: m.dst.ID, EngineURL: m.dst.Engine.URL}
	for _, st := range remote {
		ss := store.SwitchedStream{ID: st.RequestID, From: st.outputs(), Text: st.visible, Cut: st.visible >= 0}
		if !ss.Cut {
			ss.Text = visibleText(st)
		}
		sw.Streams = append(sw.Streams, ss)
	}
	start := time.Now()
	wait := relays.Switch(sw)
	return func(ctx context.Context) (map[string]bool, map[string]string) {
		switched, failed := wait(ctx)
		m.log.Debug("the other Hosts switched their streams", zap.Int("asked", len(remote)), zap.Int("switched", len(switched)),
			zap.Int("failed", len(failed)), zap.Duration("took", time.Since(start)))
		return switched, failed
	}
}

// remoteCandidates are the requests of ids that other Hosts relay, as
// the filter reads them (none without other Hosts).
func (m *migration) remoteCandidates(ctx context.Context, ids []string, byID map[string]hooks.RequestInfo) []Candidate {
	m.o.mu.Lock()
	relays := m.o.relays
	m.o.mu.Unlock()
	if relays == nil || len(ids) == 0 {
		return nil
	}
	// A Host that does not answer (dead, its lease not yet ended) costs
	// the migration one short call's bound (PauseCallTimeout), not the
	// preparation's whole RPC timeout, which the reservation shares.
	ctx, cancel := context.WithTimeout(ctx, m.o.cfg.PauseCallTimeout)
	defer cancel()
	now := time.Now()
	var out []Candidate
	for id, s := range relays.Census(ctx, m.st.ID, ids) {
		if r, ok := byID[id]; ok {
			out = append(out, Candidate{RequestInfo: r, Model: s.Model, Tag: s.Tag, AgeS: now.Sub(s.Started).Seconds()})
		}
	}
	return out
}
