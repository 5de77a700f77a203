package migrate

import (
	"context"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/ends"
)

// Wait returns migration id's status once it ended, or when ctx ends
// first (its status then, not ended). ok is false when the Host does not
// know the id (or no longer keeps it). A migration's end wakes its
// waiters (the orchestrator's users polled each status every 20 ms).
func (o *Orchestrator) Wait(ctx context.Context, id string) (hostapi.MigrationStatus, bool) {
	return ends.Wait(ctx, &o.ends, o.Get, id)
}
