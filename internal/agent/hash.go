package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/kvsum"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
)

// maxHashBlocks bounds one HashBlocks call (a whole 141 GB engine of
// 16-token blocks is ~60k blocks).
const maxHashBlocks = 1 << 20

// HashBlocks implements the Agent service: it reads the named blocks of
// this agent's engine — mapped afresh when the engine's memory changed —
// and hashes each in canonical order (global layer, K/V, global head,
// slot), so a source and a target of any TP/PP shapes give the same hash
// for the same KV.
func (s *agentService) HashBlocks(ctx context.Context, req *v1.HashBlocksRequest) (*v1.HashBlocksResponse, error) {
	a := s.a
	start := time.Now()
	if len(req.GetBlocks()) > maxHashBlocks {
		return nil, errdefs.Newf(errdefs.ErrInvalidArgument, "at most %d blocks per call", maxHashBlocks)
	}
	// A target reads through the mapping its rounds wrote through (its
	// pages are in this process already); a source through its own.
	a.dp.mu.Lock()
	_, target := a.dp.sessions[req.GetMigrationId()]
	a.dp.mu.Unlock()
	locked := time.Now()
	mem, lay, err := a.regions(ctx, target)
	if err != nil {
		return nil, err
	}
	laidOut := time.Now()
	g := lay.Geometry
	if g.NumBlocks < 1 || g.BlockSize < 1 {
		return nil, errdefs.New(errdefs.ErrConflict, "the engine's layout has no KV")
	}
	blocks := make([]hashBlock, len(req.GetBlocks()))
	for i, b := range req.GetBlocks() {
		first, n := int(b.GetFirstSlot()), int(b.GetNumSlots())
		if b.GetBlock() < 0 || int(b.GetBlock()) >= g.NumBlocks || first < 0 || n < 0 || first > g.BlockSize || n > g.BlockSize-first {
			return nil, errdefs.Newf(errdefs.ErrInvalidArgument, "block %d slots %d+%d outside the engine's %d blocks of %d", b.GetBlock(), first, n, g.NumBlocks, g.BlockSize)
		}
		if lay.OpaqueBlocks {
			first, n = 0, g.BlockSize // slots are not addressable: whole blocks are what moved
		}
		blocks[i] = hashBlock{id: int64(b.GetBlock()), slots: slotRange{first, n}}
	}
	var hashes []uint64
	var bytes int64
	if req.GetScheme() == kvsum.Scheme {
		sumStart := time.Now()
		var data [][]byte
		if mem != nil { // shared memory (GPU KV has none here)
			data = mem.Data
		}
		hashes, bytes, err = a.hashSum(req.GetMigrationId(), lay, data, blocks)
		switch {
		case err == nil:
			a.log.Debug("hash blocks", zap.String("migration_id", req.GetMigrationId()), zap.String("scheme", kvsum.Scheme), zap.Bool("target", target),
				zap.Bool("gpu", transfer.OnGPU(lay)), zap.Int("blocks", len(blocks)), zap.Int64("bytes", bytes), zap.Duration("lock", locked.Sub(start)),
				zap.Duration("layout", laidOut.Sub(locked)), zap.Duration("sum", time.Since(sumStart)), zap.Duration("total", time.Since(start)))
			return &v1.HashBlocksResponse{Hashes: hashes, Bytes: bytes, DurationS: time.Since(start).Seconds(), Scheme: kvsum.Scheme}, nil
		case !errors.Is(err, errSumUnusable):
			return nil, errdefs.New(errdefs.ErrConflict, err.Error())
		}
		// The layout's words cannot be summed as the scheme reads them:
		// xxhash64, which the answer says (the Host asks both sides again).
		a.log.Debug("hash blocks: the sum scheme does not fit this layout", zap.Error(err))
	}
	if transfer.OnGPU(lay) {
		var t hashTimes
		hashes, bytes, t, err = a.hashGPU(req.GetMigrationId(), lay, blocks)
		a.log.Debug("hash blocks", zap.String("migration_id", req.GetMigrationId()), zap.Bool("target", target), zap.Int("blocks", len(blocks)),
			zap.Int64("bytes", bytes), zap.Duration("lock", locked.Sub(start)), zap.Duration("layout", laidOut.Sub(locked)),
			zap.Duration("plan", t.plan), zap.Duration("read", t.read), zap.Duration("hash", t.hash), zap.Duration("release", t.release),
			zap.Duration("total", time.Since(start)))
	} else {
		hashes, bytes, err = hashMapped(mem.Data, lay, blocks)
	}
	if err != nil {
		return nil, errdefs.New(errdefs.ErrConflict, err.Error())
	}
	return &v1.HashBlocksResponse{Hashes: hashes, Bytes: bytes, DurationS: time.Since(start).Seconds()}, nil
}

type hashBlock struct {
	id    int64
	slots slotRange
}

// slotRange is slots [first, first+n) of a block.
type slotRange struct{ first, n int }

// piece is one contiguous part of block 0's canonical byte sequence: the
// same part of block b is at off + b×(its region's block stride).
type piece struct {
	region      int
	off, length int64
}

// canonicalPieces lists the pieces of slots [first, first+n) of a block
// in canonical order: global layer, K/V, global head, slot. Pieces that
// follow each other in memory are merged (a full block of one layer's K
// in HND is one piece).
func canonicalPieces(lay hooks.Layout, sr slotRange) ([]piece, error) {
	first, n := sr.first, sr.n
	g := lay.Geometry
	slot := int64(g.HeadSlotBytes())
	var out []piece
	add := func(p piece) {
		if k := len(out) - 1; k >= 0 && out[k].region == p.region && out[k].off+out[k].length == p.off {
			out[k].length += p.length
			return
		}
		out = append(out, p)
	}
	for l := 0; l < g.Layers; l++ {
		for kv := 0; kv < 2; kv++ {
			for h := 0; h < g.KVHeads; h++ {
				ri := -1
				for i := range lay.Regions {
					r := &lay.Regions[i]
					if l >= r.FirstLayer && l < r.FirstLayer+r.NumLayers && h >= r.FirstHead && h < r.FirstHead+r.NumHeads {
						ri = i
						break
					}
				}
				if ri < 0 {
					return nil, fmt.Errorf("layer %d head %d is in no region", l, h)
				}
				r := &lay.Regions[ri]
				off := int64(l-r.FirstLayer)*r.LayerStride + int64(kv)*r.KVStride + int64(h-r.FirstHead)*r.HeadStride + int64(first)*r.SlotStride
				if r.SlotStride == slot {
					add(piece{ri, off, int64(n) * slot})
					continue
				}
				for s := 0; s < n; s++ {
					add(piece{ri, off + int64(s)*r.SlotStride, slot})
				}
			}
		}
	}
	return out, nil
}

// checkBlock reports whether every piece of block id lies in its region.
func checkBlock(lay hooks.Layout, pieces []piece, id int64) error {
	for _, p := range pieces {
		r := lay.Regions[p.region]
		if off := p.off + id*r.BlockStride; off < 0 || off+p.length > r.Size {
			return fmt.Errorf("block %d lies outside region %d", id, p.region)
		}
	}
	return nil
}

// hashMapped hashes blocks of shared-memory KV. The walk goes piece by
// piece across all the blocks (sorted), not block by block: one piece of
// every block sits in one layer's K or V plane, so the reads move forward
// through memory instead of jumping a whole plane (tens of MiB) between
// two reads of a block — at small head sizes the jumps, not the hashing,
// were the cost. Blocks are shared among the cores.
func hashMapped(data [][]byte, lay hooks.Layout, blocks []hashBlock) ([]uint64, int64, error) {
	digests := make([]*xxhash.Digest, len(blocks))
	for i := range digests {
		digests[i] = xxhash.New()
	}
	bySlots := map[slotRange][]int{} // slots → indices into blocks
	for i, b := range blocks {
		bySlots[b.slots] = append(bySlots[b.slots], i)
	}
	var total int64
	for n, idx := range bySlots {
		pieces, err := canonicalPieces(lay, n)
		if err != nil {
			return nil, 0, err
		}
		for _, i := range idx {
			if err := checkBlock(lay, pieces, blocks[i].id); err != nil {
				return nil, 0, err
			}
			for _, p := range pieces {
				total += p.length
			}
		}
		sort.Slice(idx, func(x, y int) bool { return blocks[idx[x]].id < blocks[idx[y]].id })
		workers := min(runtime.GOMAXPROCS(0), max(1, len(idx)/64))
		var wg sync.WaitGroup
		for w := range workers {
			part := idx[w*len(idx)/workers : (w+1)*len(idx)/workers]
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, p := range pieces {
					stride := lay.Regions[p.region].BlockStride
					region := data[p.region]
					for _, i := range part {
						off := p.off + blocks[i].id*stride
						_, _ = digests[i].Write(region[off : off+p.length])
					}
				}
			}()
		}
		wg.Wait()
	}
	out := make([]uint64, len(blocks))
	for i, d := range digests {
		out[i] = d.Sum64()
	}
	return out, total, nil
}

// hashGPU hashes blocks of GPU KV: their pieces are gathered, block after
// block, into pinned host memory (one kernel launch and one download per
// chunk of up to cudaipc.HashChunk bytes), and each block's bytes are then one
// contiguous stretch to hash. It also returns where the time went.
func (a *Agent) hashGPU(session string, lay hooks.Layout, blocks []hashBlock) ([]uint64, int64, hashTimes, error) {
	out := make([]uint64, len(blocks))
	var total int64
	var t hashTimes
	for start := 0; start < len(blocks); {
		end, size := start, int64(0)
		for end < len(blocks) {
			n := int64(blocks[end].slots.n) * int64(lay.Geometry.HeadSlotBytes()) * int64(2*lay.Geometry.Layers*lay.Geometry.KVHeads)
			if end > start && size+n > cudaipc.HashChunk {
				break
			}
			size += n
			end++
		}
		n, err := a.hashGPUChunk(session, lay, blocks[start:end], out[start:end], &t)
		if err != nil {
			return nil, 0, t, err
		}
		total += n
		start = end
	}
	return out, total, t, nil
}

// hashTimes is where a GPU hash's time went: planning the gathers, reading
// the GPU's bytes into host memory (waiting for the staging included),
// hashing them, and handing the staging back.
type hashTimes struct {
	plan, read, hash, release time.Duration
}

func (a *Agent) hashGPUChunk(session string, lay hooks.Layout, blocks []hashBlock, out []uint64, t *hashTimes) (int64, error) {
	t0 := time.Now()
	st, err := planStaging(lay, blocks, &a.stagedLayouts)
	t.plan += time.Since(t0)
	if err != nil {
		return 0, err
	}
	if len(st.runs) == 0 {
		for i := range out {
			out[i] = xxhash.Sum64(nil)
		}
		return 0, nil
	}
	start := time.Now()
	host, _, release, err := a.gpu.Gather(session, lay, st.runs)
	if err != nil {
		return 0, fmt.Errorf("read GPU KV: %w", err)
	}
	gathered := time.Now()
	t.read += gathered.Sub(start)
	st.hash(host, out)
	hashed := time.Now()
	t.hash += hashed.Sub(gathered)
	release()
	t.release += time.Since(hashed)
	return st.bytes, nil
}

// staging is how a chunk of blocks is read for hashing: runs gathers the
// bytes each block's canonical pieces lie in — the smallest stretches of
// memory that hold them, in memory order, block after block, packed into
// the staging buffer in that order — and the block's canonical sequence is
// then read from the staged copy. Gathering the canonical pieces
// themselves would cut a layout that keeps a head's V right after its K
// (vLLM 0.26 on the GPU) into one 256-byte run per layer, K/V, head and
// slot: 9,216 per Qwen3-8B block, more descriptor than data.
type staging struct {
	runs   []kvlayout.CopyRun
	blocks []stagedBlock
	bytes  int64
}

// stagedBlock is one block's place in the staging buffer and the layout
// of its slot range.
type stagedBlock struct {
	at  int64
	lay *stagedLayout
}

// stagedLayout is a slot range's staging layout, the same for every block:
// the stretches of block 0 to gather, and where each canonical piece lands
// relative to the block's start in the staging buffer.
type stagedLayout struct {
	spans  []piece
	pieces []piece // canonical order; off: in the block's staged bytes
	size   int64
}

func newStagedLayout(lay hooks.Layout, sr slotRange) (*stagedLayout, error) {
	canon, err := canonicalPieces(lay, sr)
	if err != nil {
		return nil, err
	}
	order := make([]int, len(canon))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(x, y int) int {
		a, b := canon[x], canon[y]
		if c := cmp.Compare(a.region, b.region); c != 0 {
			return c
		}
		return cmp.Compare(a.off, b.off)
	})
	sl := &stagedLayout{pieces: make([]piece, len(canon))}
	for _, k := range order {
		p := canon[k]
		if n := len(sl.spans) - 1; n >= 0 && sl.spans[n].region == p.region && sl.spans[n].off+sl.spans[n].length == p.off {
			sl.spans[n].length += p.length
		} else {
			sl.spans = append(sl.spans, piece{region: p.region, off: p.off, length: p.length})
		}
		sl.pieces[k] = piece{region: p.region, off: sl.size, length: p.length}
		sl.size += p.length
	}
	return sl, nil
}

// stagedLayouts keeps the staging layout of each slot range for one KV
// layout's shape (its regions' strides and extents), from one check to the
// next: a slot range's layout is ~9,000 pieces put in memory order, and
// the check inside a pause meets tens of ranges (the stable tokens of each
// request end anywhere in a block) — 25–32 ms of each side's check when
// made afresh (H100, 2026-12-06). The check before the pause meets the
// same ranges first.
type stagedLayouts struct {
	mu    sync.Mutex
	shape string
	by    map[slotRange]*stagedLayout
}

// maxStagedLayouts bounds the cache: a block of b slots has b(b+1)/2
// ranges (136 for 16 slots).
const maxStagedLayouts = 4096

// get returns sr's staging layout for lay (nil c: made afresh).
func (c *stagedLayouts) get(lay hooks.Layout, shape string, sr slotRange) (*stagedLayout, error) {
	if c == nil {
		return newStagedLayout(lay, sr)
	}
	c.mu.Lock()
	if c.shape != shape || len(c.by) >= maxStagedLayouts {
		c.shape, c.by = shape, map[slotRange]*stagedLayout{}
	}
	sl := c.by[sr]
	c.mu.Unlock()
	if sl != nil {
		return sl, nil
	}
	sl, err := newStagedLayout(lay, sr)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.shape == shape {
		c.by[sr] = sl
	}
	c.mu.Unlock()
	return sl, nil
}

// layoutShape is what a staging layout depends on in lay: the geometry and
// each region's extents and strides (not its memory, nor its block stride).
func layoutShape(lay hooks.Layout) string {
	g := lay.Geometry
	var b strings.Builder
	fmt.Fprintf(&b, "%d/%d/%d/%d/%d", g.Layers, g.KVHeads, g.HeadDim, g.DTypeBytes, g.BlockSize)
	for _, r := range lay.Regions {
		fmt.Fprintf(&b, "|%d+%d,%d+%d,%d,%d,%d,%d", r.FirstLayer, r.NumLayers, r.FirstHead, r.NumHeads, r.LayerStride, r.KVStride, r.HeadStride, r.SlotStride)
	}
	return b.String()
}

// planStaging lays out the gather of blocks (layouts: the cache of slot
// ranges' staging layouts to use; nil: none).
func planStaging(lay hooks.Layout, blocks []hashBlock, layouts *stagedLayouts) (*staging, error) {
	st := &staging{blocks: make([]stagedBlock, len(blocks))}
	shape := ""
	if layouts != nil {
		shape = layoutShape(lay)
	}
	local := map[slotRange]*stagedLayout{}
	for i, b := range blocks {
		sl := local[b.slots]
		if sl == nil {
			var err error
			if sl, err = layouts.get(lay, shape, b.slots); err != nil {
				return nil, err
			}
			local[b.slots] = sl
		}
		if err := checkBlock(lay, sl.spans, b.id); err != nil {
			return nil, err
		}
		st.blocks[i] = stagedBlock{at: st.bytes, lay: sl}
		for _, sp := range sl.spans {
			off := sp.off + b.id*lay.Regions[sp.region].BlockStride
			if n := len(st.runs) - 1; n >= 0 && st.runs[n].SrcRegion == sp.region && st.runs[n].SrcOffset+st.runs[n].Length == off {
				st.runs[n].Length += sp.length // staged right after it too
			} else {
				st.runs = append(st.runs, kvlayout.CopyRun{SrcRegion: sp.region, SrcOffset: off, Length: sp.length})
			}
		}
		st.bytes += sl.size
	}
	return st, nil
}

// hash hashes each block's canonical sequence from the staged bytes,
// shared among the cores.
func (st *staging) hash(host []byte, out []uint64) {
	inParts(len(st.blocks), func(first, end int) {
		d := xxhash.New()
		for i := first; i < end; i++ {
			b := st.blocks[i]
			d.Reset()
			// Pieces that follow each other in the staged bytes are
			// one write (the whole block, in head-major layouts).
			lo, hi := int64(-1), int64(-1)
			for _, p := range b.lay.pieces {
				at := b.at + p.off
				if at != hi {
					if lo >= 0 {
						_, _ = d.Write(host[lo:hi])
					}
					lo = at
				}
				hi = at + p.length
			}
			if lo >= 0 {
				_, _ = d.Write(host[lo:hi])
			}
			out[i] = d.Sum64()
		}
	})
}

// inParts runs fn over [0, n) in contiguous parts, one per core (parts of
// at least 16), side by side, and waits for them.
func inParts(n int, fn func(first, end int)) {
	workers := min(runtime.GOMAXPROCS(0), max(1, n/16))
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(w*n/workers, (w+1)*n/workers)
		}()
	}
	wg.Wait()
}
