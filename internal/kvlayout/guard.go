package kvlayout

import (
	"errors"
	"fmt"
	"sort"
)

// BlockGuard confines a migration target's writes to the blocks reserved
// for that migration. A data-plane peer names target byte ranges (runs)
// or (block, slot) jobs; the guard maps each byte back to its block with
// the target's own strides and refuses anything outside the reservation,
// outside the regions, or in the gaps between a layout's tensors. Every
// check is written against integer overflow: the numbers come off the
// wire.
type BlockGuard struct {
	regions   []guardRegion
	allowed   []bool
	blockSize uint64
}

// guardRegion is one region's dimensions ordered by stride, largest first.
type guardRegion struct {
	size  uint64
	dims  []guardDim
	block int // index in dims of the block dimension
}

type guardDim struct {
	stride, size uint64
}

// NewBlockGuard builds a guard over regions (specs and byte sizes, in the
// layout's order) of a model with numBlocks blocks of blockSize slots of
// slotBytes each, letting writes reach only the allowed blocks. Layouts
// whose strides overlap (two dimensions sharing bytes) are refused: a
// write's block could not be told.
func NewBlockGuard(specs []RegionSpec, sizes []int64, numBlocks, blockSize int, slotBytes int64, allowed []int) (*BlockGuard, error) {
	if len(specs) != len(sizes) || len(specs) == 0 {
		return nil, errors.New("block guard: regions and sizes differ in number")
	}
	if numBlocks < 1 || blockSize < 1 || slotBytes < 1 {
		return nil, fmt.Errorf("block guard: bad geometry (%d blocks of %d slots of %d bytes)", numBlocks, blockSize, slotBytes)
	}
	g := &BlockGuard{allowed: make([]bool, numBlocks), blockSize: uint64(blockSize)}
	for _, b := range allowed {
		if b < 0 || b >= numBlocks {
			return nil, fmt.Errorf("block guard: block %d outside 0..%d", b, numBlocks-1)
		}
		g.allowed[b] = true
	}
	for i, s := range specs {
		r, err := newGuardRegion(s, sizes[i], numBlocks, blockSize, slotBytes)
		if err != nil {
			return nil, fmt.Errorf("block guard: region %d: %w", i, err)
		}
		g.regions = append(g.regions, r)
	}
	return g, nil
}

func newGuardRegion(s RegionSpec, size int64, numBlocks, blockSize int, slotBytes int64) (guardRegion, error) {
	st := s.Strides
	type named struct {
		guardDim
		block bool
	}
	all := []named{
		{guardDim{uint64(st.Layer), uint64(s.NumLayers)}, false},
		{guardDim{uint64(st.KV), 2}, false},
		{guardDim{uint64(st.Block), uint64(numBlocks)}, true},
		{guardDim{uint64(st.Head), uint64(s.NumHeads)}, false},
		{guardDim{uint64(st.Slot), uint64(blockSize)}, false},
	}
	if size < 0 || st.Layer < 0 || st.KV < 0 || st.Block <= 0 || st.Head < 0 || st.Slot <= 0 || s.NumLayers < 1 || s.NumHeads < 1 {
		return guardRegion{}, fmt.Errorf("bad strides or sizes %+v", s)
	}
	// A dimension of size one adds nothing to an offset (vLLM reports a
	// zero layer stride for a one-layer region), except the block
	// dimension, which is what the guard reads.
	var dims []named
	for _, d := range all {
		if d.size > 1 || d.block {
			dims = append(dims, d)
		}
	}
	sort.SliceStable(dims, func(i, j int) bool { return dims[i].stride > dims[j].stride })
	r := guardRegion{size: uint64(size)}
	for i, d := range dims {
		if d.stride == 0 {
			return guardRegion{}, errors.New("a zero stride")
		}
		// Each dimension's whole extent must fit inside one step of the
		// next larger one, or two indices would share bytes.
		if i > 0 {
			outer := dims[i-1].stride
			if d.size > outer/d.stride {
				return guardRegion{}, fmt.Errorf("strides overlap (%d × %d > %d)", d.stride, d.size, outer)
			}
		}
		if d.block {
			r.block = i
		}
		r.dims = append(r.dims, d.guardDim)
	}
	if last := dims[len(dims)-1]; last.stride < uint64(slotBytes) {
		return guardRegion{}, fmt.Errorf("innermost stride %d is below a slot's %d bytes", last.stride, slotBytes)
	}
	return r, nil
}

// blockAt is the block holding byte x of region r, and how many bytes
// from x on stay in that block's stretch; ok is false for bytes outside
// every block (past the tensors, or in a gap between them).
func (r *guardRegion) blockAt(x uint64) (block, stretch uint64, ok bool) {
	if x >= r.size {
		return 0, 0, false
	}
	rest := x
	for i, d := range r.dims {
		idx := rest / d.stride
		if idx >= d.size {
			return 0, 0, false
		}
		if i == r.block {
			block = idx
			stretch = d.stride - (rest - idx*d.stride)
		}
		rest -= idx * d.stride
	}
	return block, stretch, true
}

// CheckRun reports an error unless bytes [at, at+n) of region lie inside
// the region and touch only allowed blocks.
func (g *BlockGuard) CheckRun(region uint32, at, n uint64) error {
	if int64(region) >= int64(len(g.regions)) {
		return fmt.Errorf("run names region %d of %d", region, len(g.regions))
	}
	r := &g.regions[region]
	if at > r.size || n > r.size-at {
		return fmt.Errorf("run outside region %d: offset %d length %d, region of %d bytes", region, at, n, r.size)
	}
	for x, end := at, at+n; x < end; {
		b, stretch, ok := r.blockAt(x)
		if !ok {
			return fmt.Errorf("run at offset %d of region %d is outside every KV block", x, region)
		}
		if !g.allowed[b] {
			return fmt.Errorf("run writes block %d, which is not reserved for this migration", b)
		}
		if stretch >= end-x {
			break
		}
		x += stretch
	}
	return nil
}

// CheckSlots reports an error unless slots [first, first+n) of block are
// inside one allowed block.
func (g *BlockGuard) CheckSlots(block, first, n uint64) error {
	if block >= uint64(len(g.allowed)) || !g.allowed[block] {
		return fmt.Errorf("slot job writes block %d, which is not reserved for this migration", block)
	}
	if first > g.blockSize || n > g.blockSize-first {
		return fmt.Errorf("slot job %d+%d outside a block of %d slots", first, n, g.blockSize)
	}
	return nil
}
