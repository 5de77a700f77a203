package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/shm"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// dataPlane is the agent's side of KV transfer: its engine's regions mapped
// for reading (as a source) and writing (as a target), and the sessions it
// accepts KV for.
type dataPlane struct {
	mu       sync.Mutex
	src, dst *shm.Regions
	sessions map[string]*targetSession
	server   *tcpshm.Server
}

// targetSession is one migration this agent receives KV for: only from a
// source holding its secret, only into its reserved blocks, only until it
// expires.
type targetSession struct {
	secret  []byte
	expires time.Time
	layout  hooks.Layout // the engine's layout when the migration was prepared
	guard   *kvlayout.BlockGuard
}

// errNoKV: the engine has no KV memory now (it sleeps).
var errNoKV = errdefs.New(errdefs.ErrConflict, "the engine has no KV memory now (it sleeps: wake it first)")

// Hook forwards one hook call (the relayed routes of api/hooks). The JSON
// bodies pass through as bytes: the final round's export and install
// carry every moved request's tokens, and decoding and re-encoding them
// here would sit inside the downtime.
func (s *agentService) Hook(ctx context.Context, req *v1.HookRequest) (*v1.HookResponse, error) {
	route, ok := hooks.RouteOf(req.GetName())
	if !ok || !route.Relayed {
		return nil, errdefs.Newf(errdefs.ErrInvalidArgument, "unknown hook %q", req.GetName())
	}
	s.a.failAt(route.Name)
	out, err := s.a.eng.Hook(ctx, route, req.GetSince(), req.GetBody())
	if err != nil {
		return nil, err
	}
	return &v1.HookResponse{Body: out}, nil
}

// regions returns the engine's current layout and, for shared-memory KV,
// its regions mapped — re-mapped whenever the memory behind the layout is
// not what the mapping holds (the engine slept and woke, re-creating its
// KV under the same path). GPU KV is mapped through IPC per migration.
func (a *Agent) regions(ctx context.Context, writable bool) (*shm.Regions, hooks.Layout, error) {
	lay, err := a.eng.KVLayout(ctx)
	if err != nil {
		return nil, lay, err
	}
	return a.regionsOf(lay, writable)
}

// regionsOf is regions for a layout already read.
func (a *Agent) regionsOf(lay hooks.Layout, writable bool) (*shm.Regions, hooks.Layout, error) {
	if len(lay.Regions) == 0 {
		return nil, lay, errNoKV
	}
	if transfer.OnGPU(lay) {
		return nil, lay, nil
	}
	dp := &a.dp
	dp.mu.Lock()
	defer dp.mu.Unlock()
	cur := &dp.src
	if writable {
		cur = &dp.dst
	}
	if !(*cur).Same(lay) {
		(*cur).Close()
		r, err := shm.Map(lay, writable)
		if err != nil {
			*cur = nil
			return nil, lay, err
		}
		*cur = r
	}
	return *cur, lay, nil
}

// PrepareTarget implements the Agent service: map the engine's KV for
// writing, guard the migration's reserved blocks, and accept the
// migration's authenticated connections until its lease ends.
func (s *agentService) PrepareTarget(ctx context.Context, req *v1.PrepareTargetRequest) (*v1.PrepareTargetResponse, error) {
	a := s.a
	switch {
	case req.GetMigrationId() == "":
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "migration_id is required")
	case len(req.GetSecret()) < tcpshm.MinSecret:
		return nil, errdefs.Newf(errdefs.ErrInvalidArgument, "the migration's secret must be at least %d bytes", tcpshm.MinSecret)
	case req.GetLeaseMs() <= 0:
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "lease_ms must be positive")
	case a.dp.server == nil:
		return nil, errdefs.New(errdefs.ErrConflict, "this agent has no data plane")
	}
	_, lay, err := a.regions(ctx, true)
	if err != nil {
		return nil, errdefs.Newf(errdefs.ErrConflict, "map target KV: %v", err)
	}
	blocks := make([]int, len(req.GetBlockIds()))
	for i, b := range req.GetBlockIds() {
		blocks[i] = int(b)
	}
	sizes := make([]int64, len(lay.Regions))
	for i, r := range lay.Regions {
		sizes[i] = r.Size
	}
	g := lay.Geometry
	guard, err := kvlayout.NewBlockGuard(transfer.Specs(lay), sizes, g.NumBlocks, g.BlockSize, int64(g.HeadSlotBytes()), blocks)
	if err != nil {
		return nil, errdefs.Newf(errdefs.ErrConflict, "the target's layout: %v", err)
	}
	if transfer.OnGPU(lay) {
		// Map the target's GPU memory now, not inside the migration's
		// pause: tcp_shm rounds write through it, and the end-to-end check
		// reads it.
		if err := a.gpu.PrepareTarget(req.GetMigrationId(), lay); err != nil {
			return nil, errdefs.Newf(errdefs.ErrConflict, "map target GPU KV: %v", err)
		}
	}
	now := time.Now()
	a.dp.mu.Lock()
	for id, ts := range a.dp.sessions {
		if now.After(ts.expires) {
			delete(a.dp.sessions, id)
		}
	}
	a.dp.sessions[req.GetMigrationId()] = &targetSession{secret: append([]byte(nil), req.GetSecret()...),
		expires: now.Add(time.Duration(req.GetLeaseMs()) * time.Millisecond), layout: lay, guard: guard}
	a.dp.mu.Unlock()
	b, _ := json.Marshal(lay)
	return &v1.PrepareTargetResponse{Layout: b, DataAddress: a.dataAddr, Rdma: a.rdmaInfo()}, nil
}

// ReleaseTarget implements the Agent service.
func (s *agentService) ReleaseTarget(_ context.Context, req *v1.ReleaseTargetRequest) (*v1.ReleaseTargetResponse, error) {
	s.a.dp.mu.Lock()
	delete(s.a.dp.sessions, req.GetMigrationId())
	s.a.dp.mu.Unlock()
	s.a.gpu.Release(req.GetMigrationId())
	return &v1.ReleaseTargetResponse{}, nil
}

// dataSession resolves a data connection's session: its secret and
// expiry, and (once the peer proved it holds the secret) the memory it
// writes into, guarded to the migration's blocks.
func (a *Agent) dataSession(id string) (*tcpshm.Session, error) {
	a.dp.mu.Lock()
	ts := a.dp.sessions[id]
	a.dp.mu.Unlock()
	if ts == nil {
		return nil, fmt.Errorf("no migration %q is expected here", id)
	}
	open := func() (*tcpshm.Memory, error) {
		if transfer.OnGPU(ts.layout) {
			sink, err := a.gpu.Sink(id, ts.layout)
			if err != nil {
				return nil, err
			}
			return &tcpshm.Memory{Sink: sink, Guard: ts.guard}, nil
		}
		a.dp.mu.Lock()
		defer a.dp.mu.Unlock()
		if !a.dp.dst.Same(ts.layout) {
			// The engine re-created its KV since the migration was
			// prepared: the reserved blocks are gone with the old memory.
			return nil, fmt.Errorf("the target's KV memory changed since migration %s was prepared", id)
		}
		m := tcpshm.MemoryOf(a.dp.dst.Data, ts.layout)
		m.Guard = ts.guard
		return m, nil
	}
	return &tcpshm.Session{Secret: ts.secret, Expires: ts.expires, Open: open}, nil
}
