package kvlayout

// RegionLayout places one shard's KV in one flat memory region, the way
// vLLM's FlashAttention backend does: one tensor per local layer, laid back
// to back in layer order, of shape (2, num_blocks, local_heads, block_size,
// head_dim) with VLLM_KV_CACHE_LAYOUT=HND (head-major, the default here), or
// (2, num_blocks, block_size, local_heads, head_dim) where SlotMajor is set
// (NHD, vLLM's own default).
//
// HND keeps one head's slots of a block contiguous, so a TP rank's head
// slice of a block is a single run, and so is a whole block of one layer's K
// or V; a few slots of a block are one run per head. NHD keeps one slot's
// heads contiguous: a few slots of a block are one run per layer and K/V.
type RegionLayout struct {
	Geometry   Geometry
	Shard      Shard
	FirstLayer int  // global index of the first local layer
	NumLayers  int  // local layers
	FirstHead  int  // global index of the first local KV head
	NumHeads   int  // local KV heads
	SlotMajor  bool // NHD: a slot's heads side by side (else HND)
}

// NewRegionLayout returns the layout of shard s of g.
func NewRegionLayout(g Geometry, s Shard) RegionLayout {
	first, end := LayerRange(g.Layers, s.PPSize, s.PPStage)
	heads := g.KVHeads / s.TPSize
	return RegionLayout{
		Geometry: g, Shard: s,
		FirstLayer: first, NumLayers: end - first,
		FirstHead: s.TPRank * heads, NumHeads: heads,
	}
}

// Name is the layout's name as vLLM spells it: "HND" or "NHD".
func (r RegionLayout) Name() string {
	if r.SlotMajor {
		return "NHD"
	}
	return "HND"
}

// HeadStride is the distance between two heads of one slot of a block.
func (r RegionLayout) HeadStride() int64 {
	if r.SlotMajor {
		return int64(r.Geometry.HeadSlotBytes())
	}
	return int64(r.Geometry.BlockSize) * int64(r.Geometry.HeadSlotBytes())
}

// SlotStride is the distance between two slots of one head of a block.
func (r RegionLayout) SlotStride() int64 {
	if r.SlotMajor {
		return int64(r.NumHeads) * int64(r.Geometry.HeadSlotBytes())
	}
	return int64(r.Geometry.HeadSlotBytes())
}

// BlockStride is the size of one block of one layer's K (or V) in this shard.
func (r RegionLayout) BlockStride() int64 {
	return int64(r.NumHeads) * int64(r.Geometry.BlockSize) * int64(r.Geometry.HeadSlotBytes())
}

// KVStride is the distance from a layer's K plane to its V plane.
func (r RegionLayout) KVStride() int64 { return int64(r.Geometry.NumBlocks) * r.BlockStride() }

// LayerStride is the size of one local layer's tensor.
func (r RegionLayout) LayerStride() int64 { return 2 * r.KVStride() }

// Size is the whole region's size in bytes.
func (r RegionLayout) Size() int64 { return int64(r.NumLayers) * r.LayerStride() }

// BlockBytes is the size of one block across this shard (all local layers,
// K and V, local heads).
func (r RegionLayout) BlockBytes() int64 { return 2 * int64(r.NumLayers) * r.BlockStride() }

// Offset is the byte offset of (local layer, kv 0=K 1=V, block, local head,
// slot) in the region.
func (r RegionLayout) Offset(layer, kv, block, head, slot int) int64 {
	return int64(layer)*r.LayerStride() + int64(kv)*r.KVStride() +
		int64(block)*r.BlockStride() + int64(head)*r.HeadStride() +
		int64(slot)*r.SlotStride()
}

// Run is a contiguous byte range of a region.
type Run struct {
	Offset int64 `json:"offset"`
	Length int64 `json:"length"`
}

// BlockRuns returns the runs that hold block b in this region: one per local
// layer and K/V plane.
func (r RegionLayout) BlockRuns(b int) []Run {
	runs := make([]Run, 0, 2*r.NumLayers)
	for l := 0; l < r.NumLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			runs = append(runs, Run{Offset: r.Offset(l, kv, b, 0, 0), Length: r.BlockStride()})
		}
	}
	return runs
}

// SlotRuns returns the runs that hold slots [first, first+n) of block b: one
// per local layer, K/V plane and head (HND), or one per local layer and K/V
// plane (NHD).
func (r RegionLayout) SlotRuns(b, first, n int) []Run {
	length := int64(n) * int64(r.Geometry.HeadSlotBytes())
	heads := r.NumHeads
	if r.SlotMajor {
		length, heads = int64(n)*r.SlotStride(), 1
	}
	runs := make([]Run, 0, 2*r.NumLayers*heads)
	for l := 0; l < r.NumLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			for h := 0; h < heads; h++ {
				runs = append(runs, Run{Offset: r.Offset(l, kv, b, h, first), Length: length})
			}
		}
	}
	return runs
}
