package agent

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/kvsum"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
)

// hostSummer is a GPU whose memory is host slices (region i at (i+1)<<40)
// and whose KVSum does in Go what the vhi_kvsum kernel does: the tasks'
// words at the addresses the kernel computes, numbered as it numbers them
// (internal/cuda's device test holds the kernel to the CPU's hash).
type hostSummer struct {
	cuda.Driver
	mem [][]byte
}

func (h *hostSummer) NewStream(int) (cuda.Stream, error) { return 1, nil }
func (h *hostSummer) EnablePeer(int, int) error          { return nil }

func (h *hostSummer) KVSum(_ int, _ cuda.Stream, shape cuda.SumShape, tasks []cuda.SumTask, sums []uint64) error {
	clear(sums)
	for _, t := range tasks {
		if (uint64(t.Base)|t.LayerStride|t.KVStride|t.HeadStride|t.SlotStride)%16 != 0 || shape.Words%2 != 0 {
			return cuda.ErrSumShape
		}
		for y := range uint64(t.NumLayers) {
			for kv := range uint64(2) {
				for hd := range uint64(t.NumHeads) {
					for s := range uint64(t.Slots) {
						for j := range uint64(shape.Words) {
							addr := uint64(t.Base) + y*t.LayerStride + kv*t.KVStride + hd*t.HeadStride + s*t.SlotStride + 8*j
							w := binary.LittleEndian.Uint64(h.mem[addr>>40-1][addr&(1<<40-1):])
							i := (((uint64(t.FirstLayer)+y)*2+kv)*uint64(shape.KVHeads)+uint64(t.FirstHead)+hd)*uint64(t.Slots)*uint64(shape.Words) + s*uint64(shape.Words) + j
							sums[t.Out] += kvsum.Term(w, i)
						}
					}
				}
			}
		}
	}
	return nil
}

// The kvsum scheme gives one hash per block slot range whatever the
// layout: the CPU's walk of shared memory, the GPU's tasks (one per block
// and region, with the kernel's numbering) and the plain sum of the
// canonical byte sequence agree for every layout vLLM's backends use and
// for TP shards in two regions; a changed byte changes its block's hash; a
// head's slot of 8 bytes is summed on the CPU but not on the GPU (the
// kernel reads 16-byte pairs: the check falls back to xxhash64).
func TestTheSumSchemeIsTheSameOnEveryPath(t *testing.T) {
	g := kvlayout.Geometry{Layers: 3, KVHeads: 4, HeadDim: 8, DTypeBytes: 2, BlockSize: 4, NumBlocks: 9}
	layouts := testLayouts(g)

	rng := rand.New(rand.NewPCG(5, 6))
	var blocks []hashBlock
	for range 12 {
		first := rng.IntN(g.BlockSize)
		blocks = append(blocks, hashBlock{id: int64(rng.IntN(g.NumBlocks)), slots: slotRange{first, 1 + rng.IntN(g.BlockSize-first)}})
	}
	blocks = append(blocks, hashBlock{id: 2, slots: slotRange{0, 4}}, hashBlock{id: 8, slots: slotRange{0, 4}}, hashBlock{id: 5, slots: slotRange{2, 0}})
	for name, lay := range layouts {
		data := make([][]byte, len(lay.Regions))
		for i, r := range lay.Regions {
			data[i] = make([]byte, r.Size)
			for k := range data[i] {
				data[i][k] = byte(rng.Uint32())
			}
		}
		// The plain sum of each block's canonical byte sequence.
		want := make([]uint64, len(blocks))
		for i, b := range blocks {
			pieces, err := canonicalPieces(lay, b.slots)
			if err != nil {
				t.Fatal(err)
			}
			var seq []byte
			for _, p := range pieces {
				off := p.off + b.id*lay.Regions[p.region].BlockStride
				seq = append(seq, data[p.region][off:off+p.length]...)
			}
			want[i] = kvsum.Finish(kvsum.Add(0, seq, 0), uint64(len(seq)/8))
		}
		cpu := &Agent{log: zap.NewNop()}
		got, bytes, err := cpu.hashSum("m", lay, data, blocks)
		if err != nil {
			t.Fatal(name, err)
		}
		gpuLay := lay
		gpuLay.Regions = append([]hooks.Region(nil), lay.Regions...)
		for i := range gpuLay.Regions {
			gpuLay.Regions[i].Memory = hooks.Memory{Kind: hooks.MemoryCUDAIPC, PID: os.Getpid(), DevicePointer: uint64(i+1) << 40}
		}
		fake := &hostSummer{mem: data}
		gpu := &Agent{log: zap.NewNop(), gpu: cudaipc.NewPlane(zap.NewNop(), func() (cuda.Driver, error) { return fake, nil })}
		onGPU, gpuBytes, err := gpu.hashSum("m", gpuLay, nil, blocks)
		if err != nil {
			t.Fatal(name, "GPU:", err)
		}
		for i := range blocks {
			if got[i] != want[i] || onGPU[i] != want[i] {
				t.Fatalf("%s: block %d slots %+v: CPU %#x, GPU %#x, the canonical sequence's %#x", name, blocks[i].id, blocks[i].slots, got[i], onGPU[i], want[i])
			}
		}
		if bytes != gpuBytes || bytes == 0 {
			t.Fatalf("%s: %d bytes on the CPU, %d on the GPU", name, bytes, gpuBytes)
		}
		// A changed byte of the second block's range changes its hash alone.
		b := blocks[1]
		pieces, _ := canonicalPieces(lay, b.slots)
		p := pieces[len(pieces)/2]
		data[p.region][p.off+b.id*lay.Regions[p.region].BlockStride+3]++
		again, _, _ := cpu.hashSum("m", lay, data, blocks)
		onGPU, _, _ = gpu.hashSum("m", gpuLay, nil, blocks)
		for i := range blocks {
			same := blocks[i] == b
			if !same && blocks[i].id == b.id {
				continue // may hold the same byte
			}
			if (again[i] == want[i]) == same || onGPU[i] != again[i] {
				t.Fatalf("%s: after a byte of block %d changed, block %d: %#x → %#x (GPU %#x)", name, b.id, blocks[i].id, want[i], again[i], onGPU[i])
			}
		}
	}
	// A head slot of 8 bytes: summed on the CPU, not on the GPU.
	g.HeadDim = 4
	small := hooks.Layout{Geometry: g, Regions: []hooks.Region{{NumLayers: g.Layers, NumHeads: g.KVHeads, Size: 1 << 12, LayerStride: 1024, KVStride: 512, BlockStride: 64, HeadStride: 8, SlotStride: 32,
		Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC, PID: os.Getpid(), DevicePointer: 1 << 40}}}}
	gpu := &Agent{log: zap.NewNop(), gpu: cudaipc.NewPlane(zap.NewNop(), func() (cuda.Driver, error) { return &hostSummer{}, nil })}
	if _, _, err := gpu.hashSum("m", small, nil, blocks[:1]); !errors.Is(err, errSumUnusable) {
		t.Fatalf("8-byte head slots on the GPU: %v", err)
	}
}
