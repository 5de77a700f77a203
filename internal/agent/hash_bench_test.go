package agent

import (
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// qwenLayout is the sim's default region: Qwen3-8B's 36 layers and 8 KV
// heads at kv-scale 32, 32768 blocks.
func qwenLayout(tb testing.TB, slotMajor bool) (hooks.Layout, []byte) {
	g := kvlayout.Geometry{Layers: 36, KVHeads: 8, HeadDim: 4, DTypeBytes: 2, BlockSize: 16, NumBlocks: 32768}
	rl := kvlayout.NewRegionLayout(g, kvlayout.Shard{TPSize: 1, PPSize: 1})
	rl.SlotMajor = slotMajor
	data := make([]byte, rl.Size())
	for i := range data {
		data[i] = byte(i * 7)
	}
	return hooks.Layout{Geometry: g, Regions: []hooks.Region{{NumLayers: 36, NumHeads: 8, Size: rl.Size(), LayerStride: rl.LayerStride(),
		KVStride: rl.KVStride(), BlockStride: rl.BlockStride(), HeadStride: rl.HeadStride(), SlotStride: rl.SlotStride()}}}, data
}

// What a sampled check of 256 requests costs one side: 1,024 blocks,
// head-major (the sim's default) and slot-major (vLLM's, whose canonical
// order reads a head slot at a time).
func BenchmarkHash1024Blocks(b *testing.B) {
	for _, l := range []struct {
		name      string
		slotMajor bool
	}{{"HND", false}, {"NHD", true}} {
		b.Run(l.name, func(b *testing.B) {
			lay, data := qwenLayout(b, l.slotMajor)
			blocks := make([]hashBlock, 1024)
			for i := range blocks {
				blocks[i] = hashBlock{id: int64(i*31 + 1), slots: slotRange{0, 16 - i%3}}
			}
			for b.Loop() {
				if _, _, err := hashMapped([][]byte{data}, lay, blocks); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
