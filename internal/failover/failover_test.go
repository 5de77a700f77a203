package failover

import (
	"fmt"
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/registry"
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

// spread places a batch shortest context first, each stream on the
// survivor with the most free blocks left after what the batch gave it.
func TestSpreadPlacesShortestFirstByFreeKV(t *testing.T) {
	w := func(id string, prompt, output, maxTokens int) *waiting {
		st := hooks.RequestState{RequestID: id, PromptTokenIDs: make(hooks.IntList, prompt), OutputTokenIDs: make(hooks.IntList, output)}
		st.Sampling.MaxTokens = maxTokens
		return &waiting{state: st}
	}
	targets := []registry.Instance{
		{Registration: registry.Registration{ID: "b", Engine: registry.Engine{Geometry: registry.Geometry{BlockSize: 16}}}, Stats: registry.Stats{FreeBlocks: 100}},
		{Registration: registry.Registration{ID: "c", Engine: registry.Engine{Geometry: registry.Geometry{BlockSize: 16}}}, Stats: registry.Stats{FreeBlocks: 70}},
	}
	// Contexts 640, 80, 320 and 160 tokens; each reserves prompt + max_tokens.
	batch := []*waiting{w("long", 320, 320, 640), w("short", 48, 32, 80), w("mid", 160, 160, 320), w("small", 96, 64, 160)}
	shares := spread(batch, targets)
	got := [][]string{}
	for _, share := range shares {
		var ids []string
		for _, x := range share {
			ids = append(ids, x.state.RequestID)
		}
		got = append(got, ids)
	}
	// short (128 tokens: 8 blocks) → b (100 → 92); small (256: 16) → b
	// (92 → 76); mid (480: 30) → b (76 → 46); long (960: 60) → c.
	want := [][]string{{"short", "small", "mid"}, {"long"}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("shares %v, want %v", got, want)
	}
}
