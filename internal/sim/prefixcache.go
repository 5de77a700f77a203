package sim

// The prefix cache (vhi sim --enable-prefix-caching), as vLLM's automatic
// prefix caching shares KV: each full block of a prompt has a hash that
// chains the hashes of the blocks before it; once a request has computed
// such a block, a later request whose prompt starts with the same blocks
// maps them into its own table (one more holder each, blockPool.refs)
// instead of computing them, and only computes the rest. As in vLLM, a
// cached block whose last holder ended stays cached, free, until the
// free queue hands it out again: a later request with the same prefix
// takes it back (blockPool.revive).
//
// For the bytes to be shareable, a full prompt block's KV is a function
// of the tokens up to its end, as a model's is: its tokens are written
// under the block's hash (request.kvSeed) instead of the request's seed,
// which keys every other token's KV. An engine with the cache therefore
// writes other bytes for the same request than one without, and the
// engines a migration moves between have to agree on the flag, as they
// agree on --seed.
//
// A migration target holds what the source shared as one set of blocks
// too (Allocate's hooks.SharedPrefix), but does not offer the blocks it
// received to its own cache: their bytes arrive after the allocation
// (vLLM's plugin reserves its placeholders uncached for the same reason).

const prefixHashSeed = 0x2545_F491_4F6C_DD1D

// promptBlockHashes are the chained hashes of prompt's full blocks, or nil
// without the cache.
func (e *Engine) promptBlockHashes(prompt []int) []uint64 {
	if !e.cfg.EnablePrefixCaching {
		return nil
	}
	bs := e.geo.BlockSize
	out := make([]uint64, len(prompt)/bs)
	h := uint64(e.cfg.Seed) ^ prefixHashSeed
	for j := range out {
		for _, t := range prompt[j*bs : (j+1)*bs] {
			h = mix64(h ^ uint64(t))
		}
		out[j] = h
	}
	return out
}

// kvSeed keys the KV of r's token at pos: a full prompt block's hash with
// the cache, the request's seed otherwise.
func (r *request) kvSeed(pos, blockSize int) int64 {
	if j := pos / blockSize; j < len(r.blockHashes) {
		return int64(r.blockHashes[j] >> 1)
	}
	return r.params.Seed
}

func (p *blockPool) enableCache() {
	p.cache = map[uint64]int{}
	p.hashOf = map[int]uint64{}
}

// cacheBlock offers block b, just computed, under hash h; the first block
// computed under a hash stays the one shared.
func (p *blockPool) cacheBlock(h uint64, b int) {
	if p.cache == nil {
		return
	}
	if _, ok := p.cache[h]; ok {
		return
	}
	if _, ok := p.hashOf[b]; ok {
		return
	}
	p.cache[h], p.hashOf[b] = b, h
}

// uncache takes b out of the cache (the free queue hands it out).
func (p *blockPool) uncache(b int) {
	if h, ok := p.hashOf[b]; ok {
		delete(p.hashOf, b)
		delete(p.cache, h)
	}
}

// cached are the blocks holding hashes' leading run.
func (p *blockPool) cached(hashes []uint64) []int {
	var out []int
	for _, h := range hashes {
		b, ok := p.cache[h]
		if !ok {
			break
		}
		out = append(out, b)
	}
	return out
}

// reuseCached maps the cached blocks of r's prompt into r's table and
// counts them computed, for a request about to be scheduled with nothing
// computed. As vLLM, it leaves the prompt's last token to compute (its
// step samples the first output token). It returns the blocks it mapped.
func (e *Engine) reuseCached(r *request) int {
	if e.pool.cache == nil || r.numComputed > 0 || len(r.blocks) > 0 || len(r.blockHashes) == 0 {
		return 0
	}
	most := min(len(r.blockHashes), (len(r.prompt)-1)/e.geo.BlockSize)
	hits := e.pool.cached(r.blockHashes[:most])
	e.met.prefixQueries.Add(float64(len(r.prompt)))
	if len(hits) == 0 {
		return 0
	}
	for _, b := range hits {
		e.pool.revive(b, r.id)
	}
	r.blocks = hits
	r.numComputed = len(hits) * e.geo.BlockSize
	e.met.prefixHits.Add(float64(r.numComputed))
	return len(hits)
}

// unreuse gives back what reuseCached mapped, for a request that could not
// be scheduled after all.
func (e *Engine) unreuse(r *request, n int) {
	if n == 0 {
		return
	}
	e.pool.release(r.blocks, e.cursor+1)
	r.blocks, r.numComputed = nil, 0
}

// cacheComputed offers the full prompt blocks r computed from token from
// on to the cache.
func (e *Engine) cacheComputed(r *request, from int) {
	if e.pool.cache == nil {
		return
	}
	bs := e.geo.BlockSize
	for j := from / bs; j < r.numComputed/bs && j < len(r.blockHashes); j++ {
		e.pool.cacheBlock(r.blockHashes[j], r.blocks[j])
	}
}
