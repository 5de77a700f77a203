package switching

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeEngine is an engine's sleep state with faults to inject.
type fakeEngine struct {
	mu        sync.Mutex
	asleep    bool
	answer    string        // what the probe answers while awake
	delay     time.Duration // of every sleep and wake-up
	fail      map[string]error
	wrongWake bool // woken, it answers something else
	calls     []string
}

func (f *fakeEngine) call(name string) error {
	f.mu.Lock()
	f.calls = append(f.calls, name)
	err, d := f.fail[name], f.delay
	f.mu.Unlock()
	if d > 0 && (name == "sleep" || name == "wake") {
		time.Sleep(d)
	}
	return err
}

// sleeps counts the sleep calls.
func (f *fakeEngine) sleeps() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if c == "sleep" {
			n++
		}
	}
	return n
}

func (f *fakeEngine) Sleep(ctx context.Context, level int) error {
	if err := f.call("sleep"); err != nil {
		return err
	}
	f.mu.Lock()
	f.asleep = true
	f.mu.Unlock()
	return nil
}

func (f *fakeEngine) WakeUp(ctx context.Context, tags ...string) error {
	if err := f.call("wake"); err != nil {
		return err
	}
	f.mu.Lock()
	f.asleep = false
	if f.wrongWake {
		f.answer = "garbage"
	}
	f.mu.Unlock()
	return nil
}

func (f *fakeEngine) ReloadWeights(ctx context.Context) error { return f.call("reload") }

func (f *fakeEngine) IsSleeping(ctx context.Context) (bool, error) {
	if err := f.call("is_sleeping"); err != nil {
		return false, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.asleep, nil
}

func (f *fakeEngine) Probe(ctx context.Context, prompt string) (string, error) {
	if err := f.call("probe"); err != nil {
		return "", err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.answer, nil
}

func (f *fakeEngine) count(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if c == name {
			n++
		}
	}
	return n
}

func (f *fakeEngine) set(fn func(*fakeEngine)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

type rig struct {
	t       *testing.T
	s       *Switcher
	engines map[string]*fakeEngine
}

// newRig runs a switcher over fake engines: awake names the models awake
// at start; every model is in group g unless its name says otherwise.
func newRig(t *testing.T, c Controller, models map[string]Model, awake ...string) *rig {
	t.Helper()
	r := &rig{t: t, engines: map[string]*fakeEngine{}}
	for alias := range models {
		r.engines[alias] = &fakeEngine{asleep: true, answer: "answer of " + alias, delay: 5 * time.Millisecond, fail: map[string]error{}}
	}
	for _, a := range awake {
		r.engines[a].asleep = false
	}
	s, err := New(Options{Models: models, Controller: c, Backend: func(alias string, _ Model) Backend { return r.engines[alias] }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.Run(ctx)
	t.Cleanup(func() { cancel(); s.Wait() })
	r.s = s
	return r
}

func oneGroup(names ...string) map[string]Model {
	out := map[string]Model{}
	for i, n := range names {
		out[n] = Model{BackendURL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i), Group: "gpu0"}
	}
	return out
}

func (r *rig) acquire(alias string) *Lease {
	r.t.Helper()
	l, err := r.s.Acquire(context.Background(), alias, true)
	if err != nil {
		r.t.Fatalf("acquire %s: %v", alias, err)
	}
	return l
}

func (r *rig) states() string {
	var parts []string
	for _, a := range r.s.Aliases() {
		parts = append(parts, a+"="+r.s.State()[a].State)
	}
	return strings.Join(parts, " ")
}

// A-B-B-A with overlap: requests for a sleeping model queue and join one
// switch; a switch back waits for the requests the awake model runs.
func TestSwitchABBA(t *testing.T) {
	r := newRig(t, Controller{}, oneGroup("a", "b"), "a")
	la := r.acquire("a")
	if got := r.states(); got != "a=awake b=sleeping" {
		t.Fatalf("at start: %s", got)
	}
	// Eight requests for b while a's request runs: one switch, after it.
	var wg sync.WaitGroup
	leases := make(chan *Lease, 8)
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); leases <- r.acquire("b") }()
	}
	deadline := time.Now().Add(5 * time.Second)
	for r.s.State()["b"].Queued != 8 || r.s.State()["a"].State != StateAwake {
		if time.Now().After(deadline) {
			t.Fatalf("the queue: %+v", r.s.State())
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	if r.engines["a"].count("sleep") != 0 {
		t.Fatal("a was put to sleep under a running request")
	}
	la.Release()
	la.Release() // a second release is nothing
	wg.Wait()
	close(leases)
	if got := r.states(); got != "a=sleeping b=awake" {
		t.Fatalf("after the switch: %s", got)
	}
	if n := r.engines["b"].count("wake"); n != 1 {
		t.Fatalf("b woken %d times for eight requests", n)
	}
	rep := r.s.State()["b"].LastSwitch
	if rep == nil || rep.From != "a" || rep.State != OutcomeSucceeded || !strings.Contains(rep.Drain, "waited for 1 request") {
		t.Fatalf("report %+v", rep)
	}
	for l := range leases {
		l.Release()
	}
	// And back to a.
	r.acquire("a").Release()
	if got := r.states(); got != "a=awake b=sleeping" {
		t.Fatalf("after the switch back: %s", got)
	}
	if st := r.s.State()["a"]; st.Active != 0 || st.Queued != 0 {
		t.Fatalf("a reservation leaked: %+v", st)
	}
}

func TestQueuedRequestTimesOutAndCancels(t *testing.T) {
	r := newRig(t, Controller{RequestTimeoutS: 0.1}, oneGroup("a", "b"), "a")
	r.engines["b"].set(func(f *fakeEngine) { f.delay = 400 * time.Millisecond })
	t0 := time.Now()
	_, err := r.s.Acquire(context.Background(), "b", false)
	if !errors.Is(err, ErrQueueTimeout) || time.Since(t0) > 300*time.Millisecond {
		t.Fatalf("after %v: %v", time.Since(t0), err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	if _, err := r.s.Acquire(ctx, "b", false); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	if st := r.s.State()["b"]; st.Queued != 0 || st.Active != 0 {
		t.Fatalf("left behind: %+v", st)
	}
	// The switch itself went on: b ends awake with no lease held.
	deadline := time.Now().Add(5 * time.Second)
	for r.s.State()["b"].State != StateAwake {
		if time.Now().After(deadline) {
			t.Fatalf("states %s", r.states())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st := r.s.State()["b"]; st.Active != 0 {
		t.Fatalf("a timed-out request holds a lease: %+v", st)
	}
}

// A failed wake-up fails the queued requests with the cause, leaves the
// model in error, and the next request reconciles and goes on.
func TestAFailedWakeFailsClosedThenReconciles(t *testing.T) {
	r := newRig(t, Controller{}, oneGroup("a", "b"), "a")
	r.engines["b"].set(func(f *fakeEngine) { f.fail["wake"] = errors.New("CUDA out of memory") })
	_, err := r.s.Acquire(context.Background(), "b", true)
	var se *SwitchError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), "CUDA out of memory") {
		t.Fatalf("acquire: %v", err)
	}
	if got := r.states(); got != "a=sleeping b=error" {
		t.Fatalf("after the failure: %s", got)
	}
	r.engines["b"].set(func(f *fakeEngine) { delete(f.fail, "wake") })
	r.acquire("b").Release()
	if got := r.states(); got != "a=sleeping b=awake" {
		t.Fatalf("after the retry: %s", got)
	}
}

// A woken engine that answers its probe otherwise than before is in error
// and its requests fail: wrong weights never serve.
func TestAWrongWakeIsCaughtByTheProbe(t *testing.T) {
	r := newRig(t, Controller{}, oneGroup("a", "b"), "a", "b")
	// Both awake at start: the first alias stays, b is put to sleep (its
	// probe recorded first).
	deadline := time.Now().Add(5 * time.Second)
	for r.states() != "a=awake b=sleeping" {
		if time.Now().After(deadline) {
			t.Fatalf("start-up: %s", r.states())
		}
		time.Sleep(5 * time.Millisecond)
	}
	r.engines["b"].set(func(f *fakeEngine) { f.wrongWake = true })
	_, err := r.s.Acquire(context.Background(), "b", true)
	if err == nil || !strings.Contains(err.Error(), "wake check failed") {
		t.Fatalf("acquire: %v", err)
	}
	if st := r.s.State()["b"]; st.State != StateError {
		t.Fatalf("b is %s", st.State)
	}
}

// Two awake where one may be is an error for both, never a guess.
func TestTwoAwakeAreBothInError(t *testing.T) {
	r := newRig(t, Controller{}, oneGroup("a", "b"), "a")
	r.engines["a"].set(func(f *fakeEngine) { f.fail["sleep"] = errors.New("sleep refused") })
	if _, err := r.s.Acquire(context.Background(), "b", true); err == nil {
		t.Fatal("the switch went on with a refusing to sleep")
	}
	// a is in error; meanwhile someone woke b by hand and a never slept.
	r.engines["a"].set(func(f *fakeEngine) { delete(f.fail, "sleep") })
	r.engines["b"].set(func(f *fakeEngine) { f.asleep = false })
	r.s.mu.Lock()
	r.s.setStateLocked(r.s.models["b"], StateUnknown, nil)
	r.s.mu.Unlock()
	_, err := r.s.Acquire(context.Background(), "b", true)
	if err == nil || !strings.Contains(err.Error(), "at most one may be") {
		t.Fatalf("acquire: %v", err)
	}
	if got := r.states(); got != "a=error b=error" {
		t.Fatalf("states: %s", got)
	}
}

// The queue goes by priority, then by age: among the requests waiting
// when the group is free to switch (here, once a's minimum awake time
// ends), the highest priority model is woken first.
func TestPriorityOrdersTheQueue(t *testing.T) {
	models := oneGroup("a", "b", "c")
	b := models["b"]
	b.Priority = 5
	models["b"] = b
	r := newRig(t, Controller{MinAwakeS: 0.2}, models)
	la := r.acquire("a")
	var order []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, m := range []string{"c", "b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := r.acquire(m)
			mu.Lock()
			order = append(order, m)
			mu.Unlock()
			l.Release()
		}()
		time.Sleep(20 * time.Millisecond) // c queues first
	}
	la.Release()
	wg.Wait()
	if strings.Join(order, ",") != "b,c" {
		t.Fatalf("served %v", order)
	}
}

// A model woken less than min_awake_s ago keeps serving; the switch away
// waits for the floor.
func TestMinAwakeHoldsTheSwitch(t *testing.T) {
	r := newRig(t, Controller{MinAwakeS: 0.3}, oneGroup("a", "b"))
	r.acquire("a").Release()
	t0 := time.Now()
	r.acquire("b").Release()
	if d := time.Since(t0); d < 250*time.Millisecond {
		t.Fatalf("b woken %v after a: under the minimum awake time", d)
	}
}

// fakeMover moves every stream away and says when none is left.
type fakeMover struct {
	calls atomic.Int32
	left  atomic.Int32
}

func (m *fakeMover) MoveAway(ctx context.Context, alias string, _ Model) (func() int, string, bool) {
	m.calls.Add(1)
	return func() int { return int(m.left.Load()) }, "moved 1 stream to " + alias + "-2 by migration", true
}

// With a Mover, a switch does not wait for the streams the awake model
// runs: they go on elsewhere, and their leases no longer hold it.
func TestStreamsMovedInsteadOfWaitedFor(t *testing.T) {
	mv := &fakeMover{}
	r := &rig{t: t, engines: map[string]*fakeEngine{}}
	models := oneGroup("a", "b")
	for alias := range models {
		r.engines[alias] = &fakeEngine{asleep: alias != "a", answer: alias, fail: map[string]error{}}
	}
	s, err := New(Options{Models: models, Mover: mv, Backend: func(alias string, _ Model) Backend { return r.engines[alias] }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); s.Wait() }()
	s.Run(ctx)
	r.s = s
	long := r.acquire("a") // a long stream, never released in time
	r.acquire("b").Release()
	if mv.calls.Load() != 1 || r.states() != "a=sleeping b=awake" {
		t.Fatalf("mover calls %d, states %s", mv.calls.Load(), r.states())
	}
	if rep := s.State()["b"].LastSwitch; !strings.Contains(rep.Drain, "by migration") {
		t.Fatalf("report %+v", rep)
	}
	// The moved stream's lease does not hold a's next drain.
	r.acquire("a").Release()
	r.acquire("b").Release()
	if mv.calls.Load() != 1 {
		t.Fatalf("the moved stream was moved again: %d calls", mv.calls.Load())
	}
	long.Release()
}

func TestConfigErrors(t *testing.T) {
	ok := Model{BackendURL: "http://127.0.0.1:8000"}
	for _, c := range []struct {
		models map[string]Model
		ctl    Controller
		want   string
	}{
		{map[string]Model{"a": {BackendURL: "127.0.0.1:8000"}}, Controller{}, "backend_url"},
		{map[string]Model{"a": {BackendURL: ok.BackendURL, SleepLevel: 3}}, Controller{}, "sleep_level"},
		{map[string]Model{"a": {BackendURL: ok.BackendURL, WakeTags: []string{"all"}}}, Controller{}, "wake_tags"},
		{map[string]Model{"a": ok, "b": ok}, Controller{}, "the same backend"},
		{map[string]Model{"a": ok}, Controller{Policy: "random"}, "policy"},
		{map[string]Model{"a": ok}, Controller{StartupAwakeModel: "z"}, "startup_awake_model"},
		{map[string]Model{"a": ok}, Controller{SwitchTimeoutS: -1}, "negative"},
		{map[string]Model{"a/b": ok}, Controller{}, "alias"},
	} {
		if err := Check(c.models, c.ctl); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v %+v: %v, want %q", c.models, c.ctl, err, c.want)
		}
	}
}

// levels records each fake engine's sleep levels.
type levelEngine struct {
	*fakeEngine
	mu     sync.Mutex
	levels []int
}

func (e *levelEngine) Sleep(ctx context.Context, level int) error {
	e.mu.Lock()
	e.levels = append(e.levels, level)
	e.mu.Unlock()
	return e.fakeEngine.Sleep(ctx, level)
}

// Under a host memory budget a switch that would pass it demotes the
// group's least recently used level-1 sleeper to level 2 (woken and put
// back to sleep while the GPU is free), and that model's next wake-up
// reloads its weights; with nothing to demote the sleeping model itself
// sleeps at level 2.
func TestHostMemoryBudgetDemotesTheLeastRecentlyUsed(t *testing.T) {
	models := oneGroup("a", "b", "c")
	for k, m := range models {
		m.HostMemoryGB = 16
		models[k] = m
	}
	engines := map[string]*levelEngine{}
	for _, alias := range []string{"a", "b", "c"} {
		engines[alias] = &levelEngine{fakeEngine: &fakeEngine{asleep: alias != "a", answer: alias, fail: map[string]error{}}}
	}
	s, err := New(Options{Models: models, Controller: Controller{HostMemoryBudgetGB: 24},
		Backend: func(alias string, _ Model) Backend { return engines[alias] }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); s.Wait() }()
	s.Run(ctx)
	r := &rig{t: t, s: s}
	r.acquire("a").Release()
	r.acquire("b").Release() // a sleeps at level 1: 16 GB of 24
	if hm := s.HostMemory(); hm.UsedGB != 16 || s.State()["a"].SleepLevel != 1 {
		t.Fatalf("after a → b: %+v, a %+v", hm, s.State()["a"])
	}
	r.acquire("c").Release() // b at level 1 would make 32: a (the least recently used) is demoted
	if got := s.State(); got["a"].SleepLevel != 2 || got["b"].SleepLevel != 1 || s.HostMemory().UsedGB != 16 {
		t.Fatalf("after b → c: a %+v, b %+v, %+v", got["a"], got["b"], s.HostMemory())
	}
	engines["a"].mu.Lock()
	levels := fmt.Sprint(engines["a"].levels)
	engines["a"].mu.Unlock()
	if levels != "[1 2]" || engines["a"].count("wake") != 1 {
		t.Fatalf("a slept at %s, woke %d times (once for its demotion)", levels, engines["a"].count("wake"))
	}
	rep := s.State()["c"].LastSwitch
	var steps []string
	for _, st := range rep.Steps {
		steps = append(steps, st.Step+":"+st.Model)
	}
	if got := strings.Join(steps, " "); !strings.Contains(got, "sleep:b verify_sleeping:b demote:a wake:c") {
		t.Fatalf("steps %s", got)
	}
	// a, demoted, wakes as level 2 does: its weights are reloaded.
	r.acquire("a").Release()
	if n := engines["a"].count("reload"); n != 1 {
		t.Fatalf("a's wake-up after its demotion reloaded %d times", n)
	}
	// c sleeps now; b (level 1, 16 GB) is the one to demote, and is.
	if got := s.State(); got["c"].SleepLevel != 1 || got["b"].SleepLevel != 2 || s.HostMemory().UsedGB != 16 {
		t.Fatalf("after c → a: %+v %+v %+v", got["b"], got["c"], s.HostMemory())
	}
}

// A model with a ttl goes to sleep once no request used it for that long
// — not while a request holds it, however long — and the next request
// wakes it again.
func TestAnIdleModelSleepsAfterItsTTL(t *testing.T) {
	models := oneGroup("a", "b")
	a := models["a"]
	a.TTLS = 0.2
	models["a"] = a
	r := newRig(t, Controller{}, models, "a")
	l := r.acquire("a")
	time.Sleep(400 * time.Millisecond) // past the ttl, with the request still running
	if got := r.states(); got != "a=awake b=sleeping" {
		t.Fatalf("with a request running past the ttl: %s", got)
	}
	released := time.Now()
	l.Release()
	deadline := time.Now().Add(5 * time.Second)
	for r.states() != "a=sleeping b=sleeping" {
		if time.Now().After(deadline) {
			t.Fatalf("a did not go to sleep after its ttl: %s", r.states())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if idle := time.Since(released); idle < 200*time.Millisecond {
		t.Fatalf("a went to sleep %v after its last request, before its ttl (200 ms)", idle)
	}
	if r.engines["a"].sleeps() != 1 {
		t.Fatalf("a was put to sleep %d times", r.engines["a"].sleeps())
	}
	r.acquire("a").Release()
	if got := r.states(); got != "a=awake b=sleeping" {
		t.Fatalf("a request after the idle sleep: %s", got)
	}
}

// A negative ttl is refused when the configuration is read.
func TestANegativeTTLIsRefused(t *testing.T) {
	models := oneGroup("a")
	a := models["a"]
	a.TTLS = -1
	models["a"] = a
	if err := Check(models, Controller{}); err == nil || !strings.Contains(err.Error(), "models.a.ttl_s") {
		t.Fatalf("a negative ttl: %v", err)
	}
}

// waitStates waits until the switcher's states read want.
func (r *rig) waitStates(want string) {
	r.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for r.states() != want {
		if time.Now().After(deadline) {
			r.t.Fatalf("states %q, want %q", r.states(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A reload (vhi host's SIGHUP) changes a running switcher: settings take
// effect at once, a new model joins its group (put to sleep where another
// of the group is awake) or starts a group of its own, an idle model no
// longer configured is let go and one in use stays; what needs a restart
// (the policy, a model's group or backend) is said and left; a file that
// does not check changes nothing.
func TestReconfigureWhileServing(t *testing.T) {
	r := newRig(t, Controller{}, oneGroup("a", "b"), "a")
	r.waitStates("a=awake b=sleeping")
	held := r.acquire("a")
	r.engines["c"] = &fakeEngine{asleep: false, answer: "answer of c", fail: map[string]error{}} // awake beside a
	r.engines["d"] = &fakeEngine{asleep: true, answer: "answer of d", fail: map[string]error{}}
	next := oneGroup("a", "b", "c")
	delete(next, "b")
	a := next["a"]
	a.TTLS, a.BackendURL = 0.2, "http://127.0.0.1:9999" // the ttl applies; the backend does not
	next["a"] = a
	next["d"] = Model{BackendURL: "http://127.0.0.1:9100", Group: "gpu1"}
	left, err := r.s.Reconfigure(next, Controller{Policy: PolicyAwakePrevious})
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 2 || !strings.Contains(left[0], "controller.policy") || !strings.Contains(left[1], "models.a: its group and backend_url") {
		t.Fatalf("not applied: %q", left)
	}
	if r.s.Has("b") {
		t.Fatal("b, idle and no longer configured, is still switched")
	}
	if _, err := r.s.Acquire(context.Background(), "b", true); !errors.Is(err, ErrUnknownModel) {
		t.Fatalf("a request for b after the reload: %v", err)
	}
	r.waitStates("a=awake c=sleeping d=sleeping")
	if n := r.engines["c"].sleeps(); n != 1 {
		t.Fatalf("c, added awake beside a, was put to sleep %d times", n)
	}
	if got := r.s.State()["a"].BackendURL; got != "http://127.0.0.1:9000" {
		t.Fatalf("a's backend after the reload: %s", got)
	}
	// d's group serves: a request wakes d without touching gpu0.
	ld := r.acquire("d")
	r.waitStates("a=awake c=sleeping d=awake")
	// The ttl applies: a sleeps once idle past it.
	held.Release()
	r.waitStates("a=sleeping c=sleeping d=awake")

	// d is in use: removed from the file, it stays until a reload finds
	// it idle; then its group's goroutine ends.
	delete(next, "d")
	if left, err := r.s.Reconfigure(next, Controller{}); err != nil || len(left) != 2 || !strings.Contains(left[1], "models.d: removed from the file, but in use (1 requests)") {
		t.Fatalf("removing d while in use: %q, %v", left, err)
	}
	ld.Release()
	if left, err := r.s.Reconfigure(next, Controller{}); err != nil || len(left) != 1 || r.s.Has("d") {
		t.Fatalf("removing d once idle: %q, %v (still there: %v)", left, err, r.s.Has("d"))
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		r.s.mu.Lock()
		groups := len(r.s.groups)
		r.s.mu.Unlock()
		if groups == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d groups after d's left, want 1", groups)
		}
		time.Sleep(5 * time.Millisecond)
	}

	// A file that does not check changes nothing.
	bad := oneGroup("a", "c")
	bad["c"] = Model{BackendURL: "nope"}
	if _, err := r.s.Reconfigure(bad, Controller{MinAwakeS: 30}); err == nil || !strings.Contains(err.Error(), "models.c.backend_url") {
		t.Fatalf("a bad file: %v", err)
	}
	if r.s.ctl().MinAwakeS != 0 || r.s.State()["c"].BackendURL != "http://127.0.0.1:9002" {
		t.Fatalf("a bad file changed the running configuration: %+v", r.s.ctl())
	}
}

// The engines model switching owns (never a replica spare) are found by
// their backend URL, a trailing slash either side not mattering.
func TestOwnsBackendByURL(t *testing.T) {
	s, err := New(Options{Models: map[string]Model{"a": {BackendURL: "http://10.0.0.1:8001/"}, "b": {BackendURL: "http://10.0.0.1:8002"}},
		Backend: func(string, Model) Backend { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	for url, want := range map[string]bool{
		"http://10.0.0.1:8001": true, "http://10.0.0.1:8002/": true, "http://10.0.0.1:8003": false, "": false,
	} {
		if got := s.OwnsBackend(url); got != want {
			t.Errorf("%q: owned %v, want %v", url, got, want)
		}
	}
}

// A Host that takes a shared store over learns the switched models' states
// again (Resync): the Host before it switched the engines meanwhile, and
// may have left a switch half done with two awake. The group keeps the
// awake one (the startup model where it is one of them), puts the other to
// sleep, and wakes nothing.
func TestResyncLearnsWhatAnotherHostSwitched(t *testing.T) {
	r := newRig(t, Controller{StartupAwakeModel: "a"}, oneGroup("a", "b", "c"), "a")
	r.waitStates("a=awake b=sleeping c=sleeping")
	// Another Host woke b and put a to sleep.
	r.engines["a"].set(func(f *fakeEngine) { f.asleep = true })
	r.engines["b"].set(func(f *fakeEngine) { f.asleep = false })
	r.s.Resync()
	r.waitStates("a=sleeping b=awake c=sleeping")
	if n := r.engines["a"].count("wake"); n != 0 {
		t.Fatalf("resync woke the startup model %d times", n)
	}
	// A switch left half done: b and c awake. One goes back to sleep.
	r.engines["c"].set(func(f *fakeEngine) { f.asleep = false })
	r.s.Resync()
	for deadline := time.Now().Add(5 * time.Second); r.engines["c"].sleeps() != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("c, awake beside b, was put to sleep %d times", r.engines["c"].sleeps())
		}
	}
	r.waitStates("a=sleeping b=awake c=sleeping")
	r.acquire("b").Release() // serves at once
}
