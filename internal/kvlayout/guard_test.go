package kvlayout

import (
	"math"
	"testing"
)

func guardFor(t *testing.T, g Geometry, p Parallel, allowed []int) (*BlockGuard, []RegionLayout) {
	t.Helper()
	var specs []RegionSpec
	var sizes []int64
	var layouts []RegionLayout
	for _, s := range Shards(p) {
		r := NewRegionLayout(g, s)
		specs = append(specs, r.Spec())
		sizes = append(sizes, r.Size())
		layouts = append(layouts, r)
	}
	gd, err := NewBlockGuard(specs, sizes, g.NumBlocks, g.BlockSize, int64(g.HeadSlotBytes()), allowed)
	if err != nil {
		t.Fatal(err)
	}
	return gd, layouts
}

// Every run a plan makes into allowed blocks passes; a run that touches a
// block outside the reservation, leaves the region, or wraps around
// uint64 is refused.
func TestBlockGuard(t *testing.T) {
	g := Geometry{Layers: 4, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 8, NumBlocks: 32}
	for _, p := range []Parallel{{TP: 1, PP: 1}, {TP: 2, PP: 2}} {
		gd, layouts := guardFor(t, g, p, []int{5, 6, 7, 20})
		src := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
		var dstSpecs []RegionSpec
		for _, l := range layouts {
			dstSpecs = append(dstSpecs, l.Spec())
		}
		runs, err := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{src.Spec()}, dstSpecs,
			[]BlockCopy{{Src: 1, Dst: 5, NumSlots: 8}, {Src: 2, Dst: 6, NumSlots: 8}, {Src: 3, Dst: 7, NumSlots: 8}, {Src: 9, Dst: 20, FirstSlot: 3, NumSlots: 2}})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range runs {
			if err := gd.CheckRun(uint32(r.DstRegion), uint64(r.DstOffset), uint64(r.Length)); err != nil {
				t.Fatalf("%+v: %v", r, err)
			}
		}
		l := layouts[0]
		bad := []struct {
			name       string
			region     uint32
			at, length uint64
		}{
			{"block not reserved", 0, uint64(l.Offset(0, 0, 4, 0, 0)), 1},
			{"run spills into the next block", 0, uint64(l.Offset(0, 0, 7, 0, 0)), uint64(2 * l.BlockStride())},
			{"run spills from a reserved block into a free one", 0, uint64(l.Offset(0, 1, 20, 0, 0)), uint64(l.BlockStride() + 1)},
			{"offset 2^64-1", 0, math.MaxUint64, 1},
			{"length wraps", 0, 16, math.MaxUint64},
			{"past the region", 0, uint64(l.Size()), 1},
			{"unknown region", uint32(len(layouts)), 0, 1},
		}
		for _, c := range bad {
			if err := gd.CheckRun(c.region, c.at, c.length); err == nil {
				t.Errorf("%v: %s passed", p, c.name)
			}
		}
		if err := gd.CheckSlots(5, 0, 8); err != nil {
			t.Fatal(err)
		}
		for _, c := range [][3]uint64{{4, 0, 1}, {5, 7, 2}, {5, math.MaxUint64, 2}, {math.MaxUint64, 0, 1}, {5, 1, math.MaxUint64}} {
			if err := gd.CheckSlots(c[0], c[1], c[2]); err == nil {
				t.Errorf("slots %v passed", c)
			}
		}
	}
}

// vLLM CPU's packed block layout (block outside K/V and heads) and layouts
// with padding between tensors are guarded too; overlapping strides are
// refused.
func TestBlockGuardLayouts(t *testing.T) {
	const heads, bs, slot, blocks = 2, 4, 8, 10
	blk := int64(2 * heads * bs * slot)
	packed := RegionSpec{NumLayers: 3, NumHeads: heads, Strides: Strides{Layer: blocks*blk + 64, Block: blk, KV: blk / 2, Head: blk / (2 * heads), Slot: slot}}
	size := 3 * (blocks*blk + 64)
	gd, err := NewBlockGuard([]RegionSpec{packed}, []int64{size}, blocks, bs, slot, []int{3})
	if err != nil {
		t.Fatal(err)
	}
	if err := gd.CheckRun(0, uint64(2*packed.Strides.Layer+3*blk), uint64(blk)); err != nil {
		t.Fatal(err)
	}
	if err := gd.CheckRun(0, uint64(blocks*blk), 1); err == nil {
		t.Fatal("a write into the padding after a layer's blocks passed")
	}
	overlap := packed
	overlap.Strides.Head = blk / 2
	if _, err := NewBlockGuard([]RegionSpec{overlap}, []int64{size}, blocks, bs, slot, nil); err == nil {
		t.Fatal("overlapping strides accepted")
	}
	if _, err := NewBlockGuard([]RegionSpec{packed}, []int64{size}, blocks, bs, slot, []int{blocks}); err == nil {
		t.Fatal("an allowed block outside the pool accepted")
	}
}

func FuzzBlockGuard(f *testing.F) {
	g := Geometry{Layers: 2, KVHeads: 2, HeadDim: 4, DTypeBytes: 2, BlockSize: 4, NumBlocks: 8}
	l := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
	gd, err := NewBlockGuard([]RegionSpec{l.Spec()}, []int64{l.Size()}, g.NumBlocks, g.BlockSize, int64(g.HeadSlotBytes()), []int{2, 3})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(uint32(0), uint64(l.Offset(0, 0, 2, 0, 0)), uint64(2*l.BlockStride()))
	f.Add(uint32(0), uint64(math.MaxUint64), uint64(1))
	f.Add(uint32(1), uint64(0), uint64(0))
	f.Fuzz(func(t *testing.T, region uint32, at, n uint64) {
		if gd.CheckRun(region, at, n) != nil {
			return
		}
		// Passed: every byte must be in block 2 or 3 of region 0.
		if region != 0 || at+n > uint64(l.Size()) || at+n < at {
			t.Fatalf("passed outside the region: %d %d %d", region, at, n)
		}
		for _, x := range []uint64{at, at + n/2, at + n - 1} {
			if n == 0 {
				break
			}
			off := int64(x)
			b := (off % l.KVStride()) / l.BlockStride()
			if b != 2 && b != 3 {
				t.Fatalf("byte %d is in block %d", x, b)
			}
		}
	})
}

// What the guard costs a final round of 256 requests' token slots at
// Qwen3-8B's shape (one run per layer, K/V and head: 147,456 runs).
func BenchmarkBlockGuardFinalRound(b *testing.B) {
	g := Geometry{Layers: 36, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, BlockSize: 16, NumBlocks: 12000}
	l := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
	var allowed []int
	var copies []BlockCopy
	for i := 0; i < 256; i++ {
		allowed = append(allowed, 1+i*40)
		copies = append(copies, BlockCopy{Src: 1 + i*40, Dst: 1 + i*40, FirstSlot: 5, NumSlots: 2})
	}
	runs, err := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{l.Spec()}, []RegionSpec{l.Spec()}, copies)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		gd, _ := NewBlockGuard([]RegionSpec{l.Spec()}, []int64{l.Size()}, g.NumBlocks, g.BlockSize, int64(g.HeadSlotBytes()), allowed)
		for _, r := range runs {
			if err := gd.CheckRun(uint32(r.DstRegion), uint64(r.DstOffset), uint64(r.Length)); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(len(runs)), "runs")
}
