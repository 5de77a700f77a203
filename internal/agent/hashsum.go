package agent

import (
	"errors"
	"fmt"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvsum"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
)

// errSumUnusable says that a layout's KV cannot be hashed with
// internal/kvsum's scheme here (its head slots are not whole words, or on
// the GPU not 16-byte pairs, or the driver has no sum kernel): the check
// falls back to xxhash64.
var errSumUnusable = errors.New("the kvsum scheme does not fit this layout")

// hashSum hashes blocks with internal/kvsum's scheme: on the GPU in place,
// one kernel launch for the whole call (no staging, no host copy); in
// shared memory on the CPU. It returns each block's hash and the bytes
// read.
func (a *Agent) hashSum(session string, lay hooks.Layout, data [][]byte, blocks []hashBlock) ([]uint64, int64, error) {
	g := lay.Geometry
	hsb := int64(g.HeadSlotBytes())
	if hsb%8 != 0 {
		return nil, 0, fmt.Errorf("%w: a head's slot is %d bytes", errSumUnusable, hsb)
	}
	words := func(b hashBlock) uint64 {
		return uint64(g.Layers) * 2 * uint64(g.KVHeads) * uint64(b.slots.n) * uint64(hsb/8)
	}
	var bytes int64
	for _, b := range blocks {
		bytes += int64(words(b)) * 8
	}
	var sums []uint64
	var err error
	if transfer.OnGPU(lay) {
		sums, err = a.sumGPU(session, lay, blocks)
	} else {
		sums, err = sumMapped(data, lay, blocks)
	}
	if err != nil {
		return nil, 0, err
	}
	for i, b := range blocks {
		sums[i] = kvsum.Finish(sums[i], words(b))
	}
	return sums, bytes, nil
}

// sumGPU runs the sum kernel over blocks: one task per block and region
// (a region holds some layers' and heads' memory), each checked to lie in
// its region before the kernel reads it.
func (a *Agent) sumGPU(session string, lay hooks.Layout, blocks []hashBlock) ([]uint64, error) {
	g := lay.Geometry
	hsb := int64(g.HeadSlotBytes())
	if hsb%16 != 0 {
		return nil, fmt.Errorf("%w: a head's slot is %d bytes, not whole 16-byte pairs", errSumUnusable, hsb)
	}
	for i, r := range lay.Regions {
		if r.NumLayers < 1 || r.NumHeads < 1 || r.LayerStride < 0 || r.KVStride < 0 || r.HeadStride < 0 || r.SlotStride < 0 || r.BlockStride < 0 {
			return nil, fmt.Errorf("%w: region %d's strides", errSumUnusable, i)
		}
	}
	for _, b := range blocks {
		if b.slots.n == 0 {
			continue
		}
		for i, r := range lay.Regions {
			end := b.id*r.BlockStride + int64(b.slots.first+b.slots.n-1)*r.SlotStride + int64(r.NumLayers-1)*r.LayerStride +
				r.KVStride + int64(r.NumHeads-1)*r.HeadStride + hsb
			if end > r.Size {
				return nil, fmt.Errorf("block %d slots %d+%d lie outside region %d", b.id, b.slots.first, b.slots.n, i)
			}
		}
	}
	tasks := func(ptrs cudaipc.Regions) []cuda.SumTask {
		var ts []cuda.SumTask
		for out, b := range blocks {
			if b.slots.n == 0 {
				continue
			}
			for i, r := range lay.Regions {
				ts = append(ts, cuda.SumTask{
					Base:        ptrs[i] + cuda.DevicePtr(b.id*r.BlockStride+int64(b.slots.first)*r.SlotStride),
					LayerStride: uint64(r.LayerStride), KVStride: uint64(r.KVStride), HeadStride: uint64(r.HeadStride), SlotStride: uint64(r.SlotStride),
					FirstLayer: uint32(r.FirstLayer), NumLayers: uint32(r.NumLayers), FirstHead: uint32(r.FirstHead), NumHeads: uint32(r.NumHeads),
					Slots: uint32(b.slots.n), Out: uint32(out),
				})
			}
		}
		return ts
	}
	sums := make([]uint64, len(blocks))
	shape := cuda.SumShape{KVHeads: uint32(g.KVHeads), Words: uint32(hsb / 8)}
	err := a.gpu.KVSum(session, lay, shape, tasks, sums)
	if errors.Is(err, cuda.ErrSumShape) || errors.Is(err, cudaipc.ErrNoSumKernel) {
		return nil, fmt.Errorf("%w: %v", errSumUnusable, err)
	}
	if err != nil {
		return nil, fmt.Errorf("hash GPU KV: %w", err)
	}
	return sums, nil
}

// sumMapped sums blocks of shared-memory KV on the CPU: each block's
// canonical pieces in order, the words numbered as they come, the blocks
// shared among the cores.
func sumMapped(data [][]byte, lay hooks.Layout, blocks []hashBlock) ([]uint64, error) {
	pieces := map[slotRange][]piece{}
	for _, b := range blocks {
		ps, ok := pieces[b.slots]
		if !ok {
			var err error
			if ps, err = canonicalPieces(lay, b.slots); err != nil {
				return nil, err
			}
			pieces[b.slots] = ps
		}
		if err := checkBlock(lay, ps, b.id); err != nil {
			return nil, err
		}
	}
	sums := make([]uint64, len(blocks))
	inParts(len(blocks), func(first, end int) {
		for i := first; i < end; i++ {
			b := blocks[i]
			var sum, at uint64
			for _, p := range pieces[b.slots] {
				off := p.off + b.id*lay.Regions[p.region].BlockStride
				sum = kvsum.Add(sum, data[p.region][off:off+p.length], at)
				at += uint64(p.length / 8)
			}
			sums[i] = sum
		}
	})
	return sums, nil
}
