package kvlayout

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

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
	return Strides{Layer: r.LayerStride(), KV: r.KVStride(), Block: r.BlockStride(), Head: r.HeadStride(), Slot: r.SlotStride()}
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
// makes TP and PP remapping just another plan. Each layer is walked in the
// source's memory order and runs are merged when adjacent on both sides,
// so same-shape whole-block copies of consecutive blocks become one run per
// layer (per layer and K/V where K and V are planes of their own). This
// sits in the final round's pause: it is written to do a few additions per
// run.
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
	// The runs' list sized once: grown by append, its copies were most of
	// a slot round's plan (a head-major layout makes a run of each head's
	// slots: 147,456 runs for 256 one-slot copies at the 8B geometry).
	// Each layer gets its share of it (at most its count: merging makes
	// fewer), so that layers plan side by side where the plan is large.
	lays := make([]layerLayout, layers)
	regulars := make([]bool, layers)
	counts := make([]int, layers)
	n, counted, perLayer := 0, -1, 0
	for l := 0; l < layers; l++ {
		lays[l], regulars[l] = regular(places[l*2*heads:(l+1)*2*heads], heads)
		if regulars[l] {
			// Layers laid out alike (all of them, but where regions
			// differ) plan as many runs: counted once.
			if counted < 0 || !lays[l].shapedLike(lays[counted]) {
				counted, perLayer = l, lays[l].count(copies, headSlotBytes)
			}
			counts[l] = perLayer
		} else {
			for _, c := range copies {
				if c.NumSlots > 0 {
					counts[l] += 2 * heads * c.NumSlots
				}
			}
		}
		n += counts[l]
	}
	runs := make([]CopyRun, n)
	planLayer := func(l, at int) []CopyRun {
		share := runs[at : at : at+counts[l]]
		if regulars[l] {
			return lays[l].plan(share, copies, headSlotBytes)
		}
		return planIrregular(share, places[l*2*heads:(l+1)*2*heads], heads, copies, headSlotBytes)
	}
	planned := make([][]CopyRun, layers)
	if workers := min(runtime.GOMAXPROCS(0), layers); n < parallelPlanRuns || workers < 2 {
		at := 0
		for l := 0; l < layers; l++ {
			planned[l] = planLayer(l, at)
			at += counts[l]
		}
	} else {
		starts := make([]int, layers)
		for l := 1; l < layers; l++ {
			starts[l] = starts[l-1] + counts[l-1]
		}
		var next atomic.Int64
		var wg sync.WaitGroup
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for l := int(next.Add(1) - 1); l < layers; l = int(next.Add(1) - 1) {
					planned[l] = planLayer(l, starts[l])
				}
			}()
		}
		wg.Wait()
	}
	// Close the gaps that merging left between layers' shares (none
	// where nothing merged: each share then starts where the last ended).
	out := 0
	for _, p := range planned {
		out += copy(runs[out:], p)
	}
	return runs[:out], nil
}

// parallelPlanRuns is the plan size from which layers are planned side by
// side: a round 0 of 11,000 8B-shaped blocks is ~400,000-800,000 runs
// (10-20 ms on one core), a final round of one token a stream 18,432
// (vLLM's layout) to 147,456 (the sim's head-major one).
const parallelPlanRuns = 32768

// planIrregular appends the runs of a layer whose places are not one
// regular layout (TP shards split its heads over regions): head by head —
// a head's slots in one run where they are packed on both sides, else slot
// by slot — merged wherever bytes follow each other on both sides.
func planIrregular(runs []CopyRun, pl []place, heads int, copies []BlockCopy, headSlotBytes int64) []CopyRun {
	for kv := 0; kv < 2; kv++ {
		g := pl[kv*heads : (kv+1)*heads]
		for _, c := range copies {
			if c.NumSlots <= 0 {
				continue
			}
			for i := range g {
				p := &g[i]
				so := p.sBase + int64(c.Src)*p.sBlock + int64(c.FirstSlot)*p.sSlot
				do := p.dBase + int64(c.Dst)*p.dBlock + int64(c.FirstSlot)*p.dSlot
				if p.sSlot == headSlotBytes && p.dSlot == headSlotBytes {
					runs = appendRun(runs, p.s, so, p.d, do, int64(c.NumSlots)*headSlotBytes)
					continue
				}
				for k := int64(0); k < int64(c.NumSlots); k++ {
					runs = appendRun(runs, p.s, so+k*p.sSlot, p.d, do+k*p.dSlot, headSlotBytes)
				}
			}
		}
	}
	return runs
}

// Dimensions of a layer's KV inside a block.
const (
	dimKV = iota
	dimHead
	dimSlot
)

// dim is one dimension of a layer's KV in a block: its size (slots: the
// copy's) and its stride on each side.
type dim struct {
	kind  int
	count int64
	s, d  int64
}

// layerLayout is one layer's KV when each side holds it in one region at
// regular strides: the head vector of (kv, block, head, slot) starts at
// base + kv·KV + block·Block + head·Head + slot·Slot on that side.
type layerLayout struct {
	s, d           int
	sBase, dBase   int64
	sBlock, dBlock int64
	dims           [3]dim // K/V, head, slot
}

// regular reads a layer's places (K then V, each head in turn) as one
// layerLayout, or says it is not one.
func regular(pl []place, heads int) (layerLayout, bool) {
	p0 := pl[0]
	lay := layerLayout{s: p0.s, d: p0.d, sBase: p0.sBase, dBase: p0.dBase, sBlock: p0.sBlock, dBlock: p0.dBlock}
	kv := dim{kind: dimKV, count: 2, s: pl[heads].sBase - p0.sBase, d: pl[heads].dBase - p0.dBase}
	hd := dim{kind: dimHead, count: int64(heads)}
	if heads > 1 {
		hd.s, hd.d = pl[1].sBase-p0.sBase, pl[1].dBase-p0.dBase
	}
	lay.dims = [3]dim{kv, hd, {kind: dimSlot, s: p0.sSlot, d: p0.dSlot}}
	for k := 0; k < 2; k++ {
		for h := 0; h < heads; h++ {
			p := pl[k*heads+h]
			if p.s != lay.s || p.d != lay.d || p.sBlock != lay.sBlock || p.dBlock != lay.dBlock ||
				p.sSlot != p0.sSlot || p.dSlot != p0.dSlot ||
				p.sBase != p0.sBase+int64(k)*kv.s+int64(h)*hd.s || p.dBase != p0.dBase+int64(k)*kv.d+int64(h)*hd.d {
				return layerLayout{}, false
			}
		}
	}
	return lay, true
}

// plan appends the runs of one layer. It walks the layer's bytes in the
// source's memory order — K/V outside the blocks when K and V are planes
// of their own ([2, blocks, …]), the dimensions inside a block from the
// largest source stride to the smallest — so that whatever the layout
// (slot-major, head-major, K and V side by side per head or per slot),
// bytes that follow each other on both sides come out as one run: a
// whole block of a layer between same-shaped engines is one run, merged
// over consecutive blocks.
func (lay layerLayout) plan(runs []CopyRun, copies []BlockCopy, headSlotBytes int64) []CopyRun {
	w := lay.walk()
	idx := w.idx
	var (
		loops        []dim
		n, slots     = 0, -1
		length       int64
		sSlot, dSlot = lay.dims[dimSlot].s, lay.dims[dimSlot].d
	)
	for _, kv := range w.kvs {
		sKV, dKV := lay.sBase+kv*lay.dims[dimKV].s, lay.dBase+kv*lay.dims[dimKV].d
		for _, c := range copies {
			if c.NumSlots <= 0 {
				continue
			}
			if c.NumSlots != slots { // a copy's walk depends on its slots alone
				slots = c.NumSlots
				loops, n, length = w.fold(c, headSlotBytes)
			}
			so := sKV + int64(c.Src)*lay.sBlock + int64(c.FirstSlot)*sSlot
			do := dKV + int64(c.Dst)*lay.dBlock + int64(c.FirstSlot)*dSlot
			if n == 0 { // the copy is one run (a whole block of a layer's K, say)
				runs = appendRun(runs, lay.s, so, lay.d, do, length)
				continue
			}
			// Walk the rest like an odometer, innermost fastest.
			clear(idx)
			for {
				s, d := so, do
				for i := 0; i < n; i++ {
					s += idx[i] * loops[i].s
					d += idx[i] * loops[i].d
				}
				runs = appendRun(runs, lay.s, s, lay.d, d, length)
				i := n - 1
				for ; i >= 0; i-- {
					if idx[i]++; idx[i] < loops[i].count {
						break
					}
					idx[i] = 0
				}
				if i < 0 {
					break
				}
			}
		}
	}
	return runs
}

// count is at most how many runs plan appends for copies (merging makes
// fewer).
func (lay layerLayout) count(copies []BlockCopy, headSlotBytes int64) int {
	w := lay.walk()
	total, slots, k := 0, -1, 0
	for _, c := range copies {
		if c.NumSlots <= 0 {
			continue
		}
		if c.NumSlots != slots { // a copy's runs depend on its slots alone
			loops, n, _ := w.fold(c, headSlotBytes)
			slots, k = c.NumSlots, 1
			for _, l := range loops[:n] {
				k *= int(l.count)
			}
		}
		total += k
	}
	return total * len(w.kvs)
}

// shapedLike says whether lay and o walk alike (count is the same).
func (lay layerLayout) shapedLike(o layerLayout) bool {
	return lay.dims == o.dims && lay.sBlock == o.sBlock
}

// layerWalk is the order plan walks a layer's bytes in.
type layerWalk struct {
	kvs   []int64 // the K/V planes walked apart ({0} when K/V is inside a block)
	inner []dim   // the dimensions inside a block, largest source stride first
	loops []dim   // inner with one copy's slot count (fold's scratch)
	idx   []int64 // the odometer (plan's scratch)
}

// walk orders the layer's dimensions in the source's memory order: K/V
// outside the blocks when K and V are planes of their own ([2, blocks,
// …]), the dimensions inside a block from the largest source stride to
// the smallest.
func (lay layerLayout) walk() layerWalk {
	kvOuter := abs(lay.dims[dimKV].s) > abs(lay.sBlock)
	inner := make([]dim, 0, 3)
	for _, d := range lay.dims {
		if !kvOuter || d.kind != dimKV {
			inner = append(inner, d)
		}
	}
	// Largest source stride first (a stable insertion sort of ≤ 3).
	for i := 1; i < len(inner); i++ {
		for j := i; j > 0 && abs(inner[j].s) > abs(inner[j-1].s); j-- {
			inner[j], inner[j-1] = inner[j-1], inner[j]
		}
	}
	kvs := []int64{0}
	if kvOuter {
		kvs = []int64{0, 1}
	}
	return layerWalk{kvs: kvs, inner: inner, loops: make([]dim, len(inner)), idx: make([]int64, len(inner))}
}

// fold is the walk's loops for copy c: the innermost dimensions that
// continue a run on both sides folded into its length, n the loops left.
func (w layerWalk) fold(c BlockCopy, headSlotBytes int64) (loops []dim, n int, length int64) {
	loops = w.loops
	copy(loops, w.inner)
	for i := range loops {
		if loops[i].kind == dimSlot {
			loops[i].count = int64(c.NumSlots)
		}
	}
	length, n = headSlotBytes, len(loops)
	for n > 0 && (loops[n-1].count == 1 || (loops[n-1].s == length && loops[n-1].d == length)) {
		length *= loops[n-1].count
		n--
	}
	return loops, n, length
}

func abs(x int64) int64 {
	if x < 0 {
		return -x
	}
	return x
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
