package switching

import (
	"context"

	"github.com/vllm-hi/vllm-hi/internal/engine"
)

// Backend is what a switch does to one engine: vLLM's sleep-mode routes
// and a greedy probe (internal/engine.Admin, the engines' admin client).
// An interface so the state machine's tests can make an engine fail at
// any step.
type Backend interface {
	Sleep(ctx context.Context, level int) error
	// WakeUp calls /wake_up with these tags (none: everything).
	WakeUp(ctx context.Context, tags ...string) error
	ReloadWeights(ctx context.Context) error
	IsSleeping(ctx context.Context) (bool, error)
	// Probe is a greedy completion of prompt: what the engine's weights
	// compute.
	Probe(ctx context.Context, prompt string) (string, error)
}

var _ Backend = (*engine.Admin)(nil)
