package kvlayout

import "fmt"

// Strides locate KV in one region: the HeadDim×dtype bytes of (local layer,
// K/V, block, local head, slot) start at the dot product with the indices.
type Strides struct {
	Layer, KV, Block, Head, Slot int64
}

// RegionSpec is what a copy plan needs to know of one region.
type RegionSpec struct {
	FirstLayer, NumLayers int
	FirstHead, NumHeads   int
	Strides               Strides
}

// Strides of a RegionLayout.
func (r RegionLayout) Strides() Strides {
	return Strides{Layer: r.LayerStride(), KV: r.KVStride(), Block: r.BlockStride(), Head: r.HeadStride(), Slot: int64(r.Geometry.HeadSlotBytes())}
}

// Spec of a RegionLayout.
func (r RegionLayout) Spec() RegionSpec {
	return RegionSpec{FirstLayer: r.FirstLayer, NumLayers: r.NumLayers, FirstHead: r.FirstHead, NumHeads: r.NumHeads, Strides: r.Strides()}
}

func (r RegionSpec) holds(layer, head int) bool {
	return layer >= r.FirstLayer && layer < r.FirstLayer+r.NumLayers && head >= r.FirstHead && head < r.FirstHead+r.NumHeads
}

func (r RegionSpec) offset(layer, kv, block, head, slot int) int64 {
	s := r.Strides
	return int64(layer-r.FirstLayer)*s.Layer + int64(kv)*s.KV + int64(block)*s.Block + int64(head-r.FirstHead)*s.Head + int64(slot)*s.Slot
}

// CopyRun is one contiguous copy from a source region to a target region.
type CopyRun struct {
	SrcRegion int   `json:"src_region"`
	SrcOffset int64 `json:"src_offset"`
	DstRegion int   `json:"dst_region"`
	DstOffset int64 `json:"dst_offset"`
	Length    int64 `json:"length"`
}

// BlockCopy asks for slots [FirstSlot, FirstSlot+NumSlots) of source block
// Src to land in the same slots of target block Dst.
type BlockCopy struct {
	Src, Dst            int
	FirstSlot, NumSlots int
}

// Plan builds the copy runs that move the given block slots from a source
// with regions src to a target with regions dst. Both describe the same
// model (layers, heads, head size); their TP/PP sharding may differ, which
// makes TP and PP remapping just another plan. Runs are emitted per layer
// and K/V plane, block by block, and merged when adjacent on both sides, so
// same-shape whole-block copies of consecutive blocks become one run per
// layer and K/V. This sits in the final round's pause: it is written to
// do a few additions per run.
func Plan(layers, heads int, headSlotBytes int64, src, dst []RegionSpec, copies []BlockCopy) ([]CopyRun, error) {
	// Per (layer, K/V, head): which regions, and the offset of block 0
	// slot 0 on each side.
	type place struct {
		s, d           int
		sBase, dBase   int64
		sBlock, dBlock int64
		sSlot, dSlot   int64
	}
	places := make([]place, layers*2*heads)
	for l := 0; l < layers; l++ {
		for h := 0; h < heads; h++ {
			si, di := -1, -1
			for i, r := range src {
				if r.holds(l, h) {
					si = i
				}
			}
			for i, r := range dst {
				if r.holds(l, h) {
					di = i
				}
			}
			if si < 0 || di < 0 {
				return nil, fmt.Errorf("plan: layer %d head %d is not held by both sides", l, h)
			}
			for kv := 0; kv < 2; kv++ {
				places[(l*2+kv)*heads+h] = place{
					s: si, d: di,
					sBase: src[si].offset(l, kv, 0, h, 0), dBase: dst[di].offset(l, kv, 0, h, 0),
					sBlock: src[si].Strides.Block, dBlock: dst[di].Strides.Block,
					sSlot: src[si].Strides.Slot, dSlot: dst[di].Strides.Slot,
				}
			}
		}
	}
	n := 0
	for _, c := range copies {
		if c.NumSlots > 0 {
			n++
		}
	}
	runs := make([]CopyRun, 0, n*layers*2*heads)
	for g := 0; g < layers*2; g++ {
		pl := places[g*heads : (g+1)*heads]
		for _, c := range copies {
			if c.NumSlots <= 0 {
				continue
			}
			for i := range pl {
				p := &pl[i]
				so := p.sBase + int64(c.Src)*p.sBlock + int64(c.FirstSlot)*p.sSlot
				do := p.dBase + int64(c.Dst)*p.dBlock + int64(c.FirstSlot)*p.dSlot
				if p.sSlot == headSlotBytes && p.dSlot == headSlotBytes {
					runs = appendRun(runs, p.s, so, p.d, do, int64(c.NumSlots)*headSlotBytes)
					continue
				}
				// Slots are not packed (vLLM's CPU layout interleaves K and V
				// per slot): one run per slot.
				for k := int64(0); k < int64(c.NumSlots); k++ {
					runs = appendRun(runs, p.s, so+k*p.sSlot, p.d, do+k*p.dSlot, headSlotBytes)
				}
			}
		}
	}
	return runs, nil
}

// appendRun appends a run, merging it into the last one when it continues
// it on both sides.
func appendRun(runs []CopyRun, s int, so int64, d int, do, length int64) []CopyRun {
	if k := len(runs) - 1; k >= 0 {
		last := &runs[k]
		if last.SrcRegion == s && last.DstRegion == d && last.SrcOffset+last.Length == so && last.DstOffset+last.Length == do {
			last.Length += length
			return runs
		}
	}
	return append(runs, CopyRun{SrcRegion: s, SrcOffset: so, DstRegion: d, DstOffset: do, Length: length})
}

// Bytes is the total length of runs.
func Bytes(runs []CopyRun) int64 {
	var n int64
	for _, r := range runs {
		n += r.Length
	}
	return n
}
