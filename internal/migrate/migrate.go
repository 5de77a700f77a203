// Package migrate is the Host's migration orchestrator: reserve both
// instances, prepare the target, copy KV in a full round and incremental
// rounds while the source keeps decoding, then pause, copy the last delta
// and the scheduler state, install and resume on the target, splice every
// client stream onto it, and apply the migration type. Any failure before
// the target resumed aborts: the source resumes, the target frees what it
// reserved, and the client streams go on from the source.
package migrate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/grpcauth"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// Migration types.
const (
	DestroySource    = "destroy_source"
	PreserveSource   = "preserve_source"
	KeepSourceActive = "keep_source_active"
)

// Migration states.
const (
	StateRunning   = "running"
	StateSucceeded = "succeeded"
	StateAborted   = "aborted"
	StateFailed    = "failed"
)

// Request is the body of POST /vllm_hi/migrate.
type Request struct {
	Src              string   `json:"src_vllm_hi_id"`
	Dst              string   `json:"dst_vllm_hi_id"`
	TargetTP         *int     `json:"target_tp,omitempty"`
	TargetPP         *int     `json:"target_pp,omitempty"`
	TargetGPUMemUtil *float64 `json:"target_gpu_memory_utilization,omitempty"`
	Type             string   `json:"migration_type,omitempty"`
	TN               int      `json:"tn,omitempty"`
	RequestFilter    string   `json:"request_filter,omitempty"`
	FinalGranularity string   `json:"final_granularity,omitempty"` // "slot" (default) or "block"
	InjectFault      string   `json:"inject_fault,omitempty"`      // tests: "corrupt" or "cut" in the final round
}

// Step is one entry of a migration's step history.
type Step struct {
	Step      string    `json:"step"`
	StartedAt time.Time `json:"started_at"`
	EndedAt   time.Time `json:"ended_at,omitempty"`
	DurationS float64   `json:"duration_s"`
}

// Round is one copy round.
type Round struct {
	Round      int     `json:"round"`
	Kind       string  `json:"kind"` // full, incremental, final
	BlockCount int     `json:"block_count"`
	TokenSlots int     `json:"token_slots"`
	Bytes      int64   `json:"data_size_bytes"`
	DurationS  float64 `json:"duration_s"`
}

// Status is GET /vllm_hi/migration/{id}/status.
type Status struct {
	ID                string    `json:"migration_id"`
	State             string    `json:"state"`
	CurrentStep       string    `json:"current_step"`
	StepHistory       []Step    `json:"step_history"`
	Rounds            []Round   `json:"rounds"`
	DowntimeS         float64   `json:"downtime_s"`
	ClientDowntimeS   float64   `json:"client_downtime_s"`
	PauseWaitS        float64   `json:"pause_wait_s"`
	NewActiveInstance string    `json:"new_active_instance"`
	Error             string    `json:"error"`
	Src               string    `json:"src_vllm_hi_id"`
	Dst               string    `json:"dst_vllm_hi_id"`
	Type              string    `json:"migration_type"`
	RequestFilter     string    `json:"request_filter"`
	TN                int       `json:"tn"`
	Requests          int       `json:"request_count"`
	Migrated          int       `json:"migrated_request_count"`
	Dropped           []string  `json:"dropped_request_ids"`
	CreatedAt         time.Time `json:"created_at"`
	FinishedAt        time.Time `json:"finished_at,omitempty"`
}

// Config tunes the orchestrator (the seed's env vars).
type Config struct {
	MaxIncrRounds    int           // VLLM_HI_MAX_INCR_ROUNDS, default 8
	StallRounds      int           // VLLM_HI_INCR_STALL_ROUNDS, default 2
	DefaultFilter    string        // VLLM_HI_REQUEST_FILTER, default all
	DefaultTN        int           // data-plane connections, default 2
	PauseLease       time.Duration // how long the source stays paused without confirmation
	ReservationLease time.Duration // how long the target holds unclaimed blocks
	SpliceTimeout    time.Duration
	AgentToken       string
	// AllowFaultInjection accepts the inject_fault field (tests only).
	AllowFaultInjection bool
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{MaxIncrRounds: 8, StallRounds: 2, DefaultTN: 2, PauseLease: 10 * time.Second, ReservationLease: 60 * time.Second, SpliceTimeout: 5 * time.Second}
}

// Error is a refusal of a migrate request, with its HTTP status.
type Error struct {
	Status int
	Msg    string
}

func (e *Error) Error() string { return e.Msg }

func refuse(code int, format string, a ...any) error {
	return &Error{Status: code, Msg: fmt.Sprintf(format, a...)}
}

// Orchestrator runs migrations.
type Orchestrator struct {
	cfg     Config
	reg     *registry.Registry
	proxy   *proxy.Proxy
	streams *proxy.Streams
	met     *Metrics
	log     *zap.Logger

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
	all   map[string]*migration
	order []string
	busy  map[string]string // instance → migration id
	wg    sync.WaitGroup
}

// New returns an orchestrator; met may be nil.
func New(cfg Config, reg *registry.Registry, px *proxy.Proxy, met *Metrics, log *zap.Logger) *Orchestrator {
	return &Orchestrator{cfg: cfg, reg: reg, proxy: px, streams: px.Streams(), met: met, log: log,
		conns: map[string]*grpc.ClientConn{}, all: map[string]*migration{}, busy: map[string]string{}}
}

// Close waits for running migrations and closes agent connections.
func (o *Orchestrator) Close() {
	o.wg.Wait()
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, c := range o.conns {
		c.Close()
	}
}

func (o *Orchestrator) agent(addr string) (v1.AgentClient, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if c, ok := o.conns[addr]; ok {
		return v1.NewAgentClient(c), nil
	}
	c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(grpcauth.Token(o.cfg.AgentToken)))
	if err != nil {
		return nil, err
	}
	o.conns[addr] = c
	return v1.NewAgentClient(c), nil
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

// migration is one migration's live state.
type migration struct {
	o        *Orchestrator
	req      Request
	filter   Filter
	src, dst registry.Instance
	srcA     v1.AgentClient
	dstA     v1.AgentClient
	log      *zap.Logger

	dstLayout []byte
	dataAddr  string
	moving    map[string]*v1.RequestBlocks // by request id
	reserved  map[string]bool              // request ids holding a reservation on the target
	pausedSrc bool

	mu sync.Mutex
	st Status
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
func (o *Orchestrator) Start(req Request) (string, error) {
	id, err := o.start(req)
	if err != nil {
		o.met.refused()
	}
	return id, err
}

func (o *Orchestrator) start(req Request) (string, error) {
	if req.Src == "" || req.Dst == "" {
		return "", refuse(400, "src_vllm_hi_id and dst_vllm_hi_id are required")
	}
	if req.Src == req.Dst {
		return "", refuse(400, "source and target are the same instance %s", req.Src)
	}
	if req.Type == "" {
		req.Type = DestroySource
	}
	switch req.Type {
	case DestroySource, PreserveSource, KeepSourceActive:
	default:
		return "", refuse(400, "migration_type %q: want destroy_source, preserve_source or keep_source_active", req.Type)
	}
	switch req.FinalGranularity {
	case "", "slot", "block":
	default:
		return "", refuse(400, "final_granularity %q: want slot or block", req.FinalGranularity)
	}
	switch req.InjectFault {
	case "":
	case "corrupt", "cut", "crash_after_pause":
		if !o.cfg.AllowFaultInjection {
			return "", refuse(400, "inject_fault is only accepted by a Host started with --allow-fault-injection")
		}
	default:
		return "", refuse(400, "inject_fault %q: want corrupt, cut or crash_after_pause", req.InjectFault)
	}
	if req.TN < 0 || req.TN > 64 {
		return "", refuse(400, "tn %d out of range 1..64", req.TN)
	}
	if req.TN == 0 {
		req.TN = o.cfg.DefaultTN
	}
	spec := req.RequestFilter
	if spec == "" {
		spec = o.cfg.DefaultFilter
	}
	filter, err := ParseFilter(spec)
	if err != nil {
		return "", refuse(400, "%v", err)
	}
	src, err := o.reg.Get(req.Src)
	if err != nil {
		return "", refuse(404, "unknown source instance %s", req.Src)
	}
	dst, err := o.reg.Get(req.Dst)
	if err != nil {
		return "", refuse(404, "unknown target instance %s", req.Dst)
	}
	switch {
	case !src.Reachable || !dst.Reachable:
		return "", refuse(409, "both instances must be reachable")
	case !src.Engine.Migratable || !dst.Engine.Migratable:
		return "", refuse(409, "both engines must serve the vllm-hi hooks (migratable); %s: %v, %s: %v", src.ID, src.Engine.Migratable, dst.ID, dst.Engine.Migratable)
	case src.Role != registry.RoleActive:
		return "", refuse(409, "source %s is %s, not active", src.ID, src.Role)
	case dst.Role != registry.RoleStandby:
		return "", refuse(409, "target %s is %s, not standby", dst.ID, dst.Role)
	case !sameModels(src, dst):
		return "", refuse(409, "target %s does not serve the source's models %v", dst.ID, src.Engine.ServedModels)
	case req.TargetTP != nil && *req.TargetTP != dst.Engine.TP, req.TargetPP != nil && *req.TargetPP != dst.Engine.PP:
		return "", refuse(409, "target %s runs tp %d pp %d; start a target with the shape you ask for", dst.ID, dst.Engine.TP, dst.Engine.PP)
	}
	id := newID()
	o.mu.Lock()
	for _, inst := range []string{src.ID, dst.ID} {
		if m, ok := o.busy[inst]; ok {
			o.mu.Unlock()
			return "", refuse(409, "instance %s is busy with migration %s", inst, m)
		}
	}
	o.busy[src.ID], o.busy[dst.ID] = id, id
	o.mu.Unlock()

	m := &migration{o: o, req: req, filter: filter, src: src, dst: dst, log: o.log.With(zap.String("migration_id", id)),
		moving: map[string]*v1.RequestBlocks{}, reserved: map[string]bool{}}
	m.st = Status{ID: id, State: StateRunning, Src: src.ID, Dst: dst.ID, Type: req.Type, RequestFilter: filter.String(),
		TN: req.TN, CreatedAt: time.Now().UTC(), StepHistory: []Step{}, Rounds: []Round{}, Dropped: []string{}}
	if err := m.prepare(); err != nil {
		m.rollback(context.Background())
		o.release(src.ID, dst.ID)
		var re *Error
		if errors.As(err, &re) {
			return "", err
		}
		return "", refuse(409, "%v", err)
	}
	o.mu.Lock()
	o.all[id] = m
	o.order = append(o.order, id)
	o.mu.Unlock()
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

func (o *Orchestrator) release(ids ...string) {
	o.mu.Lock()
	for _, id := range ids {
		delete(o.busy, id)
	}
	o.mu.Unlock()
}

// Get returns a migration's status.
func (o *Orchestrator) Get(id string) (Status, bool) {
	o.mu.Lock()
	m, ok := o.all[id]
	o.mu.Unlock()
	if !ok {
		return Status{}, false
	}
	return m.status(), true
}

// List returns every migration, newest first.
func (o *Orchestrator) List() []Status {
	o.mu.Lock()
	ids := append([]string(nil), o.order...)
	o.mu.Unlock()
	out := make([]Status, 0, len(ids))
	for i := len(ids) - 1; i >= 0; i-- {
		if s, ok := o.Get(ids[i]); ok {
			out = append(out, s)
		}
	}
	return out
}

func (m *migration) status() Status {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.st
	s.StepHistory = append([]Step(nil), s.StepHistory...)
	s.Rounds = append([]Round(nil), s.Rounds...)
	s.Dropped = append([]string(nil), s.Dropped...)
	return s
}

// step starts a named step, ending the previous one.
func (m *migration) step(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now().UTC()
	m.endStepLocked(now)
	m.st.CurrentStep = name
	m.st.StepHistory = append(m.st.StepHistory, Step{Step: name, StartedAt: now})
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

// prepare: select requests on the source, ready the target's data plane
// and reserve blocks there for each request's whole remaining life.
func (m *migration) prepare() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m.step("reserve")
	var err error
	if m.srcA, err = m.o.agent(m.src.AgentAddress); err != nil {
		return err
	}
	if m.dstA, err = m.o.agent(m.dst.AgentAddress); err != nil {
		return err
	}
	list, err := hook[hooks.RequestList](ctx, m.srcA, "requests", nil, 0)
	if err != nil {
		return fmt.Errorf("list the source's requests: %w", err)
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

	m.step("prepare_target")
	pt, err := m.dstA.PrepareTarget(ctx, &v1.PrepareTargetRequest{MigrationId: m.st.ID})
	if err != nil {
		return fmt.Errorf("prepare the target: %s", status.Convert(err).Message())
	}
	m.dstLayout, m.dataAddr = pt.GetLayout(), pt.GetDataAddress()
	var dstLayout hooks.Layout
	_ = json.Unmarshal(m.dstLayout, &dstLayout)
	maxLen := dstLayout.Geometry.BlockSize * (dstLayout.Geometry.NumBlocks - 1)
	if m.dst.Engine.MaxModelLen > 0 {
		maxLen = m.dst.Engine.MaxModelLen
	}
	var items []hooks.AllocateItem
	for _, r := range selected {
		need := min(r.NumPromptTokens+max(r.MaxTokens, r.NumOutputTokens+1), maxLen)
		items = append(items, hooks.AllocateItem{RequestID: r.RequestID, NumTokens: max(need, r.NumPromptTokens+r.NumOutputTokens+1)})
	}
	if len(items) > 0 {
		alloc, err := hook[hooks.AllocateResponse](ctx, m.dstA, "allocate", hooks.AllocateRequest{Requests: items, LeaseMS: int(m.o.cfg.ReservationLease / time.Millisecond)}, 0)
		if err != nil {
			if status.Code(err) == codes.ResourceExhausted {
				return refuse(409, "target %s cannot hold the KV of %d requests: %s", m.dst.ID, len(items), status.Convert(err).Message())
			}
			return fmt.Errorf("reserve blocks on the target: %s", status.Convert(err).Message())
		}
		for _, a := range alloc.Requests {
			m.reserved[a.RequestID] = true
			rb := &v1.RequestBlocks{RequestId: a.RequestID}
			for _, b := range a.BlockIDs {
				rb.DstBlockIds = append(rb.DstBlockIds, int32(b))
			}
			m.moving[a.RequestID] = rb
		}
	}
	m.st.Requests = len(items)
	return nil
}

// fail ends the migration before the target resumed: roll back.
func (m *migration) fail(err error) {
	m.log.Warn("migration aborted; rolling back", zap.Error(err))
	m.step("rollback")
	m.rollback(context.Background())
	m.finish(StateAborted, err.Error())
}

// rollback resumes the source and frees everything reserved on the target.
func (m *migration) rollback(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if m.pausedSrc {
		m.resumeOnSource(ctx, m.ids())
		m.pausedSrc = false
	}
	if m.dstA != nil {
		var ids []string
		for id := range m.reserved {
			ids = append(ids, id)
		}
		if len(ids) > 0 {
			if _, err := hook[hooks.AbortResponse](ctx, m.dstA, "abort", hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true}, 0); err != nil {
				m.log.Error("rollback: releasing the target's blocks failed (its reservation lease will)", zap.Error(err))
			}
		}
		_, _ = m.dstA.ReleaseTarget(ctx, &v1.ReleaseTargetRequest{MigrationId: m.st.ID})
	}
	if m.srcA != nil {
		// The source agent keeps its cuda_ipc mappings across rounds.
		_, _ = m.srcA.ReleaseTarget(ctx, &v1.ReleaseTargetRequest{MigrationId: m.st.ID})
	}
	m.reserved = map[string]bool{}
}

func (m *migration) finish(state, errMsg string) {
	m.mu.Lock()
	now := time.Now().UTC()
	m.endStepLocked(now)
	m.st.State, m.st.Error, m.st.FinishedAt = state, errMsg, now
	m.st.CurrentStep = "done"
	st := m.st
	m.mu.Unlock()
	m.o.met.ended(st)
	m.o.release(m.src.ID, m.dst.ID)
	m.log.Info("migration finished", zap.String("state", state), zap.String("error", errMsg))
}

// copyRound runs one round on the source agent and records it.
func (m *migration) copyRound(ctx context.Context, kind string, since uint64, slotGranular bool, fault string) (*v1.CopyRoundResponse, error) {
	m.mu.Lock()
	reqs := make([]*v1.RequestBlocks, 0, len(m.moving))
	for _, rb := range m.moving {
		reqs = append(reqs, rb)
	}
	m.mu.Unlock()
	resp, err := m.srcA.CopyRound(ctx, &v1.CopyRoundRequest{
		MigrationId: m.st.ID, Kind: kind, SinceCursor: since, Requests: reqs,
		TargetDataAddress: m.dataAddr, TargetLayout: m.dstLayout, Tn: int32(m.req.TN),
		SlotGranular: slotGranular, InjectFault: fault,
	})
	if err != nil {
		return nil, fmt.Errorf("%s copy round: %s", kind, status.Convert(err).Message())
	}
	m.drop(resp.GetDroppedRequestIds()...)
	m.mu.Lock()
	for _, rb := range resp.GetRequests() {
		if cur, ok := m.moving[rb.GetRequestId()]; ok {
			cur.SrcBlockIds = rb.GetSrcBlockIds()
		}
	}
	m.st.Rounds = append(m.st.Rounds, Round{Round: len(m.st.Rounds), Kind: kind, BlockCount: int(resp.GetBlockCount()),
		TokenSlots: int(resp.GetTokenSlots()), Bytes: resp.GetBytes(), DurationS: resp.GetDurationS()})
	m.mu.Unlock()
	return resp, nil
}

// run is the migration after prepare.
func (m *migration) run() {
	ctx := context.Background()
	m.step("round_0")
	r0, err := m.copyRound(ctx, "full", 0, false, "")
	if err != nil {
		m.fail(err)
		return
	}
	since := r0.GetCursor()

	// Incremental rounds until the seed's convergence rules say stop.
	m.step("incremental_rounds")
	best, stall := -1, 0
	for round := 1; round <= m.o.cfg.MaxIncrRounds; round++ {
		r, err := m.copyRound(ctx, "incremental", since, false, "")
		if err != nil {
			m.fail(err)
			return
		}
		since = r.GetCursor()
		n := int(r.GetBlockCount())
		if n <= 1 {
			break
		}
		if best < 0 || n < best {
			best, stall = n, 0
		} else if stall++; stall >= m.o.cfg.StallRounds {
			break
		}
	}
	m.final(ctx, since)
}

// final pauses the source and, while it is paused, copies the last delta
// and moves the scheduler state side by side: the target installs the
// state paused while the copy runs, and resuming it once both are done is
// the commit (ownership flips there). Then the streams switch.
func (m *migration) final(ctx context.Context, since uint64) {
	m.step("pause_source")
	pauseStart := time.Now()
	paused := m.ids()
	wait, ok := m.pauseSource(ctx)
	if !ok {
		return
	}
	// The requests kept decoding, and their clients kept receiving tokens,
	// until the step in flight ended: the downtime starts there.
	stopped := pauseStart.Add(wait)
	if m.req.InjectFault == "crash_after_pause" {
		// Test of the Host dying while the source is paused: the source's
		// pause lease and the target's reservation lease must clean up.
		m.log.Error("injected fault: the Host exits with the source paused")
		os.Exit(3)
	}

	m.step("final_round")
	var states []movedState
	if len(m.ids()) > 0 {
		var err error
		if states, err = m.finalRound(ctx, since); err != nil {
			m.fail(err)
			return
		}
	}
	m.step("install_target")
	moved := make([]string, len(states))
	for i, st := range states {
		moved[i] = st.RequestID
	}
	if len(moved) > 0 {
		if _, err := hook[hooks.ResumeResponse](ctx, m.dstA, "resume", hooks.ResumeRequest{RequestIDs: moved}, 0); err != nil {
			m.fail(fmt.Errorf("resume the installed requests on the target: %s", status.Convert(err).Message()))
			return
		}
	}
	// Ownership has flipped: the target runs the requests.
	downtime := time.Since(stopped)
	for _, id := range moved {
		delete(m.reserved, id)
	}
	m.mu.Lock()
	m.st.DowntimeS = downtime.Seconds()
	m.st.PauseWaitS = wait.Seconds()
	m.st.Migrated = len(states)
	m.mu.Unlock()

	m.step("switch")
	var spliced []*proxy.Stream
	var waits []<-chan error
	var orphans []string
	for _, st := range states {
		s := m.o.streams.Get(st.RequestID)
		if s == nil {
			orphans = append(orphans, st.RequestID) // the client left meanwhile
			continue
		}
		spliced = append(spliced, s)
		waits = append(waits, s.Splice(m.dst.Engine.URL, m.dst.ID, len(st.OutputTokenIDs), visibleText(st)))
	}
	timeout := time.After(m.o.cfg.SpliceTimeout)
	for i, w := range waits {
		select {
		case err := <-w:
			if err != nil {
				m.log.Warn("a stream could not move", zap.String("request_id", spliced[i].ID), zap.Error(err))
			}
		case <-timeout:
			m.log.Warn("streams still moving at the splice timeout")
		}
	}
	// Drop the source's copies (a spliced stream already closed its
	// source connection, which aborted some of them) and the target's
	// requests nobody listens to any more.
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	if len(moved) > 0 {
		if _, err := hook[hooks.AbortResponse](actx, m.srcA, "abort", hooks.AbortRequest{RequestIDs: moved, Silent: true, IgnoreMissing: true}, 0); err != nil {
			m.log.Warn("dropping the source's copies failed (their pause lease will resume them)", zap.Error(err))
		}
	}
	if len(orphans) > 0 {
		_, _ = hook[hooks.AbortResponse](actx, m.dstA, "abort", hooks.AbortRequest{RequestIDs: orphans, IgnoreMissing: true}, 0)
	}
	m.resumeLeftBehind(actx, paused, moved)
	cancel()
	m.pausedSrc = false
	// Requests dropped on the way give their target reservations back.
	m.rollback(ctx)

	m.step("apply_type")
	switch m.req.Type {
	case DestroySource:
		_ = m.o.reg.SetRole(m.dst.ID, registry.RoleActive)
		_ = m.o.reg.SetRole(m.src.ID, registry.RoleStandby)
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if _, err := m.srcA.Retire(rctx, &v1.RetireRequest{}); err != nil {
			m.log.Warn("retiring the source failed", zap.Error(err))
		}
		cancel()
		m.setNewActive(m.dst.ID)
	case PreserveSource:
		_ = m.o.reg.SetRole(m.dst.ID, registry.RoleActive)
		_ = m.o.reg.SetRole(m.src.ID, registry.RoleStandby)
		m.setNewActive(m.dst.ID)
	case KeepSourceActive:
		m.setNewActive(m.src.ID)
	}
	// Client-perceived downtime: the longest gap a moved stream's client
	// saw across the switch, from its last token from the source to its
	// first event from the target.
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
	m.finish(StateSucceeded, "")
}

// pauseSource pauses the moving requests on the source at a step
// boundary (dropping any that finished meanwhile) and returns how long the
// engine waited for the step in flight. ok is false when the migration
// failed.
func (m *migration) pauseSource(ctx context.Context) (wait time.Duration, ok bool) {
	ids := m.ids()
	for attempt := 0; len(ids) > 0; attempt++ {
		p, err := hook[hooks.PauseResponse](ctx, m.srcA, "pause", hooks.PauseRequest{RequestIDs: ids, LeaseMS: int(m.o.cfg.PauseLease / time.Millisecond)}, 0)
		if err == nil {
			m.pausedSrc = true
			return time.Duration(p.StepWaitS * float64(time.Second)), true
		}
		if status.Code(err) != codes.NotFound || attempt > 3 {
			m.fail(fmt.Errorf("pause the source: %s", status.Convert(err).Message()))
			return 0, false
		}
		// Some request finished just now: drop it and pause the rest.
		if ids, err = m.liveOnSource(ctx, ids); err != nil {
			m.fail(fmt.Errorf("pause the source: %w", err))
			return 0, false
		}
	}
	return 0, true
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
	list, err := hook[hooks.RequestList](ctx, m.srcA, "requests", nil, 0)
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
		m.log.Error("resuming the source failed (its pause lease will resume the requests)", zap.Strings("request_ids", ids), zap.Error(err))
		return
	}
	if len(resume) == 0 {
		return
	}
	if _, err := hook[hooks.ResumeResponse](ctx, m.srcA, "resume", hooks.ResumeRequest{RequestIDs: resume}, 0); err != nil {
		m.log.Error("resuming the source failed (its pause lease will resume the requests)", zap.Strings("request_ids", resume), zap.Error(err))
	}
}

// finalRound copies the last delta while the state moves: the source's
// export goes to the target untouched and the target installs it paused,
// both while the copy runs. It returns the moved requests' states once
// both are done. A request the copy dropped (its client left meanwhile)
// is taken off the target again.
func (m *migration) finalRound(ctx context.Context, since uint64) ([]movedState, error) {
	fault := m.req.InjectFault
	if fault == "crash_after_pause" {
		fault = ""
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	copied := make(chan error, 1)
	go func() {
		_, err := m.copyRound(cctx, "final", since, m.req.FinalGranularity != "block", fault)
		copied <- err
	}()
	states, err := m.moveState(ctx)
	if err != nil {
		cancel()
	}
	// Never return with the copy still writing into the target: a rollback
	// frees those blocks.
	if cerr := <-copied; cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, err
	}
	moving := map[string]bool{}
	for _, id := range m.ids() {
		moving[id] = true
	}
	kept, gone := states[:0:0], []string(nil)
	for _, st := range states {
		if moving[st.RequestID] {
			kept = append(kept, st)
		} else {
			gone = append(gone, st.RequestID)
		}
	}
	if len(gone) > 0 {
		if _, err := hook[hooks.AbortResponse](ctx, m.dstA, "abort", hooks.AbortRequest{RequestIDs: gone, Silent: true, IgnoreMissing: true}, 0); err != nil {
			return nil, fmt.Errorf("take requests the copy dropped off the target: %s", status.Convert(err).Message())
		}
	}
	return kept, nil
}

// moveState exports the paused requests' state from the source and installs
// it, paused, on the target, in a few chunks side by side: encoding and
// decoding 256 requests' token ids and text is the longest part of the
// final round, and engines handle hook calls concurrently.
func (m *migration) moveState(ctx context.Context) ([]movedState, error) {
	ids := m.ids()
	n := min(maxStateChunks, (len(ids)+minStateChunk-1)/minStateChunk)
	if n <= 1 {
		return m.moveChunk(ctx, ids)
	}
	out := make([][]movedState, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		chunk := ids[i*len(ids)/n : (i+1)*len(ids)/n]
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i], errs[i] = m.moveChunk(ctx, chunk)
		}()
	}
	wg.Wait()
	var all []movedState
	for i := range n {
		if errs[i] != nil {
			return nil, errs[i]
		}
		all = append(all, out[i]...)
	}
	return all, nil
}

// State moves in up to maxStateChunks chunks of at least minStateChunk
// requests.
const (
	maxStateChunks = 8
	minStateChunk  = 16
)

// moveChunk exports some paused requests and installs them on the target.
// The export goes on as it came: the target installs into the blocks it
// reserved per request id, so nothing in it needs rewriting. The Host
// reads only what splicing needs, while the target installs.
func (m *migration) moveChunk(ctx context.Context, ids []string) ([]movedState, error) {
	var raw []byte
	for attempt := 0; ; attempt++ {
		if len(ids) == 0 {
			return nil, nil
		}
		b, _ := json.Marshal(hooks.ExportRequest{RequestIDs: ids})
		var err error
		if raw, err = hookRaw(ctx, m.srcA, "export", b, 0); err == nil {
			break
		}
		if status.Code(err) != codes.NotFound || attempt > 3 {
			return nil, fmt.Errorf("export the source's state: %s", status.Convert(err).Message())
		}
		// A client left after the pause: its request is gone from the source.
		if ids, err = m.liveOnSource(ctx, ids); err != nil {
			return nil, fmt.Errorf("export the source's state: %w", err)
		}
	}
	if len(raw) < 2 || raw[0] != '{' {
		return nil, fmt.Errorf("export the source's state: unreadable answer")
	}
	// {"cursor":…,"requests":[…]} → {"resume":false,"lease_ms":…,"cursor":…,"requests":[…]}
	head := fmt.Sprintf(`{"resume":false,"lease_ms":%d,`, m.o.cfg.PauseLease/time.Millisecond)
	install := append([]byte(head), raw[1:]...)
	installed := make(chan error, 1)
	go func() {
		_, err := hookRaw(ctx, m.dstA, "install", install, 0)
		installed <- err
	}()
	var exp struct {
		Requests []movedState `json:"requests"`
	}
	perr := json.Unmarshal(raw, &exp)
	if err := <-installed; err != nil {
		return nil, fmt.Errorf("install on the target: %s", status.Convert(err).Message())
	}
	if perr != nil {
		return nil, fmt.Errorf("export the source's state: unreadable answer: %v", perr)
	}
	return exp.Requests, nil
}

func (m *migration) setNewActive(id string) {
	m.mu.Lock()
	m.st.NewActiveInstance = id
	m.mu.Unlock()
}

// Busy reports whether an instance is part of a running migration.
func (o *Orchestrator) Busy(instance string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.busy[instance]
	return ok
}

// movedState is the part of an exported request the Host reads.
type movedState struct {
	RequestID      string        `json:"request_id"`
	OutputTokenIDs hooks.IntList `json:"output_token_ids"`
	TextOffsets    hooks.IntList `json:"text_offsets"`
}

// visibleText is how much text (code points) the source's client stream
// carries once every exported output token went out.
func visibleText(st movedState) int {
	if len(st.TextOffsets) != len(st.OutputTokenIDs) {
		return -1
	}
	if len(st.TextOffsets) == 0 {
		return 0
	}
	return st.TextOffsets[len(st.TextOffsets)-1]
}
