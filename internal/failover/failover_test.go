package failover

import (
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

func state(n int) hooks.RequestState {
	st := hooks.RequestState{RequestID: "r", PromptTokenIDs: hooks.IntList{1, 2, 3}, RNGPosition: n}
	text := ""
	for i := 0; i < n; i++ {
		st.OutputTokenIDs = append(st.OutputTokenIDs, 100+i)
		text += "ab"
		st.TextOffsets = append(st.TextOffsets, len(text))
	}
	st.OutputText = text
	return st
}

// The snapshot is cut to the client's place; a snapshot older than the
// client is installed whole (the target regenerates the rest, the stream
// skips it); a client whose text does not end at a token is refused.
func TestCut(t *testing.T) {
	for _, c := range []struct {
		name       string
		n          int
		sent, text int
		want       int // output tokens installed; -1: refused
	}{
		{"the engine ran ahead of the client", 10, 6, 12, 6},
		{"the client is past the snapshot", 10, 14, 28, 10},
		{"exactly at the snapshot", 10, 10, 20, 10},
		{"nothing sent yet", 10, 0, 0, 0},
		{"merged events: the text is past the sixth token", 10, 6, 16, -1},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := cut(state(c.n), c.sent, c.text)
			if c.want < 0 {
				if err == nil || !strings.Contains(err.Error(), "does not end at a token") {
					t.Fatalf("want a refusal, got %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got.OutputTokenIDs) != c.want || len(got.TextOffsets) != c.want || got.RNGPosition != c.want ||
				len(got.OutputText) != 2*c.want || got.NumComputedTokens != 0 {
				t.Fatalf("cut to %d tokens, %d offsets, rng %d, text %q", len(got.OutputTokenIDs), len(got.TextOffsets), got.RNGPosition, got.OutputText)
			}
		})
	}
	// The snapshot itself is left alone.
	st := state(10)
	_, _ = cut(st, 3, 6)
	if len(st.OutputTokenIDs) != 10 {
		t.Fatal("cut changed the snapshot")
	}
}
