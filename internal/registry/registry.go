// Package registry is the Host's table of instances: who they are, which
// role and state each is in, and whether its agent is still heartbeating.
// What the Host decided about an instance (role, retired, draining) is
// written through to a store, so it survives a Host restart; agents that
// restart get it back when they register again.
package registry

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/store"
)

// Role is what an instance does for its model.
type Role string

// Roles.
const (
	RoleActive  Role = "active"  // receives new requests for its models
	RoleStandby Role = "standby" // a migration target; receives nothing
)

// State is an instance's lifecycle state.
type State string

// States. Active and standby mirror the role while healthy; draining is
// set by an operator; migrating is derived from the operation holding the
// instance, and unreachable from missed heartbeats, which wins over
// everything else when listing.
const (
	StateActive      State = "active"
	StateStandby     State = "standby"
	StateMigrating   State = "migrating"
	StateDraining    State = "draining"
	StateUnreachable State = "unreachable"
)

// Lifecycle is what an instance is doing, as operators see it: one value
// that tells whether it serves, waits, is asleep or gone.
type Lifecycle string

// Lifecycles.
const (
	LifecycleActive    Lifecycle = "active"    // serves its models
	LifecycleStandby   Lifecycle = "standby"   // awake, a migration target
	LifecycleSleeping  Lifecycle = "sleeping"  // its engine sleeps (not by a migration)
	LifecycleDraining  Lifecycle = "draining"  // gets no new requests
	LifecycleRetired   Lifecycle = "retired"   // a destroy_source migration moved its requests away and released its KV
	LifecycleUnhealthy Lifecycle = "unhealthy" // its agent stopped heartbeating, or its engine is not healthy
)

// Operation kinds that hold an instance.
const (
	OpMigration = "migration"
	OpWake      = "wake"
)

// Operation is what holds an instance busy: a migration, a wake. The
// registry is the one place that says so; the migrating state is derived
// from it.
type Operation struct {
	Kind string
	ID   string
}

func (o Operation) String() string {
	if o.ID == "" {
		return o.Kind
	}
	return o.Kind + " " + o.ID
}

// Engine is what an agent reports about its engine.
type Engine struct {
	URL          string
	ServedModels []string
	Model        string
	TP, PP       int
	MaxModelLen  int
	Migratable   bool
	Kind         string
	Version      string
	Geometry     Geometry
	// HooksAuthenticated: the engine refuses hook calls without the
	// agent's credential.
	HooksAuthenticated bool
}

// Geometry mirrors the KV geometry an agent reports.
type Geometry struct {
	Layers, KVHeads, HeadDim, DTypeBytes, BlockSize, NumBlocks int
	DType                                                      string
}

// Stats is the engine load an agent reports with each heartbeat.
type Stats struct {
	Healthy                 bool
	Running, Waiting        int
	FreeBlocks, TotalBlocks int
	Sleeping                bool
}

// Registration is an agent's request to register.
type Registration struct {
	ID              string
	Type            string // "A" or "B"
	Engine          Engine
	AgentAddress    string
	DataAddress     string
	Session         string
	Hostname        string
	TransferBackend string
	TLS             bool // the agent's gRPC service and data plane speak TLS
	// Role and Retired are what the agent last heard from a Host (empty
	// and false from a fresh agent): a Host that has no record of the
	// instance takes them over instead of the start-up type.
	Role    Role
	Retired bool
	// GPUs are the agent's node's GPUs (NVML), GPUNote why there are none.
	GPUs    []GPU
	GPUNote string
	// RDMA is the agent's rdma data plane (nil: none; RDMANote why).
	RDMA     *RDMA
	RDMANote string
}

// RDMA is what an agent reported of its rdma data plane (UCX).
type RDMA struct {
	UCXVersion string
	Devices    []string // RDMA devices; none: UCX over TCP and shared memory
	Transports []string
	CUDA       bool
}

// GPU is one GPU an agent reported.
type GPU struct {
	Index       int
	UUID, Name  string
	MemoryBytes uint64
	PCIBusID    string
}

// Instance is one registered engine. Values returned by the registry are
// copies.
type Instance struct {
	Registration
	Role    Role
	State   State     // operational state (active/standby/draining)
	Busy    Operation // what holds it (zero: nothing)
	Retired bool      // released by a destroy_source migration, not woken since
	// Stopping: its agent is being stopped and had the Host drain it; it
	// comes back active, not draining, when it registers again.
	Stopping bool
	// Scaling: the Host is scaling its engine (elastic EP): it is routed
	// to while its health checks fail (vLLM answers 503 through a commit).
	Scaling       bool
	RegisteredAt  time.Time
	LastHeartbeat time.Time
	Stats         Stats
	Reachable     bool
	// wokenAt is when the Host last woke the engine (Woken): an agent
	// collects its stats before it sends them, so a heartbeat that
	// arrives up to one heartbeat interval later may still say the
	// engine sleeps.
	wokenAt time.Time
}

// EffectiveState is the state to show and route by.
func (i Instance) EffectiveState() State {
	switch {
	case !i.Reachable:
		return StateUnreachable
	case i.Busy.Kind == OpMigration:
		return StateMigrating
	}
	return i.State
}

// Lifecycle is the instance's lifecycle.
func (i Instance) Lifecycle() Lifecycle {
	switch {
	case !i.Reachable || (!i.Stats.Healthy && !i.Scaling):
		return LifecycleUnhealthy
	case i.Retired:
		return LifecycleRetired
	case i.Stats.Sleeping:
		return LifecycleSleeping
	case i.State == StateDraining:
		return LifecycleDraining
	case i.Role == RoleActive:
		return LifecycleActive
	}
	return LifecycleStandby
}

// NotReady says why the instance cannot take part in an operation now,
// "" when it can: no heartbeat within the registry's window, or its engine
// answered the agent's last health check unhealthy. An operator refused
// with it learns which side to look at.
func (i Instance) NotReady(now time.Time) string {
	switch {
	case !i.Reachable:
		return fmt.Sprintf("%s is unreachable (its last heartbeat %s ago)", i.ID, now.Sub(i.LastHeartbeat).Round(100*time.Millisecond))
	case !i.Stats.Healthy:
		return fmt.Sprintf("%s's engine failed its last health check", i.ID)
	}
	return ""
}

// routable reports whether new requests may go to the instance.
func (i *Instance) routable() bool {
	// A scaling engine answers 503 to its health checks: the Host holds
	// its requests through the commit rather than take it for unhealthy.
	return i.Role == RoleActive && i.State == StateActive && i.Reachable && (i.Stats.Healthy || i.Scaling) && !i.Retired && !i.Stats.Sleeping
}

// Serves reports whether the instance serves model.
func (i Instance) Serves(model string) bool {
	for _, m := range i.Engine.ServedModels {
		if m == model {
			return true
		}
	}
	return false
}

// ServesModelsOf reports whether i serves every model o serves (where o's
// requests can go).
func (i Instance) ServesModelsOf(o Instance) bool {
	for _, m := range o.Engine.ServedModels {
		if !i.Serves(m) {
			return false
		}
	}
	return true
}

// Persister keeps instance records durable (the Host's store).
type Persister interface {
	PutInstance(store.Instance) error
	DeleteInstance(id string) error
}

// Registry is safe for concurrent use.
type Registry struct {
	mu        sync.Mutex
	now       func() time.Time
	interval  time.Duration // expected heartbeat interval
	missed    int           // heartbeats missed before unreachable
	retention time.Duration // how long an instance without an agent is remembered
	instances map[string]*Instance
	// departed are instances whose agent deregistered (a clean stop): not
	// listed, remembered so the agent gets its role back when it returns.
	departed map[string]store.Instance
	rr       map[string]int // round-robin cursor per model
	busy     map[string]Operation
	persist  Persister
	log      *zap.Logger
}

// Options configure a Registry.
type Options struct {
	HeartbeatInterval time.Duration // default 1 s
	MissedHeartbeats  int           // default 3
	// Retention bounds how long an instance whose agent stopped (or never
	// came back after a Host restart) is remembered; default 24 h.
	Retention time.Duration
	Now       func() time.Time
	Persist   Persister // nil: nothing survives a restart
	Log       *zap.Logger
}

// New returns an empty registry.
func New(o Options) *Registry {
	if o.HeartbeatInterval <= 0 {
		o.HeartbeatInterval = time.Second
	}
	if o.MissedHeartbeats <= 0 {
		o.MissedHeartbeats = 3
	}
	if o.Retention <= 0 {
		o.Retention = 24 * time.Hour
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	return &Registry{now: o.Now, interval: o.HeartbeatInterval, missed: o.MissedHeartbeats, retention: o.Retention,
		instances: map[string]*Instance{}, departed: map[string]store.Instance{}, rr: map[string]int{}, busy: map[string]Operation{}, persist: o.Persist, log: o.Log}
}

// Restore loads the records a previous Host kept. Instances come back
// unreachable, with their roles, until their agents register again.
func (r *Registry) Restore(records []store.Instance) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for _, rec := range records {
		if rec.Departed {
			r.departed[rec.ID] = rec
			continue
		}
		st := State(rec.Role)
		if rec.Draining {
			st = StateDraining
		}
		// LastHeartbeat now: the sweep leaves a restored record alone for
		// the retention, like any unreachable instance.
		r.instances[rec.ID] = &Instance{
			Registration: Registration{ID: rec.ID, Type: rec.Type, Engine: Engine{URL: rec.EngineURL, ServedModels: rec.ServedModels}},
			Role:         Role(rec.Role), State: st, Retired: rec.Retired, RegisteredAt: rec.RegisteredAt, LastHeartbeat: now,
		}
	}
}

// Adopt takes over what the Host leading a shared store decided about
// an instance (its record, as written there): its role, retired and
// draining marks. The instance's registration and load stay this
// Host's own (its agent registers with every Host); one this Host has
// not seen yet comes in as Restore brings it. A departed record changes
// nothing here: the agent deregisters from every Host (a deleted one is
// Forget's).
func (r *Registry) Adopt(rec store.Instance) {
	if rec.Departed {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	st := State(rec.Role)
	if rec.Draining {
		st = StateDraining
	}
	inst, ok := r.instances[rec.ID]
	if !ok {
		r.instances[rec.ID] = &Instance{
			Registration: Registration{ID: rec.ID, Type: rec.Type, Engine: Engine{URL: rec.EngineURL, ServedModels: rec.ServedModels}},
			Role:         Role(rec.Role), State: st, Retired: rec.Retired, RegisteredAt: rec.RegisteredAt, LastHeartbeat: r.now(),
		}
		return
	}
	if inst.Engine.URL != rec.EngineURL {
		return // another engine took the id: its agent's registration says which
	}
	inst.Role, inst.State, inst.Retired = Role(rec.Role), st, rec.Retired
}

// SaveAll writes every instance's record through: what a Host that just
// took the lead of a shared store learned while it followed (agents
// register with every Host) becomes the records.
func (r *Registry) SaveAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, inst := range r.instances {
		r.save(inst)
	}
}

func record(i *Instance, departed bool, now time.Time) store.Instance {
	return store.Instance{ID: i.ID, Type: i.Type, Role: string(i.Role), Retired: i.Retired, Draining: i.State == StateDraining && !i.Stopping,
		EngineURL: i.Engine.URL, ServedModels: i.Engine.ServedModels, RegisteredAt: i.RegisteredAt, Departed: departed, LastSeen: now}
}

// save writes an instance's record through (r.mu held). A store that
// fails is logged, not fatal: the Host keeps serving from memory.
func (r *Registry) save(i *Instance) {
	if r.persist == nil {
		return
	}
	if err := r.persist.PutInstance(record(i, false, r.now())); err != nil {
		r.log.Error("saving an instance's state failed", zap.String("vllm_hi_id", i.ID), zap.Error(err))
	}
}

func (r *Registry) forget(id string) {
	if r.persist == nil {
		return
	}
	if err := r.persist.DeleteInstance(id); err != nil {
		r.log.Error("forgetting an instance failed", zap.String("vllm_hi_id", id), zap.Error(err))
	}
}

// HeartbeatInterval is what agents are told to use.
func (r *Registry) HeartbeatInterval() time.Duration { return r.interval }

// staleAfterWake is how long after a wake a heartbeat's "sleeping" is
// taken for one collected before it: one heartbeat interval, and at
// least a second for the stats call and the RPC.
func (r *Registry) staleAfterWake() time.Duration { return max(r.interval, time.Second) }

func validate(reg Registration) error {
	switch {
	case reg.ID == "":
		return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: vllm_hi_id is required")
	case len(reg.ID) > 128:
		return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: vllm_hi_id longer than 128 characters")
	case reg.Type != "A" && reg.Type != "B":
		return errdefs.Newf(errdefs.ErrInvalidArgument, "invalid registration: type must be A or B, got %q", reg.Type)
	case reg.Session == "":
		return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: session is required")
	case reg.Engine.URL == "":
		return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: engine_url is required")
	case len(reg.Engine.ServedModels) == 0:
		return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: the engine serves no model")
	case reg.Engine.TP < 1 || reg.Engine.PP < 1:
		return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: tp and pp must be ≥ 1")
	}
	for _, m := range reg.Engine.ServedModels {
		if m == "" {
			return errdefs.New(errdefs.ErrInvalidArgument, "invalid registration: empty served model name")
		}
	}
	return nil
}

// Register adds or refreshes an instance. The same session re-registering
// (a retry) keeps everything. A new session of an id the Host knows — the
// agent restarted, or the Host did — keeps the instance's role, retired
// and draining marks, but only from the same engine and only once the old
// session stopped heartbeating: one agent never takes over another's id.
// An id the Host does not know takes the role the agent reports (what a
// previous Host told it), else its start-up type.
func (r *Registry) Register(reg Registration) (Instance, error) {
	if err := validate(reg); err != nil {
		return Instance{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if old, ok := r.instances[reg.ID]; ok {
		if old.Session == reg.Session {
			old.Registration = reg
			old.LastHeartbeat = now
			old.Reachable = true
			return r.view(old), nil
		}
		if r.reachable(old, now) && old.Session != "" {
			return Instance{}, errdefs.Newf(errdefs.ErrAlreadyExists, "instance id %s is held by another live agent (registered from %s)", reg.ID, old.AgentAddress)
		}
		if old.Engine.URL != reg.Engine.URL {
			return Instance{}, errdefs.Newf(errdefs.ErrAlreadyExists, "instance id %s belongs to the engine at %s, not %s (DELETE /vllm_hi/instances/%s to free the id)",
				reg.ID, old.Engine.URL, reg.Engine.URL, reg.ID)
		}
		inst := &Instance{Registration: reg, Role: old.Role, State: old.State, Retired: old.Retired, RegisteredAt: old.RegisteredAt,
			LastHeartbeat: now, Reachable: true, Stats: Stats{Healthy: true}}
		if inst.State == "" {
			inst.State = State(inst.Role)
		}
		r.instances[reg.ID] = inst
		r.save(inst)
		return r.view(inst), nil
	}
	// The agent checked its engine's health before registering.
	inst := &Instance{Registration: reg, RegisteredAt: now, LastHeartbeat: now, Reachable: true, Stats: Stats{Healthy: true}}
	switch {
	case r.departed[reg.ID].EngineURL == reg.Engine.URL && r.departed[reg.ID].Role != "":
		d := r.departed[reg.ID]
		inst.Role, inst.Retired = Role(d.Role), d.Retired
	case reg.Role == RoleActive || reg.Role == RoleStandby:
		inst.Role, inst.Retired = reg.Role, reg.Retired
	case reg.Type == "A":
		inst.Role = RoleActive
	default:
		inst.Role = RoleStandby
	}
	inst.State = State(inst.Role)
	if d, ok := r.departed[reg.ID]; ok && d.Draining && d.EngineURL == reg.Engine.URL {
		inst.State = StateDraining
	}
	delete(r.departed, reg.ID)
	r.instances[reg.ID] = inst
	r.save(inst)
	return r.view(inst), nil
}

// Heartbeat records a heartbeat; a not-found error tells the agent to
// register.
func (r *Registry) Heartbeat(id, session string, s Stats) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok || inst.Session != session {
		return errdefs.Newf(errdefs.ErrNotFound, "unknown instance %s", id)
	}
	now := r.now()
	inst.LastHeartbeat = now
	if s.Sleeping && !inst.Stats.Sleeping && !inst.wokenAt.IsZero() && now.Sub(inst.wokenAt) < r.staleAfterWake() {
		// Collected before the wake landed: a sleep that is real shows
		// again in the next heartbeat.
		s.Sleeping = false
	}
	inst.Stats = s
	if !inst.Reachable {
		inst.Reachable = true
	}
	return nil
}

// SetStopping marks an instance whose agent is being stopped (see
// Instance.Stopping).
func (r *Registry) SetStopping(id string) error {
	_, err := r.update(id, func(inst *Instance) error {
		inst.Stopping = true
		return nil
	})
	return err
}

// SetScaling marks an instance as being scaled, or no longer.
func (r *Registry) SetScaling(id string, scaling bool) error {
	_, err := r.update(id, func(inst *Instance) error {
		inst.Scaling = scaling
		return nil
	})
	return err
}

// Owned checks that session is the one registered as id: what an agent
// asks about its own instance only.
func (r *Registry) Owned(id, session string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok || session == "" || inst.Session != session {
		return errdefs.Newf(errdefs.ErrNotFound, "unknown instance %s", id)
	}
	return nil
}

// Deregister removes an instance whose agent stops (its own session only).
// The Host remembers its role for when the agent comes back.
func (r *Registry) Deregister(id, session string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok || session == "" || inst.Session != session {
		return errdefs.Newf(errdefs.ErrNotFound, "unknown instance %s", id)
	}
	delete(r.instances, id)
	rec := record(inst, true, r.now())
	r.departed[id] = rec
	if r.persist != nil {
		if err := r.persist.PutInstance(rec); err != nil {
			r.log.Error("saving an instance's state failed", zap.String("vllm_hi_id", id), zap.Error(err))
		}
	}
	return nil
}

// Forget drops everything the Host knows of an instance whose agent is
// gone (unreachable or deregistered), freeing its id for another engine.
func (r *Registry) Forget(id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, live := r.instances[id]
	_, departed := r.departed[id]
	switch {
	case !live && !departed:
		return errdefs.Newf(errdefs.ErrNotFound, "unknown instance %s", id)
	case r.busy[id] != Operation{}:
		return errdefs.Newf(errdefs.ErrConflict, "instance %s is busy with %s", id, r.busy[id])
	case live && inst.Reachable && inst.Session != "":
		return errdefs.Newf(errdefs.ErrConflict, "instance %s is registered and heartbeating; stop its agent first", id)
	}
	delete(r.instances, id)
	delete(r.departed, id)
	r.forget(id)
	return nil
}

func (r *Registry) reachable(i *Instance, now time.Time) bool {
	return now.Sub(i.LastHeartbeat) <= time.Duration(r.missed)*r.interval
}

// Sweep marks instances whose heartbeats stopped as unreachable, and
// forgets those gone for longer than the retention. The Host calls it
// every heartbeat interval.
func (r *Registry) Sweep() {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for id, inst := range r.instances {
		if inst.Reachable && !r.reachable(inst, now) {
			inst.Reachable = false
		}
		if !inst.Reachable && now.Sub(inst.LastHeartbeat) > r.retention {
			delete(r.instances, id)
			r.forget(id)
		}
	}
	for id, d := range r.departed {
		if now.Sub(d.LastSeen) > r.retention {
			delete(r.departed, id)
			r.forget(id)
		}
	}
}

// Get returns one instance.
func (r *Registry) Get(id string) (Instance, error) {
	return r.update(id, nil)
}

// update applies change (when not nil) to a live instance and saves it,
// all under the lock, and returns the instance as it is then; a change
// that fails changes nothing.
func (r *Registry) update(id string, change func(*Instance) error) (Instance, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok {
		return Instance{}, errdefs.Newf(errdefs.ErrNotFound, "unknown instance %s", id)
	}
	if change != nil {
		if err := change(inst); err != nil {
			return r.view(inst), err
		}
		r.save(inst)
	}
	return r.view(inst), nil
}

// List returns every instance, sorted by id.
func (r *Registry) List() []Instance {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Instance, 0, len(r.instances))
	for _, inst := range r.instances {
		out = append(out, r.view(inst))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// SetState changes an instance's operational state (drain, undrain),
// checking it is currently in one of from.
func (r *Registry) SetState(id string, to State, from ...State) (Instance, error) {
	return r.update(id, func(inst *Instance) error {
		if len(from) > 0 && !slices.Contains(from, inst.State) {
			return errdefs.Newf(errdefs.ErrConflict, "instance %s is %s", id, inst.State)
		}
		inst.State = to
		return nil
	})
}

// SetRole changes an instance's role and the state that mirrors it.
func (r *Registry) SetRole(id string, role Role) error {
	_, err := r.update(id, func(inst *Instance) error {
		inst.Role, inst.State = role, State(role)
		return nil
	})
	return err
}

// SetRetired marks an instance retired (its KV released by a
// destroy_source migration) or not (woken).
func (r *Registry) SetRetired(id string, retired bool) (Instance, error) {
	return r.update(id, func(inst *Instance) error {
		inst.Retired = retired
		return nil
	})
}

// Woken records that an instance's engine has its KV back: no longer
// retired or sleeping (until its agent reports otherwise).
func (r *Registry) Woken(id string) (Instance, error) {
	return r.update(id, func(inst *Instance) error {
		inst.Retired, inst.Stats.Sleeping = false, false
		inst.wokenAt = r.now()
		return nil
	})
}

// Route picks the instance that serves new requests for model: an active,
// reachable, healthy, awake instance in state active, round-robin among
// several. It
// reports whether any instance serves the model at all (known) so the
// caller can tell 404 from 503.
func (r *Registry) Route(model string) (inst Instance, known, ok bool) {
	return r.route(model, nil)
}

// RouteAvoiding is Route among the instances not in avoid: another
// engine for a request whose first one could not be reached.
func (r *Registry) RouteAvoiding(model string, avoid []string) (Instance, bool) {
	inst, _, ok := r.route(model, avoid)
	return inst, ok
}

func (r *Registry) route(model string, avoid []string) (inst Instance, known, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var cands []*Instance
	for _, i := range r.instances {
		if !i.Serves(model) {
			continue
		}
		known = true
		if i.routable() && !slices.Contains(avoid, i.ID) {
			cands = append(cands, i)
		}
	}
	if len(cands) == 0 {
		return Instance{}, known, false
	}
	sort.Slice(cands, func(a, b int) bool { return cands[a].ID < cands[b].ID })
	n := r.rr[model]
	r.rr[model] = n + 1
	return r.view(cands[n%len(cands)]), true, true
}

// Models lists every served model name with one instance serving it (an
// active one when there is one), sorted.
func (r *Registry) Models() []Instance {
	r.mu.Lock()
	defer r.mu.Unlock()
	best := map[string]*Instance{}
	for _, i := range r.instances {
		for _, m := range i.Engine.ServedModels {
			if b, ok := best[m]; !ok || (b.Role != RoleActive && i.Role == RoleActive) {
				best[m] = i
			}
		}
	}
	names := make([]string, 0, len(best))
	for m := range best {
		names = append(names, m)
	}
	sort.Strings(names)
	out := make([]Instance, 0, len(names))
	for _, m := range names {
		inst := r.view(best[m])
		inst.Engine.ServedModels = []string{m}
		out = append(out, inst)
	}
	return out
}

// CountByState counts instances by effective state.
func (r *Registry) CountByState() map[State]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[State]int{}
	for _, i := range r.instances {
		out[r.view(i).EffectiveState()]++
	}
	return out
}

// view is a copy of i as callers see it (with what holds it).
func (r *Registry) view(i *Instance) Instance {
	c := *i
	c.Busy = r.busy[i.ID]
	return c
}

// ErrBusy is in the chain of a Claim refused because another operation
// holds an instance (a conflict that ends by itself).
var ErrBusy = errors.New("busy")

// Claim marks every one of ids busy with op, or none: it refuses with a
// conflict naming the operation that holds one already, and with not
// found for an id it does not know.
func (r *Registry) Claim(op Operation, ids ...string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		if _, ok := r.instances[id]; !ok {
			return errdefs.Newf(errdefs.ErrNotFound, "unknown instance %s", id)
		}
		if held, ok := r.busy[id]; ok {
			return errdefs.Newf(errdefs.ErrConflict, "instance %s is %w with %s", id, ErrBusy, held)
		}
	}
	for _, id := range ids {
		r.busy[id] = op
	}
	return nil
}

// Release frees the instances op holds among ids.
func (r *Registry) Release(op Operation, ids ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		if r.busy[id] == op {
			delete(r.busy, id)
		}
	}
}
