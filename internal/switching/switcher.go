package switching

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// States of a model, as GET /admin/state reports them.
const (
	StateUnknown            = "unknown"
	StateAwake              = "awake"
	StateSleeping           = "sleeping"
	StateWaking             = "waking"
	StateSleepingInProgress = "sleeping_in_progress"
	StateError              = "error"
)

// Errors a request or an admin call meets, of the project's kinds
// (internal/errdefs), which the Host's REST edge translates.
var (
	ErrUnknownModel = errdefs.New(errdefs.ErrNotFound, "no such model")
	// ErrQueueTimeout: the model was not awake within the request timeout.
	ErrQueueTimeout = errdefs.New(errdefs.ErrDeadlineExceeded, "the model did not become awake within the request timeout")
	ErrClosed       = errdefs.New(errdefs.ErrUnavailable, "the Host is shutting down")
)

// SwitchError is a failed switch as the requests queued for it see it.
type SwitchError struct {
	Model string
	Err   error
}

func (e *SwitchError) Error() string {
	return fmt.Sprintf("switching to %s failed: %v", e.Model, e.Err)
}
func (e *SwitchError) Unwrap() error { return e.Err }

// Mover moves the streams running on a model's backend onto another
// instance of the same served model by migration, so that a switch need
// not wait for them (the Host implements it with its registry and
// orchestrator).
type Mover interface {
	// MoveAway starts the move and returns once it ended. ok is false when
	// nothing can take them (no other instance, the backend is not a
	// migratable instance); onBackend then counts the streams still
	// relayed from the backend, and note says what happened.
	MoveAway(ctx context.Context, alias string, m Model) (onBackend func() int, note string, ok bool)
}

// Options configure a Switcher.
type Options struct {
	Models     map[string]Model
	Controller Controller
	// Backend makes the client of a model's engine.
	Backend func(alias string, m Model) Backend
	Mover   Mover // nil: a drain always waits
	Metrics *Metrics
	Log     *zap.Logger
	// Tracer, when set, gets a span per switch and one per step
	// (trace.go).
	Tracer trace.Tracer
}

// Switcher is the model-switching state of the Host.
type Switcher struct {
	// controller is the switching policy (a reload replaces it: read it
	// with ctl).
	controller atomic.Pointer[Controller]
	mover      Mover
	met        *Metrics
	log        *zap.Logger
	tr         trace.Tracer // nil: no spans

	backend func(alias string, m Model) Backend

	mu      sync.Mutex
	changed chan struct{} // closed and replaced at every change: drains wait on it
	models  map[string]*model
	groups  []*group
	runCtx  context.Context // Run's (nil before): a group a reload adds starts with it
	wg      sync.WaitGroup
}

type model struct {
	alias string
	// conf is the model's configuration (a reload replaces it: read it
	// with cfg).
	conf        atomic.Pointer[Model]
	be          Backend
	g           *group
	state       string
	leases      map[*Lease]struct{}
	queued      int
	awakeSince  time.Time
	pinnedUntil time.Time
	// asleepAt is the level the model sleeps at (0 while it is not known
	// to sleep): a model demoted to level 2 wakes as level 2 does.
	asleepAt int
	lastUsed time.Time // a lease taken or given back: the LRU order of demotion
	probe    string    // the greedy probe's answer when first seen awake
	probed   bool
	lastErr  string
	last     *SwitchReport
}

type group struct {
	name      string
	members   []*model
	waiters   []*waiter
	switching *model // the model a switch in progress wakes
	kick      chan struct{}
	retry     *time.Timer // re-kicks the group when a hold ends
	idle      *time.Timer // re-kicks it when an awake model's ttl may have passed
	// joining and leaving are the members a reload added or let go, for
	// the group's goroutine to apply between transitions (it alone reads
	// members outside s.mu).
	joining, leaving []*model
	// resync: the group's states are to be learned again (Resync).
	resync bool
}

// waiter is a request (or an admin call) queued for a model.
type waiter struct {
	m      *model
	at     time.Time
	stream bool
	admin  bool // a switch or prewarm: takes no lease
	ready  chan error
	lease  *Lease
}

// New builds a Switcher; Run starts it.
func New(o Options) (*Switcher, error) {
	if err := Check(o.Models, o.Controller); err != nil {
		return nil, err
	}
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	if o.Metrics == nil {
		o.Metrics = NewMetrics()
	}
	s := &Switcher{backend: o.Backend, mover: o.Mover, met: o.Metrics, log: o.Log, tr: o.Tracer, changed: make(chan struct{}), models: map[string]*model{}}
	groups := groupsOf(o.Models, o.Controller.policy())
	names := make([]string, 0, len(groups))
	for n := range groups {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		g := &group{name: n, kick: make(chan struct{}, 1)}
		for _, alias := range groups[n] {
			m := &model{alias: alias, g: g, state: StateUnknown, leases: map[*Lease]struct{}{}}
			cfg := o.Models[alias]
			m.conf.Store(&cfg)
			m.be = o.Backend(alias, cfg)
			g.members = append(g.members, m)
			s.models[alias] = m
		}
		s.groups = append(s.groups, g)
	}
	c := o.Controller
	s.controller.Store(&c)
	s.met.observe(s)
	return s, nil
}

// ctl is the controller's configuration now.
func (s *Switcher) ctl() Controller { return *s.controller.Load() }

// cfg is the model's configuration now.
func (m *model) cfg() Model { return *m.conf.Load() }

// Has says whether alias is a switched model.
func (s *Switcher) Has(alias string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.models[alias]
	return ok
}

// OwnsBackend says whether url is a switched model's backend.
func (s *Switcher) OwnsBackend(url string) bool {
	url = strings.TrimRight(url, "/")
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.models {
		if strings.TrimRight(m.cfg().BackendURL, "/") == url {
			return true
		}
	}
	return false
}

// Aliases are the switched models' names, sorted.
func (s *Switcher) Aliases() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.models))
}

// Run serves the groups until ctx ends; queued requests then fail with
// ErrClosed. It returns at once; Wait waits for the groups to stop.
func (s *Switcher) Run(ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runCtx = ctx
	for _, g := range s.groups {
		s.startGroup(ctx, g)
	}
}

// startGroup starts g's goroutine (s.mu held).
func (s *Switcher) startGroup(ctx context.Context, g *group) {
	s.wg.Add(1)
	go func() { defer s.wg.Done(); s.serve(ctx, g) }()
}

// Wait returns when every group's goroutine has stopped.
func (s *Switcher) Wait() { s.wg.Wait() }

// notifyLocked wakes whoever waits for a change (s.mu held).
func (s *Switcher) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *Switcher) setStateLocked(m *model, state string, err error) {
	m.state = state
	if err != nil {
		m.lastErr = err.Error()
	} else if state == StateAwake || state == StateSleeping {
		m.lastErr = ""
	}
	switch {
	case state == StateAwake:
		m.awakeSince, m.asleepAt = time.Now(), 0
	case state == StateSleeping && m.asleepAt == 0:
		m.asleepAt = m.cfg().Level() // found asleep: at the level it is configured for
	}
	s.notifyLocked()
}

func (s *Switcher) setState(m *model, state string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.setStateLocked(m, state, err)
}

// kick asks g's goroutine to look at its queue.
func (g *group) kickNow() {
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// Lease is one request's reservation of a model: while it is held the
// model is not put to sleep under the request (unless its stream was
// moved to another instance). Release it exactly once; more calls do
// nothing.
type Lease struct {
	s      *Switcher
	m      *model
	stream bool
	moved  bool // its stream runs on another instance now
	once   sync.Once
}

// BackendURL is where the request goes.
func (l *Lease) BackendURL() string { return l.m.cfg().BackendURL }

// ServedModelName is the engine's name of the model.
func (l *Lease) ServedModelName() string { return l.m.cfg().ServedName(l.m.alias) }

// Release gives the reservation back.
func (l *Lease) Release() {
	l.once.Do(func() {
		l.s.mu.Lock()
		defer l.s.mu.Unlock()
		delete(l.m.leases, l)
		l.m.lastUsed = time.Now()
		l.s.notifyLocked()
		if l.m.cfg().ttl() > 0 && len(l.m.leases) == 0 {
			l.m.g.kickNow() // its idle time starts: the group times it
		}
	})
}

func (s *Switcher) grantLocked(w *waiter) {
	if !w.admin {
		w.lease = &Lease{s: s, m: w.m, stream: w.stream}
		w.m.leases[w.lease] = struct{}{}
		w.m.lastUsed = time.Now()
	}
	w.ready <- nil
}

// Acquire reserves alias for one request: at once when it is awake and
// its group is not switching, else queued until a switch wakes it (or
// fails, or the request timeout passes, or ctx ends). stream says the
// request streams (only streams can move by migration).
func (s *Switcher) Acquire(ctx context.Context, alias string, stream bool) (*Lease, error) {
	w, granted, err := s.enqueue(alias, stream, false)
	switch {
	case err != nil:
		return nil, err
	case granted:
		return w.lease, nil
	}
	if err := s.await(ctx, w, s.ctl().requestTimeout()); err != nil {
		return nil, err
	}
	return w.lease, nil
}

// enqueue grants a request at once where it can (granted), else queues
// it: its lease is then w's to read only after w.ready answered.
func (s *Switcher) enqueue(alias string, stream, admin bool) (w *waiter, granted bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.models[alias]
	if !ok {
		return nil, false, fmt.Errorf("%w: %s", ErrUnknownModel, alias)
	}
	w = &waiter{m: m, at: time.Now(), stream: stream, admin: admin, ready: make(chan error, 1)}
	if m.state == StateAwake && m.g.switching == nil {
		s.grantLocked(w)
		<-w.ready
		return w, true, nil
	}
	m.g.waiters = append(m.g.waiters, w)
	m.queued++
	s.met.queued.WithLabelValues(m.alias).Set(float64(m.queued))
	m.g.kickNow()
	return w, false, nil
}

// await waits for w's turn, at most timeout.
func (s *Switcher) await(ctx context.Context, w *waiter, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	var cause error
	select {
	case err := <-w.ready:
		return err
	case <-ctx.Done():
		cause = ctx.Err()
	case <-t.C:
		cause = fmt.Errorf("%w (%v, %s is %s)", ErrQueueTimeout, timeout, w.m.alias, s.State()[w.m.alias].State)
	}
	s.mu.Lock()
	if s.dequeueLocked(w) {
		s.mu.Unlock()
		return cause
	}
	s.mu.Unlock()
	// Granted meanwhile: the lease is ours to give back.
	if err := <-w.ready; err == nil && w.lease != nil {
		w.lease.Release()
	}
	return cause
}

// dequeueLocked removes w from its group's queue; false if it was not
// there (granted or failed already).
func (s *Switcher) dequeueLocked(w *waiter) bool {
	g := w.m.g
	for i, x := range g.waiters {
		if x == w {
			g.waiters = append(g.waiters[:i], g.waiters[i+1:]...)
			w.m.queued--
			s.met.queued.WithLabelValues(w.m.alias).Set(float64(w.m.queued))
			return true
		}
	}
	return false
}

// settleLocked grants (err nil) or fails every waiter of m.
func (s *Switcher) settleLocked(m *model, err error) {
	keep := m.g.waiters[:0]
	for _, w := range m.g.waiters {
		if w.m != m {
			keep = append(keep, w)
			continue
		}
		m.queued--
		if err != nil {
			w.ready <- err
		} else {
			s.grantLocked(w)
		}
	}
	m.g.waiters = keep
	s.met.queued.WithLabelValues(m.alias).Set(float64(m.queued))
}

// nextLocked is the model g should serve next: the highest priority among
// those with waiters, then the longest waiting.
func (g *group) nextLocked() *model {
	var best *waiter
	for _, w := range g.waiters {
		if best == nil || w.m.cfg().Priority > best.m.cfg().Priority ||
			(w.m.cfg().Priority == best.m.cfg().Priority && w.at.Before(best.at)) {
			best = w
		}
	}
	if best == nil {
		return nil
	}
	return best.m
}

// holdLocked is when the awake model other than t may be put to sleep:
// not before its minimum awake time and its prewarm pin end.
func (s *Switcher) holdLocked(g *group, t *model) time.Time {
	var until time.Time
	for _, m := range g.members {
		if m == t || m.state != StateAwake {
			continue
		}
		if h := m.awakeSince.Add(s.ctl().minAwake()); h.After(until) {
			until = h
		}
		if m.pinnedUntil.After(until) {
			until = m.pinnedUntil
		}
	}
	return until
}

// serve is g's goroutine: start-up, then one transition at a time.
func (s *Switcher) serve(ctx context.Context, g *group) {
	s.startup(ctx, g, true)
	stop := func() {
		s.mu.Lock()
		for _, m := range g.members {
			s.settleLocked(m, ErrClosed)
		}
		if g.retry != nil {
			g.retry.Stop()
		}
		if g.idle != nil {
			g.idle.Stop()
		}
		s.mu.Unlock()
	}
	for {
		select {
		case <-ctx.Done():
			stop()
			return
		case <-g.kick:
		}
		if s.membershipChanges(ctx, g) {
			stop() // a reload let its last member go
			return
		}
		s.resyncIfAsked(ctx, g)
		for ctx.Err() == nil {
			s.mu.Lock()
			t := g.nextLocked()
			if t == nil {
				s.mu.Unlock()
				break
			}
			if t.state == StateAwake && s.onlyAwakeLocked(g, t) {
				s.settleLocked(t, nil)
				s.mu.Unlock()
				continue
			}
			if until := s.holdLocked(g, t); time.Now().Before(until) {
				// The awake model keeps serving until its hold ends; the
				// queue waits (each request within its own timeout).
				if g.retry != nil {
					g.retry.Stop()
				}
				g.retry = time.AfterFunc(time.Until(until), g.kickNow)
				s.mu.Unlock()
				break
			}
			g.switching = t
			s.notifyLocked()
			s.mu.Unlock()
			err := s.switchTo(ctx, g, t)
			s.mu.Lock()
			g.switching = nil
			if err != nil {
				err = &SwitchError{Model: t.alias, Err: err}
			}
			s.settleLocked(t, err)
			s.notifyLocked()
			s.mu.Unlock()
		}
		if ctx.Err() == nil {
			s.sleepIdle(ctx, g)
		}
	}
}

// onlyAwakeLocked says whether t is g's one awake model.
func (s *Switcher) onlyAwakeLocked(g *group, t *model) bool {
	for _, m := range g.members {
		if m != t && m.state != StateSleeping {
			return false
		}
	}
	return true
}
