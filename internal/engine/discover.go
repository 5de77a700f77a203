package engine

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Info is what discovery learned about an engine.
type Info struct {
	URL          string
	ServedModels []string
	Model        string
	MaxModelLen  int
	TP, PP       int
	Migratable   bool
	Kind         string // "vhi-sim", "vllm", or "openai" (no hooks)
	Version      string
	// HooksAuthenticated: the engine refuses hook calls without the
	// agent's credential (set by the agent, which probes it).
	HooksAuthenticated bool
	Layout             *hooks.Layout // nil when routing-only
}

// WaitHealthy polls /health until it answers 200 or ctx ends.
func (c *Client) WaitHealthy(ctx context.Context, every time.Duration) error {
	var last error
	for {
		if last = c.Health(ctx); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("engine %s not healthy: %w (last error: %v)", c.base, ctx.Err(), last)
		case <-time.After(every):
		}
	}
}

// Discover learns the engine's served models from /v1/models and, when it
// serves the hooks, its layout. An engine without the hooks (plain vLLM, any
// OpenAI-compatible server) is routing-only; tp and pp then come from the
// operator (defaults 1).
func (c *Client) Discover(ctx context.Context, tp, pp int) (Info, error) {
	models, err := c.Models(ctx)
	if err != nil {
		return Info{}, fmt.Errorf("discover %s: %w", c.base, err)
	}
	if len(models) == 0 {
		return Info{}, fmt.Errorf("discover %s: /v1/models lists no model", c.base)
	}
	info := Info{URL: c.base, TP: tp, PP: pp, Kind: "openai", Model: models[0].Root, MaxModelLen: models[0].MaxModelLen}
	for _, m := range models {
		info.ServedModels = append(info.ServedModels, m.ID)
	}
	if info.Model == "" {
		info.Model = models[0].ID
	}
	var v struct {
		Version string `json:"version"`
	}
	if err := c.do(ctx, http.MethodGet, "/version", nil, &v); err == nil {
		info.Version = v.Version
		info.Kind = "vllm"
	}
	lay, err := c.Layout(ctx)
	switch {
	case err == nil:
		if lay.HooksVersion != hooks.Version {
			return Info{}, fmt.Errorf("discover %s: engine hooks version %d, this agent speaks %d", c.base, lay.HooksVersion, hooks.Version)
		}
		info.Migratable = true
		info.Kind, info.Version = lay.Engine, lay.EngineVersion
		info.TP, info.PP = lay.Parallel.TP, lay.Parallel.PP
		info.Layout = &lay
	case IsStatus(err, http.StatusNotFound), IsStatus(err, http.StatusMethodNotAllowed):
		// No hooks: routing-only.
	default:
		return Info{}, fmt.Errorf("discover %s: layout hook: %w", c.base, err)
	}
	return info, nil
}
