package switching

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// SwitchReport is what one switch did, step by step; Step one of them.
type (
	SwitchReport = hostapi.SwitchReport
	Step         = hostapi.SwitchStep
)

// Switch outcomes (the metric's label).
const (
	OutcomeSucceeded = "succeeded"
	OutcomeFailed    = "failed"
)

// runStep records one step of rep, bounded by ctx.
func runStep(ctx context.Context, rep *SwitchReport, name string, m *model, f func(context.Context) error) error {
	t0 := time.Now()
	err := f(ctx)
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	st := Step{Step: name, Model: m.alias, StartedAt: t0.UTC(), DurationS: time.Since(t0).Seconds()}
	if errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%s: the switch deadline passed", name)
	}
	if err != nil {
		st.Error = err.Error()
		err = fmt.Errorf("%s %s: %w", name, m.alias, err)
	}
	rep.Steps = append(rep.Steps, st)
	return err
}

// switchTo makes t the awake model of g within the switch timeout:
// reconcile, drain and sleep the awake one, wake t, check it.
func (s *Switcher) switchTo(ctx context.Context, g *group, t *model) error {
	rep := &SwitchReport{Model: t.alias, StartedAt: time.Now()}
	sctx, cancel := context.WithTimeout(ctx, s.ctl().switchTimeout())
	defer cancel()
	err := s.transition(sctx, g, t, rep)
	rep.DurationS = time.Since(rep.StartedAt).Seconds()
	outcome := OutcomeSucceeded
	if err != nil {
		outcome, rep.Error = OutcomeFailed, err.Error()
	}
	rep.State = outcome
	s.met.switches.WithLabelValues(t.alias, outcome).Inc()
	s.traceSwitch(rep)
	s.met.seconds.WithLabelValues(t.alias).Observe(rep.DurationS)
	s.mu.Lock()
	t.last = rep
	s.mu.Unlock()
	s.log.Info("switch", zap.String("model", t.alias), zap.String("from", rep.From), zap.String("state", outcome),
		zap.Float64("duration_s", rep.DurationS), zap.Float64("drain_s", rep.DrainS), zap.String("drain", rep.Drain), zap.Error(err))
	return err
}

func (s *Switcher) transition(ctx context.Context, g *group, t *model, rep *SwitchReport) error {
	if err := runStep(ctx, rep, "reconcile", t, func(ctx context.Context) error { return s.reconcile(ctx, g, t) }); err != nil {
		return err
	}
	s.mu.Lock()
	var awake []*model
	for _, m := range g.members {
		if m.state == StateAwake {
			awake = append(awake, m)
		}
	}
	if len(awake) > 1 {
		names := make([]string, len(awake))
		for i, m := range awake {
			names[i] = m.alias
		}
		err := fmt.Errorf("%d models of one GPU group are awake (%s) where at most one may be: all are in error until the next switch reconciles them",
			len(awake), strings.Join(names, ", "))
		for _, m := range awake {
			s.setStateLocked(m, StateError, err)
		}
		s.mu.Unlock()
		return err
	}
	s.mu.Unlock()
	if len(awake) == 1 && awake[0] != t {
		v := awake[0]
		rep.From = v.alias
		if err := s.putToSleep(ctx, v, rep); err != nil {
			s.setState(v, StateError, err)
			return err
		}
	}
	if len(awake) == 1 && awake[0] == t {
		return nil
	}
	s.setState(t, StateWaking, nil)
	if err := s.wake(ctx, t, rep); err != nil {
		s.setState(t, StateError, err)
		return err
	}
	s.setState(t, StateAwake, nil)
	return nil
}

// reconcile asks every member whose state is not settled what it is; t's
// answer must come.
func (s *Switcher) reconcile(ctx context.Context, g *group, t *model) error {
	for _, m := range g.members {
		s.mu.Lock()
		settled := m.state == StateAwake || m.state == StateSleeping
		s.mu.Unlock()
		if settled {
			continue
		}
		asleep, err := m.be.IsSleeping(ctx)
		switch {
		case err != nil:
			s.setState(m, StateError, fmt.Errorf("reconciling: %w", err))
			if m == t {
				return err
			}
		case asleep:
			s.setState(m, StateSleeping, nil)
		default:
			s.setState(m, StateAwake, nil)
		}
	}
	return nil
}

// putToSleep drains v and puts it to sleep, checking that it sleeps.
func (s *Switcher) putToSleep(ctx context.Context, v *model, rep *SwitchReport) error {
	t0 := time.Now()
	err := runStep(ctx, rep, "drain", v, func(ctx context.Context) error {
		how, err := s.drain(ctx, v)
		rep.Drain = how
		return err
	})
	rep.DrainS = time.Since(t0).Seconds()
	if err != nil {
		return err
	}
	level, demote := s.sleepPlan(v)
	s.setState(v, StateSleepingInProgress, nil)
	if err := runStep(ctx, rep, "sleep", v, func(ctx context.Context) error { return v.be.Sleep(ctx, level) }); err != nil {
		return err
	}
	if err := runStep(ctx, rep, "verify_sleeping", v, func(ctx context.Context) error {
		asleep, err := v.be.IsSleeping(ctx)
		if err == nil && !asleep {
			err = fmt.Errorf("the engine says it is not sleeping after /sleep")
		}
		return err
	}); err != nil {
		return err
	}
	s.mu.Lock()
	v.asleepAt = level
	s.setStateLocked(v, StateSleeping, nil)
	s.mu.Unlock()
	// The group's GPU is free until the target wakes: the sleepers that
	// must give their host memory back wake there and sleep at level 2.
	for _, u := range demote {
		if err := runStep(ctx, rep, "demote", u, func(ctx context.Context) error { return s.demote(ctx, u) }); err != nil {
			s.setState(u, StateError, err)
			return err
		}
	}
	return nil
}

// sleepPlan is the level v sleeps at and the level-1 sleepers of its
// group to demote, under the host memory budget: the least recently used
// first, until what level-1 sleepers hold with v fits. The model being
// woken is not counted (its host copy goes back to the GPU). When the
// group's sleepers cannot free enough, v itself sleeps at level 2.
func (s *Switcher) sleepPlan(v *model) (int, []*model) {
	budget := s.ctl().HostMemoryBudgetGB
	if v.cfg().Level() == 2 || budget <= 0 || v.cfg().HostMemoryGB <= 0 {
		return v.cfg().Level(), nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	used := v.cfg().HostMemoryGB
	var cands []*model
	for _, m := range s.models {
		if m == v || m == v.g.switching || m.state != StateSleeping || m.asleepAt != 1 {
			continue
		}
		used += m.cfg().HostMemoryGB
		if m.g == v.g && m.cfg().HostMemoryGB > 0 {
			cands = append(cands, m)
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].lastUsed.Before(cands[j].lastUsed) })
	var demote []*model
	for _, m := range cands {
		if used <= budget {
			break
		}
		demote = append(demote, m)
		used -= m.cfg().HostMemoryGB
	}
	if used > budget {
		s.log.Info("host memory budget: the model sleeps at level 2", zap.String("model", v.alias),
			zap.Float64("level1_gb", used), zap.Float64("budget_gb", budget))
		return 2, nil
	}
	return 1, demote
}

// demote wakes a level-1 sleeper and puts it back to sleep at level 2,
// so that its weights leave host memory.
func (s *Switcher) demote(ctx context.Context, u *model) error {
	if err := WakeUp(ctx, u.be, u.cfg()); err != nil {
		return fmt.Errorf("waking it: %w", err)
	}
	if err := SleepAndVerify(ctx, u.be, 2); err != nil {
		return err
	}
	s.mu.Lock()
	u.asleepAt = 2
	s.mu.Unlock()
	s.log.Info("host memory budget: demoted to level 2", zap.String("model", u.alias), zap.Float64("host_memory_gb", u.cfg().HostMemoryGB))
	return nil
}

// SleepAndVerify puts be to sleep at level and checks that it says so.
func SleepAndVerify(ctx context.Context, be Backend, level int) error {
	if err := be.Sleep(ctx, level); err != nil {
		return err
	}
	asleep, err := be.IsSleeping(ctx)
	if err == nil && !asleep {
		err = fmt.Errorf("the engine says it is not sleeping after /sleep")
	}
	return err
}

// drain empties v of the requests it runs: its streams moved elsewhere
// by migration where the Mover can, the rest waited for. It says how.
func (s *Switcher) drain(ctx context.Context, v *model) (string, error) {
	s.mu.Lock()
	streams, others := v.onBackendLocked()
	s.mu.Unlock()
	if streams+others == 0 {
		return "nothing to drain", nil
	}
	how := fmt.Sprintf("waited for %d requests to finish", streams+others)
	onBackend := func() int { return 0 }
	moved := false
	if s.mover != nil && streams > 0 {
		if n, note, ok := s.mover.MoveAway(ctx, v.alias, v.cfg()); ok {
			onBackend, moved = n, true
			how = note
			if others > 0 {
				how += fmt.Sprintf("; waited for %d non-streaming requests", others)
			}
		} else if note != "" {
			how += " (" + note + ")"
		}
	}
	for {
		s.mu.Lock()
		streams, others := v.onBackendLocked()
		left := others
		if moved {
			left += onBackend()
		} else {
			left += streams
		}
		if left == 0 {
			if moved {
				// Every stream still leased runs elsewhere now.
				for l := range v.leases {
					l.moved = l.moved || l.stream
				}
			}
			s.mu.Unlock()
			return how, nil
		}
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return how, fmt.Errorf("%d requests still run on %s: %w", left, v.alias, ctx.Err())
		case <-changed:
		case <-time.After(20 * time.Millisecond): // onBackend is not ours to watch
		}
	}
}

// onBackendLocked counts the leases of m whose requests still run on its
// backend, streaming and not.
func (m *model) onBackendLocked() (streams, others int) {
	for l := range m.leases {
		switch {
		case l.moved:
		case l.stream:
			streams++
		default:
			others++
		}
	}
	return streams, others
}

// wake wakes t (its tags in order; after a level-2 sleep the weights
// are reloaded before the KV cache wakes), checks it is awake and that it
// answers its probe as before.
func (s *Switcher) wake(ctx context.Context, t *model, rep *SwitchReport) error {
	s.mu.Lock()
	cfg := t.cfg()
	if t.asleepAt == 2 {
		cfg.SleepLevel = 2 // demoted: its weights come back from disk
	}
	s.mu.Unlock()
	if err := runStep(ctx, rep, "wake", t, func(ctx context.Context) error { return WakeUp(ctx, t.be, cfg) }); err != nil {
		return err
	}
	if err := runStep(ctx, rep, "verify_awake", t, func(ctx context.Context) error {
		asleep, err := t.be.IsSleeping(ctx)
		if err == nil && asleep {
			err = fmt.Errorf("the engine says it is still sleeping after /wake_up")
		}
		return err
	}); err != nil {
		return err
	}
	return runStep(ctx, rep, "probe", t, func(ctx context.Context) error { return s.checkProbe(ctx, t) })
}

// WakeUp wakes the engine be of model m: its wake tags in order (none:
// one call), and after a level-2 sleep the weights, their reload, then
// the KV cache.
func WakeUp(ctx context.Context, be Backend, m Model) error {
	tags := m.WakeTags
	level2 := m.Level() == 2
	if len(tags) == 0 {
		if !level2 {
			return be.WakeUp(ctx)
		}
		tags = []string{"weights", "kv_cache"}
	}
	reloaded := false
	for _, tag := range tags {
		if err := be.WakeUp(ctx, tag); err != nil {
			return err
		}
		if tag == "weights" && level2 {
			if err := be.ReloadWeights(ctx); err != nil {
				return fmt.Errorf("reloading the weights discarded by the level-2 sleep: %w", err)
			}
			reloaded = true
		}
	}
	if level2 && !reloaded {
		return fmt.Errorf("sleep_level 2 discards the weights, but wake_tags %v never wake them to reload", tags)
	}
	return nil
}

// WakeAndVerify wakes be (WakeUp) and checks that it says it is awake.
func WakeAndVerify(ctx context.Context, be Backend, m Model) error {
	if err := WakeUp(ctx, be, m); err != nil {
		return err
	}
	asleep, err := be.IsSleeping(ctx)
	if err == nil && asleep {
		err = fmt.Errorf("the engine says it is still sleeping after /wake_up")
	}
	return err
}

// checkProbe runs the greedy probe on t and compares it with the answer
// recorded the first time t was seen awake (recording it then).
func (s *Switcher) checkProbe(ctx context.Context, t *model) error {
	got, err := t.be.Probe(ctx, s.ctl().probePrompt())
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !t.probed {
		t.probe, t.probed = got, true
		return nil
	}
	if got != t.probe {
		return fmt.Errorf("wake check failed: the probe answered %q where it answered %q before (the woken weights are not the model's)", got, t.probe)
	}
	return nil
}

// startup learns every member's state, records the probes of the awake
// ones, leaves at most one awake (the startup model where it is in g) and
// queues the startup model's wake-up.
func (s *Switcher) startup(ctx context.Context, g *group, wakeStartupModel bool) {
	sctx, cancel := context.WithTimeout(ctx, s.ctl().switchTimeout())
	defer cancel()
	rep := &SwitchReport{}
	var awake []*model
	for _, m := range g.members {
		if err := s.reconcile(sctx, g, m); err != nil {
			s.log.Warn("model state unknown at start-up", zap.String("model", m.alias), zap.Error(err))
			continue
		}
		s.mu.Lock()
		isAwake := m.state == StateAwake
		s.mu.Unlock()
		if isAwake {
			if err := s.checkProbe(sctx, m); err != nil {
				s.setState(m, StateError, fmt.Errorf("the start-up probe: %w", err))
				continue
			}
			awake = append(awake, m)
		}
	}
	keep := ""
	if len(awake) > 0 {
		keep = awake[0].alias
	}
	for _, m := range awake {
		if m.alias == s.ctl().StartupAwakeModel {
			keep = m.alias
		}
	}
	for _, m := range awake {
		if m.alias == keep {
			continue
		}
		// Nothing is routed to it yet: it sleeps without a drain.
		s.log.Info("start-up: more than one model of a group awake; putting one to sleep", zap.String("model", m.alias), zap.String("kept", keep))
		if err := s.putToSleep(sctx, m, rep); err != nil {
			s.setState(m, StateError, err)
		}
	}
	s.mu.Lock()
	st := s.ctl().StartupAwakeModel
	inGroup := st != "" && s.models[st] != nil && s.models[st].g == g
	s.mu.Unlock()
	if wakeStartupModel && inGroup && keep != st {
		go func() {
			if _, err := s.Switch(ctx, st); err != nil {
				s.log.Warn("waking the startup model", zap.String("model", st), zap.Error(err))
			}
		}()
	}
}

// Switch makes alias its group's awake model now, as a request for it
// would, and reports the switch (nil when it was awake already).
func (s *Switcher) Switch(ctx context.Context, alias string) (*SwitchReport, error) {
	w, granted, err := s.enqueue(alias, false, true)
	switch {
	case err != nil:
		return nil, err
	case granted:
		return s.lastReport(w.m), nil
	}
	if err := s.await(ctx, w, s.ctl().switchTimeout()+s.ctl().requestTimeout()); err != nil {
		return s.lastReport(w.m), err
	}
	return s.lastReport(w.m), nil
}

// Prewarm wakes alias and keeps it awake for ttl: no request for another
// model of its group puts it to sleep before then.
func (s *Switcher) Prewarm(ctx context.Context, alias string, ttl time.Duration) (time.Time, error) {
	if ttl <= 0 || ttl > s.ctl().maxPrewarm() {
		return time.Time{}, fmt.Errorf("ttl_s %.0f: want more than 0 and at most %.0f", ttl.Seconds(), s.ctl().maxPrewarm().Seconds())
	}
	if _, err := s.Switch(ctx, alias); err != nil {
		return time.Time{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.models[alias]
	m.pinnedUntil = time.Now().Add(ttl)
	return m.pinnedUntil, nil
}

func (s *Switcher) lastReport(m *model) *SwitchReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	return m.last
}

// ModelState is one alias in GET /admin/state.
type ModelState = hostapi.SwitchedModel

// HostMemory is what level-1 sleepers hold against the budget (nil
// without one).
func (s *Switcher) HostMemory() *hostapi.HostMemory {
	if s.ctl().HostMemoryBudgetGB <= 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	hm := &hostapi.HostMemory{BudgetGB: s.ctl().HostMemoryBudgetGB}
	for _, m := range s.models {
		if m.state == StateSleeping && m.asleepAt == 1 {
			hm.UsedGB += m.cfg().HostMemoryGB
		}
	}
	return hm
}

// State is every alias's state.
func (s *Switcher) State() map[string]ModelState {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]ModelState, len(s.models))
	for alias, m := range s.models {
		st := ModelState{State: m.state, Active: len(m.leases), Queued: m.queued, Group: m.cfg().Group,
			ServedModelName: m.cfg().ServedName(alias), BackendURL: m.cfg().BackendURL, LastError: m.lastErr, LastSwitch: m.last}
		if m.state == StateAwake {
			at := m.awakeSince
			st.AwakeSince = &at
		}
		if m.state == StateSleeping {
			st.SleepLevel = m.asleepAt
		}
		st.HostMemoryGB = m.cfg().HostMemoryGB
		if time.Now().Before(m.pinnedUntil) {
			at := m.pinnedUntil
			st.PinnedUntil = &at
		}
		out[alias] = st
	}
	return out
}
