package drain

import (
	"fmt"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// A drain spreads its requests by the targets' free KV: the longest goes
// first to the emptiest target, and a target that has little room gets
// little.
func TestDrainSpreadsByFreeKV(t *testing.T) {
	geo := registry.Instance{}
	geo.Engine.Geometry.BlockSize = 16
	big, small := geo, geo
	big.ID, big.Stats.FreeBlocks = "big", 100
	small.ID, small.Stats.FreeBlocks = "small", 40
	var reqs []hooks.RequestInfo
	for i, tokens := range []int{320, 160, 160, 160, 160, 160, 16} {
		reqs = append(reqs, hooks.RequestInfo{RequestID: fmt.Sprint("r", i), NumPromptTokens: tokens, MaxTokens: 0})
	}
	got := map[string][]string{}
	for _, s := range spread(reqs, []registry.Instance{big, small}) {
		got[s.target] = s.ids
	}
	// r0 (21 blocks) → big (79 left), r1 → big (68), r2 → big (57),
	// r3 → big (46), r4 → big (35), r5 → small (29), r6 → big (33).
	if want := []string{"r0", "r1", "r2", "r3", "r4", "r6"}; fmt.Sprint(got["big"]) != fmt.Sprint(want) {
		t.Fatalf("big got %v, want %v", got["big"], want)
	}
	if want := []string{"r5"}; fmt.Sprint(got["small"]) != fmt.Sprint(want) {
		t.Fatalf("small got %v, want %v", got["small"], want)
	}
}
