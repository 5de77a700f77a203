package migrate

import (
	"crypto/rand"
	"math"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// refuse is a refusal of a migrate request: nothing started.
func refuse(kind error, format string, a ...any) error {
	return errdefs.Newf(kind, format, a...)
}

// validate checks a request's own fields and fills in defaults.
func (o *Orchestrator) validate(req *hostapi.MigrateRequest) (Filter, error) {
	bad := errdefs.ErrInvalidArgument
	if req.Src == "" || (req.Dst == "" && len(o.launchers()) == 0) {
		return nil, refuse(bad, "src_vllm_hi_id and dst_vllm_hi_id are required (a target is launched on demand only for models with a launch command: targets in vhi host --config)")
	}
	if req.Src == req.Dst {
		return nil, refuse(bad, "source and target are the same instance %s", req.Src)
	}
	if req.Type == "" {
		req.Type = hostapi.DestroySource
	}
	switch req.Type {
	case hostapi.DestroySource, hostapi.PreserveSource, hostapi.KeepSourceActive:
	default:
		return nil, refuse(bad, "migration_type %q: want destroy_source, preserve_source or keep_source_active", req.Type)
	}
	switch req.FinalGranularity {
	case "", "slot", "block":
	default:
		return nil, refuse(bad, "final_granularity %q: want slot or block", req.FinalGranularity)
	}
	switch req.PauseInFlight {
	case "", PauseInFlightDrop, PauseInFlightWait:
	default:
		return nil, refuse(bad, "pause_in_flight %q: want drop or wait", req.PauseInFlight)
	}
	switch req.InjectFault {
	case "":
	case "corrupt", "cut", "silent_corrupt", "crash_before_pause", "crash_after_pause", "crash_after_commit", "target_full":
		if !o.cfg.AllowFaultInjection {
			return nil, refuse(bad, "inject_fault is only accepted by a Host started with --allow-fault-injection")
		}
	default:
		return nil, refuse(bad, "inject_fault %q: want corrupt, cut, silent_corrupt, crash_before_pause, crash_after_pause, crash_after_commit or target_full", req.InjectFault)
	}
	if req.TN < 0 || req.TN > 64 {
		return nil, refuse(bad, "tn %d out of range 1..64", req.TN)
	}
	if req.TN == 0 {
		req.TN = o.cfg.DefaultTN
	}
	if u := req.TargetGPUMemUtil; u != nil && (math.IsNaN(*u) || *u <= 0 || *u > 1) {
		return nil, refuse(bad, "target_gpu_memory_utilization %v: want a fraction in (0, 1]", *u)
	}
	for _, v := range []*int{req.TargetTP, req.TargetPP} {
		if v != nil && *v < 1 {
			return nil, refuse(bad, "target_tp and target_pp must be ≥ 1")
		}
	}
	spec := req.RequestFilter
	if spec == "" {
		spec = o.cfg.DefaultFilter
	}
	filter, err := ParseFilter(spec)
	if err != nil {
		return nil, refuse(bad, "%v", err)
	}
	return filter, nil
}

// admit checks the request and both instances as the registry knows them
// — roles, health, models, shapes, KV geometries — and claims both
// instances for the new migration. A refusal changes nothing.
func (o *Orchestrator) admit(req hostapi.MigrateRequest, id string) (*migration, error) {
	filter, err := o.validate(&req)
	if err != nil {
		return nil, err
	}
	src, err := o.reg.Get(req.Src)
	if err != nil {
		return nil, refuse(errdefs.ErrNotFound, "unknown source instance %s", req.Src)
	}
	dst, err := o.reg.Get(req.Dst)
	if err != nil {
		return nil, refuse(errdefs.ErrNotFound, "unknown target instance %s", req.Dst)
	}
	conflict := errdefs.ErrConflict
	sg, dg := src.Engine.Geometry, dst.Engine.Geometry
	switch {
	case !src.Reachable || !dst.Reachable || !src.Stats.Healthy || !dst.Stats.Healthy:
		return nil, refuse(conflict, "both instances must be reachable and healthy: %s", notReady(time.Now(), src, dst))
	case !src.Engine.Migratable || !dst.Engine.Migratable:
		return nil, refuse(conflict, "both engines must serve the vllm-hi hooks (migratable); %s: %v, %s: %v", src.ID, src.Engine.Migratable, dst.ID, dst.Engine.Migratable)
	case src.Role != registry.RoleActive:
		return nil, refuse(conflict, "source %s is %s, not active", src.ID, src.Role)
	case dst.Role == registry.RoleActive && req.Type != hostapi.KeepSourceActive:
		// Both engines serve afterwards only when the source stays active:
		// the other types hand the source's role to the target.
		return nil, refuse(conflict, "target %s is active: an active target takes requests with migration_type keep_source_active only (a drain, a rebalance)", dst.ID)
	case dst.Role == registry.RoleActive && dst.State != registry.StateActive:
		return nil, refuse(conflict, "target %s is %s: it takes no new requests", dst.ID, dst.Lifecycle())
	case dst.Retired || dst.Stats.Sleeping:
		return nil, refuse(conflict, "target %s is %s: wake it first (vhi wake %s)", dst.ID, dst.Lifecycle(), dst.ID)
	case !dst.ServesModelsOf(src):
		return nil, refuse(conflict, "target %s does not serve the source's models %v", dst.ID, src.Engine.ServedModels)
	case req.TargetTP != nil && *req.TargetTP != dst.Engine.TP, req.TargetPP != nil && *req.TargetPP != dst.Engine.PP:
		return nil, refuse(conflict, "target %s runs tp %d pp %d; start a target with the shape you ask for", dst.ID, dst.Engine.TP, dst.Engine.PP)
	case sg.Layers != dg.Layers || sg.KVHeads != dg.KVHeads || sg.HeadDim != dg.HeadDim || sg.DTypeBytes != dg.DTypeBytes || sg.BlockSize != dg.BlockSize:
		return nil, refuse(conflict, "the KV geometries differ: %s has %d layers × %d KV heads × %d × %d B in blocks of %d, %s %d × %d × %d × %d B in blocks of %d",
			src.ID, sg.Layers, sg.KVHeads, sg.HeadDim, sg.DTypeBytes, sg.BlockSize, dst.ID, dg.Layers, dg.KVHeads, dg.HeadDim, dg.DTypeBytes, dg.BlockSize)
	}
	if id == "" {
		id = newID()
	}
	op := registry.Operation{Kind: registry.OpMigration, ID: id}
	if err := o.reg.Claim(op, src.ID, dst.ID); err != nil {
		return nil, err
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	m := &migration{o: o, op: op, req: req, filter: filter, src: src, dst: dst, log: o.log.With(zap.String("migration_id", id)),
		secret: secret, moving: map[string]*v1.RequestBlocks{}, reserved: map[string]bool{},
		recompute: map[string]bool{}}
	now := time.Now().UTC()
	m.deadline = now.Add(o.cfg.ReservationLease - margin(o.cfg.ReservationLease))
	m.st = hostapi.MigrationStatus{ID: id, State: hostapi.StateRunning, Src: src.ID, Dst: dst.ID, Type: req.Type, RequestFilter: filter.String(),
		TN: req.TN, CreatedAt: now, Deadline: m.deadline, StepHistory: []hostapi.Step{}, Rounds: []hostapi.Round{}, Dropped: []string{}}
	return m, nil
}

// notReady is why each of the instances that cannot take part cannot.
func notReady(now time.Time, insts ...registry.Instance) string {
	var why []string
	for _, i := range insts {
		if w := i.NotReady(now); w != "" {
			why = append(why, w)
		}
	}
	return strings.Join(why, "; ")
}
