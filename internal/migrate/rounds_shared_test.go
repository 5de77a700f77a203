package migrate

import (
	"testing"

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
