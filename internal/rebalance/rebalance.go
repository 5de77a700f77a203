// Package rebalance is the Host's automatic rebalancing, off by default:
// on an interval it looks at each model's active instances, and where one
// is overloaded — its waiting queue or its KV use past a threshold
// (head-of-line blocking: short requests wait behind long ones) — or the
// KV use of two instances differs by more than a spread, it moves the
// longest running sequences from the fullest instance to the emptiest by a
// keep_source_active migration. At most one migration per instance at a
// time, and an instance that took part in one rests for a cooldown before
// the next (the hysteresis that keeps two instances from trading the same
// requests). Every decision is logged with its reason and counted; a
// dry run decides and logs without migrating.
package rebalance

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/periodic"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// Config tunes the balancer. Interval 0 turns it off.
type Config struct {
	Interval time.Duration
	// KVHigh: an instance whose KV use (1 − free/total blocks) reaches it
	// is overloaded; WaitingHigh: so is one with more waiting requests.
	KVHigh      float64
	WaitingHigh int
	// Spread: two instances of a model whose KV use differs by more are
	// evened out.
	Spread float64
	// MaxRequests: the longest this many running sequences move per
	// decision.
	MaxRequests int
	// Cooldown: how long an instance that took part in a decision rests.
	Cooldown time.Duration
	// DryRun decides and logs, but starts no migration.
	DryRun bool
}

// DefaultConfig is off, with the thresholds a user turning it on starts
// from.
func DefaultConfig() Config {
	return Config{KVHigh: 0.85, WaitingHigh: 0, Spread: 0.4, MaxRequests: 4, Cooldown: 10 * time.Second}
}

// Check says what is wrong with c.
func (c Config) Check() error {
	switch {
	case c.Interval < 0:
		return fmt.Errorf("rebalance interval %v must not be negative", c.Interval)
	case c.KVHigh <= 0 || c.KVHigh > 1:
		return fmt.Errorf("rebalance KV threshold %v: want a fraction in (0, 1]", c.KVHigh)
	case c.Spread <= 0 || c.Spread > 1:
		return fmt.Errorf("rebalance spread %v: want a fraction in (0, 1]", c.Spread)
	case c.WaitingHigh < 0 || c.MaxRequests < 1 || c.Cooldown < 0:
		return fmt.Errorf("rebalance: waiting threshold ≥ 0, max requests ≥ 1 and cooldown ≥ 0")
	}
	return nil
}

// Reasons of a decision.
const (
	ReasonWaiting = "waiting_queue" // requests wait on the source: head-of-line blocking
	ReasonKVHigh  = "kv_high"       // the source's KV use passed KVHigh
	ReasonSpread  = "kv_spread"     // the two instances' KV use differs by more than Spread
)

// Decision is one move the balancer chose.
type Decision = hostapi.RebalanceDecision

// Migrator starts migrations and reports on them (the orchestrator).
type Migrator interface {
	Start(hostapi.MigrateRequest) (string, error)
	Get(id string) (hostapi.MigrationStatus, bool)
}

// Relayed counts the streams the Host relays from an instance: only those
// can move (the proxy's stream table).
type Relayed func(instance string) int

// Balancer runs the policy.
type Balancer struct {
	cfg     Config
	reg     *registry.Registry
	mig     Migrator
	relayed Relayed
	log     *zap.Logger
	met     *prometheus.CounterVec
	now     func() time.Time
	mu      sync.Mutex
	rest    map[string]time.Time // instance → end of its cooldown
	busy    map[string]string    // instance → the migration it is in
	decided []Decision           // the latest decisions, oldest first
}

// keep is how many decisions Decisions returns.
const keep = 100

// New returns a balancer; met (vhi_rebalance_decisions_total, labels
// reason and outcome) may be nil.
func New(cfg Config, reg *registry.Registry, mig Migrator, relayed Relayed, met *prometheus.CounterVec, log *zap.Logger) *Balancer {
	return &Balancer{cfg: cfg, reg: reg, mig: mig, relayed: relayed, met: met, log: log, now: time.Now, rest: map[string]time.Time{}, busy: map[string]string{}}
}

// NewMetric is the decisions counter the Host registers.
func NewMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vhi_rebalance_decisions_total",
		Help: "Rebalancing decisions by reason (waiting_queue, kv_high, kv_spread) and outcome (started, dry_run, refused).",
	}, []string{"reason", "outcome"})
}

// Run decides every Interval until ctx ends (nothing when off).
func (b *Balancer) Run(ctx context.Context) {
	if b.cfg.Interval <= 0 {
		return
	}
	b.log.Info("rebalancing on", zap.Duration("interval", b.cfg.Interval), zap.Float64("kv_high", b.cfg.KVHigh),
		zap.Int("waiting_high", b.cfg.WaitingHigh), zap.Float64("spread", b.cfg.Spread), zap.Bool("dry_run", b.cfg.DryRun))
	periodic.Do(ctx, b.cfg.Interval, func() { b.Step() })
}

// Decisions are the latest decisions, newest first.
func (b *Balancer) Decisions() []Decision {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]Decision, len(b.decided))
	for i, d := range b.decided {
		out[len(b.decided)-1-i] = d
	}
	return out
}

// load is what the policy reads of an instance.
type load struct {
	inst    registry.Instance
	kvUse   float64
	waiting int
}

// Step makes one pass over every model and acts on what it decides.
func (b *Balancer) Step() []Decision {
	now := b.now()
	b.settle(now)
	byModel := map[string][]load{}
	for _, in := range b.reg.List() {
		if in.Lifecycle() != registry.LifecycleActive || !in.Engine.Migratable || in.Stats.TotalBlocks <= 0 {
			continue
		}
		l := load{inst: in, kvUse: 1 - float64(in.Stats.FreeBlocks)/float64(in.Stats.TotalBlocks), waiting: in.Stats.Waiting}
		for _, m := range in.Engine.ServedModels {
			byModel[m] = append(byModel[m], l)
		}
	}
	models := make([]string, 0, len(byModel))
	for m := range byModel {
		models = append(models, m)
	}
	sort.Strings(models)
	var out []Decision
	for _, m := range models {
		if d, ok := b.decide(m, byModel[m], now); ok {
			out = append(out, b.act(d, now))
		}
	}
	return out
}

// decide picks at most one move for a model: from the fullest instance
// not resting or busy to the emptiest, when the fullest is overloaded and
// the emptiest has room, or when they differ by more than the spread.
func (b *Balancer) decide(model string, ls []load, now time.Time) (Decision, bool) {
	b.mu.Lock()
	var free []load
	for _, l := range ls {
		if b.busy[l.inst.ID] == "" && !now.Before(b.rest[l.inst.ID]) && l.inst.Busy.Kind == "" {
			free = append(free, l)
		}
	}
	b.mu.Unlock()
	if len(free) < 2 {
		return Decision{}, false
	}
	sort.Slice(free, func(i, j int) bool {
		if free[i].waiting != free[j].waiting {
			return free[i].waiting > free[j].waiting
		}
		if free[i].kvUse != free[j].kvUse {
			return free[i].kvUse > free[j].kvUse
		}
		return free[i].inst.ID < free[j].inst.ID
	})
	src := free[0]
	dst := free[len(free)-1]
	for _, l := range free[1:] {
		if l.kvUse < dst.kvUse || (l.kvUse == dst.kvUse && l.waiting < dst.waiting) {
			dst = l
		}
	}
	if src.inst.ID == dst.inst.ID || src.inst.Stats.Running == 0 || b.relayed(src.inst.ID) == 0 {
		// Nothing this Host relays runs there: nothing could move.
		return Decision{}, false
	}
	d := Decision{Model: model, Src: src.inst.ID, Dst: dst.inst.ID, Filter: fmt.Sprintf("longest:%d", b.cfg.MaxRequests)}
	roomy := dst.kvUse < b.cfg.KVHigh && dst.waiting == 0
	switch {
	case src.waiting > b.cfg.WaitingHigh && roomy:
		d.Reason = ReasonWaiting
		d.Detail = fmt.Sprintf("%d waiting on %s (threshold %d); %s at %.0f %% KV, none waiting", src.waiting, src.inst.ID, b.cfg.WaitingHigh, dst.inst.ID, dst.kvUse*100)
	case src.kvUse >= b.cfg.KVHigh && roomy:
		d.Reason = ReasonKVHigh
		d.Detail = fmt.Sprintf("%s at %.0f %% KV (threshold %.0f %%); %s at %.0f %%", src.inst.ID, src.kvUse*100, b.cfg.KVHigh*100, dst.inst.ID, dst.kvUse*100)
	case src.kvUse-dst.kvUse > b.cfg.Spread:
		d.Reason = ReasonSpread
		d.Detail = fmt.Sprintf("%s at %.0f %% KV, %s at %.0f %% (spread %.0f %%)", src.inst.ID, src.kvUse*100, dst.inst.ID, dst.kvUse*100, b.cfg.Spread*100)
	default:
		return Decision{}, false
	}
	return d, true
}

// act starts the decision's migration (unless a dry run), records it and
// rests both instances.
func (b *Balancer) act(d Decision, now time.Time) Decision {
	d.At, d.DryRun = now.UTC(), b.cfg.DryRun
	outcome := "dry_run"
	if !b.cfg.DryRun {
		id, err := b.mig.Start(hostapi.MigrateRequest{Src: d.Src, Dst: d.Dst, Type: hostapi.KeepSourceActive, RequestFilter: d.Filter})
		if err != nil {
			outcome, d.Error = "refused", err.Error()
		} else {
			outcome, d.Migration = "started", id
		}
	}
	b.mu.Lock()
	b.rest[d.Src], b.rest[d.Dst] = now.Add(b.cfg.Cooldown), now.Add(b.cfg.Cooldown)
	if d.Migration != "" {
		b.busy[d.Src], b.busy[d.Dst] = d.Migration, d.Migration
	}
	b.decided = append(b.decided, d)
	if len(b.decided) > keep {
		b.decided = b.decided[len(b.decided)-keep:]
	}
	b.mu.Unlock()
	if b.met != nil {
		b.met.WithLabelValues(d.Reason, outcome).Inc()
	}
	b.log.Info("rebalance", zap.String("model", d.Model), zap.String("src", d.Src), zap.String("dst", d.Dst),
		zap.String("reason", d.Reason), zap.String("detail", d.Detail), zap.String("outcome", outcome),
		zap.String("migration_id", d.Migration), zap.String("error", d.Error))
	return d
}

// settle frees the instances whose migration ended; their cooldown then
// counts from the end.
func (b *Balancer) settle(now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for inst, id := range b.busy {
		if st, ok := b.mig.Get(id); !ok || st.Ended() {
			delete(b.busy, inst)
			b.rest[inst] = now.Add(b.cfg.Cooldown)
		}
	}
}
