package migrate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"math"
	"sort"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
)

// Step names, in order.
const (
	stepReserve     = "reserve"
	stepPrepare     = "prepare_target"
	stepRound0      = "round_0"
	stepIncremental = "incremental_rounds"
	stepPause       = "pause_source"
	stepCopyCheck   = "verify_copied"
	stepFinal       = "final_round"
	stepVerify      = "verify"
	stepCommit      = "install_target"
	stepSwitch      = "switch"
	stepApply       = "apply_type"
	stepRollback    = "rollback"
)

// migration is one migration's live state.
type migration struct {
	o        *Orchestrator
	req      hostapi.MigrateRequest
	filter   Filter
	src, dst registry.Instance
	srcA     v1.AgentClient
	dstA     v1.AgentClient
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
	moving    map[string]*v1.RequestBlocks // by request id
	reserved  map[string]bool              // request ids holding a reservation on the target
	// stableTokens: per request, the tokens before this index were
	// checked (or sampled) before the pause; the pause checks the rest.
	stableTokens map[string]int
	dstOpaque    bool // the target's blocks are opaque (see hooks.Layout)
	pausedSrc    bool

	mu sync.Mutex
	st hostapi.MigrationStatus
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "mig-" + hex.EncodeToString(b[:])
}

// Start validates a migrate request, reserves both instances, selects the
// requests and reserves their blocks on the target — all before answering,
// so that a bad request or a target that cannot hold the KV is refused
// with nothing started — and then runs the rest in the background.
func (o *Orchestrator) Start(req hostapi.MigrateRequest) (string, error) {
	id, err := o.start(req)
	if err != nil {
		o.met.Refused()
	}
	return id, err
}

// validate checks a request's own fields and fills in defaults.
func (o *Orchestrator) validate(req *hostapi.MigrateRequest) (Filter, error) {
	if req.Src == "" || req.Dst == "" {
		return nil, refuse(400, "src_vllm_hi_id and dst_vllm_hi_id are required")
	}
	if req.Src == req.Dst {
		return nil, refuse(400, "source and target are the same instance %s", req.Src)
	}
	if req.Type == "" {
		req.Type = hostapi.DestroySource
	}
	switch req.Type {
	case hostapi.DestroySource, hostapi.PreserveSource, hostapi.KeepSourceActive:
	default:
		return nil, refuse(400, "migration_type %q: want destroy_source, preserve_source or keep_source_active", req.Type)
	}
	switch req.FinalGranularity {
	case "", "slot", "block":
	default:
		return nil, refuse(400, "final_granularity %q: want slot or block", req.FinalGranularity)
	}
	switch req.InjectFault {
	case "":
	case "corrupt", "cut", "silent_corrupt", "crash_after_pause":
		if !o.cfg.AllowFaultInjection {
			return nil, refuse(400, "inject_fault is only accepted by a Host started with --allow-fault-injection")
		}
	default:
		return nil, refuse(400, "inject_fault %q: want corrupt, cut, silent_corrupt or crash_after_pause", req.InjectFault)
	}
	if req.TN < 0 || req.TN > 64 {
		return nil, refuse(400, "tn %d out of range 1..64", req.TN)
	}
	if req.TN == 0 {
		req.TN = o.cfg.DefaultTN
	}
	if u := req.TargetGPUMemUtil; u != nil && (math.IsNaN(*u) || *u <= 0 || *u > 1) {
		return nil, refuse(400, "target_gpu_memory_utilization %v: want a fraction in (0, 1]", *u)
	}
	for _, v := range []*int{req.TargetTP, req.TargetPP} {
		if v != nil && *v < 1 {
			return nil, refuse(400, "target_tp and target_pp must be ≥ 1")
		}
	}
	spec := req.RequestFilter
	if spec == "" {
		spec = o.cfg.DefaultFilter
	}
	filter, err := ParseFilter(spec)
	if err != nil {
		return nil, refuse(400, "%v", err)
	}
	return filter, nil
}

func (o *Orchestrator) start(req hostapi.MigrateRequest) (string, error) {
	filter, err := o.validate(&req)
	if err != nil {
		return "", err
	}
	src, err := o.reg.Get(req.Src)
	if err != nil {
		return "", refuse(404, "unknown source instance %s", req.Src)
	}
	dst, err := o.reg.Get(req.Dst)
	if err != nil {
		return "", refuse(404, "unknown target instance %s", req.Dst)
	}
	sg, dg := src.Engine.Geometry, dst.Engine.Geometry
	switch {
	case !src.Reachable || !dst.Reachable || !src.Stats.Healthy || !dst.Stats.Healthy:
		return "", refuse(409, "both instances must be reachable and healthy")
	case !src.Engine.Migratable || !dst.Engine.Migratable:
		return "", refuse(409, "both engines must serve the vllm-hi hooks (migratable); %s: %v, %s: %v", src.ID, src.Engine.Migratable, dst.ID, dst.Engine.Migratable)
	case src.Role != registry.RoleActive:
		return "", refuse(409, "source %s is %s, not active", src.ID, src.Role)
	case dst.Role != registry.RoleStandby:
		return "", refuse(409, "target %s is %s, not standby", dst.ID, dst.Role)
	case dst.Retired || dst.Stats.Sleeping:
		return "", refuse(409, "target %s is %s: wake it first (vhi wake %s)", dst.ID, dst.Lifecycle(), dst.ID)
	case !sameModels(src, dst):
		return "", refuse(409, "target %s does not serve the source's models %v", dst.ID, src.Engine.ServedModels)
	case req.TargetTP != nil && *req.TargetTP != dst.Engine.TP, req.TargetPP != nil && *req.TargetPP != dst.Engine.PP:
		return "", refuse(409, "target %s runs tp %d pp %d; start a target with the shape you ask for", dst.ID, dst.Engine.TP, dst.Engine.PP)
	case sg.Layers != dg.Layers || sg.KVHeads != dg.KVHeads || sg.HeadDim != dg.HeadDim || sg.DTypeBytes != dg.DTypeBytes || sg.BlockSize != dg.BlockSize:
		return "", refuse(409, "the KV geometries differ: %s has %d layers × %d KV heads × %d × %d B in blocks of %d, %s %d × %d × %d × %d B in blocks of %d",
			src.ID, sg.Layers, sg.KVHeads, sg.HeadDim, sg.DTypeBytes, sg.BlockSize, dst.ID, dg.Layers, dg.KVHeads, dg.HeadDim, dg.DTypeBytes, dg.BlockSize)
	}
	id := newID()
	if err := o.claim("migration "+id, src.ID, dst.ID); err != nil {
		return "", err
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	m := &migration{o: o, req: req, filter: filter, src: src, dst: dst, log: o.log.With(zap.String("migration_id", id)),
		secret: secret, moving: map[string]*v1.RequestBlocks{}, reserved: map[string]bool{}}
	now := time.Now().UTC()
	m.deadline = now.Add(o.cfg.ReservationLease - margin(o.cfg.ReservationLease))
	m.st = hostapi.MigrationStatus{ID: id, State: hostapi.StateRunning, Src: src.ID, Dst: dst.ID, Type: req.Type, RequestFilter: filter.String(),
		TN: req.TN, CreatedAt: now, Deadline: m.deadline, StepHistory: []hostapi.Step{}, Rounds: []hostapi.Round{}, Dropped: []string{}}
	if err := m.prepare(); err != nil {
		m.rollback(context.Background())
		o.release(src.ID, dst.ID)
		var re *Error
		if errors.As(err, &re) {
			return "", err
		}
		return "", refuse(409, "%v", err)
	}
	o.add(m)
	o.rec.save(id)
	o.wg.Add(2)
	go func() {
		defer o.wg.Done()
		m.run()
	}()
	go func() {
		// Connections to the target for the streams that will move, opened
		// while the copy rounds run.
		defer o.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		o.proxy.Warm(ctx, dst.Engine.URL, len(m.moving))
	}()
	return id, nil
}

func sameModels(a, b registry.Instance) bool {
	for _, m := range a.Engine.ServedModels {
		if !b.Serves(m) {
			return false
		}
	}
	return true
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

// step starts a named step, ending the previous one.
func (m *migration) step(name string) {
	m.mu.Lock()
	now := time.Now().UTC()
	m.endStepLocked(now)
	m.st.CurrentStep = name
	m.st.StepHistory = append(m.st.StepHistory, hostapi.Step{Step: name, StartedAt: now})
	m.mu.Unlock()
	m.o.rec.save(m.st.ID)
}

func (m *migration) endStepLocked(now time.Time) {
	if n := len(m.st.StepHistory); n > 0 && m.st.StepHistory[n-1].EndedAt.IsZero() {
		h := &m.st.StepHistory[n-1]
		h.EndedAt = now
		h.DurationS = now.Sub(h.StartedAt).Seconds()
	}
}

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

func (m *migration) ids() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.moving))
	for id := range m.moving {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// call bounds one control call to an agent by the RPC timeout (and the
// caller's context).
func (m *migration) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, m.o.cfg.RPCTimeout)
}

// prepare: select requests on the source, reserve blocks on the target
// for each request's whole remaining life, and ready the target's data
// plane to take exactly those blocks from a source holding the
// migration's secret.
func (m *migration) prepare() error {
	ctx, cancel := context.WithDeadline(context.Background(), m.deadline)
	defer cancel()
	m.step(stepReserve)
	var err error
	if m.srcA, err = m.o.agent(m.src); err != nil {
		return err
	}
	if m.dstA, err = m.o.agent(m.dst); err != nil {
		return err
	}
	cctx, ccancel := m.call(ctx)
	defer ccancel()
	if m.srcLayout, err = hook[hooks.Layout](cctx, m.srcA, "layout", nil, 0); err != nil {
		return fmt.Errorf("read the source's layout: %w", rpcError(err))
	}
	list, err := hook[hooks.RequestList](cctx, m.srcA, "requests", nil, 0)
	if err != nil {
		return fmt.Errorf("list the source's requests: %w", rpcError(err))
	}
	var candidates []hooks.RequestInfo
	for _, r := range list.Requests {
		// Only running streams this Host relays can be spliced; the rest
		// (non-streaming requests, clients talking to the engine directly,
		// waiting requests) finish where they are.
		if r.Status == hooks.StatusRunning && r.Stream && !r.Paused && m.o.streams.Get(r.RequestID) != nil {
			candidates = append(candidates, r)
		}
	}
	selected := m.filter.Select(candidates)
	g := m.dst.Engine.Geometry
	maxLen := g.BlockSize * (g.NumBlocks - 1)
	if m.dst.Engine.MaxModelLen > 0 {
		maxLen = m.dst.Engine.MaxModelLen
	}
	var items []hooks.AllocateItem
	for _, r := range selected {
		need := min(r.NumPromptTokens+max(r.MaxTokens, r.NumOutputTokens+1), maxLen)
		items = append(items, hooks.AllocateItem{RequestID: r.RequestID, NumTokens: max(need, r.NumPromptTokens+r.NumOutputTokens+1)})
	}
	var blocks []int32
	if len(items) > 0 {
		alloc, err := hook[hooks.AllocateResponse](cctx, m.dstA, "allocate", hooks.AllocateRequest{Requests: items, LeaseMS: int(m.o.cfg.ReservationLease / time.Millisecond)}, 0)
		if err != nil {
			if status.Code(err) == codes.ResourceExhausted {
				return refuse(409, "target %s cannot hold the KV of %d requests: %s", m.dst.ID, len(items), status.Convert(err).Message())
			}
			return fmt.Errorf("reserve blocks on the target: %w", rpcError(err))
		}
		for _, a := range alloc.Requests {
			m.reserved[a.RequestID] = true
			rb := &v1.RequestBlocks{RequestId: a.RequestID}
			for _, b := range a.BlockIDs {
				rb.DstBlockIds = append(rb.DstBlockIds, int32(b))
				blocks = append(blocks, int32(b))
			}
			m.moving[a.RequestID] = rb
		}
	}
	m.step(stepPrepare)
	// The target takes this migration's KV only until its reservation is
	// about to end: a stalled migration cannot write into blocks the
	// engine freed and handed to someone else.
	lease := time.Until(m.deadline)
	pt, err := m.dstA.PrepareTarget(cctx, &v1.PrepareTargetRequest{MigrationId: m.st.ID, Secret: m.secret, BlockIds: blocks,
		LeaseMs: lease.Milliseconds()})
	if err != nil {
		return fmt.Errorf("prepare the target: %w", rpcError(err))
	}
	m.dstLayout, m.dataAddr = pt.GetLayout(), pt.GetDataAddress()
	var dstLayout hooks.Layout
	if err := json.Unmarshal(m.dstLayout, &dstLayout); err != nil {
		return fmt.Errorf("the target's layout: %w", err)
	}
	m.dstOpaque = dstLayout.OpaqueBlocks
	if dstLayout.Geometry.BlockSize != m.srcLayout.Geometry.BlockSize {
		return refuse(409, "the engines' block sizes differ (%d, %d)", m.srcLayout.Geometry.BlockSize, dstLayout.Geometry.BlockSize)
	}
	m.mu.Lock()
	m.st.Requests = len(items)
	m.mu.Unlock()
	return nil
}

// rpcError is a gRPC error's message (what an operator needs to read).
func rpcError(err error) error {
	if s, ok := status.FromError(err); ok {
		if s.Code() == codes.DeadlineExceeded {
			return fmt.Errorf("timed out: %s", s.Message())
		}
		return errors.New(s.Message())
	}
	return err
}

// hook calls one engine hook through an agent.
func hook[T any](ctx context.Context, a v1.AgentClient, name string, body any, since uint64) (T, error) {
	var out T
	var b []byte
	if body != nil {
		b, _ = json.Marshal(body)
	}
	raw, err := hookRaw(ctx, a, name, b, since)
	if err != nil {
		return out, err
	}
	return out, json.Unmarshal(raw, &out)
}

// hookRaw calls an engine hook through its agent with a ready body and
// returns the answer's bytes.
func hookRaw(ctx context.Context, a v1.AgentClient, name string, body []byte, since uint64) ([]byte, error) {
	resp, err := a.Hook(ctx, &v1.HookRequest{Name: name, Body: body, Since: since})
	if err != nil {
		return nil, err
	}
	return resp.GetBody(), nil
}
