package switching

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"
)

// Reconfigure applies a re-read configuration (vhi host on SIGHUP) to a
// running Switcher, as far as it can without a restart:
//   - the controller's settings (timeouts, minimum awake time, prewarm
//     bound, host memory budget, probe) take effect at once; its policy,
//     which decides the groups, does not;
//   - a model's settings (ttl, priority, sleep level, wake tags, served
//     name, host memory, launch command) take effect at once; its group
//     and backend_url do not (the model keeps them);
//   - a new model joins its group (a new group starts serving): its
//     group's goroutine learns its state, and puts it to sleep if another
//     model of the group is awake;
//   - a model no longer configured is let go when nothing uses it (no
//     request holds or waits for it, no switch wakes it): requests for it
//     are then unknown; its engine is left as it is.
//
// It returns what it could not apply, each naming the setting; an error
// (a configuration that does not check) changes nothing.
func (s *Switcher) Reconfigure(models map[string]Model, c Controller) (left []string, err error) {
	if err := Check(models, c); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.ctl()
	if c.policy() != old.policy() {
		left = append(left, fmt.Sprintf("controller.policy (%s → %s): it decides the groups; read at start only", old.policy(), c.policy()))
		c.Policy = old.Policy
	}
	s.controller.Store(&c)

	groups := groupsOf(models, c.policy())
	groupOf := map[string]string{}
	for name, members := range groups {
		for _, alias := range members {
			groupOf[alias] = name
		}
	}
	kicked := map[*group]bool{}
	for _, alias := range slices.Sorted(maps.Keys(models)) {
		cfg := models[alias]
		m := s.models[alias]
		if m == nil {
			s.addLocked(alias, cfg, groupOf[alias])
			continue
		}
		cur := m.cfg()
		if groupOf[alias] != m.g.name || strings.TrimRight(cfg.BackendURL, "/") != strings.TrimRight(cur.BackendURL, "/") {
			left = append(left, fmt.Sprintf("models.%s: its group and backend_url are read at start only (it keeps %s in %s)",
				alias, cur.BackendURL, groupLabel(m.g.name)))
			cfg.Group, cfg.BackendURL = cur.Group, cur.BackendURL
		}
		m.conf.Store(&cfg)
		kicked[m.g] = true
	}
	for _, alias := range slices.Sorted(maps.Keys(s.models)) {
		if _, ok := models[alias]; ok {
			continue
		}
		m := s.models[alias]
		if busy := len(m.leases) + m.queued; busy > 0 || m.g.switching == m {
			left = append(left, fmt.Sprintf("models.%s: removed from the file, but in use (%d requests%s): it stays until a reload finds it idle",
				alias, busy, map[bool]string{true: ", a switch", false: ""}[m.g.switching == m]))
			continue
		}
		delete(s.models, alias)
		m.g.leaving = append(m.g.leaving, m)
		s.met.forget(alias)
		kicked[m.g] = true
	}
	for g := range kicked {
		g.kickNow() // a changed ttl is timed again, a member leaves
	}
	s.notifyLocked()
	s.log.Info("switched models reconfigured", zap.Int("models", len(s.models)), zap.Strings("not_applied", left))
	return left, nil
}

// addLocked adds a model configured by a reload to its group (a new group
// starts serving at once when the Switcher runs), with its state unknown:
// the group's goroutine learns it before it serves the model (s.mu held).
func (s *Switcher) addLocked(alias string, cfg Model, groupName string) {
	var g *group
	for _, x := range s.groups {
		if x.name == groupName {
			g = x
		}
	}
	m := &model{alias: alias, state: StateUnknown, leases: map[*Lease]struct{}{}}
	m.conf.Store(&cfg)
	m.be = s.backend(alias, cfg)
	s.models[alias] = m
	if g != nil {
		m.g = g
		g.joining = append(g.joining, m)
		g.kickNow()
		return
	}
	g = &group{name: groupName, kick: make(chan struct{}, 1), members: []*model{m}}
	m.g = g
	s.groups = append(s.groups, g)
	if s.runCtx != nil {
		s.startGroup(s.runCtx, g) // its start-up learns the state
	}
}

// membershipChanges applies, on g's goroutine, the members a reload added
// or let go: a new member's state is learned, and it is put to sleep if
// another member is awake (at most one of a group is). It reports whether
// g has no member left (its goroutine then ends).
func (s *Switcher) membershipChanges(ctx context.Context, g *group) (empty bool) {
	s.mu.Lock()
	joining, leaving := g.joining, g.leaving
	g.joining, g.leaving = nil, nil
	for _, m := range leaving {
		for i, x := range g.members {
			if x == m {
				g.members = append(g.members[:i], g.members[i+1:]...)
				break
			}
		}
	}
	g.members = append(g.members, joining...)
	empty = len(g.members) == 0
	if empty {
		for i, x := range s.groups {
			if x == g {
				s.groups = append(s.groups[:i], s.groups[i+1:]...)
				break
			}
		}
	}
	s.mu.Unlock()
	for _, m := range leaving {
		s.log.Info("a switched model left the configuration", zap.String("model", m.alias), zap.String("group", groupLabel(g.name)))
	}
	if len(joining) == 0 {
		return empty
	}
	sctx, cancel := context.WithTimeout(ctx, s.ctl().switchTimeout())
	defer cancel()
	for _, m := range joining {
		if err := s.reconcile(sctx, g, m); err != nil {
			s.log.Warn("a switched model added by a reload: its state is unknown", zap.String("model", m.alias), zap.Error(err))
			continue
		}
		s.mu.Lock()
		awake, others := m.state == StateAwake, false
		for _, x := range g.members {
			others = others || (x != m && x.state != StateSleeping)
		}
		s.mu.Unlock()
		switch {
		case awake && others:
			// Nothing was routed to it yet: it sleeps without a drain.
			s.log.Info("a switched model added by a reload is awake beside another of its group; putting it to sleep",
				zap.String("model", m.alias), zap.String("group", groupLabel(g.name)))
			if err := s.putToSleep(sctx, m, &SwitchReport{Model: m.alias, From: m.alias, StartedAt: time.Now()}); err != nil {
				s.setState(m, StateError, err)
			}
		case awake:
			if err := s.checkProbe(sctx, m); err != nil {
				s.setState(m, StateError, fmt.Errorf("the probe of a model added by a reload: %w", err))
			}
		}
		s.log.Info("a switched model joined by a reload", zap.String("model", m.alias), zap.String("group", groupLabel(g.name)),
			zap.String("state", s.State()[m.alias].State))
	}
	return empty
}

// Resync makes every group learn its members' states again from their
// engines, between its transitions: what a Host that takes a shared store
// over does, since the Host before it switched the models meanwhile (a
// switch it left half done may have left two awake: one is put to sleep,
// the startup model kept where it is one of them). The awake model stays
// awake; nothing is woken.
func (s *Switcher) Resync() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, g := range s.groups {
		g.resync = true
		g.kickNow()
	}
}

// resyncIfAsked learns g's states again on its goroutine when Resync
// asked for it.
func (s *Switcher) resyncIfAsked(ctx context.Context, g *group) {
	s.mu.Lock()
	asked := g.resync
	g.resync = false
	if asked {
		for _, m := range g.members {
			if len(m.leases) == 0 {
				m.state = StateUnknown // reconcile asks the engine again
			}
		}
		s.notifyLocked()
	}
	s.mu.Unlock()
	if asked {
		s.log.Info("learning the switched models' states again", zap.String("group", groupLabel(g.name)))
		s.startup(ctx, g, false)
	}
}

// groupLabel is a group's name as the configuration spells it.
func groupLabel(name string) string {
	switch {
	case strings.HasPrefix(name, "model:"):
		return "its own group"
	case name == "group:":
		return "the ungrouped models' group"
	}
	return "group " + strings.TrimPrefix(name, "group:")
}
