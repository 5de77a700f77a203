package scale

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// A replicas scale brings a dense model (no elastic EP) to N active
// instances. Out: each new replica is a standby of the model, a retired
// or sleeping one woken, or one launched from the model's launch command
// (targets.MODEL), in that order; every new one must answer the greedy
// probe as the model's running replicas do before it gets a request —
// a failure releases them all and changes nothing — then it is made
// active and running streams are moved onto it by keep_source_active
// migrations until the replicas carry even shares. In: the replicas with
// the least to move (those the Host launched first) are drained onto the
// rest by migration — scale-in never waits for a long request and never
// drops one — retired, and those the Host launched stopped.

// Mover is what a replicas scale needs of the migration orchestrator.
type Mover interface {
	Start(hostapi.MigrateRequest) (string, error)
	Get(id string) (hostapi.MigrationStatus, bool)
	// Wait and WaitDrain return once the migration (drain) ended, or ctx did.
	Wait(ctx context.Context, id string) (hostapi.MigrationStatus, bool)
	StartDrain(id string, req hostapi.DrainRequest) (string, error)
	WaitDrain(ctx context.Context, id string) (hostapi.DrainStatus, bool)
	Wake(ctx context.Context, id string) (registry.Instance, error)
	CanLaunch(model string) bool
	LaunchReplica(model string, like registry.Instance) (migrate.Launched, error)
}

// launchedStopGrace is how long a launched replica taken out gets to exit
// after SIGTERM.
const launchedStopGrace = 20 * time.Second

// Replicas are the instances serving model now (lifecycle active), by id.
func (s *Scaler) Replicas(model string) []registry.Instance {
	var out []registry.Instance
	for _, in := range s.reg.List() {
		if in.Serves(model) && in.Reachable && in.Lifecycle() == registry.LifecycleActive {
			out = append(out, in)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// spares are the instances of model that can become replicas without a
// launch: standbys, then retired or sleeping ones to wake.
func (s *Scaler) spares(model string) []registry.Instance {
	var standby, asleep []registry.Instance
	for _, in := range s.reg.List() {
		if !in.Serves(model) || !in.Reachable || in.Busy.Kind != "" || (s.owned != nil && s.owned(in)) {
			continue
		}
		switch in.Lifecycle() {
		case registry.LifecycleStandby:
			standby = append(standby, in)
		case registry.LifecycleRetired, registry.LifecycleSleeping:
			if in.Engine.Migratable {
				asleep = append(asleep, in)
			}
		}
	}
	for _, l := range [][]registry.Instance{standby, asleep} {
		sort.Slice(l, func(i, j int) bool { return l[i].ID < l[j].ID })
	}
	return append(standby, asleep...)
}

func (s *Scaler) startReplicas(req hostapi.ScaleRequest, cause string) (string, error) {
	switch {
	case req.ID != "":
		return "", errdefs.New(errdefs.ErrInvalidArgument, "replicas scale a model: name it by model, not vllm_hi_id")
	case *req.Replicas < 1:
		return "", errdefs.Newf(errdefs.ErrInvalidArgument, "replicas %d: want at least 1 (drain the last instance to take a model out)", *req.Replicas)
	case s.mover == nil:
		return "", errdefs.New(errdefs.ErrUnavailable, "this Host cannot move streams: replicas scaling is off")
	}
	model, to := req.Model, *req.Replicas
	known := s.mover.CanLaunch(model)
	for _, in := range s.reg.List() {
		known = known || in.Serves(model)
	}
	if !known {
		return "", errdefs.Newf(errdefs.ErrNotFound, "no instance serves %q and it has no launch command", model)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if o := s.running[modelKey(model)]; o != nil {
		st := o.status()
		if st.To == to {
			return st.ID, nil
		}
		return "", errdefs.Newf(errdefs.ErrConflict, "the replicas of %s are being scaled to %d by %s: wait for it", model, st.To, st.ID)
	}
	for _, o := range s.running {
		if st := o.status(); st.Kind == KindElasticEP && st.Model == model {
			return "", errdefs.Newf(errdefs.ErrConflict, "%s of %s is being scaled by %s: wait for it", st.Instance, model, st.ID)
		}
	}
	from := len(s.Replicas(model))
	if need, spare := to-from, len(s.spares(model)); need > spare && !s.mover.CanLaunch(model) {
		return "", errdefs.Newf(errdefs.ErrConflict, "%s has %d replicas and %d standby, retired or sleeping instances to add, and no launch command "+
			"(targets.%s in vhi host --config): %d more cannot be found", model, from, spare, model, need-spare)
	}
	o := &op{commit: make(chan struct{}), st: hostapi.ScaleStatus{ID: newID(), State: hostapi.StateRunning, Kind: KindReplicas, Cause: cause,
		Model: model, From: from, To: to, CreatedAt: time.Now().UTC()}}
	o.endCommit() // a replicas scale has no commit to hold requests through
	s.ops[o.st.ID] = o
	s.running[modelKey(model)] = o
	go s.runReplicas(o)
	return o.st.ID, nil
}

// phaseOn records a phase about one replica.
func (o *op) phaseOn(name, instance string, start time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.st.Phases = append(o.st.Phases, hostapi.ScalePhase{Phase: name, Instance: instance, StartedAt: start.UTC(), DurationS: time.Since(start).Seconds()})
}

func (o *op) update(f func(*hostapi.ScaleStatus)) {
	o.mu.Lock()
	defer o.mu.Unlock()
	f(&o.st)
}

func (s *Scaler) runReplicas(o *op) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	t0 := time.Now()
	model := o.st.Model
	cur := s.Replicas(model)
	state, err := hostapi.StateSucceeded, error(nil)
	switch {
	case o.st.To > len(cur):
		err = s.scaleOut(ctx, o, cur)
	case o.st.To < len(cur):
		err = s.scaleIn(ctx, o, cur)
	}
	if err != nil {
		state = hostapi.StateFailed
	}
	o.update(func(st *hostapi.ScaleStatus) {
		st.State, st.TotalS, st.FinishedAt, st.Instances = state, time.Since(t0).Seconds(), time.Now().UTC(), ids(s.Replicas(model))
		if err != nil {
			st.Error = err.Error()
		}
	})
	s.mu.Lock()
	delete(s.running, modelKey(model))
	s.mu.Unlock()
	s.met.WithLabelValues(KindReplicas, state).Inc()
	st := o.status()
	s.traceOp(st)
	s.log.Info("scaled replicas", zap.String("scale_id", st.ID), zap.String("model", model), zap.String("cause", st.Cause), zap.Int("from", st.From),
		zap.Int("to", st.To), zap.String("state", state), zap.Strings("added", st.Added), zap.Strings("removed", st.Removed),
		zap.Int("moved", st.Moved), zap.Float64("downtime_s", st.DowntimeS), zap.Float64("total_s", st.TotalS), zap.Error(err))
}

func ids(l []registry.Instance) []string {
	out := make([]string, len(l))
	for i, in := range l {
		out[i] = in.ID
	}
	return out
}

func (s *Scaler) probe(ctx context.Context, in registry.Instance, model string) (string, error) {
	return s.admin(in, model).Probe(ctx, s.cfg.ProbePrompt)
}

// replica is a new replica being brought up.
type replica struct {
	inst     registry.Instance
	launched *migrate.Launched
	err      error
}

// scaleOut brings len(cur) replicas to o's target.
func (s *Scaler) scaleOut(ctx context.Context, o *op, cur []registry.Instance) error {
	model := o.st.Model
	before, beforeOn := "", ""
	if len(cur) > 0 {
		tc := time.Now()
		b, err := s.probe(ctx, cur[0], model)
		o.phaseOn("check", cur[0].ID, tc)
		if err != nil {
			return fmt.Errorf("the probe before scaling, on %s: %w", cur[0].ID, err)
		}
		before, beforeOn = b, cur[0].ID
	}
	spares := s.spares(model)
	like := registry.Instance{}
	if len(cur) > 0 {
		like = cur[0]
	} else if len(spares) > 0 {
		like = spares[0]
	}
	news := make([]replica, o.st.To-len(cur))
	var wg sync.WaitGroup
	for i := range news {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i < len(spares) {
				news[i] = s.spare(ctx, o, spares[i])
				return
			}
			tl := time.Now()
			l, err := s.mover.LaunchReplica(model, like)
			o.phaseOn("launch", l.ID, tl)
			news[i] = replica{launched: &l, err: err}
			if err == nil {
				s.keepLaunched(model, l)
				news[i].inst, news[i].err = s.reg.Get(l.ID)
			}
		}()
	}
	wg.Wait()
	// Every new replica answers the probe as the running ones do, or none
	// of them gets a request.
	var problems []string
	for i := range news {
		r := &news[i]
		if r.err == nil {
			tv := time.Now()
			got, err := s.probe(ctx, r.inst, model)
			o.phaseOn("verify", r.inst.ID, tv)
			switch {
			case err != nil:
				r.err = fmt.Errorf("its probe: %w", err)
			case before == "":
				before, beforeOn = got, r.inst.ID
			case got != before:
				r.err = fmt.Errorf("its probe answered %q, %s answered %q", got, beforeOn, before)
			}
		}
		if r.err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", r.name(), r.err))
		}
	}
	if len(problems) > 0 {
		for _, r := range news {
			if r.launched != nil {
				s.stopLaunched(*r.launched)
			}
		}
		return fmt.Errorf("%d of %d new replicas could not be brought in (%s); none was, and the launched ones are stopped",
			len(problems), len(news), strings.Join(problems, "; "))
	}
	ta := time.Now()
	added := make([]registry.Instance, 0, len(news))
	for _, r := range news {
		if err := s.reg.SetRole(r.inst.ID, registry.RoleActive); err != nil {
			return fmt.Errorf("activating %s: %w", r.inst.ID, err)
		}
		if r.launched != nil {
			s.mu.Lock()
			s.launched[r.inst.ID] = *r.launched
			s.mu.Unlock()
		}
		added = append(added, r.inst)
	}
	o.update(func(st *hostapi.ScaleStatus) { st.Added = ids(added) })
	o.phaseOn("activate", "", ta)
	s.even(ctx, o, cur, added)
	return nil
}

func (r replica) name() string {
	switch {
	case r.inst.ID != "":
		return r.inst.ID
	case r.launched != nil && r.launched.ID != "":
		return r.launched.ID
	}
	return "a launched replica"
}

// spare readies a standby (nothing to do) or wakes a retired or sleeping
// instance.
func (s *Scaler) spare(ctx context.Context, o *op, in registry.Instance) replica {
	t := time.Now()
	if in.Lifecycle() == registry.LifecycleStandby {
		o.phaseOn("standby", in.ID, t)
		return replica{inst: in}
	}
	woken, err := s.mover.Wake(ctx, in.ID)
	o.phaseOn("wake", in.ID, t)
	if err != nil {
		return replica{inst: in, err: fmt.Errorf("waking it: %w", err)}
	}
	return replica{inst: woken}
}

// even moves running streams from the replicas before (cur) onto the new
// ones until each carries about an even share: from the fullest, the
// longest streams, by keep_source_active migrations one after another
// (an instance takes part in one migration at a time). A migration that
// fails rolls back on its own: its streams stay where they were.
func (s *Scaler) even(ctx context.Context, o *op, cur, added []registry.Instance) {
	loads := map[string]int{}
	total := 0
	for _, in := range cur {
		if in.Engine.Migratable {
			loads[in.ID] = s.relayed(in.ID)
			total += loads[in.ID]
		}
	}
	share := total / o.st.To
	for _, dst := range added {
		if !dst.Engine.Migratable {
			continue
		}
		for want := share; want > 0 && ctx.Err() == nil; {
			src := ""
			for id, n := range loads {
				if src == "" || n > loads[src] || (n == loads[src] && id < src) {
					src = id
				}
			}
			k := min(loads[src]-share, want)
			if src == "" || k <= 0 {
				break
			}
			loads[src] -= k
			want -= k
			tm := time.Now()
			id, err := s.mover.Start(hostapi.MigrateRequest{Src: src, Dst: dst.ID, Type: hostapi.KeepSourceActive, RequestFilter: fmt.Sprintf("longest:%d", k)})
			if err != nil {
				s.log.Warn("moving streams to a new replica was refused", zap.String("src", src), zap.String("dst", dst.ID), zap.Error(err))
				continue
			}
			st, _ := s.mover.Wait(ctx, id)
			o.phaseOn("move", dst.ID, tm)
			o.update(func(sc *hostapi.ScaleStatus) {
				sc.Migrations = append(sc.Migrations, id)
				if st.State == hostapi.StateSucceeded {
					sc.Moved += st.Migrated
					sc.DowntimeS = max(sc.DowntimeS, st.ClientDowntimeS)
				}
			})
			if st.State != hostapi.StateSucceeded {
				s.log.Warn("moving streams to a new replica failed; they stay where they were", zap.String("migration_id", id), zap.String("error", st.Error))
			}
		}
	}
}

// scaleIn drains the replicas beyond o's target onto the rest, one after
// another (a drain's migrations must not land on a replica drained next).
func (s *Scaler) scaleIn(ctx context.Context, o *op, cur []registry.Instance) error {
	s.mu.Lock()
	mine := func(id string) bool { _, ok := s.launched[id]; return ok }
	order := append([]registry.Instance(nil), cur...)
	sort.SliceStable(order, func(i, j int) bool {
		a, b := order[i], order[j]
		if mine(a.ID) != mine(b.ID) {
			return mine(a.ID)
		}
		if la, lb := s.relayed(a.ID), s.relayed(b.ID); la != lb {
			return la < lb
		}
		return a.ID > b.ID
	})
	s.mu.Unlock()
	victims, keep := order[:len(cur)-o.st.To], ids(order[len(cur)-o.st.To:])
	for _, v := range victims {
		td := time.Now()
		did, err := s.mover.StartDrain(v.ID, hostapi.DrainRequest{To: keep})
		if err != nil {
			o.phaseOn("drain", v.ID, td)
			return fmt.Errorf("draining %s was refused: %w", v.ID, err)
		}
		st, _ := s.mover.WaitDrain(ctx, did)
		o.phaseOn("drain", v.ID, td)
		down := 0.0
		for _, mid := range st.Migration {
			if ms, ok := s.mover.Get(mid); ok && ms.State == hostapi.StateSucceeded {
				down = max(down, ms.ClientDowntimeS)
			}
		}
		o.update(func(sc *hostapi.ScaleStatus) {
			sc.Migrations = append(sc.Migrations, st.Migration...)
			sc.Moved += st.Moved
			sc.DowntimeS = max(sc.DowntimeS, down)
		})
		if st.State != hostapi.StateSucceeded {
			why := st.Error
			if why == "" {
				why = errors.Join(ctx.Err(), errors.New("it did not end")).Error()
			}
			return fmt.Errorf("the drain of %s (%s) failed: %s; it stays draining, what is left on it finishes there", v.ID, did, why)
		}
		o.update(func(sc *hostapi.ScaleStatus) { sc.Removed = append(sc.Removed, v.ID) })
		s.mu.Lock()
		l, ok := s.launched[v.ID]
		delete(s.launched, v.ID)
		s.mu.Unlock()
		if ok {
			ts := time.Now()
			s.stopLaunched(l)
			o.phaseOn("stop", v.ID, ts)
		}
	}
	return nil
}
