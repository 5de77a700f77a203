package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/cespare/xxhash/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// maxHashBlocks bounds one HashBlocks call (a whole 141 GB engine of
// 16-token blocks is ~60k blocks).
const maxHashBlocks = 1 << 20

// HashBlocks implements the Agent service: it reads the named blocks of
// this agent's engine — mapped afresh when the engine's memory changed —
// and hashes each in canonical order, so a source and a target of any
// TP/PP shapes give the same hash for the same KV.
func (s *agentService) HashBlocks(ctx context.Context, req *v1.HashBlocksRequest) (*v1.HashBlocksResponse, error) {
	a := s.a
	start := time.Now()
	if len(req.GetBlocks()) > maxHashBlocks {
		return nil, status.Errorf(codes.InvalidArgument, "at most %d blocks per call", maxHashBlocks)
	}
	mem, lay, err := a.regions(ctx, false)
	if err != nil {
		return nil, engineError(err)
	}
	g := lay.Geometry
	if g.NumBlocks < 1 || g.BlockSize < 1 || len(lay.Regions) == 0 {
		return nil, status.Error(codes.FailedPrecondition, "the engine's layout has no KV")
	}
	var runs []kvlayout.CopyRun
	ends := make([]int, len(req.GetBlocks())) // runs of block i end at ends[i]
	for i, b := range req.GetBlocks() {
		n := int(b.GetNumSlots())
		if b.GetBlock() < 0 || int(b.GetBlock()) >= g.NumBlocks || n < 0 || n > g.BlockSize {
			return nil, status.Errorf(codes.InvalidArgument, "block %d slots %d outside the engine's %d blocks of %d", b.GetBlock(), n, g.NumBlocks, g.BlockSize)
		}
		if lay.OpaqueBlocks {
			n = g.BlockSize // slots are not addressable: whole blocks are what moved
		}
		if runs, err = appendCanonical(runs, lay, int(b.GetBlock()), n); err != nil {
			return nil, status.Error(codes.FailedPrecondition, err.Error())
		}
		ends[i] = len(runs)
	}
	var data [][]byte
	if onGPU(lay) {
		host, gathered, release, err := a.gpu.gather(req.GetMigrationId(), lay, runs)
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "read GPU KV: %v", err)
		}
		defer release()
		data, runs = [][]byte{host}, gathered
	} else {
		data = mem.Data
	}
	out := &v1.HashBlocksResponse{Hashes: make([]uint64, len(ends))}
	d := xxhash.New()
	at := 0
	for i, end := range ends {
		d.Reset()
		for _, r := range runs[at:end] {
			_, _ = d.Write(data[r.SrcRegion][r.SrcOffset : r.SrcOffset+r.Length])
			out.Bytes += r.Length
		}
		out.Hashes[i] = d.Sum64()
		at = end
	}
	out.DurationS = time.Since(start).Seconds()
	return out, nil
}

// appendCanonical appends the source runs holding slots [0, n) of block,
// in canonical order: global layer, K/V, global head, slot.
func appendCanonical(runs []kvlayout.CopyRun, lay hooks.Layout, block, n int) ([]kvlayout.CopyRun, error) {
	if n == 0 {
		return runs, nil
	}
	g := lay.Geometry
	slot := int64(g.HeadSlotBytes())
	for l := 0; l < g.Layers; l++ {
		for kv := 0; kv < 2; kv++ {
			for h := 0; h < g.KVHeads; h++ {
				ri := -1
				for i, r := range lay.Regions {
					if l >= r.FirstLayer && l < r.FirstLayer+r.NumLayers && h >= r.FirstHead && h < r.FirstHead+r.NumHeads {
						ri = i
						break
					}
				}
				if ri < 0 {
					return nil, fmt.Errorf("layer %d head %d is in no region", l, h)
				}
				r := lay.Regions[ri]
				off := int64(l-r.FirstLayer)*r.LayerStride + int64(kv)*r.KVStride + int64(block)*r.BlockStride + int64(h-r.FirstHead)*r.HeadStride
				if r.SlotStride == slot {
					if off < 0 || off+int64(n)*slot > r.Size {
						return nil, fmt.Errorf("block %d lies outside region %d", block, ri)
					}
					runs = append(runs, kvlayout.CopyRun{SrcRegion: ri, SrcOffset: off, Length: int64(n) * slot})
					continue
				}
				for s := 0; s < n; s++ {
					o := off + int64(s)*r.SlotStride
					if o < 0 || o+slot > r.Size {
						return nil, fmt.Errorf("block %d lies outside region %d", block, ri)
					}
					runs = append(runs, kvlayout.CopyRun{SrcRegion: ri, SrcOffset: o, Length: slot})
				}
			}
		}
	}
	return runs, nil
}
