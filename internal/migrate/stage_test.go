package migrate

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// The export in the pause asks for the tokens after those the target's
// stage holds, and only for requests the target said it staged: a stage
// that left a request out, or failed, leaves the Host counting on nothing.
func TestTheExportInThePauseCountsOnlyOnWhatTheTargetStaged(t *testing.T) {
	snap := func(n map[string]int) json.RawMessage {
		var rs []map[string]any
		for id, k := range n {
			rs = append(rs, map[string]any{"request_id": id, "output_token_ids": hooks.IntList(make([]int, k))})
		}
		b, _ := json.Marshal(rs)
		return b
	}
	var m migration
	if got := m.stagedOutputs([]string{"a"}); got != nil {
		t.Fatalf("nothing staged: %v", got)
	}
	m.recordStaged(snap(map[string]int{"a": 5, "b": 7, "c": 2}), []string{"a", "b", "c"})
	m.recordStaged(snap(map[string]int{"a": 9, "b": 11}), []string{"a"}) // a top-up the target took for a only
	if got, want := m.stagedOutputs([]string{"a", "b", "c", "d"}), map[string]int{"a": 9, "c": 2}; !reflect.DeepEqual(got, want) {
		t.Fatalf("after the top-up: %v, want %v", got, want)
	}
	m.recordStaged(json.RawMessage(`not json`), nil) // a stage that failed: what the target holds is not known
	if got := m.stagedOutputs([]string{"a", "c"}); len(got) != 0 {
		t.Fatalf("after a failed stage: %v", got)
	}
	// The Host counts a request's output tokens from what the export says.
	st := movedState{OutputTokenIDs: hooks.IntList{4, 5}, OutputFrom: 9}
	if st.outputs() != 11 || sourceVisibleText(st) != -1 {
		t.Fatalf("a tail of 2 after 9: %d outputs, visible text %d", st.outputs(), sourceVisibleText(st))
	}
}
