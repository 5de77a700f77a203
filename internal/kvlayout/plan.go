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

// place is where one (layer, K/V, head) lives on each side: the regions,
// the offset of block 0 slot 0, and the block and slot strides.
type place struct {
	s, d           int
	sBase, dBase   int64
	sBlock, dBlock int64
	sSlot, dSlot   int64
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
	perGroup := heads // runs per copy and (layer, K/V): one per head, or one
	if slotsFollowHeads(places[:heads], headSlotBytes) {
		perGroup = 1
	}
	runs := make([]CopyRun, 0, n*layers*2*perGroup)
	for g := 0; g < layers*2; g++ {
		pl := places[g*heads : (g+1)*heads]
		switch {
		case slotsFollowHeads(pl, headSlotBytes):
			// Each slot holds every head side by side, slot after slot, on
			// both sides (vLLM's GPU layouts): a block's slots are one run.
			p := &pl[0]
			for _, c := range copies {
				if c.NumSlots <= 0 {
					continue
				}
				so := p.sBase + int64(c.Src)*p.sBlock + int64(c.FirstSlot)*p.sSlot
				do := p.dBase + int64(c.Dst)*p.dBlock + int64(c.FirstSlot)*p.dSlot
				runs = appendRun(runs, p.s, so, p.d, do, int64(c.NumSlots)*p.sSlot)
			}
		case headsHoldSlots(pl, headSlotBytes):
			// Each head holds its slots side by side: one run per head.
			for _, c := range copies {
				if c.NumSlots <= 0 {
					continue
				}
				for i := range pl {
					p := &pl[i]
					so := p.sBase + int64(c.Src)*p.sBlock + int64(c.FirstSlot)*p.sSlot
					do := p.dBase + int64(c.Dst)*p.dBlock + int64(c.FirstSlot)*p.dSlot
					runs = appendRun(runs, p.s, so, p.d, do, int64(c.NumSlots)*headSlotBytes)
				}
			}
		default:
			// Anything else (vLLM's CPU layout interleaves K and V per slot;
			// TP shards split the heads): slot by slot, head by head,
			// merged wherever bytes follow each other on both sides.
			for _, c := range copies {
				if c.NumSlots <= 0 {
					continue
				}
				for k := int64(c.FirstSlot); k < int64(c.FirstSlot+c.NumSlots); k++ {
					for i := range pl {
						p := &pl[i]
						runs = appendRun(runs, p.s, p.sBase+int64(c.Src)*p.sBlock+k*p.sSlot,
							p.d, p.dBase+int64(c.Dst)*p.dBlock+k*p.dSlot, headSlotBytes)
					}
				}
			}
		}
	}
	return runs, nil
}

// headsHoldSlots: on both sides each head's slots are packed (slot stride
// = one head's K or V vector).
func headsHoldSlots(pl []place, headSlotBytes int64) bool {
	for i := range pl {
		if pl[i].sSlot != headSlotBytes || pl[i].dSlot != headSlotBytes {
			return false
		}
	}
	return true
}

// slotsFollowHeads: on both sides all heads of a layer's K (or V) sit in
// one region, head after head within a slot, and slot after slot, so any
// range of a block's slots is one contiguous stretch.
func slotsFollowHeads(pl []place, headSlotBytes int64) bool {
	heads := int64(len(pl))
	if heads < 2 {
		return false // one head: headsHoldSlots covers the packed case
	}
	p0 := pl[0]
	if p0.sSlot != heads*headSlotBytes || p0.dSlot != heads*headSlotBytes {
		return false
	}
	for i := range pl {
		p := pl[i]
		if p.s != p0.s || p.d != p0.d || p.sBlock != p0.sBlock || p.dBlock != p0.dBlock ||
			p.sSlot != p0.sSlot || p.dSlot != p0.dSlot ||
			p.sBase != p0.sBase+int64(i)*headSlotBytes || p.dBase != p0.dBase+int64(i)*headSlotBytes {
			return false
		}
	}
	return true
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
