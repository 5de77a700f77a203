package migrate

import (
	"context"
	"sync"
	"testing"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/kvsum"
)

// hashingAgent answers HashBlocks in the schemes it knows (an older
// agent knows none but xxhash64, ""), each block's hash its id plus a
// per-scheme offset, and records the schemes it was asked for.
type hashingAgent struct {
	v1.AgentClient
	knows map[string]bool
	mu    sync.Mutex
	asked []string
}

func (h *hashingAgent) HashBlocks(_ context.Context, req *v1.HashBlocksRequest, _ ...grpc.CallOption) (*v1.HashBlocksResponse, error) {
	h.mu.Lock()
	h.asked = append(h.asked, req.GetScheme())
	h.mu.Unlock()
	scheme := req.GetScheme()
	if !h.knows[scheme] {
		scheme = ""
	}
	off := uint64(0)
	if scheme != "" {
		off = 1 << 40
	}
	var out []uint64
	for _, b := range req.GetBlocks() {
		out = append(out, uint64(b.GetBlock())+off)
	}
	return &v1.HashBlocksResponse{Hashes: out, Scheme: scheme}, nil
}

// A check of GPU KV asks both agents for the kvsum scheme; where one
// answers in another (an agent of an earlier version), both are asked again
// in xxhash64 and compared in it. A check of host memory asks for
// xxhash64 alone.
func TestTheCheckFallsBackToTheSchemeBothAgentsServe(t *testing.T) {
	blocks := []*v1.BlockSlots{{Block: 3, NumSlots: 16}, {Block: 4, NumSlots: 16}}
	for _, tc := range []struct {
		name     string
		onGPU    bool
		srcKnows map[string]bool
		dstKnows map[string]bool
		asked    []string
	}{
		{"GPU, both new", true, map[string]bool{kvsum.Scheme: true}, map[string]bool{kvsum.Scheme: true}, []string{kvsum.Scheme}},
		{"GPU, an old target", true, map[string]bool{kvsum.Scheme: true}, map[string]bool{}, []string{kvsum.Scheme, ""}},
		{"host memory", false, map[string]bool{kvsum.Scheme: true}, map[string]bool{kvsum.Scheme: true}, []string{""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst := &hashingAgent{knows: tc.srcKnows}, &hashingAgent{knows: tc.dstKnows}
			m := &migration{log: zap.NewNop(), srcA: agentclient.Agent{RPC: src}, dstA: agentclient.Agent{RPC: dst}}
			if tc.onGPU {
				m.srcLayout.Regions = []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC}}}
				m.dstOnGPU = true
			}
			_, diff, err := m.compare(context.Background(), blocks, blocks, []blockAt{{"a", 0}, {"a", 1}})
			if err != nil || len(diff) != 0 {
				t.Fatalf("compare: %v, differing %v", err, diff)
			}
			for _, a := range []*hashingAgent{src, dst} {
				if len(a.asked) != len(tc.asked) || a.asked[0] != tc.asked[0] || a.asked[len(a.asked)-1] != tc.asked[len(tc.asked)-1] {
					t.Fatalf("asked for %q, want %q", a.asked, tc.asked)
				}
			}
		})
	}
}
