package sim

import "fmt"

// blockPool is a paged-KV block allocator with vLLM's free-queue order
// (freed blocks go to the back, allocation takes from the front) and
// per-block, per-slot write generations so "what changed since cursor X" is
// a scan of two arrays, not a journal.
//
// Block 0 is the null block, as in vLLM: never handed out.
//
// A block may have several holders (a prompt prefix shared through the
// prefix cache, or mapped to one block by a migration's reservation):
// refs counts them and the block is free once the last lets it go. With
// the prefix cache, a free block keeps its place in the cache until the
// queue hands it out again (vLLM's eviction order), and a request whose
// prompt starts with it takes it back out of the queue (revive): the free
// queue is a doubly linked list over block ids for that.
type blockPool struct {
	blockSize int
	// The free queue: next/prev link free blocks, block 0 (never free)
	// is the list's sentinel; n is how many are free.
	next, prev []int32
	n          int
	allocated  []bool
	refs       []int32
	owner      []string // request id that allocated each allocated block
	// cache maps a prompt block's hash to the block holding its KV, and
	// hashOf says which hash a cached block is under (prefixcache.go);
	// nil without --enable-prefix-caching.
	cache    map[uint64]int
	hashOf   map[int]uint64
	writeGen []uint64 // per block: generation of its last write
	slotGen  []uint64 // per block × slot: generation of its last write
	freeGen  []uint64 // per block: generation it was last freed at
}

func newBlockPool(numBlocks, blockSize int) *blockPool {
	p := &blockPool{
		blockSize: blockSize,
		next:      make([]int32, numBlocks),
		prev:      make([]int32, numBlocks),
		allocated: make([]bool, numBlocks),
		refs:      make([]int32, numBlocks),
		owner:     make([]string, numBlocks),
		writeGen:  make([]uint64, numBlocks),
		slotGen:   make([]uint64, numBlocks*blockSize),
		freeGen:   make([]uint64, numBlocks),
	}
	p.allocated[0] = true // null block
	for b := 1; b < numBlocks; b++ {
		p.pushBack(b)
	}
	return p
}

func (p *blockPool) total() int   { return len(p.allocated) - 1 }
func (p *blockPool) numFree() int { return p.n }

// pushBack puts free block b at the back of the queue.
func (p *blockPool) pushBack(b int) {
	last := p.prev[0]
	p.next[last], p.prev[b] = int32(b), last
	p.next[b], p.prev[0] = 0, int32(b)
	p.n++
}

// unlink takes free block b out of the queue.
func (p *blockPool) unlink(b int) {
	nx, pv := p.next[b], p.prev[b]
	p.next[pv], p.prev[nx] = nx, pv
	p.n--
}

// allocate takes k blocks for owner from the front of the queue, or none
// when fewer than k are free; a cached block handed out leaves the cache.
func (p *blockPool) allocate(k int, owner string) ([]int, bool) {
	if k > p.n {
		return nil, false
	}
	out := make([]int, k)
	for i := range out {
		b := int(p.next[0])
		p.unlink(b)
		p.uncache(b)
		p.allocated[b] = true
		p.refs[b] = 1
		p.owner[b] = owner
		out[i] = b
	}
	return out, true
}

// share adds a holder to allocated blocks.
func (p *blockPool) share(blocks []int) {
	for _, b := range blocks {
		if b <= 0 || b >= len(p.allocated) || !p.allocated[b] {
			panic(fmt.Sprintf("sim: sharing block %d that is not allocated", b))
		}
		p.refs[b]++
	}
}

// revive gives owner a cached block: one more holder of an allocated one,
// or a free one taken back out of the queue with its KV as it was.
func (p *blockPool) revive(b int, owner string) {
	if p.allocated[b] {
		p.refs[b]++
		return
	}
	p.unlink(b)
	p.allocated[b] = true
	p.refs[b] = 1
	p.owner[b] = owner
}

// release lets go of one holder's blocks; a block none holds any more
// goes to the back of the free queue at generation gen (keeping its
// place in the prefix cache until the queue hands it out).
func (p *blockPool) release(blocks []int, gen uint64) {
	for _, b := range blocks {
		if b <= 0 || b >= len(p.allocated) || !p.allocated[b] {
			panic(fmt.Sprintf("sim: freeing block %d that is not allocated", b))
		}
		if p.refs[b]--; p.refs[b] > 0 {
			continue
		}
		p.allocated[b] = false
		p.owner[b] = ""
		p.freeGen[b] = gen
		p.pushBack(b)
	}
}

// markWritten records a write of slot in block at generation gen.
func (p *blockPool) markWritten(block, slot int, gen uint64) {
	p.writeGen[block] = gen
	p.slotGen[block*p.blockSize+slot] = gen
}

// changedSlots returns the range of slots of block written after since
// (slots are appended in order, so it is one range), or n == 0.
func (p *blockPool) changedSlots(block int, since uint64) (first, n int) {
	gens := p.slotGen[block*p.blockSize : (block+1)*p.blockSize]
	first, last := -1, -1
	for s, g := range gens {
		if g > since {
			if first < 0 {
				first = s
			}
			last = s
		}
	}
	if first < 0 {
		return 0, 0
	}
	return first, last - first + 1
}
