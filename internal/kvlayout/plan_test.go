package kvlayout

import (
	"iter"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
)

// value is what byte i of head vector (layer, kv, head, block, slot) holds.
func value(l, kv, h, b, s, i int) byte { return byte(l*131 + kv*71 + h*37 + b*17 + s*7 + i*3 + 1) }

// vec is one head vector's place: layer, K or V, block, head, slot.
type vec struct{ l, kv, b, h, s int }

// vectors visits every head vector of layers × K/V × blocks × heads ×
// slots.
func vectors(layers, blocks, heads, slots int) iter.Seq[vec] {
	return func(yield func(vec) bool) {
		for l := range layers {
			for kv := range 2 {
				for b := range blocks {
					for h := range heads {
						for s := range slots {
							if !yield(vec{l, kv, b, h, s}) {
								return
							}
						}
					}
				}
			}
		}
	}
}

func fill(g Geometry, par Parallel) ([][]byte, []RegionSpec) {
	var mem [][]byte
	var specs []RegionSpec
	for _, sh := range Shards(par) {
		r := NewRegionLayout(g, sh)
		buf := make([]byte, r.Size())
		for v := range vectors(r.NumLayers, g.NumBlocks, r.NumHeads, g.BlockSize) {
			off := r.Offset(v.l, v.kv, v.b, v.h, v.s)
			for i := 0; i < g.HeadSlotBytes(); i++ {
				buf[off+int64(i)] = value(r.FirstLayer+v.l, v.kv, r.FirstHead+v.h, v.b, v.s, i)
			}
		}
		mem = append(mem, buf)
		specs = append(specs, r.Spec())
	}
	return mem, specs
}

// Applying a plan moves exactly the asked slots, to the asked blocks, for
// every pair of TP×PP shapes (so TP and PP remapping are just plans), and
// merges consecutive blocks.
func TestPlanMovesExactlyTheAskedSlots(t *testing.T) {
	g := Geometry{Layers: 4, KVHeads: 4, HeadDim: 2, DTypeBytes: 2, BlockSize: 4, NumBlocks: 12}
	shapes := []Parallel{{TP: 1, PP: 1}, {TP: 2, PP: 1}, {TP: 4, PP: 1}, {TP: 1, PP: 2}, {TP: 2, PP: 2}, {TP: 1, PP: 4}}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, sp := range shapes {
		for _, dp := range shapes {
			src, srcSpecs := fill(g, sp)
			dst := make([][]byte, 0)
			var dstSpecs []RegionSpec
			for _, sh := range Shards(dp) {
				r := NewRegionLayout(g, sh)
				dst = append(dst, make([]byte, r.Size()))
				dstSpecs = append(dstSpecs, r.Spec())
			}
			var copies []BlockCopy
			want := map[[3]int][2]int{} // (dst block, slot) → (src block, slot)
			for i := 0; i < 5; i++ {
				first := rng.IntN(g.BlockSize)
				c := BlockCopy{Src: 1 + rng.IntN(g.NumBlocks-1), Dst: 1 + i*2, FirstSlot: first, NumSlots: 1 + rng.IntN(g.BlockSize-first)}
				copies = append(copies, c)
				for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
					want[[3]int{c.Dst, s}] = [2]int{c.Src, s}
				}
			}
			runs, err := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), srcSpecs, dstSpecs, copies)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range runs {
				copy(dst[r.DstRegion][r.DstOffset:r.DstOffset+r.Length], src[r.SrcRegion][r.SrcOffset:r.SrcOffset+r.Length])
			}
			for ri, sh := range Shards(dp) {
				r := NewRegionLayout(g, sh)
				for v := range vectors(r.NumLayers, g.NumBlocks, r.NumHeads, g.BlockSize) {
					off := r.Offset(v.l, v.kv, v.b, v.h, v.s)
					from, moved := want[[3]int{v.b, v.s}]
					for i := 0; i < g.HeadSlotBytes(); i++ {
						got := dst[ri][off+int64(i)]
						var exp byte
						if moved {
							exp = value(r.FirstLayer+v.l, v.kv, r.FirstHead+v.h, from[0], from[1], i)
						}
						if got != exp {
							t.Fatalf("%+v→%+v: layer %d kv %d block %d head %d slot %d byte %d = %d, want %d",
								sp, dp, r.FirstLayer+v.l, v.kv, v.b, r.FirstHead+v.h, v.s, i, got, exp)
						}
					}
				}
			}
		}
	}
}

func TestPlanMergesConsecutiveBlocks(t *testing.T) {
	g := Geometry{Layers: 3, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 16, NumBlocks: 64}
	r := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1}).Spec()
	var copies []BlockCopy
	for b := 10; b < 20; b++ {
		copies = append(copies, BlockCopy{Src: b, Dst: b + 30, NumSlots: 16})
	}
	runs, _ := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{r}, []RegionSpec{r}, copies)
	if len(runs) != 2*g.Layers {
		t.Fatalf("10 consecutive whole blocks: %d runs, want one per layer and K/V (%d)", len(runs), 2*g.Layers)
	}
	if Bytes(runs) != 10*int64(g.BlockBytes()) {
		t.Fatalf("bytes %d", Bytes(runs))
	}
}

// vLLM's CPU layout (LBHNC with K and V side by side in the channel
// dimension) has slots that are not packed: a plan to and from it still
// moves exactly the asked slots.
func TestPlanHandlesInterleavedKV(t *testing.T) {
	g := Geometry{Layers: 2, KVHeads: 2, HeadDim: 2, DTypeBytes: 4, BlockSize: 4, NumBlocks: 6}
	hs := int64(g.HeadSlotBytes())
	inter := RegionSpec{NumLayers: g.Layers, NumHeads: g.KVHeads, Strides: Strides{
		Slot: 2 * hs, KV: hs, Head: 2 * hs * int64(g.BlockSize),
		Block: 2 * hs * int64(g.BlockSize*g.KVHeads), Layer: 2 * hs * int64(g.BlockSize*g.KVHeads*g.NumBlocks)}}
	size := inter.Strides.Layer * int64(g.Layers)
	hnd := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
	src, _ := fill(g, Parallel{TP: 1, PP: 1})
	copies := []BlockCopy{{Src: 1, Dst: 4, FirstSlot: 1, NumSlots: 3}, {Src: 2, Dst: 5, NumSlots: 4}}
	there := make([]byte, size)
	runs, err := Plan(g.Layers, g.KVHeads, hs, []RegionSpec{hnd.Spec()}, []RegionSpec{inter}, copies)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range runs {
		copy(there[r.DstOffset:r.DstOffset+r.Length], src[0][r.SrcOffset:r.SrcOffset+r.Length])
	}
	back := make([]byte, hnd.Size())
	runs, _ = Plan(g.Layers, g.KVHeads, hs, []RegionSpec{inter}, []RegionSpec{hnd.Spec()}, []BlockCopy{{Src: 4, Dst: 1, FirstSlot: 1, NumSlots: 3}, {Src: 5, Dst: 2, NumSlots: 4}})
	for _, r := range runs {
		copy(back[r.DstOffset:r.DstOffset+r.Length], there[r.SrcOffset:r.SrcOffset+r.Length])
	}
	for l := 0; l < g.Layers; l++ {
		for kv := 0; kv < 2; kv++ {
			for h := 0; h < g.KVHeads; h++ {
				for _, c := range copies {
					for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
						off := inter.offset(l, kv, c.Dst, h, s)
						boff := hnd.Offset(l, kv, c.Src, h, s)
						for i := 0; i < int(hs); i++ {
							want := value(l, kv, h, c.Src, s, i)
							if there[off+int64(i)] != want || back[boff+int64(i)] != want {
								t.Fatalf("layer %d kv %d head %d slot %d byte %d: there %d back %d want %d", l, kv, h, s, i, there[off+int64(i)], back[boff+int64(i)], want)
							}
						}
					}
				}
			}
		}
	}
}

// A slot-major layout (FlashAttention's logical [2, blocks, slots, heads,
// head_dim] per layer, layers end to end): every head of a slot side by side, so a
// block's slots are one stretch. Between two such engines a plan is one
// run per copy, layer and K/V, merged over consecutive blocks; to and
// from the sim's head-major layout it still moves exactly the asked slots.
func TestPlanSlotMajorLayouts(t *testing.T) {
	g := Geometry{Layers: 3, KVHeads: 4, HeadDim: 2, DTypeBytes: 2, BlockSize: 4, NumBlocks: 8}
	hs := int64(g.HeadSlotBytes())
	slot := hs * int64(g.KVHeads)
	block := slot * int64(g.BlockSize)
	plane := block * int64(g.NumBlocks)
	nhd := RegionSpec{NumLayers: g.Layers, NumHeads: g.KVHeads, Strides: Strides{
		Layer: 2 * plane, KV: plane, Block: block, Head: hs, Slot: slot}}
	size := nhd.Strides.Layer * int64(g.Layers)

	whole := []BlockCopy{{Src: 1, Dst: 5, NumSlots: 4}, {Src: 2, Dst: 6, NumSlots: 4}, {Src: 7, Dst: 0, FirstSlot: 1, NumSlots: 2}}
	runs, err := Plan(g.Layers, g.KVHeads, hs, []RegionSpec{nhd}, []RegionSpec{nhd}, whole)
	if err != nil {
		t.Fatal(err)
	}
	if want := 2 * 2 * g.Layers; len(runs) != want {
		t.Fatalf("%d runs, want %d (blocks 1-2 → 5-6 merged, then the slots of block 7, per layer and K/V)", len(runs), want)
	}

	hnd := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
	src, _ := fill(g, Parallel{TP: 1, PP: 1})
	there := make([]byte, size)
	runs, err = Plan(g.Layers, g.KVHeads, hs, []RegionSpec{hnd.Spec()}, []RegionSpec{nhd}, whole)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range runs {
		copy(there[r.DstOffset:r.DstOffset+r.Length], src[0][r.SrcOffset:r.SrcOffset+r.Length])
	}
	// And on from one slot-major engine to another (other blocks).
	onward := make([]byte, size)
	var next []BlockCopy
	for _, c := range whole {
		next = append(next, BlockCopy{Src: c.Dst, Dst: c.Dst + 1, FirstSlot: c.FirstSlot, NumSlots: c.NumSlots})
	}
	next[1].Dst = 3 // 6 → 7 would be 5 → 6's target: keep the targets apart
	runs, _ = Plan(g.Layers, g.KVHeads, hs, []RegionSpec{nhd}, []RegionSpec{nhd}, next)
	for _, r := range runs {
		copy(onward[r.DstOffset:r.DstOffset+r.Length], there[r.SrcOffset:r.SrcOffset+r.Length])
	}
	moved := map[[2]int]bool{}
	for i, c := range whole {
		for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
			moved[[2]int{next[i].Dst, s}] = true
			for l := 0; l < g.Layers; l++ {
				for kv := 0; kv < 2; kv++ {
					for h := 0; h < g.KVHeads; h++ {
						a, b := nhd.offset(l, kv, c.Dst, h, s), nhd.offset(l, kv, next[i].Dst, h, s)
						for k := int64(0); k < hs; k++ {
							want := value(l, kv, h, c.Src, s, int(k))
							if there[a+k] != want || onward[b+k] != want {
								t.Fatalf("layer %d kv %d head %d slot %d byte %d: there %d onward %d want %d", l, kv, h, s, k, there[a+k], onward[b+k], want)
							}
						}
					}
				}
			}
		}
	}
	// Nothing else was written onward.
	for v := range vectors(g.Layers, g.NumBlocks, g.KVHeads, g.BlockSize) {
		if moved[[2]int{v.b, v.s}] {
			continue
		}
		off := nhd.offset(v.l, v.kv, v.b, v.h, v.s)
		for k := int64(0); k < hs; k++ {
			if onward[off+k] != 0 {
				t.Fatalf("layer %d kv %d block %d head %d slot %d written", v.l, v.kv, v.b, v.h, v.s)
			}
		}
	}
}

// layouts are the per-layer KV views vLLM's backends use, layers end to
// end in one buffer: K/V planes first or inside a block, slot-major or
// head-major, and K and V side by side per head (a last dimension of
// 2×head_dim), which vLLM 0.26 uses on the GPU. The plan walks each in its
// memory order, so a layer's whole block between same-shaped engines is
// one run (two where K and V are planes), merged over consecutive blocks.
func layouts(g Geometry) map[string]RegionSpec {
	hs := int64(g.HeadSlotBytes())
	h, n, b := int64(g.KVHeads), int64(g.BlockSize), int64(g.NumBlocks)
	blk := 2 * h * n * hs // one layer's block, K and V
	spec := func(layer, kv, block, head, slot int64) RegionSpec {
		return RegionSpec{NumLayers: g.Layers, NumHeads: g.KVHeads, Strides: Strides{Layer: layer, KV: kv, Block: block, Head: head, Slot: slot}}
	}
	return map[string]RegionSpec{
		"[2,B,N,H,D]":  spec(blk*b, blk/2*b, blk/2, hs, h*hs),
		"[2,B,H,N,D]":  spec(blk*b, blk/2*b, blk/2, n*hs, hs),
		"[B,2,N,H,D]":  spec(blk*b, blk/2, blk, hs, h*hs),
		"[B,H,N,2D]":   spec(blk*b, hs, blk, 2*n*hs, 2*hs),
		"[B,N,H,2D]":   spec(blk*b, hs, blk, 2*hs, 2*h*hs),
		"[B,H,2,N,D]":  spec(blk*b, n*hs, blk, 2*n*hs, hs),
		"sim (HND×KV)": NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1}).Spec(),
	}
}

func TestPlanEveryVLLMLayout(t *testing.T) {
	g := Geometry{Layers: 3, KVHeads: 4, HeadDim: 2, DTypeBytes: 2, BlockSize: 4, NumBlocks: 10}
	hs := int64(g.HeadSlotBytes())
	size := int64(g.Layers) * 2 * int64(g.KVHeads*g.BlockSize*g.NumBlocks) * hs
	// Three consecutive whole blocks, then slots of two others.
	copies := []BlockCopy{{Src: 1, Dst: 5, NumSlots: 4}, {Src: 2, Dst: 6, NumSlots: 4}, {Src: 3, Dst: 7, NumSlots: 4},
		{Src: 9, Dst: 0, FirstSlot: 1, NumSlots: 2}, {Src: 4, Dst: 8, FirstSlot: 3, NumSlots: 1}}
	moved := map[[2]int][2]int{} // target (block, slot) → source (block, slot)
	for _, c := range copies {
		for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
			moved[[2]int{c.Dst, s}] = [2]int{c.Src, s}
		}
	}
	all := layouts(g)
	for sn, src := range all {
		mem := make([]byte, size)
		for v := range vectors(g.Layers, g.NumBlocks, g.KVHeads, g.BlockSize) {
			off := src.offset(v.l, v.kv, v.b, v.h, v.s)
			for i := int64(0); i < hs; i++ {
				mem[off+i] = value(v.l, v.kv, v.h, v.b, v.s, int(i))
			}
		}
		for dn, dst := range all {
			runs, err := Plan(g.Layers, g.KVHeads, hs, []RegionSpec{src}, []RegionSpec{dst}, copies[:3])
			if err != nil {
				t.Fatal(err)
			}
			if sn == dn {
				want := g.Layers // a layer's three blocks are one stretch
				if src.Strides.KV > src.Strides.Block {
					want = 2 * g.Layers // K and V planes
				}
				if len(runs) != want {
					t.Errorf("%s: three consecutive whole blocks took %d runs, want %d", sn, len(runs), want)
				}
			}
			runs, err = Plan(g.Layers, g.KVHeads, hs, []RegionSpec{src}, []RegionSpec{dst}, copies)
			if err != nil {
				t.Fatal(err)
			}
			out := make([]byte, size)
			for _, r := range runs {
				copy(out[r.DstOffset:r.DstOffset+r.Length], mem[r.SrcOffset:r.SrcOffset+r.Length])
			}
			for v := range vectors(g.Layers, g.NumBlocks, g.KVHeads, g.BlockSize) {
				from, ok := moved[[2]int{v.b, v.s}]
				off := dst.offset(v.l, v.kv, v.b, v.h, v.s)
				for i := int64(0); i < hs; i++ {
					var want byte
					if ok {
						want = value(v.l, v.kv, v.h, from[0], from[1], int(i))
					}
					if out[off+i] != want {
						t.Fatalf("%s → %s: layer %d kv %d block %d head %d slot %d byte %d = %d, want %d",
							sn, dn, v.l, v.kv, v.b, v.h, v.s, i, out[off+i], want)
					}
				}
			}
		}
	}
}

// Round 0 of the seed's full load on real vLLM: 256 requests' 11,000
// blocks of Qwen3-8B (36 layers, 8 KV heads × 128, bf16, 16 slots), in
// each of vLLM's layouts.
func BenchmarkPlanQwen3_8B(b *testing.B) {
	g := Geometry{Layers: 36, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, BlockSize: 16, NumBlocks: 20000}
	var copies []BlockCopy
	for i := 0; i < 11000; i++ {
		copies = append(copies, BlockCopy{Src: i + i/43, Dst: 19999 - i, NumSlots: 16}) // 256 requests' runs, reversed on B
	}
	for name, l := range layouts(g) {
		b.Run(name, func(b *testing.B) {
			var runs []CopyRun
			for b.Loop() {
				runs, _ = Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{l}, []RegionSpec{l}, copies)
			}
			b.ReportMetric(float64(len(runs)), "runs")
		})
	}
}

// Between TP shapes (a layer's heads in two regions on one side) a plan
// moves each head's packed slots as one run, never slot by slot: the
// in-process shape tests' round 0 took 4 s when it did.
func TestPlanAcrossTPMovesHeadsWhole(t *testing.T) {
	g := Geometry{Layers: 2, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 16, NumBlocks: 8}
	_, one := fill(g, Parallel{TP: 1, PP: 1})
	_, two := fill(g, Parallel{TP: 2, PP: 1})
	copies := []BlockCopy{{Src: 1, Dst: 4, NumSlots: 16}, {Src: 6, Dst: 2, FirstSlot: 3, NumSlots: 5}}
	for _, dir := range [][2][]RegionSpec{{one, two}, {two, one}} {
		runs, err := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), dir[0], dir[1], copies)
		if err != nil {
			t.Fatal(err)
		}
		if max := g.Layers * 2 * g.KVHeads * len(copies); len(runs) > max {
			t.Fatalf("%d runs, want at most one per layer, K/V, head and copy (%d)", len(runs), max)
		}
	}
}

// Plan sizes its list of runs once, from a count of each layer's walk:
// growing it by append copied the list over and over (most of a slot
// round's plan at the 8B geometry, 147,456 runs). Where no run merges the
// count is exact.
func TestPlanSizesItsRunsOnce(t *testing.T) {
	p, _ := LookupProfile("qwen3-8b")
	g, _ := p.Scaled(32, 16, 4096)
	r := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1}).Spec()
	for _, slots := range []int{1, 5, 16} {
		var copies []BlockCopy
		for i := 0; i < 64; i++ {
			copies = append(copies, BlockCopy{Src: 1 + i*7, Dst: 2 + i*5, FirstSlot: (i % 2) * (16 - slots), NumSlots: slots})
		}
		runs, err := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{r}, []RegionSpec{r}, copies)
		if err != nil {
			t.Fatal(err)
		}
		if cap(runs) != len(runs) {
			t.Fatalf("%d slots a copy: %d runs in a list of %d", slots, len(runs), cap(runs))
		}
	}
}

// A large plan, its layers planned side by side, is the plan made one
// layer after another: the same runs in the same order, whatever the
// layout on each side (one region each, or TP shards on one side).
func TestPlanInParallelEqualsPlanInTurn(t *testing.T) {
	p, _ := LookupProfile("qwen3-8b")
	g, _ := p.Scaled(32, 16, 4096)
	one := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
	nhd := one
	nhd.SlotMajor = true
	var tp2 []RegionSpec
	for _, sh := range Shards(Parallel{TP: 2, PP: 1}) {
		tp2 = append(tp2, NewRegionLayout(g, sh).Spec())
	}
	var copies []BlockCopy
	for i := 0; i < 300; i++ {
		copies = append(copies, BlockCopy{Src: 1 + i*7, Dst: 2 + i*5, FirstSlot: i % 16, NumSlots: 1 + (i%3)*(15-i%16)/2})
	}
	for name, sides := range map[string][2][]RegionSpec{
		"HND→HND": {{one.Spec()}, {one.Spec()}},
		"HND→NHD": {{one.Spec()}, {nhd.Spec()}},
		"TP2→NHD": {tp2, {nhd.Spec()}},
	} {
		plan := func() []CopyRun {
			runs, err := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), sides[0], sides[1], copies)
			if err != nil {
				t.Fatal(err)
			}
			return runs
		}
		side := plan()
		procs := runtime.GOMAXPROCS(1)
		inTurn := plan()
		runtime.GOMAXPROCS(procs)
		if len(inTurn) < parallelPlanRuns {
			t.Fatalf("%s: %d runs, too few to plan in parallel", name, len(inTurn))
		}
		if !slices.Equal(side, inTurn) {
			t.Fatalf("%s: %d runs side by side, %d in turn, or in another order", name, len(side), len(inTurn))
		}
	}
}
