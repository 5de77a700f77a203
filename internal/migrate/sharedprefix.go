package migrate

import (
	"slices"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// A prompt prefix that the source's prefix cache shares between moving
// requests (vLLM shares the full blocks of a common prefix by block hash)
// is one set of blocks there. The migration reserves it as one set on the
// target too (hooks.SharedPrefix: the target maps each later holder's
// table to the first holder's blocks) and the rounds then copy each such
// block once (transfer.PlanRound copies each source-target pair once).

// sharedPrefixes gives, for each selected request, the earlier selected
// request whose first blocks on the source are its own first blocks
// (full, computed ones: what a prefix cache shares), and how many; the
// map has an entry only where there is one. Among several earlier holders
// it takes the one sharing the longest prefix.
func sharedPrefixes(selected []Candidate, blockSize int) map[string]hooks.SharedPrefix {
	type holder struct {
		id    string
		index int
	}
	first := map[int]holder{}    // source block → the first request holding it, and where
	tables := map[string][]int{} // the selected requests' source tables
	out := map[string]hooks.SharedPrefix{}
	for _, r := range selected {
		table := []int(r.BlockIDs)
		full := min(len(table), r.NumComputedTokens/blockSize)
		// The deepest block of this table's start that an earlier request
		// holds at the same place names the candidate; its table then has
		// to begin as this one does up to there.
		ref, k := "", 0
		for i := 0; i < full; i++ {
			h, ok := first[table[i]]
			if !ok || h.index != i {
				break
			}
			ref, k = h.id, i+1
		}
		if k > 0 && slices.Equal(tables[ref][:k], table[:k]) {
			out[r.RequestID] = hooks.SharedPrefix{RequestID: ref, Blocks: k}
		}
		tables[r.RequestID] = table
		for i, b := range table {
			if _, ok := first[b]; !ok {
				first[b] = holder{r.RequestID, i}
			}
		}
	}
	return out
}

// sharedOnTarget counts the blocks the target mapped to an earlier item's
// (the SharedPrefix it was asked for and took); an engine that does not
// share answers fresh blocks for every item, and the count is 0.
func sharedOnTarget(items []hooks.AllocateItem, alloc hooks.AllocateResponse) int {
	blocks := map[string][]int{}
	for _, a := range alloc.Requests {
		blocks[a.RequestID] = a.BlockIDs
	}
	n := 0
	for _, it := range items {
		sp := it.SharedPrefix
		if sp == nil {
			continue
		}
		mine, theirs := blocks[it.RequestID], blocks[sp.RequestID]
		for i := 0; i < sp.Blocks && i < len(mine) && i < len(theirs) && mine[i] == theirs[i]; i++ {
			n++
		}
	}
	return n
}

// sharedBlocks counts the source blocks held by more than one of the
// moving requests, once per extra holder: what a round copying every
// request's blocks sends more than once.
func sharedBlocks(reqs []*v1.RequestBlocks) int {
	seen := map[int32]bool{}
	n := 0
	for _, rb := range reqs {
		for _, b := range rb.GetSrcBlockIds() {
			if seen[b] {
				n++
			}
			seen[b] = true
		}
	}
	return n
}

// copiesOnce counts, of the block copies a full round makes per request,
// those it left out because another moving request maps the same source
// block to the same target block (a prefix shared on both sides).
func copiesOnce(reqs []*v1.RequestBlocks) int {
	type pair struct{ src, dst int32 }
	seen := map[pair]bool{}
	n := 0
	for _, rb := range reqs {
		src, dst := rb.GetSrcBlockIds(), rb.GetDstBlockIds()
		for i := 0; i < len(src) && i < len(dst); i++ {
			p := pair{src[i], dst[i]}
			if seen[p] {
				n++
			}
			seen[p] = true
		}
	}
	return n
}

// onceEach drops the slot ranges a check lists twice — a block several
// moving requests share on both sides (a shared prompt prefix) is one
// block to hash, however many tables hold it — keeping the first
// holder's place for the report of a difference.
func onceEach(src, dst []*v1.BlockSlots, at []blockAt) ([]*v1.BlockSlots, []*v1.BlockSlots, []blockAt) {
	type key struct{ src, dst, first, n int32 }
	seen := make(map[key]bool, len(src))
	k := 0
	for i := range src {
		id := key{src[i].GetBlock(), dst[i].GetBlock(), src[i].GetFirstSlot(), src[i].GetNumSlots()}
		if seen[id] {
			continue
		}
		seen[id] = true
		src[k], dst[k], at[k] = src[i], dst[i], at[i]
		k++
	}
	return src[:k], dst[:k], at[:k]
}
