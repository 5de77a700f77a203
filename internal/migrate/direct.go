package migrate

import (
	"context"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/engine"
)

// Calls the Host makes to an engine itself, past its agent, when the
// agent cannot make them (it died or was restarted inside the migration):
// the source's resume and the target's release. The Host holds the
// credential the engines' hooks take (it reads the engines' streams with
// it too), so a dead agent costs the clients the time the Host takes to
// notice, not an engine's lease.

// direct opens a client to an engine's hooks.
func (o *Orchestrator) direct(engineURL string) (*engine.Client, error) {
	return engine.NewClient(engineURL, engine.Options{Token: o.cfg.AgentToken, TLS: o.cfg.AgentTLS})
}

// releaseDirectly drops what a migration that did not commit left on an
// engine (the target): ids' reservations and uncommitted installs, never
// a running request.
func (o *Orchestrator) releaseDirectly(ctx context.Context, engineURL string, ids []string) (int, error) {
	return o.abortDirectly(ctx, engineURL, ids, true)
}

// abortDirectly ends ids on an engine (reservedOnly: only reservations
// and uncommitted installs); missing ones are no error.
func (o *Orchestrator) abortDirectly(ctx context.Context, engineURL string, ids []string, reservedOnly bool) (int, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	c, err := o.direct(engineURL)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	out, err := c.Abort(ctx, hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true, ReservedOnly: reservedOnly})
	return len(out.Aborted), err
}
