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
// makes TP and PP remapping just another plan. Runs adjacent on both sides
// are merged, so same-shape whole-block copies of consecutive blocks
// become one run per layer and K/V.
func Plan(layers, heads int, headSlotBytes int64, src, dst []RegionSpec, copies []BlockCopy) ([]CopyRun, error) {
	type where struct{ s, d int }
	loc := make([]where, layers*heads)
	for l := 0; l < layers; l++ {
		for h := 0; h < heads; h++ {
			w := where{-1, -1}
			for i, r := range src {
				if r.holds(l, h) {
					w.s = i
				}
			}
			for i, r := range dst {
				if r.holds(l, h) {
					w.d = i
				}
			}
			if w.s < 0 || w.d < 0 {
				return nil, fmt.Errorf("plan: layer %d head %d is not held by both sides", l, h)
			}
			loc[l*heads+h] = w
		}
	}
	// Runs are grouped per (layer, K/V) stream so that consecutive blocks
	// merge; the groups are concatenated at the end.
	groups := make([][]CopyRun, layers*2)
	add := func(g int, r CopyRun) {
		runs := groups[g]
		if n := len(runs); n > 0 {
			p := &runs[n-1]
			if p.SrcRegion == r.SrcRegion && p.DstRegion == r.DstRegion &&
				p.SrcOffset+p.Length == r.SrcOffset && p.DstOffset+p.Length == r.DstOffset {
				p.Length += r.Length
				return
			}
		}
		groups[g] = append(runs, r)
	}
	for _, c := range copies {
		if c.NumSlots <= 0 {
			continue
		}
		length := int64(c.NumSlots) * headSlotBytes
		for l := 0; l < layers; l++ {
			for kv := 0; kv < 2; kv++ {
				for h := 0; h < heads; h++ {
					w := loc[l*heads+h]
					s, d := src[w.s], dst[w.d]
					add(l*2+kv, CopyRun{
						SrcRegion: w.s, SrcOffset: s.offset(l, kv, c.Src, h, c.FirstSlot),
						DstRegion: w.d, DstOffset: d.offset(l, kv, c.Dst, h, c.FirstSlot),
						Length: length,
					})
				}
			}
		}
	}
	var runs []CopyRun
	for _, g := range groups {
		runs = append(runs, g...)
	}
	return runs, nil
}

// Bytes is the total length of runs.
func Bytes(runs []CopyRun) int64 {
	var n int64
	for _, r := range runs {
		n += r.Length
	}
	return n
}
