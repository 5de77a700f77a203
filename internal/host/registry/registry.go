// Package registry is the Host's table of instances: who they are, which
// role and state each is in, and whether its agent is still heartbeating.
package registry

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"
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

// States. Active and standby mirror the role while healthy; migrating and
// draining are set by operations; unreachable is derived from missed
// heartbeats and wins over everything else when listing.
const (
	StateActive      State = "active"
	StateStandby     State = "standby"
	StateMigrating   State = "migrating"
	StateDraining    State = "draining"
	StateUnreachable State = "unreachable"
)

// Errors the gRPC and REST layers translate to status codes.
var (
	ErrNotFound      = errors.New("instance not found")
	ErrAlreadyExists = errors.New("instance id is held by another live agent")
	ErrInvalid       = errors.New("invalid registration")
	ErrConflict      = errors.New("instance is busy or in the wrong role")
)

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
}

// Instance is one registered engine. Values returned by the registry are
// copies.
type Instance struct {
	Registration
	Role          Role
	State         State // operational state (active/standby/migrating/draining)
	RegisteredAt  time.Time
	LastHeartbeat time.Time
	Stats         Stats
	Reachable     bool
}

// EffectiveState is the state to show and route by.
func (i Instance) EffectiveState() State {
	if !i.Reachable {
		return StateUnreachable
	}
	return i.State
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

// Registry is safe for concurrent use.
type Registry struct {
	mu        sync.Mutex
	now       func() time.Time
	interval  time.Duration // expected heartbeat interval
	missed    int           // heartbeats missed before unreachable
	instances map[string]*Instance
	rr        map[string]int // round-robin cursor per model
}

// Options configure a Registry.
type Options struct {
	HeartbeatInterval time.Duration // default 1 s
	MissedHeartbeats  int           // default 3
	Now               func() time.Time
}

// New returns an empty registry.
func New(o Options) *Registry {
	if o.HeartbeatInterval <= 0 {
		o.HeartbeatInterval = time.Second
	}
	if o.MissedHeartbeats <= 0 {
		o.MissedHeartbeats = 3
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Registry{now: o.Now, interval: o.HeartbeatInterval, missed: o.MissedHeartbeats,
		instances: map[string]*Instance{}, rr: map[string]int{}}
}

// HeartbeatInterval is what agents are told to use.
func (r *Registry) HeartbeatInterval() time.Duration { return r.interval }

func validate(reg Registration) error {
	switch {
	case reg.ID == "":
		return fmt.Errorf("%w: vllm_hi_id is required", ErrInvalid)
	case len(reg.ID) > 128:
		return fmt.Errorf("%w: vllm_hi_id longer than 128 characters", ErrInvalid)
	case reg.Type != "A" && reg.Type != "B":
		return fmt.Errorf("%w: type must be A or B, got %q", ErrInvalid, reg.Type)
	case reg.Session == "":
		return fmt.Errorf("%w: session is required", ErrInvalid)
	case reg.Engine.URL == "":
		return fmt.Errorf("%w: engine_url is required", ErrInvalid)
	case len(reg.Engine.ServedModels) == 0:
		return fmt.Errorf("%w: the engine serves no model", ErrInvalid)
	case reg.Engine.TP < 1 || reg.Engine.PP < 1:
		return fmt.Errorf("%w: tp and pp must be ≥ 1", ErrInvalid)
	}
	for _, m := range reg.Engine.ServedModels {
		if m == "" {
			return fmt.Errorf("%w: empty served model name", ErrInvalid)
		}
	}
	return nil
}

// Register adds or refreshes an instance. The same session re-registering
// (a retry, or after a Host restart) keeps its role and state; a different
// session may take over an id only once the old one stopped heartbeating.
func (r *Registry) Register(reg Registration) (Instance, error) {
	if err := validate(reg); err != nil {
		return Instance{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if old, ok := r.instances[reg.ID]; ok {
		if old.Session != reg.Session && r.reachable(old, now) {
			return Instance{}, fmt.Errorf("%w: %s (registered from %s)", ErrAlreadyExists, reg.ID, old.AgentAddress)
		}
		if old.Session == reg.Session {
			old.Registration = reg
			old.LastHeartbeat = now
			old.Reachable = true
			return *old, nil
		}
	}
	inst := &Instance{Registration: reg, RegisteredAt: now, LastHeartbeat: now, Reachable: true}
	if reg.Type == "A" {
		inst.Role, inst.State = RoleActive, StateActive
	} else {
		inst.Role, inst.State = RoleStandby, StateStandby
	}
	r.instances[reg.ID] = inst
	return *inst, nil
}

// Heartbeat records a heartbeat; ErrNotFound tells the agent to register.
func (r *Registry) Heartbeat(id, session string, s Stats) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok || inst.Session != session {
		return fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	inst.LastHeartbeat = r.now()
	inst.Stats = s
	if !inst.Reachable {
		inst.Reachable = true
	}
	return nil
}

// Deregister removes an instance.
func (r *Registry) Deregister(id, session string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok || (session != "" && inst.Session != session) {
		return fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	delete(r.instances, id)
	return nil
}

func (r *Registry) reachable(i *Instance, now time.Time) bool {
	return now.Sub(i.LastHeartbeat) <= time.Duration(r.missed)*r.interval
}

// Sweep marks instances whose heartbeats stopped as unreachable. The Host
// calls it every heartbeat interval.
func (r *Registry) Sweep() {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for _, inst := range r.instances {
		if inst.Reachable && !r.reachable(inst, now) {
			inst.Reachable = false
		}
	}
}

// Get returns one instance.
func (r *Registry) Get(id string) (Instance, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok {
		return Instance{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return *inst, nil
}

// List returns every instance, sorted by id.
func (r *Registry) List() []Instance {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Instance, 0, len(r.instances))
	for _, inst := range r.instances {
		out = append(out, *inst)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// SetState changes an instance's operational state (drain, undrain,
// migrating), checking it is currently in one of from.
func (r *Registry) SetState(id string, to State, from ...State) (Instance, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok {
		return Instance{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if len(from) > 0 {
		okFrom := false
		for _, f := range from {
			okFrom = okFrom || inst.State == f
		}
		if !okFrom {
			return *inst, fmt.Errorf("%w: %s is %s", ErrConflict, id, inst.State)
		}
	}
	inst.State = to
	return *inst, nil
}

// SetRole changes an instance's role and the state that mirrors it.
func (r *Registry) SetRole(id string, role Role) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.instances[id]
	if !ok {
		return fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	inst.Role = role
	inst.State = State(role)
	return nil
}

// Route picks the instance that serves new requests for model: an active,
// reachable instance in state active, round-robin among several. It
// reports whether any instance serves the model at all (known) so the
// caller can tell 404 from 503.
func (r *Registry) Route(model string) (inst Instance, known, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var cands []*Instance
	for _, i := range r.instances {
		if !i.Serves(model) {
			continue
		}
		known = true
		if i.Role == RoleActive && i.State == StateActive && i.Reachable {
			cands = append(cands, i)
		}
	}
	if len(cands) == 0 {
		return Instance{}, known, false
	}
	sort.Slice(cands, func(a, b int) bool { return cands[a].ID < cands[b].ID })
	n := r.rr[model]
	r.rr[model] = n + 1
	return *cands[n%len(cands)], true, true
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
		inst := *best[m]
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
		out[i.EffectiveState()]++
	}
	return out
}
