// Package scale is the Host's scaling of a deployment to an absolute
// size. For elastic EP it drives vLLM's own API: POST /scale_elastic_ep
// {"new_data_parallel_size", "drain_timeout"} runs vLLM's prepare in the
// background (the engine keeps serving) and then its commit, through which
// vLLM answers every route with 503 "The model is currently scaling"
// (vllm/v1/engine/async_llm.py, entrypoints/serve/elastic_ep in 0.32).
// The Host times the two phases by polling POST /is_scaling_elastic_ep
// (503 from the first moment of the commit), holds the requests that meet
// the commit's 503 and sends them again once it ends — clients see
// latency, never the 503 — keeps routing to the engine through it (its
// failed health checks are the commit, not a fault), and checks a greedy
// probe against the answer before; a failed check scales back.
package scale

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/launch"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/store"
)

// Config tunes scaling.
type Config struct {
	// Tracer, when set, gets a span per scale operation and one per phase
	// (trace.go).
	Tracer trace.Tracer
	// HoldTimeout bounds how long one request waits through a commit;
	// MaxHeld how many wait at once (beyond it the 503 goes through).
	HoldTimeout time.Duration
	MaxHeld     int
	// DrainTimeout is vLLM's drain_timeout (seconds in its body): how long
	// it waits for in-flight requests where it drains them.
	DrainTimeout time.Duration
	// Timeout bounds one operation.
	Timeout     time.Duration
	ProbePrompt string
}

// DefaultConfig are the documented defaults.
func DefaultConfig() Config {
	return Config{HoldTimeout: 2 * time.Minute, MaxHeld: 4096, DrainTimeout: 2 * time.Minute, Timeout: 30 * time.Minute,
		ProbePrompt: "The capital of France is"}
}

// Check says what is wrong with c.
func (c Config) Check() error {
	if c.HoldTimeout <= 0 || c.MaxHeld < 0 || c.DrainTimeout < time.Second || c.Timeout <= 0 {
		return fmt.Errorf("scale: hold timeout > 0, max held ≥ 0, drain timeout ≥ 1 s and timeout > 0")
	}
	return nil
}

// Kinds of operation.
const (
	KindElasticEP = "elastic_ep"
	KindReplicas  = "replicas"
)

// Causes of an operation.
const (
	CauseOperator   = "operator"
	CauseAutoscaler = "autoscaler"
)

// Scaler runs the scale operations.
type Scaler struct {
	cfg   Config
	reg   *registry.Registry
	mover Mover
	// relayed counts the streams this Host relays from an instance (the
	// ones a migration can move).
	relayed func(instance string) int
	client  *http.Client
	token   string
	log     *zap.Logger
	met     *prometheus.CounterVec

	held atomic.Int64
	mu   sync.Mutex
	ops  map[string]*op
	// running is the operation of each instance (elastic EP) or model
	// (modelKey: replicas); sizes what the Host last scaled each instance
	// to; launched the replicas it started, by instance.
	running  map[string]*op
	sizes    map[string]int
	launched map[string]migrate.Launched
	// owned are instances another controller puts to sleep and wakes
	// (NotSpare); nil: none.
	owned func(registry.Instance) bool
	// keep holds the launched replicas across Host restarts (Remember);
	// nil: they are known to this Host only.
	keep LaunchedStore
}

// LaunchedStore keeps the replicas a Host launched, so that a restarted
// Host still stops them when it takes them out (the Host's store).
type LaunchedStore interface {
	PutLaunched(store.Launched) error
	DeleteLaunched(id string) error
}

// Remember keeps the replicas this Scaler launches in keep, and adopts
// those an earlier Host launched (earlier, from keep): a later scale-in
// stops them as if this Host had started them. Records of processes that
// have exited (or whose pid now names another process) are dropped. Call
// it before the Host serves.
func (s *Scaler) Remember(keep LaunchedStore, earlier []store.Launched) {
	s.keep = keep
	for _, r := range earlier {
		p, err := launch.Adopt(r.PID, r.Start, r.LogFile)
		if err != nil {
			s.log.Info("a replica an earlier Host launched is gone", zap.String("vllm_hi_id", r.ID), zap.Int("pid", r.PID), zap.Error(err))
			if err := keep.DeleteLaunched(r.ID); err != nil {
				s.log.Warn("forgetting a launched replica", zap.String("vllm_hi_id", r.ID), zap.Error(err))
			}
			continue
		}
		s.log.Info("adopted a replica an earlier Host launched", zap.String("vllm_hi_id", r.ID), zap.Int("pid", r.PID))
		s.launched[r.ID] = migrate.Launched{ID: r.ID, Process: p, LogFile: r.LogFile}
	}
}

// keepLaunched records a replica just launched (before it is activated:
// a Host that dies meanwhile leaves its successor a process to stop).
func (s *Scaler) keepLaunched(model string, l migrate.Launched) {
	if s.keep == nil || l.Process == nil {
		return
	}
	pid, start := l.Process.Identity()
	if err := s.keep.PutLaunched(store.Launched{ID: l.ID, Model: model, PID: pid, Start: start, LogFile: l.LogFile, At: time.Now()}); err != nil {
		s.log.Warn("keeping a launched replica's record (a restarted Host will not stop it)", zap.String("vllm_hi_id", l.ID), zap.Error(err))
	}
}

// stopLaunched stops a launched replica and forgets its record.
func (s *Scaler) stopLaunched(l migrate.Launched) {
	if l.Process != nil {
		l.Process.Stop(launchedStopGrace)
	}
	if s.keep != nil && l.ID != "" {
		if err := s.keep.DeleteLaunched(l.ID); err != nil {
			s.log.Warn("forgetting a launched replica", zap.String("vllm_hi_id", l.ID), zap.Error(err))
		}
	}
}

// NotSpare names the instances that another controller owns — the engines
// model switching puts to sleep and wakes on a GPU they share — so that a
// replicas scale-out never takes one as a spare: waking it would put a
// second model's weights and KV on a GPU the switcher has given to
// another. Call it before the Host serves.
func (s *Scaler) NotSpare(owned func(registry.Instance) bool) { s.owned = owned }

// modelKey is the running key of a model's replicas operation.
func modelKey(model string) string { return "model:" + model }

type op struct {
	mu      sync.Mutex
	st      hostapi.ScaleStatus
	commit  chan struct{} // closed when the commit is over (or the operation)
	closing sync.Once
}

func (o *op) status() hostapi.ScaleStatus {
	o.mu.Lock()
	defer o.mu.Unlock()
	st := o.st
	st.Phases = append([]hostapi.ScalePhase(nil), o.st.Phases...)
	return st
}

func (o *op) endCommit() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.closing.Do(func() { close(o.commit) })
}

// newID is a fresh operation id.
func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "scale-" + hex.EncodeToString(b[:])
}

// New builds a Scaler; token is presented to the engines. mover moves
// streams and launches replicas (replicas scales); relayed counts the
// streams the Host relays from an instance.
func New(cfg Config, reg *registry.Registry, mover Mover, relayed func(string) int, token string, met *prometheus.CounterVec, log *zap.Logger) *Scaler {
	return &Scaler{cfg: cfg, reg: reg, mover: mover, relayed: relayed, client: &http.Client{}, token: token, log: log, met: met,
		ops: map[string]*op{}, running: map[string]*op{}, sizes: map[string]int{}, launched: map[string]migrate.Launched{}}
}

// NewMetric is vhi_scales_total{kind,state}.
func NewMetric() *prometheus.CounterVec {
	m := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vhi_scales_total", Help: "Scale operations, by kind (elastic_ep, replicas) and outcome (succeeded, failed, rolled_back, refused).",
	}, []string{"kind", "state"})
	for _, k := range []string{KindElasticEP, KindReplicas} {
		for _, st := range []string{hostapi.StateSucceeded, hostapi.StateFailed, hostapi.StateRolledBack, "refused"} {
			m.WithLabelValues(k, st) // every series from the start, at 0
		}
	}
	return m
}

// Start checks req and starts the operation; a request for the target an
// operation of the same instance is already scaling to answers that one's
// id (an idempotent repeat), another target is a conflict naming it.
func (s *Scaler) Start(req hostapi.ScaleRequest) (string, error) {
	return s.StartFor(req, CauseOperator)
}

// StartFor is Start on behalf of cause (operator, autoscaler).
func (s *Scaler) StartFor(req hostapi.ScaleRequest, cause string) (string, error) {
	kind := KindElasticEP
	if req.Replicas != nil {
		kind = KindReplicas
	}
	id, err := s.start(req, cause)
	if err != nil {
		s.met.WithLabelValues(kind, "refused").Inc()
	}
	return id, err
}

func (s *Scaler) start(req hostapi.ScaleRequest, cause string) (string, error) {
	switch {
	case (req.Model == "") == (req.ID == ""):
		return "", errdefs.New(errdefs.ErrInvalidArgument, "name the deployment by model or by vllm_hi_id, one of them")
	case req.Replicas != nil && req.DataParallelSize != nil:
		return "", errdefs.New(errdefs.ErrInvalidArgument, "data_parallel_size (elastic EP) or replicas (dense), not both")
	case req.Replicas != nil:
		return s.startReplicas(req, cause)
	case req.DataParallelSize == nil:
		return "", errdefs.New(errdefs.ErrInvalidArgument, "data_parallel_size (elastic EP) or replicas (dense) is required")
	case *req.DataParallelSize < 1:
		return "", errdefs.Newf(errdefs.ErrInvalidArgument, "data_parallel_size %d: want at least 1", *req.DataParallelSize)
	}
	inst, err := s.resolve(req)
	if err != nil {
		return "", err
	}
	to := *req.DataParallelSize
	s.mu.Lock()
	defer s.mu.Unlock()
	if o := s.running[inst.ID]; o != nil {
		st := o.status()
		if st.To == to {
			return st.ID, nil
		}
		return "", errdefs.Newf(errdefs.ErrConflict, "%s is being scaled to %d by %s: wait for it", inst.ID, st.To, st.ID)
	}
	for _, m := range inst.Engine.ServedModels {
		if o := s.running[modelKey(m)]; o != nil {
			return "", errdefs.Newf(errdefs.ErrConflict, "the replicas of %s are being scaled by %s: wait for it", m, o.status().ID)
		}
	}
	model := ""
	if len(inst.Engine.ServedModels) > 0 {
		model = inst.Engine.ServedModels[0]
	}
	o := &op{commit: make(chan struct{}), st: hostapi.ScaleStatus{ID: newID(), State: hostapi.StateRunning, Kind: KindElasticEP, Cause: cause,
		Instance: inst.ID, Model: model, From: s.sizes[inst.ID], To: to, CreatedAt: time.Now().UTC()}}
	s.ops[o.st.ID] = o
	s.running[inst.ID] = o
	go s.run(o, inst)
	return o.st.ID, nil
}

// resolve finds the instance to scale: the one named, or the one active
// instance of the model whose engine has vLLM's elastic-EP routes.
func (s *Scaler) resolve(req hostapi.ScaleRequest) (registry.Instance, error) {
	if req.ID != "" {
		inst, err := s.reg.Get(req.ID)
		if err != nil {
			return inst, errdefs.Newf(errdefs.ErrNotFound, "no instance %q", req.ID)
		}
		return inst, nil
	}
	var found []registry.Instance
	known := false
	for _, in := range s.reg.List() {
		if !in.Serves(req.Model) {
			continue
		}
		known = true
		// vLLM serves its elastic-EP routes whether or not the engine
		// was started with --enable-elastic-ep: only the scale call says.
		if in.Role == registry.RoleActive {
			found = append(found, in)
		}
	}
	switch {
	case !known:
		return registry.Instance{}, errdefs.Newf(errdefs.ErrNotFound, "no instance serves %q", req.Model)
	case len(found) == 0:
		return registry.Instance{}, errdefs.Newf(errdefs.ErrConflict, "no active instance serves %q", req.Model)
	case len(found) > 1:
		ids := make([]string, len(found))
		for i, in := range found {
			ids[i] = in.ID
		}
		return registry.Instance{}, errdefs.Newf(errdefs.ErrConflict, "%d active instances serve %q (%s): name the elastic-EP one by vllm_hi_id", len(found), req.Model, strings.Join(ids, ", "))
	}
	return found[0], nil
}

// admin is the engine admin client of inst.
func (s *Scaler) admin(inst registry.Instance, model string) *engine.Admin {
	return engine.NewAdmin(inst.Engine.URL, model, s.token, s.client)
}

// phase records one phase of o.
func (o *op) phase(name string, start time.Time, d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.st.Phases = append(o.st.Phases, hostapi.ScalePhase{Phase: name, StartedAt: start.UTC(), DurationS: d.Seconds()})
}

func (s *Scaler) run(o *op, inst registry.Instance) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	t0 := time.Now()
	state, err := s.scale(ctx, o, inst)
	o.endCommit()
	s.awaitHealthy(inst.ID)
	_ = s.reg.SetScaling(inst.ID, false)
	o.mu.Lock()
	o.st.State, o.st.TotalS, o.st.FinishedAt = state, time.Since(t0).Seconds(), time.Now().UTC()
	if err != nil {
		o.st.Error = err.Error()
	}
	st := o.st
	o.mu.Unlock()
	s.mu.Lock()
	delete(s.running, inst.ID)
	s.mu.Unlock()
	s.met.WithLabelValues(KindElasticEP, state).Inc() // run is the elastic-EP path
	s.traceOp(st)
	s.log.Info("scaled", zap.String("scale_id", st.ID), zap.String("vllm_hi_id", inst.ID), zap.Int("from", st.From), zap.Int("to", st.To),
		zap.String("state", state), zap.Float64("downtime_s", st.DowntimeS), zap.Float64("total_s", st.TotalS), zap.Int("held", st.HeldRequests), zap.Error(err))
}

// awaitHealthy waits, for a few heartbeats at most, until the instance's
// agent reports its engine healthy again: its health checks failed through
// the commit, and it stays routable as scaling until then.
func (s *Scaler) awaitHealthy(id string) {
	deadline := time.Now().Add(4 * s.reg.HeartbeatInterval())
	for time.Now().Before(deadline) {
		if in, err := s.reg.Get(id); err != nil || in.Stats.Healthy {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// scale runs the operation's phases and says how it ended.
func (s *Scaler) scale(ctx context.Context, o *op, inst registry.Instance) (string, error) {
	probe := s.admin(inst, o.st.Model)
	tc := time.Now()
	before, err := probe.Probe(ctx, s.cfg.ProbePrompt)
	o.phase("check", tc, time.Since(tc))
	if err != nil {
		return hostapi.StateFailed, fmt.Errorf("the probe before scaling: %w", err)
	}
	if err := s.reg.SetScaling(inst.ID, true); err != nil {
		return hostapi.StateFailed, err
	}
	if err := s.reconfigure(ctx, o, inst, o.st.To); err != nil {
		// vLLM failed the reconfiguration (a drain timeout, a worker that
		// did not join): it keeps its size before — but only the probe
		// says the engine still answers as it did.
		tv := time.Now()
		after, perr := probe.Probe(ctx, s.cfg.ProbePrompt)
		o.phase("verify", tv, time.Since(tv))
		if perr != nil || after != before {
			_, _ = s.reg.SetState(inst.ID, registry.StateDraining, registry.StateActive)
			return hostapi.StateFailed, fmt.Errorf("%w; after it the probe answered %q (%v), %q before, so %s is taken out of routing (draining)", err, after, perr, before, inst.ID)
		}
		return hostapi.StateFailed, fmt.Errorf("%w; the engine answers the probe as before and keeps serving at its size before", err)
	}
	s.mu.Lock()
	from := s.sizes[inst.ID]
	s.sizes[inst.ID] = o.st.To
	s.mu.Unlock()
	tv := time.Now()
	after, err := probe.Probe(ctx, s.cfg.ProbePrompt)
	o.phase("verify", tv, time.Since(tv))
	if err == nil && after == before {
		return hostapi.StateSucceeded, nil
	}
	if err == nil {
		err = fmt.Errorf("the probe answered %q after scaling, %q before", after, before)
	}
	if from == 0 {
		// Fail closed: nothing knows the size to go back to.
		_, _ = s.reg.SetState(inst.ID, registry.StateDraining, registry.StateActive)
		return hostapi.StateFailed, fmt.Errorf("%w; the size before is not known, so %s is taken out of routing (draining)", err, inst.ID)
	}
	o.mu.Lock()
	o.commit = make(chan struct{})
	o.closing = sync.Once{}
	o.mu.Unlock()
	if rerr := s.reconfigure(ctx, o, inst, from); rerr != nil {
		_, _ = s.reg.SetState(inst.ID, registry.StateDraining, registry.StateActive)
		return hostapi.StateFailed, fmt.Errorf("%w; scaling back to %d failed too (%v): %s is taken out of routing", err, from, rerr, inst.ID)
	}
	s.mu.Lock()
	s.sizes[inst.ID] = from
	s.mu.Unlock()
	return hostapi.StateRolledBack, err
}

// reconfigure calls POST /scale_elastic_ep and times its phases by
// polling: prepare until the engine first answers 503, commit from then
// until its answer.
func (s *Scaler) reconfigure(ctx context.Context, o *op, inst registry.Instance, to int) error {
	admin := s.admin(inst, "")
	done := make(chan error, 1)
	t0 := time.Now()
	go func() { done <- admin.ScaleElasticEP(ctx, to, s.cfg.DrainTimeout) }()
	var commitAt time.Time
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			end := time.Now()
			if commitAt.IsZero() {
				commitAt = end // a commit too short to see between two polls
			}
			o.endCommit()
			o.phase("prepare", t0, commitAt.Sub(t0))
			o.phase("commit", commitAt, end.Sub(commitAt))
			o.mu.Lock()
			o.st.DowntimeS += end.Sub(commitAt).Seconds()
			o.mu.Unlock()
			return err
		case <-tick.C:
			if !commitAt.IsZero() {
				continue
			}
			pctx, cancel := context.WithTimeout(ctx, time.Second)
			state, _ := admin.IsScalingElasticEP(pctx)
			cancel()
			if state == engine.ScalingCommitting {
				commitAt = time.Now()
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Hold is the proxy's question about a 503 from instance: when it is an
// elastic-EP commit's, wait for the commit to end (bounded) and say the
// request may be sent again.
func (s *Scaler) Hold(ctx context.Context, instance string, body []byte) bool {
	if !engine.IsScalingAnswer(body) {
		return false
	}
	if s.held.Add(1) > int64(s.cfg.MaxHeld) {
		s.held.Add(-1)
		return false
	}
	defer s.held.Add(-1)
	s.mu.Lock()
	o := s.running[instance]
	s.mu.Unlock()
	hctx, cancel := context.WithTimeout(ctx, s.cfg.HoldTimeout)
	defer cancel()
	if o != nil {
		o.mu.Lock()
		o.st.HeldRequests++
		commit := o.commit
		o.mu.Unlock()
		select {
		case <-commit:
			return true
		case <-hctx.Done():
			return false
		}
	}
	// Scaled by someone else: wait until the engine serves again.
	inst, err := s.reg.Get(instance)
	if err != nil {
		return false
	}
	admin := s.admin(inst, "")
	for {
		if state, _ := admin.IsScalingElasticEP(hctx); state == engine.ScalingServing {
			return true
		}
		select {
		case <-hctx.Done():
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Size is the data-parallel size the Host last scaled instance to (0:
// it has not: vLLM's API does not say).
func (s *Scaler) Size(instance string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sizes[instance]
}

// Get returns an operation's status.
func (s *Scaler) Get(id string) (hostapi.ScaleStatus, bool) {
	s.mu.Lock()
	o, ok := s.ops[id]
	s.mu.Unlock()
	if !ok {
		return hostapi.ScaleStatus{}, false
	}
	return o.status(), true
}

// List is every operation, newest first.
func (s *Scaler) List() []hostapi.ScaleStatus {
	s.mu.Lock()
	out := make([]hostapi.ScaleStatus, 0, len(s.ops))
	for _, o := range s.ops {
		out = append(out, o.status())
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	return out
}
