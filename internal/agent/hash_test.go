package agent

import (
	"math/rand/v2"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// The GPU check gathers the stretches a block's canonical pieces lie in
// and hashes the canonical sequence from the staged copy; for every layout
// vLLM's backends use (and TP shards in two regions) that gives the hash
// the mapped-memory walk gives, and a layout that keeps a head's V right
// after its K gathers one stretch per layer and block, not one per slot.
func TestStagedHashMatchesTheCanonicalWalk(t *testing.T) {
	g := kvlayout.Geometry{Layers: 3, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 4, NumBlocks: 9}
	layouts := testLayouts(g)

	rng := rand.New(rand.NewPCG(3, 4))
	var blocks []hashBlock
	for i := 0; i < 12; i++ {
		first := rng.IntN(g.BlockSize)
		blocks = append(blocks, hashBlock{id: int64(rng.IntN(g.NumBlocks)), slots: slotRange{first, 1 + rng.IntN(g.BlockSize-first)}})
	}
	blocks = append(blocks, hashBlock{id: 2, slots: slotRange{0, 4}}, hashBlock{id: 3, slots: slotRange{0, 4}})
	shared := &stagedLayouts{}
	for name, lay := range layouts {
		data := make([][]byte, len(lay.Regions))
		for i, r := range lay.Regions {
			data[i] = make([]byte, r.Size)
			for k := range data[i] {
				data[i][k] = byte(rng.Uint32())
			}
		}
		want, wantBytes, err := hashMapped(data, lay, blocks)
		if err != nil {
			t.Fatal(err)
		}
		// Made afresh, and from a cache shared by every layout here (twice:
		// filled, then read): a cache that mixed up two layouts' shapes
		// would stage the wrong bytes.
		for pass, cache := range []*stagedLayouts{nil, shared, shared} {
			st, err := planStaging(lay, blocks, cache)
			if err != nil {
				t.Fatal(err)
			}
			// What the gather does: the runs' bytes packed in order.
			var host []byte
			for _, r := range st.runs {
				host = append(host, data[r.SrcRegion][r.SrcOffset:r.SrcOffset+r.Length]...)
			}
			if int64(len(host)) != st.bytes || st.bytes != wantBytes {
				t.Fatalf("%s pass %d: staged %d bytes, planned %d, hashed %d", name, pass, len(host), st.bytes, wantBytes)
			}
			got := make([]uint64, len(blocks))
			st.hash(host, got)
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("%s pass %d: block %d slots %+v: staged hash %x, canonical walk %x", name, pass, blocks[i].id, blocks[i].slots, got[i], want[i])
				}
			}
		}
		// Any change to a hashed byte changes its block's hash.
		b := blocks[0]
		sl, _ := newStagedLayout(lay, b.slots)
		sp := sl.spans[len(sl.spans)/2]
		data[sp.region][sp.off+b.id*lay.Regions[sp.region].BlockStride]++
		again, _, _ := hashMapped(data, lay, blocks[:1])
		if again[0] == want[0] {
			t.Fatalf("%s: a changed byte left the hash as it was", name)
		}
		if name == "[B,H,N,2D]" {
			full, _ := newStagedLayout(lay, slotRange{0, g.BlockSize})
			if len(full.spans) != g.Layers {
				t.Fatalf("%s: a whole block gathers in %d stretches, want one per layer (%d)", name, len(full.spans), g.Layers)
			}
		}
	}
}

// testLayouts lays out g's KV every way vLLM's backends do (one region),
// and as TP2 shards in two regions (heads 0-1 and 2-3, head-major).
func testLayouts(g kvlayout.Geometry) map[string]hooks.Layout {
	hs := int64(g.HeadSlotBytes())
	h, n, nb := int64(g.KVHeads), int64(g.BlockSize), int64(g.NumBlocks)
	blk := 2 * h * n * hs
	one := func(layer, kv, block, head, slot int64) hooks.Layout {
		return hooks.Layout{Geometry: g, Regions: []hooks.Region{{NumLayers: g.Layers, NumHeads: g.KVHeads, Size: blk * nb * int64(g.Layers),
			LayerStride: layer, KVStride: kv, BlockStride: block, HeadStride: head, SlotStride: slot}}}
	}
	layouts := map[string]hooks.Layout{
		"[2,B,N,H,D]": one(blk*nb, blk/2*nb, blk/2, hs, h*hs),
		"[2,B,H,N,D]": one(blk*nb, blk/2*nb, blk/2, n*hs, hs),
		"[B,H,N,2D]":  one(blk*nb, hs, blk, 2*n*hs, 2*hs),
		"[B,N,H,2D]":  one(blk*nb, hs, blk, 2*hs, 2*h*hs),
	}
	var tp hooks.Layout
	tp.Geometry = g
	for _, sh := range kvlayout.Shards(kvlayout.Parallel{TP: 2, PP: 1}) {
		rl := kvlayout.NewRegionLayout(g, sh)
		tp.Regions = append(tp.Regions, hooks.Region{FirstLayer: rl.FirstLayer, NumLayers: rl.NumLayers, FirstHead: rl.FirstHead, NumHeads: rl.NumHeads,
			Size: rl.Size(), LayerStride: rl.LayerStride(), KVStride: rl.KVStride(), BlockStride: rl.BlockStride(), HeadStride: rl.HeadStride(), SlotStride: hs})
	}
	layouts["TP2 head-major"] = tp
	return layouts
}
