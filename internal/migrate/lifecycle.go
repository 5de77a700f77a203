package migrate

import (
	"context"

	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// Wake brings a retired or sleeping engine's KV back (its agent's Wake),
// so the instance can be a migration target again.
func (o *Orchestrator) Wake(ctx context.Context, id string) (registry.Instance, error) {
	inst, err := o.reg.Get(id)
	if err != nil {
		return inst, err
	}
	switch lc := inst.Lifecycle(); {
	case !inst.Reachable:
		return inst, errdefs.Newf(errdefs.ErrConflict, "instance %s is unreachable", id)
	case !inst.Engine.Migratable:
		return inst, errdefs.Newf(errdefs.ErrConflict, "instance %s is routing-only (its engine has no vllm-hi hooks)", id)
	case lc != registry.LifecycleRetired && lc != registry.LifecycleSleeping:
		return inst, errdefs.Newf(errdefs.ErrConflict, "instance %s is %s, not retired or sleeping", id, lc)
	}
	op := registry.Operation{Kind: registry.OpWake}
	if err := o.reg.Claim(op, id); err != nil {
		return inst, err
	}
	defer o.reg.Release(op, id)
	a, err := o.agents.Get(inst.AgentAddress, inst.TLS)
	if err != nil {
		return inst, errdefs.Newf(errdefs.ErrUpstream, "%w", err)
	}
	if _, err := a.Engine.Wake(ctx); err != nil {
		return inst, errdefs.Newf(errdefs.ErrUpstream, "waking the engine failed: %w", err)
	}
	return o.reg.Woken(id)
}
