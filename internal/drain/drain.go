// Package drain empties an instance without ending a stream: it stops
// routing new requests to it, moves its running streams onto the other
// active instances of its models by keep_source_active migrations (spread
// by their free KV), lets what cannot move finish or move in a later
// pass, and retires the instance once nothing is left on it. It drives
// the migration orchestrator through Mover, as rebalancing and scaling do.
package drain

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/ends"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// Mover is what a drain needs of the migration orchestrator.
type Mover interface {
	Start(hostapi.MigrateRequest) (string, error)
	Wait(ctx context.Context, id string) (hostapi.MigrationStatus, bool)
	// Retire asks inst's engine to release its KV, as destroy_source
	// does: the status's source_kv and its note.
	Retire(ctx context.Context, inst registry.Instance) (state, note string)
}

// Config bounds a drain and its calls.
type Config struct {
	// Timeout bounds a drain: moving its requests and waiting for what
	// cannot move to finish.
	Timeout time.Duration
	// RPCTimeout bounds each call to an agent.
	RPCTimeout time.Duration
	// Tracer, when set, gets a span per drain (trace.go).
	Tracer trace.Tracer
}

// Drainer runs the drains and keeps their statuses.
type Drainer struct {
	cfg     Config
	reg     *registry.Registry
	mover   Mover
	agents  *agentclient.Pool
	streams *proxy.Streams
	met     *Metrics
	log     *zap.Logger
	ctx     context.Context // ends at Close
	cancel  context.CancelFunc
	wg      sync.WaitGroup

	mu     sync.Mutex
	drains map[string]*drain
	order  []string    // drain ids, oldest first
	ends   ends.Signal // a drain ended (Wait)
}

// New returns a Drainer; met may be nil.
func New(cfg Config, reg *registry.Registry, mover Mover, agents *agentclient.Pool, streams *proxy.Streams, met *Metrics, log *zap.Logger) *Drainer {
	d := &Drainer{cfg: cfg, reg: reg, mover: mover, agents: agents, streams: streams, met: met, log: log,
		drains: map[string]*drain{}}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	return d
}

// Close stops the running drains (each ends failed; its instance stays
// draining) and waits for them until ctx ends.
func (o *Drainer) Close(ctx context.Context) {
	o.cancel()
	done := make(chan struct{})
	go func() { o.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// A drain empties an active instance (see the package doc); what cannot
// move (non-streaming requests, those still waiting for a seat) finishes
// or starts and moves in a later pass.
type drain struct {
	o   *Drainer
	log *zap.Logger
	src registry.Instance
	// to are the targets the operator named (nil: every eligible one,
	// looked up again on every pass).
	to []string
	// retire: an operator's drain retires the emptied instance; an agent
	// that is stopping only has its requests moved (it comes back).
	retire bool

	mu sync.Mutex
	st hostapi.DrainStatus
}

// Passes wait this long when nothing can move yet, and a failed
// migration this many times in a row ends the drain.
const (
	drainPoll        = 50 * time.Millisecond
	drainMaxFailures = 3
)

// Start checks that instance id can be drained onto to (or onto every
// other active instance of its models), marks it draining, and drains it
// in the background. A refusal changes nothing.
func (o *Drainer) Start(id string, req hostapi.DrainRequest) (string, error) {
	return o.startDrainFor(id, req, hostapi.DrainCauseOperator)
}

func (o *Drainer) startDrainFor(id string, req hostapi.DrainRequest, cause string) (string, error) {
	did, err := o.startDrain(id, req, cause)
	if err != nil {
		o.met.ended("refused")
	}
	return did, err
}

func (o *Drainer) startDrain(id string, req hostapi.DrainRequest, cause string) (string, error) {
	src, err := o.reg.Get(id)
	if err != nil {
		return "", err
	}
	switch {
	case src.Retired:
		return "", errdefs.Newf(errdefs.ErrConflict, "instance %s is retired", id)
	case src.Role != registry.RoleActive:
		return "", errdefs.Newf(errdefs.ErrConflict, "instance %s is %s, not active: only an active instance has requests to drain", id, src.Role)
	case src.State == registry.StateDraining:
		if d := o.drainOf(id); d != "" {
			return "", errdefs.Newf(errdefs.ErrConflict, "instance %s is draining already (%s)", id, d)
		}
		return "", errdefs.Newf(errdefs.ErrConflict, "instance %s is draining already (undrain it first)", id)
	}
	if cause == hostapi.DrainCauseOperator && !req.Force {
		// An operator's drain must not take a model offline by accident
		// (its next request would get a 503): the last active instance
		// of a model drains only when asked to with force.
		for _, m := range src.Engine.ServedModels {
			if _, ok := o.reg.RouteAvoiding(m, []string{src.ID}); !ok {
				return "", errdefs.Newf(errdefs.ErrConflict, "instance %s is the last active instance of model %s: draining it takes the model offline "+
					"(its requests would answer 503); drain with force (vhi drain --force) to do that", id, m)
			}
		}
	}
	for _, t := range req.To {
		if t == id {
			return "", errdefs.Newf(errdefs.ErrConflict, "instance %s cannot be drained onto itself", id)
		}
		if _, err := o.reg.Get(t); err != nil {
			return "", errdefs.Newf(errdefs.ErrNotFound, "unknown target instance %s", t)
		}
	}
	targets, why := o.drainTargets(src, req.To)
	if len(req.To) > 0 && len(targets) < len(req.To) {
		return "", errdefs.Newf(errdefs.ErrConflict, "%s", why)
	}
	if src.Engine.Migratable && len(targets) == 0 {
		// Its engine says what runs there now (heartbeats lag a second);
		// when it cannot, the last heartbeat does.
		busy := src.Stats.Running + src.Stats.Waiting
		if list, err := (&drain{o: o, src: src}).requests(context.Background()); err == nil {
			busy = len(list.Requests)
		}
		if busy > 0 {
			return "", errdefs.Newf(errdefs.ErrConflict, "instance %s has %d requests and no instance can take them: %s", id, busy, why)
		}
	}
	if _, err := o.reg.SetState(id, registry.StateDraining, registry.StateActive); err != nil {
		return "", err
	}
	if cause == hostapi.DrainCauseStop {
		_ = o.reg.SetStopping(id)
	}
	return o.launch(src, req.To, targets, cause, "draining"), nil
}

// launch runs a drain of src (marked draining) in the background and
// returns its id.
func (o *Drainer) launch(src registry.Instance, to []string, targets []registry.Instance, cause, what string) string {
	d := &drain{o: o, src: src, to: to, retire: cause == hostapi.DrainCauseOperator}
	d.st = hostapi.DrainStatus{ID: newDrainID(), Instance: src.ID, Cause: cause, State: hostapi.StateRunning, Targets: ids(targets),
		Migration: []string{}, CreatedAt: time.Now().UTC()}
	d.log = o.log.With(zap.String("drain_id", d.st.ID), zap.String("vllm_hi_id", src.ID))
	o.mu.Lock()
	o.drains[d.st.ID] = d
	o.order = append(o.order, d.st.ID)
	o.mu.Unlock()
	d.log.Info(what, zap.Strings("targets", d.st.Targets))
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		d.run()
	}()
	return d.st.ID
}

// TakeOver finishes, on a Host that took a shared store over, the drains
// the Host before it left: every instance the records say is draining (an
// operator's drain: an agent's stop is not recorded, its agent repeats
// it) with no drain running here is drained again from where it stands —
// onto every eligible instance, its requests moved or waited for — and
// retired once empty, as the operator asked. It returns the drains it
// started.
func (o *Drainer) TakeOver() []string {
	var started []string
	for _, in := range o.reg.List() {
		if in.State != registry.StateDraining || in.Stopping || in.Retired || o.drainOf(in.ID) != "" {
			continue
		}
		targets, _ := o.drainTargets(in, nil)
		started = append(started, o.launch(in, nil, targets, hostapi.DrainCauseOperator, "draining again: the Host that ran its drain is gone"))
	}
	return started
}

// ForStop starts a drain of instance id, or, while the instance is
// draining already, returns its latest drain's status: the call of an
// agent being stopped, which repeats it to follow the drain.
func (o *Drainer) ForStop(id string) (hostapi.DrainStatus, error) {
	if inst, err := o.reg.Get(id); err == nil && inst.State == registry.StateDraining {
		for _, s := range o.List() {
			if s.Instance == id {
				return s, nil
			}
		}
	}
	did, err := o.startDrainFor(id, hostapi.DrainRequest{}, hostapi.DrainCauseStop)
	if err != nil {
		return hostapi.DrainStatus{}, err
	}
	s, _ := o.Get(did)
	return s, nil
}

// Get returns a drain's status.
func (o *Drainer) Get(id string) (hostapi.DrainStatus, bool) {
	o.mu.Lock()
	d := o.drains[id]
	o.mu.Unlock()
	if d == nil {
		return hostapi.DrainStatus{}, false
	}
	return d.status(), true
}

// List lists every drain, newest first.
func (o *Drainer) List() []hostapi.DrainStatus {
	o.mu.Lock()
	order := slices.Clone(o.order)
	o.mu.Unlock()
	out := make([]hostapi.DrainStatus, 0, len(order))
	for _, id := range slices.Backward(order) { // newest first
		if s, ok := o.Get(id); ok {
			out = append(out, s)
		}
	}
	return out
}

// drainOf is the running drain of instance id ("" if none).
func (o *Drainer) drainOf(id string) string {
	for _, s := range o.List() {
		if s.Instance == id && !s.Ended() {
			return s.ID
		}
	}
	return ""
}

// drainTargets are the instances that can take src's requests now: named
// ones (to) or every other one serving src's models, each active,
// healthy, migratable and of src's KV geometry. why says what ruled the
// others out.
func (o *Drainer) drainTargets(src registry.Instance, to []string) ([]registry.Instance, string) {
	var out []registry.Instance
	var why []string
	for _, t := range o.reg.List() {
		if t.ID == src.ID || (len(to) > 0 && !slices.Contains(to, t.ID)) {
			continue
		}
		if reason := drainTargetProblem(src, t); reason != "" {
			if len(to) > 0 || t.ServesModelsOf(src) {
				why = append(why, t.ID+": "+reason)
			}
			continue
		}
		out = append(out, t)
	}
	if len(why) == 0 {
		why = append(why, fmt.Sprintf("no other instance serves %v", src.Engine.ServedModels))
	}
	return out, strings.Join(why, "; ")
}

// drainTargetProblem says why t cannot take src's requests ("" if it can).
func drainTargetProblem(src, t registry.Instance) string {
	sg, tg := src.Engine.Geometry, t.Engine.Geometry
	switch {
	case !t.ServesModelsOf(src):
		return fmt.Sprintf("does not serve %v", src.Engine.ServedModels)
	case t.Role != registry.RoleActive || t.Lifecycle() != registry.LifecycleActive:
		return "is " + string(t.Lifecycle()) + ", not active"
	case !t.Engine.Migratable:
		return "has no vllm-hi hooks"
	case sg.Layers != tg.Layers || sg.KVHeads != tg.KVHeads || sg.HeadDim != tg.HeadDim || sg.DTypeBytes != tg.DTypeBytes || sg.BlockSize != tg.BlockSize:
		return "has another KV geometry"
	}
	return ""
}

func ids(in []registry.Instance) []string {
	out := make([]string, len(in))
	for i, t := range in {
		out[i] = t.ID
	}
	return out
}

func (d *drain) status() hostapi.DrainStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.st
	s.Targets = slices.Clone(d.st.Targets)
	s.Migration = slices.Clone(d.st.Migration)
	return s
}

func (d *drain) update(fn func(*hostapi.DrainStatus)) {
	d.mu.Lock()
	fn(&d.st)
	d.mu.Unlock()
}

// run moves requests off the source pass by pass until none is left,
// then retires it.
func (d *drain) run() {
	o := d.o
	ctx, cancel := context.WithTimeout(o.ctx, o.cfg.Timeout)
	defer cancel()
	failures := 0
	seen := map[string]bool{}  // every request id ever listed on the source
	moved := map[string]bool{} // the ids migrations took
	count := 0                 // the requests they moved
	for {
		list, err := d.requests(ctx)
		if err != nil {
			d.fail(fmt.Errorf("list the requests of %s: %w", d.src.ID, err))
			return
		}
		live := map[string]bool{}
		for _, r := range list.Requests {
			live[r.RequestID], seen[r.RequestID] = true, true
		}
		finished := 0
		for id := range seen {
			if !live[id] && !moved[id] {
				finished++
			}
		}
		d.update(func(s *hostapi.DrainStatus) { s.Remaining, s.Finished = len(list.Requests), finished })
		if len(list.Requests) == 0 {
			d.finish(ctx)
			return
		}
		movable := d.movable(list.Requests)
		if len(movable) > 0 {
			ids, n, err := d.pass(ctx, movable)
			for _, id := range ids {
				moved[id] = true
			}
			count += n
			d.update(func(s *hostapi.DrainStatus) { s.Moved = count })
			switch {
			case errors.Is(err, registry.ErrBusy):
				// Another operation holds an instance: wait for it.
			case err != nil:
				failures++
				d.log.Warn("a drain migration failed", zap.Int("failures", failures), zap.Error(err))
				if failures >= drainMaxFailures {
					d.fail(fmt.Errorf("%d migrations in a row failed, the last: %w", failures, err))
					return
				}
			default:
				failures = 0
			}
		}
		select {
		case <-ctx.Done():
			d.fail(fmt.Errorf("the drain did not end within %v: %d requests left on %s", o.cfg.Timeout, len(list.Requests), d.src.ID))
			return
		case <-time.After(drainPoll):
		}
	}
}

// requests lists what runs or waits on the source. An engine without
// the hooks (routing-only) cannot say which requests it runs, nor can
// they move: the drain waits until its heartbeats count none.
func (d *drain) requests(ctx context.Context) (hooks.RequestList, error) {
	if !d.src.Engine.Migratable {
		inst, err := d.o.reg.Get(d.src.ID)
		if err != nil {
			return hooks.RequestList{}, err
		}
		var l hooks.RequestList
		for i := range inst.Stats.Running + inst.Stats.Waiting {
			l.Requests = append(l.Requests, hooks.RequestInfo{RequestID: fmt.Sprintf("unlisted-%d", i), Status: hooks.StatusWaiting})
		}
		return l, nil
	}
	a, err := d.o.agents.Get(d.src.AgentAddress, d.src.TLS)
	if err != nil {
		return hooks.RequestList{}, err
	}
	cctx, cancel := context.WithTimeout(ctx, d.o.cfg.RPCTimeout)
	defer cancel()
	return a.Engine.Requests(cctx)
}

// movable are the requests a migration can move now: running streams
// this Host relays (as a migration selects them) whose state can move.
func (d *drain) movable(reqs []hooks.RequestInfo) []hooks.RequestInfo {
	var out []hooks.RequestInfo
	for _, r := range reqs {
		if r.Status == hooks.StatusRunning && r.Stream && !r.Paused && r.Unmovable == "" && d.o.streams.Get(r.RequestID) != nil {
			out = append(out, r)
		}
	}
	return out
}

// pass spreads reqs over the targets by their free KV and migrates each
// target's share, one migration at a time (each holds the source). It
// returns the ids its successful migrations took, how many requests they
// moved and the first error.
func (d *drain) pass(ctx context.Context, reqs []hooks.RequestInfo) ([]string, int, error) {
	targets, why := d.o.drainTargets(d.src, d.to)
	if len(targets) == 0 {
		return nil, 0, errdefs.Newf(errdefs.ErrConflict, "no instance can take the requests: %s", why)
	}
	d.update(func(s *hostapi.DrainStatus) {
		for _, t := range targets {
			if !slices.Contains(s.Targets, t.ID) {
				s.Targets = append(s.Targets, t.ID)
			}
		}
	})
	var moved []string
	n := 0
	var first error
	for _, share := range spread(reqs, targets) {
		if len(share.ids) == 0 {
			continue
		}
		st, err := d.migrate(ctx, share.target, share.ids)
		if st.ID != "" {
			d.update(func(s *hostapi.DrainStatus) { s.Migration = append(s.Migration, st.ID) })
		}
		if st.State == hostapi.StateSucceeded {
			for _, id := range share.ids {
				if !slices.Contains(st.Dropped, id) {
					moved = append(moved, id)
				}
			}
			n += st.Migrated
		}
		if err == nil && st.State != hostapi.StateSucceeded {
			err = fmt.Errorf("migration %s to %s %s: %s", st.ID, share.target, st.State, st.Error)
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return moved, n, first
}

// migrate moves ids to target and waits for the migration's end.
func (d *drain) migrate(ctx context.Context, target string, ids []string) (hostapi.MigrationStatus, error) {
	id, err := d.o.mover.Start(hostapi.MigrateRequest{Src: d.src.ID, Dst: target, Type: hostapi.KeepSourceActive,
		RequestFilter: "ids:" + strings.Join(ids, ",")})
	if err != nil {
		return hostapi.MigrationStatus{}, err
	}
	st, _ := d.o.mover.Wait(ctx, id)
	if !st.Ended() {
		// The migration has its own deadline; the drain stops waiting.
		return st, fmt.Errorf("migration %s still running: %w", id, ctx.Err())
	}
	return st, nil
}

// share is one target's part of a pass.
type share struct {
	target string
	ids    []string
}

// spread assigns each request, longest first, to the target with the most
// free KV blocks left after what it was given already — so the moved
// load lands where there is room, and a big request is not the one left
// for a full target.
func spread(reqs []hooks.RequestInfo, targets []registry.Instance) []share {
	sorted := slices.Clone(reqs)
	sort.SliceStable(sorted, func(i, j int) bool {
		return sorted[i].NumPromptTokens+sorted[i].NumOutputTokens > sorted[j].NumPromptTokens+sorted[j].NumOutputTokens
	})
	free := make([]int, len(targets))
	out := make([]share, len(targets))
	for i, t := range targets {
		free[i], out[i].target = t.Stats.FreeBlocks, t.ID
	}
	for _, r := range sorted {
		best := 0
		for i := range targets {
			if free[i] > free[best] {
				best = i
			}
		}
		bs := max(1, targets[best].Engine.Geometry.BlockSize)
		free[best] -= (r.NumPromptTokens + max(r.MaxTokens, r.NumOutputTokens+1) + bs - 1) / bs
		out[best].ids = append(out[best].ids, r.RequestID)
	}
	return out
}

// finish ends a drain whose instance holds nothing any more. An
// operator's drain retires it: no role, its KV released through its
// engine's retire hook (as destroy_source does). A stopping agent's
// instance stays as it is, draining, until its agent deregisters.
func (d *drain) finish(ctx context.Context) {
	o := d.o
	state, note := "", ""
	if d.retire {
		state, note = hostapi.SourceKVNotReleased, "the engine has no vllm-hi hooks"
		if d.src.Engine.Migratable {
			state, note = o.mover.Retire(ctx, d.src)
		}
		_ = o.reg.SetRole(d.src.ID, registry.RoleStandby)
		_, _ = o.reg.SetRetired(d.src.ID, true)
	}
	d.update(func(s *hostapi.DrainStatus) {
		s.State, s.SourceKV, s.SourceKVNote, s.FinishedAt = hostapi.StateSucceeded, state, note, time.Now().UTC()
	})
	o.met.ended(hostapi.StateSucceeded)
	o.ends.Ended()
	st := d.status()
	o.traceDrain(st)
	d.log.Info("drained", zap.String("cause", st.Cause), zap.Int("moved", st.Moved), zap.Int("finished", st.Finished),
		zap.Strings("migrations", st.Migration), zap.String("source_kv", state))
}

// fail ends the drain; the instance stays draining (no new requests),
// what is left on it finishes there.
func (d *drain) fail(err error) {
	d.update(func(s *hostapi.DrainStatus) {
		s.State, s.Error, s.FinishedAt = hostapi.StateFailed, err.Error(), time.Now().UTC()
	})
	d.o.met.ended(hostapi.StateFailed)
	d.o.ends.Ended()
	d.o.traceDrain(d.status())
	d.log.Warn("the drain failed; the instance stays draining", zap.Error(err))
}

func newDrainID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "drain-" + hex.EncodeToString(b[:])
}

// Wait returns drain id's status once it ended, or when ctx ends first
// (its status then, not ended). ok is false for an unknown id.
func (o *Drainer) Wait(ctx context.Context, id string) (hostapi.DrainStatus, bool) {
	return ends.Wait(ctx, &o.ends, o.Get, id)
}
