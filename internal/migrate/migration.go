package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/launch"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// migration is one migration's live state.
type migration struct {
	o *Orchestrator
	// launched is the target process the Host started for this migration
	// (nil when it named one): stopped if the migration aborts.
	launched *launch.Process
	op       registry.Operation // what holds both instances in the registry
	// preAttached are the streams opened on the target before the pause.
	preAttached []string
	// held are the streams whose relay holds their client where the
	// target's pre-attached stream opens (heldCut).
	held     []string
	req      hostapi.MigrateRequest
	filter   Filter
	src, dst registry.Instance
	srcA     agentclient.Agent
	dstA     agentclient.Agent
	log      *zap.Logger

	// secret authenticates the migration's data-plane connections; only
	// the two agents get it.
	secret []byte
	// deadline: the commit must happen before it (the target's block
	// reservation ends a margin later).
	deadline  time.Time
	srcLayout hooks.Layout
	dstLayout []byte
	dataAddr  string
	dstRDMA   *v1.RDMAInfo                 // the target agent's rdma data plane (nil: none)
	moving    map[string]*v1.RequestBlocks // by request id
	reserved  map[string]bool              // request ids holding a reservation on the target
	// recompute are moving requests whose KV the target could not hold:
	// their state moves, their KV does not (the target recomputes it).
	// They are in moving too, with no blocks.
	recompute map[string]bool
	// stableTokens: per request, the tokens before this index were
	// checked (or sampled) before the pause; the pause checks the rest.
	stableTokens map[string]int
	dstOpaque    bool // the target's blocks are opaque (see hooks.Layout)
	dstOnGPU     bool // the target's KV is GPU memory (the check hashes it there)
	noKVSum      bool // an agent answered a check in another scheme than kvsum64 (m.mu)
	dstStages    bool // the target prepares installs ahead (see hooks.Layout)
	// staged is, by request id, how many output tokens the target's stage
	// of the request holds (its latest stage that the target took): the
	// export in the pause then carries only the tokens after them.
	staged    map[string]int
	pausedSrc bool
	// pauseExported is the export of the paused requests the source's
	// pause answered with (hooks.PauseRequest.Export), for the state move
	// to install; nil when the engine did not serve it.
	pauseExported json.RawMessage
	// phase is where the migration is, for its heartbeat (heartbeat.go).
	phase atomic.Int32
	tr    spans // its trace (trace.go), under mu

	mu sync.Mutex
	st hostapi.MigrationStatus
}

func (m *migration) status() hostapi.MigrationStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.st
	s.StepHistory = append([]hostapi.Step(nil), s.StepHistory...)
	s.Rounds = append([]hostapi.Round(nil), s.Rounds...)
	s.Dropped = append([]string(nil), s.Dropped...)
	if s.Verification != nil {
		v := *s.Verification
		s.Verification = &v
	}
	return s
}

// drop takes requests out of the migration (they finished, their client
// left, or the engine preempted them): they stay where they are.
func (m *migration) drop(ids ...string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, id := range ids {
		if _, ok := m.moving[id]; ok {
			delete(m.moving, id)
			m.st.Dropped = append(m.st.Dropped, id)
		}
	}
}

// ids are the requests still moving, sorted.
func (m *migration) ids() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Sorted(maps.Keys(m.moving))
}

// call bounds one control call to an agent by the RPC timeout (and the
// caller's context).
func (m *migration) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, m.o.cfg.RPCTimeout)
}

// pausedCall bounds one control call made while the source is paused
// (Config.PauseCallTimeout).
func (m *migration) pausedCall(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, m.o.cfg.PauseCallTimeout)
}

// slowPausedCall turns the error of a call that pausedCall's bound cut
// (its parent still live) into one that says so.
func (m *migration) slowPausedCall(parent, call context.Context, err error) error {
	if err != nil && parent.Err() == nil && errors.Is(call.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w (no answer within the pause's call timeout, %v: --migration-pause-call-timeout)", err, m.o.cfg.PauseCallTimeout)
	}
	return err
}
