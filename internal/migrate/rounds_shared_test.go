package migrate

import (
	"maps"
	"slices"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

func TestSharedBlocks(t *testing.T) {
	reqs := []*v1.RequestBlocks{
		{RequestId: "a", SrcBlockIds: []int32{1, 2, 3}},
		{RequestId: "b", SrcBlockIds: []int32{1, 2, 7}}, // a shared two-block prefix
		{RequestId: "c", SrcBlockIds: []int32{1, 9}},
	}
	if got := sharedBlocks(reqs); got != 3 {
		t.Fatalf("shared blocks %d, want 3 (1 twice more, 2 once more)", got)
	}
	if got := sharedBlocks(reqs[:1]); got != 0 {
		t.Fatalf("one request shares nothing: %d", got)
	}
}

func TestSharedPrefixes(t *testing.T) {
	cand := func(id string, computed int, blocks ...int) Candidate {
		return Candidate{RequestInfo: hooks.RequestInfo{RequestID: id, NumComputedTokens: computed, BlockIDs: blocks}}
	}
	const bs = 4
	got := sharedPrefixes([]Candidate{
		cand("a", 12, 1, 2, 3),
		cand("b", 11, 1, 2, 7),     // two full blocks in common with a
		cand("c", 16, 1, 2, 7, 9),  // three with b (its deepest), two with a
		cand("d", 6, 1, 5),         // its second block is not a's
		cand("e", 3, 1, 8),         // its first block is not full yet: nothing to share
		cand("f", 20, 4, 1, 2, 10), // a's blocks at other places: not a prefix
	}, bs)
	want := map[string]hooks.SharedPrefix{
		"b": {RequestID: "a", Blocks: 2},
		"c": {RequestID: "b", Blocks: 3},
		"d": {RequestID: "a", Blocks: 1},
	}
	if !maps.Equal(got, want) {
		t.Fatalf("shared prefixes %v, want %v", got, want)
	}
	items := []hooks.AllocateItem{{RequestID: "a"}, {RequestID: "b", SharedPrefix: &hooks.SharedPrefix{RequestID: "a", Blocks: 2}},
		{RequestID: "c", SharedPrefix: &hooks.SharedPrefix{RequestID: "b", Blocks: 3}}}
	shared := hooks.AllocateResponse{Requests: []hooks.AllocatedItem{{RequestID: "a", BlockIDs: []int{10, 11, 12}},
		{RequestID: "b", BlockIDs: []int{10, 11, 20}}, {RequestID: "c", BlockIDs: []int{10, 11, 20, 30}}}}
	if n := sharedOnTarget(items, shared); n != 5 {
		t.Fatalf("a target that shares: %d blocks shared, want 5", n)
	}
	apart := hooks.AllocateResponse{Requests: []hooks.AllocatedItem{{RequestID: "a", BlockIDs: []int{10, 11, 12}},
		{RequestID: "b", BlockIDs: []int{13, 14, 15}}, {RequestID: "c", BlockIDs: []int{16, 17, 18, 19}}}}
	if n := sharedOnTarget(items, apart); n != 0 {
		t.Fatalf("a target that does not share: %d blocks shared", n)
	}
	rbs := []*v1.RequestBlocks{
		{RequestId: "a", SrcBlockIds: []int32{1, 2, 3}, DstBlockIds: []int32{10, 11, 12}},
		{RequestId: "b", SrcBlockIds: []int32{1, 2, 7}, DstBlockIds: []int32{10, 11, 20, 21}},
		{RequestId: "c", SrcBlockIds: []int32{1, 9}, DstBlockIds: []int32{40, 41}}, // shared on the source only
	}
	if n := copiesOnce(rbs); n != 2 {
		t.Fatalf("copies left out %d, want 2", n)
	}
}

func TestACheckHashesASharedBlockOnce(t *testing.T) {
	slot := func(b, first, n int32) *v1.BlockSlots { return &v1.BlockSlots{Block: b, FirstSlot: first, NumSlots: n} }
	src := []*v1.BlockSlots{slot(1, 0, 16), slot(2, 0, 16), slot(1, 0, 16), slot(3, 0, 16), slot(1, 0, 16), slot(2, 0, 5)}
	dst := []*v1.BlockSlots{slot(10, 0, 16), slot(11, 0, 16), slot(10, 0, 16), slot(12, 0, 16), slot(40, 0, 16), slot(11, 0, 5)}
	at := []blockAt{{"a", 0}, {"a", 1}, {"b", 0}, {"b", 1}, {"c", 0}, {"d", 1}}
	s, d, w := onceEach(src, dst, at)
	// b's first block is a's on both sides; c's goes to a block of its
	// own (a target that did not share it); d's is another slot range.
	want := []blockAt{{"a", 0}, {"a", 1}, {"b", 1}, {"c", 0}, {"d", 1}}
	if len(s) != len(want) || len(d) != len(want) || !slices.Equal(w, want) {
		t.Fatalf("kept %v, want %v", w, want)
	}
}
