// Package autoscale is the Host's autoscaler, off by default: on an
// interval it reads, per configured model, the rolling p95 time to first
// token the Host measured (failed requests counted as a penalty, as the
// Elastic EP seed counts them) and the requests waiting on the model's
// engines, and scales the model out when either passes its bound, in when
// the p95 stays far under the SLO with nothing waiting — within min and
// max, one step at a time, resting a cooldown after every operation.
// Operations go through the Scaler (POST /vllm_hi/scale's path:
// data_parallel_size for an elastic-EP engine, replicas for a dense
// model); every decision is logged with its reason, kept for
// GET /vllm_hi/autoscale, and counted.
package autoscale

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/durations"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/scale"
	"github.com/vllm-hi/vllm-hi/internal/slo"
)

// Kinds of policy.
const (
	KindReplicas     = "replicas"
	KindDataParallel = "data_parallel"
)

// Reasons of a decision.
const (
	ReasonTTFT    = "ttft_p95"    // the rolling p95 TTFT passed scale_out_at × the SLO
	ReasonQueue   = "queue_depth" // more requests wait per replica (rank) than queue_high
	ReasonRunning = "concurrency" // more requests run per replica (rank) than running_high
	ReasonTTFTLow = "ttft_low"    // the p95 stayed under scale_in_at × the SLO, nothing waiting
)

// Config is the autoscale section of vhi host --config.
type Config struct {
	// IntervalS is how often the policies are evaluated (default 5).
	IntervalS durations.Seconds `yaml:"interval_s"`
	// DryRun decides and logs, but starts no operation.
	DryRun bool `yaml:"dry_run"`
	// FailurePenaltyS is the TTFT a failed request counts as (default 30).
	FailurePenaltyS durations.Seconds `yaml:"failure_penalty_s"`
	Models          map[string]Policy `yaml:"models"`
}

// Policy is one model's.
type Policy struct {
	// Kind is replicas (a dense model: instances) or data_parallel (an
	// elastic-EP engine: its ranks); default replicas.
	Kind string `yaml:"kind"`
	// Instance is the elastic-EP engine of a data_parallel policy
	// (default: the model's one active instance).
	Instance string `yaml:"vllm_hi_id"`
	Min      int    `yaml:"min"`
	Max      int    `yaml:"max"`
	// Start is a data_parallel engine's size before the Host first scales
	// it (vLLM's API does not say; default min).
	Start int `yaml:"start"`
	// Step is how much one decision changes the size (default 1).
	Step int `yaml:"step"`
	// SLOS is the rolling p95 TTFT to hold, in seconds; WindowS the
	// rolling window (default 30).
	SLOS    durations.Seconds `yaml:"ttft_p95_slo_s"`
	WindowS durations.Seconds `yaml:"window_s"`
	// ScaleOutAt and ScaleInAt are fractions of the SLO (defaults 0.6 and
	// 0.2): out above the first, in below the second.
	ScaleOutAt float64 `yaml:"scale_out_at"`
	ScaleInAt  float64 `yaml:"scale_in_at"`
	// QueueHigh: more requests waiting per replica (rank) scale out
	// (default 8; a queue is the SLO's early warning).
	QueueHigh float64 `yaml:"queue_high"`
	// RunningHigh: more requests running per replica (rank) scale out
	// (Knative's concurrency target; default 0: off). It warns before
	// anything waits — what an engine slow to scale (elastic EP's
	// prepare takes minutes) needs; scale-in waits until the running
	// requests fit under 0.8 × it on one replica (rank) fewer.
	RunningHigh float64 `yaml:"running_high"`
	// CooldownS is the rest after an operation ends (default 60).
	CooldownS durations.Seconds `yaml:"cooldown_s"`
	// MinSamples: a p95 over fewer requests decides nothing (default 20).
	MinSamples int `yaml:"min_samples"`
}

// withDefaults fills in what p leaves out.
func (p Policy) withDefaults() Policy {
	def := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	if p.Kind == "" {
		p.Kind = KindReplicas
	}
	if p.Step == 0 {
		p.Step = 1
	}
	if p.Start == 0 {
		p.Start = p.Min
	}
	if p.MinSamples == 0 {
		p.MinSamples = 20
	}
	if p.WindowS == 0 {
		p.WindowS = 30
	}
	def(&p.ScaleOutAt, 0.6)
	def(&p.ScaleInAt, 0.2)
	def(&p.QueueHigh, 8)
	if p.CooldownS == 0 {
		p.CooldownS = 60
	}
	return p
}

// Enabled says whether any model has a policy.
func (c Config) Enabled() bool { return len(c.Models) > 0 }

// Check says what is wrong with c, naming the field.
func (c Config) Check() error {
	if c.IntervalS < 0 || c.FailurePenaltyS < 0 {
		return fmt.Errorf("autoscale: interval_s and failure_penalty_s must not be negative")
	}
	for m, p := range c.Models {
		if p.Instance != "" && p.Kind != KindDataParallel {
			return fmt.Errorf("autoscale.models.%s: vllm_hi_id names the engine of a data_parallel policy", m)
		}
		p = p.withDefaults()
		switch {
		case p.Kind != KindReplicas && p.Kind != KindDataParallel:
			return fmt.Errorf("autoscale.models.%s: kind %q: want replicas or data_parallel", m, p.Kind)
		case p.Min < 1 || p.Max < p.Min:
			return fmt.Errorf("autoscale.models.%s: want 1 ≤ min ≤ max (min %d, max %d)", m, p.Min, p.Max)
		case p.Start < p.Min || p.Start > p.Max:
			return fmt.Errorf("autoscale.models.%s: start %d outside [min, max]", m, p.Start)
		case p.SLOS <= 0:
			return fmt.Errorf("autoscale.models.%s: ttft_p95_slo_s is required (seconds > 0)", m)
		case p.Step < 1 || p.WindowS <= 0 || p.CooldownS < 0 || p.MinSamples < 1 || p.QueueHigh < 0 || p.RunningHigh < 0:
			return fmt.Errorf("autoscale.models.%s: step ≥ 1, window_s > 0, cooldown_s ≥ 0, min_samples ≥ 1, queue_high and running_high ≥ 0", m)
		case p.ScaleInAt <= 0 || p.ScaleOutAt <= p.ScaleInAt:
			return fmt.Errorf("autoscale.models.%s: want 0 < scale_in_at < scale_out_at", m)
		}
	}
	return nil
}

// Interval is IntervalS with its default.
func (c Config) Interval() time.Duration {
	if c.IntervalS == 0 {
		return 5 * time.Second
	}
	return c.IntervalS.Duration()
}

// Penalty is FailurePenaltyS with its default.
func (c Config) Penalty() time.Duration {
	if c.FailurePenaltyS == 0 {
		return 30 * time.Second
	}
	return c.FailurePenaltyS.Duration()
}

// Window is the longest window of the policies (at least 30 s): the span
// the Host's TTFT window must keep.
func (c Config) Window() time.Duration {
	w := 30 * time.Second
	for _, p := range c.Models {
		w = max(w, p.withDefaults().WindowS.Duration())
	}
	return w
}

// Scaler starts and reports scale operations (the Host's scale.Scaler).
type Scaler interface {
	StartFor(req hostapi.ScaleRequest, cause string) (string, error)
	Get(id string) (hostapi.ScaleStatus, bool)
	Replicas(model string) []registry.Instance
	Size(instance string) int
}

// Metrics are the autoscaler's instruments.
type Metrics struct {
	Decisions *prometheus.CounterVec
	P95       *prometheus.GaugeVec
	Size      *prometheus.GaugeVec
}

// NewMetrics builds them.
func NewMetrics() *Metrics {
	return &Metrics{
		Decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_autoscale_decisions_total",
			Help: "Autoscaler decisions by model, direction (out, in), reason (ttft_p95, queue_depth, concurrency, ttft_low) and outcome (started, dry_run, refused).",
		}, []string{"model", "direction", "reason", "outcome"}),
		P95: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vhi_autoscale_ttft_p95_seconds", Help: "The rolling p95 time to first token the autoscaler reads, by model (failed requests count as the penalty).",
		}, []string{"model"}),
		Size: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vhi_autoscale_size", Help: "The size the autoscaler sees, by model: replicas, or data-parallel ranks.",
		}, []string{"model"}),
	}
}

// Collectors are what the Host registers.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.Decisions, m.P95, m.Size}
}

// keep is how many decisions Status returns.
const keep = 200

// Autoscaler evaluates the policies.
type Autoscaler struct {
	cfg    Config
	scaler Scaler
	ttft   *slo.Window
	met    *Metrics
	log    *zap.Logger
	now    func() time.Time

	mu      sync.Mutex
	state   map[string]*modelState
	decided []hostapi.AutoscaleDecision // oldest first
}

type modelState struct {
	op          string    // the operation it started last
	coolingFrom time.Time // when that operation ended (zero: running or none)
	view        hostapi.AutoscaleModel
}

// New builds an autoscaler (it runs only with policies).
func New(cfg Config, scaler Scaler, ttft *slo.Window, met *Metrics, log *zap.Logger) *Autoscaler {
	a := &Autoscaler{cfg: cfg, scaler: scaler, ttft: ttft, met: met, log: log, now: time.Now, state: map[string]*modelState{}}
	for m := range cfg.Models {
		a.state[m] = &modelState{}
		met.Decisions.WithLabelValues(m, "out", ReasonTTFT, "started") // the series a dashboard plots, from the start
		met.Decisions.WithLabelValues(m, "in", ReasonTTFTLow, "started")
	}
	return a
}

// Run evaluates every interval until ctx ends (nothing while it has no
// policies; a reload may give it some).
func (a *Autoscaler) Run(ctx context.Context) {
	if cfg := a.config(); cfg.Enabled() {
		a.log.Info("autoscaling on", zap.Duration("interval", cfg.Interval()), zap.Int("models", len(cfg.Models)), zap.Bool("dry_run", cfg.DryRun))
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(a.config().Interval()):
			if a.config().Enabled() {
				a.Step()
			}
		}
	}
}

// config is the policies now.
func (a *Autoscaler) config() Config {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cfg
}

// SetConfig replaces the policies (vhi host's SIGHUP reload): a model's
// cool-down and latest view are kept; a model without a policy any more
// is no longer scaled.
func (a *Autoscaler) SetConfig(cfg Config) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.cfg = cfg
	for m := range a.state {
		if _, ok := cfg.Models[m]; !ok {
			delete(a.state, m)
		}
	}
	for m := range cfg.Models {
		if a.state[m] == nil {
			a.state[m] = &modelState{}
		}
	}
	a.log.Info("autoscaling policies reloaded", zap.Int("models", len(cfg.Models)), zap.Bool("dry_run", cfg.DryRun))
}

// Step evaluates every policy once and returns the decisions it made.
func (a *Autoscaler) Step() []hostapi.AutoscaleDecision {
	cfg := a.config()
	models := make([]string, 0, len(cfg.Models))
	for m := range cfg.Models {
		models = append(models, m)
	}
	sort.Strings(models)
	var out []hostapi.AutoscaleDecision
	for _, m := range models {
		if d, inst, ok := a.evaluate(m, cfg.Models[m].withDefaults(), cfg.DryRun); ok {
			out = append(out, a.act(d, inst))
		}
	}
	return out
}

// size is the current size of a model whose replicas are reps, and the
// instance a data_parallel policy scales ("" when it has none, or
// several).
func (a *Autoscaler) size(reps []registry.Instance, p Policy) (int, string) {
	if p.Kind == KindReplicas {
		return len(reps), ""
	}
	id := p.Instance
	if id == "" {
		if len(reps) != 1 {
			return 0, ""
		}
		id = reps[0].ID
	}
	if n := a.scaler.Size(id); n > 0 {
		return n, id
	}
	return p.Start, id
}

// load sums the requests waiting and running on a model's active
// instances (as their agents last reported).
func load(reps []registry.Instance) (waiting, running int) {
	for _, in := range reps {
		waiting += in.Stats.Waiting
		running += in.Stats.Running
	}
	return waiting, running
}

// evaluate reads the model's signals and decides at most one step; inst
// is the engine a data_parallel decision scales.
func (a *Autoscaler) evaluate(model string, p Policy, dryRun bool) (d hostapi.AutoscaleDecision, inst string, ok bool) {
	now := a.now()
	reps := a.scaler.Replicas(model)
	size, inst := a.size(reps, p)
	window := p.WindowS.Duration()
	p95, n := a.ttft.Quantile(model, now, window, 0.95)
	waiting, running := load(reps)
	a.met.P95.WithLabelValues(model).Set(p95)
	a.met.Size.WithLabelValues(model).Set(float64(size))

	a.mu.Lock()
	st := a.state[model]
	st.view = hostapi.AutoscaleModel{Model: model, Kind: p.Kind, Size: size, Min: p.Min, Max: p.Max, SLOS: float64(p.SLOS), TTFTP95S: p95, Samples: n, Waiting: waiting}
	busy := false
	if st.op != "" && st.coolingFrom.IsZero() {
		if s, ok := a.scaler.Get(st.op); !ok || s.Ended() {
			st.coolingFrom = now
			if ok && !s.FinishedAt.IsZero() {
				st.coolingFrom = s.FinishedAt
			}
		} else {
			busy = true
			st.view.Scaling = st.op
		}
	}
	cooling := !st.coolingFrom.IsZero() && now.Before(st.coolingFrom.Add(p.CooldownS.Duration()))
	if cooling {
		st.view.CoolingUntil = st.coolingFrom.Add(p.CooldownS.Duration()).UTC()
	}
	a.mu.Unlock()
	if busy || cooling || size == 0 || (p.Kind == KindDataParallel && inst == "") {
		return d, "", false
	}
	d = hostapi.AutoscaleDecision{At: now.UTC(), Model: model, Kind: p.Kind, From: size, TTFTP95S: p95, Samples: n, Waiting: waiting, DryRun: dryRun}
	perUnit := float64(waiting) / float64(size)
	runningEach := float64(running) / float64(size)
	fitsFewer := p.RunningHigh == 0 || (size > 1 && float64(running)/float64(size-p.Step) < 0.8*p.RunningHigh)
	switch {
	case size < p.Max && n >= p.MinSamples && p95 > p.ScaleOutAt*float64(p.SLOS):
		d.Direction, d.Reason, d.To = "out", ReasonTTFT, min(p.Max, size+p.Step)
		d.Detail = fmt.Sprintf("p95 TTFT %.3f s over %d requests in %v > %.2f × the %.3f s SLO", p95, n, window, p.ScaleOutAt, float64(p.SLOS))
	case size < p.Max && p.QueueHigh > 0 && perUnit > p.QueueHigh:
		d.Direction, d.Reason, d.To = "out", ReasonQueue, min(p.Max, size+p.Step)
		d.Detail = fmt.Sprintf("%d requests waiting on %d (%.1f each) > %g", waiting, size, perUnit, p.QueueHigh)
	case size < p.Max && p.RunningHigh > 0 && runningEach > p.RunningHigh:
		d.Direction, d.Reason, d.To = "out", ReasonRunning, min(p.Max, size+p.Step)
		d.Detail = fmt.Sprintf("%d requests running on %d (%.1f each) > %g", running, size, runningEach, p.RunningHigh)
	case size > p.Min && n >= p.MinSamples && p95 < p.ScaleInAt*float64(p.SLOS) && waiting == 0 && fitsFewer:
		d.Direction, d.Reason, d.To = "in", ReasonTTFTLow, max(p.Min, size-p.Step)
		d.Detail = fmt.Sprintf("p95 TTFT %.3f s over %d requests in %v < %.2f × the %.3f s SLO, nothing waiting", p95, n, window, p.ScaleInAt, float64(p.SLOS))
	default:
		return hostapi.AutoscaleDecision{}, "", false
	}
	if p.Kind == KindDataParallel {
		d.Detail += " (" + inst + ")"
	}
	return d, inst, true
}

// act starts the decision's operation (unless a dry run) and records it.
func (a *Autoscaler) act(d hostapi.AutoscaleDecision, inst string) hostapi.AutoscaleDecision {
	outcome := "dry_run"
	var opID string
	if !d.DryRun {
		req := hostapi.ScaleRequest{Model: d.Model}
		to := d.To
		if d.Kind == KindReplicas {
			req.Replicas = &to
		} else {
			req.Model, req.ID, req.DataParallelSize = "", inst, &to
		}
		id, err := a.scaler.StartFor(req, scale.CauseAutoscaler)
		if err != nil {
			outcome, d.Error = "refused", err.Error()
		} else {
			outcome, d.ScaleID, opID = "started", id, id
		}
	}
	a.mu.Lock()
	st := a.state[d.Model]
	if opID != "" {
		st.op, st.coolingFrom = opID, time.Time{}
	} else {
		// A refusal or a dry run rests the model as an operation would:
		// the same decision is not logged again every interval.
		st.op, st.coolingFrom = "", a.now()
	}
	a.decided = append(a.decided, d)
	if len(a.decided) > keep {
		a.decided = slices.Clone(a.decided[len(a.decided)-keep:])
	}
	a.mu.Unlock()
	a.met.Decisions.WithLabelValues(d.Model, d.Direction, d.Reason, outcome).Inc()
	a.log.Info("autoscale", zap.String("model", d.Model), zap.String("direction", d.Direction), zap.Int("from", d.From), zap.Int("to", d.To),
		zap.String("reason", d.Reason), zap.String("detail", d.Detail), zap.String("outcome", outcome), zap.String("scale_id", d.ScaleID), zap.String("error", d.Error))
	return d
}

// Status is the autoscaler's view and its latest decisions, newest first.
func (a *Autoscaler) Status() hostapi.AutoscaleStatus {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := hostapi.AutoscaleStatus{Enabled: a.cfg.Enabled(), DryRun: a.cfg.DryRun, Models: []hostapi.AutoscaleModel{}, Decisions: make([]hostapi.AutoscaleDecision, len(a.decided))}
	for m, st := range a.state {
		v := st.view
		if v.Model == "" {
			p := a.cfg.Models[m].withDefaults()
			v = hostapi.AutoscaleModel{Model: m, Kind: p.Kind, Min: p.Min, Max: p.Max, SLOS: float64(p.SLOS)}
		}
		out.Models = append(out.Models, v)
	}
	sort.Slice(out.Models, func(i, j int) bool { return out.Models[i].Model < out.Models[j].Model })
	for i, d := range a.decided {
		out.Decisions[len(a.decided)-1-i] = d
	}
	return out
}
