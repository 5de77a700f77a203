package migrate

import (
	"context"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
)

// Wake brings a retired or sleeping engine's KV back (its agent's Wake),
// so the instance can be a migration target again.
func (o *Orchestrator) Wake(ctx context.Context, id string) (registry.Instance, error) {
	inst, err := o.reg.Get(id)
	if err != nil {
		return inst, refuse(404, "unknown instance %s", id)
	}
	switch lc := inst.Lifecycle(); {
	case !inst.Reachable:
		return inst, refuse(409, "instance %s is unreachable", id)
	case !inst.Engine.Migratable:
		return inst, refuse(409, "instance %s is routing-only (its engine has no vllm-hi hooks)", id)
	case lc != registry.LifecycleRetired && lc != registry.LifecycleSleeping:
		return inst, refuse(409, "instance %s is %s, not retired or sleeping", id, lc)
	}
	if err := o.claim("wake", id); err != nil {
		return inst, err
	}
	defer o.release(id)
	a, err := o.agent(inst)
	if err != nil {
		return inst, &Error{Status: 502, Msg: err.Error()}
	}
	if _, err := a.Wake(ctx, &v1.WakeRequest{}); err != nil {
		return inst, &Error{Status: 502, Msg: "waking the engine failed: " + rpcError(err).Error()}
	}
	return o.reg.Woken(id)
}
