package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
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

// The pause's export is installed in the chunks the state move would have
// exported: each chunk's answer carries the export's cursor and its own
// requests as they came; a request the Host no longer moves stays behind,
// and the moving ones it lacks are exported as before.
func TestThePausesExportIsInstalledInChunks(t *testing.T) {
	var ids []string
	var reqs []string
	for i := range 40 {
		id := fmt.Sprintf("r%02d", i)
		ids = append(ids, id)
		if i != 7 {
			reqs = append(reqs, fmt.Sprintf(`{"request_id":%q,"output_token_ids":"AQAAAA=="}`, id))
		}
	}
	reqs = append(reqs, `{"request_id":"ended","output_token_ids":[]}`)
	raw := json.RawMessage(`{"cursor":12,"requests":[` + strings.Join(reqs, ",") + `]}`)
	parts, rest, err := splitExport(raw, ids)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rest, []string{"r07"}) {
		t.Fatalf("left for the chunked export: %v, want r07", rest)
	}
	if len(parts) != 1 {
		t.Fatalf("%d parts for 39 tails, want one install", len(parts))
	}
	seen := 0
	for _, p := range parts {
		var exp struct {
			Cursor   uint64       `json:"cursor"`
			Requests []movedState `json:"requests"`
		}
		if err := json.Unmarshal(p.raw, &exp); err != nil || exp.Cursor != 12 || len(exp.Requests) != len(p.ids) {
			t.Fatalf("part %s: %+v (%v)", p.raw, exp, err)
		}
		for i, r := range exp.Requests {
			if r.RequestID != p.ids[i] || r.RequestID == "ended" || len(r.OutputTokenIDs) != 1 || r.OutputTokenIDs[0] != 1 {
				t.Fatalf("part %v carries %+v", p.ids, r)
			}
			seen++
		}
	}
	if seen != 39 {
		t.Fatalf("%d requests in the parts, want 39", seen)
	}
	// Larger states go in installs of up to maxInstallChunkBytes.
	pad := strings.Repeat("A", 200<<10)
	var big []string
	for _, id := range ids[:5] {
		big = append(big, fmt.Sprintf(`{"request_id":%q,"output_token_ids":"AQAAAA==","pad":%q}`, id, pad))
	}
	parts, rest, err = splitExport(json.RawMessage(`{"cursor":12,"requests":[`+strings.Join(big, ",")+`]}`), ids[:5])
	if err != nil || len(rest) != 0 {
		t.Fatal(err, rest)
	}
	var sizes []int
	for _, p := range parts {
		if len(p.raw) > maxInstallChunkBytes+100 || !json.Valid(p.raw) {
			t.Fatalf("an install of %d bytes (valid JSON: %v)", len(p.raw), json.Valid(p.raw))
		}
		sizes = append(sizes, len(p.ids))
	}
	if !reflect.DeepEqual(sizes, []int{2, 2, 1}) {
		t.Fatalf("installs of %v requests, want [2 2 1]", sizes)
	}
	if parts, rest, err := splitExport(nil, ids); err != nil || parts != nil || len(rest) != 40 {
		t.Fatalf("no export with the pause: %v %v %v", parts, rest, err)
	}
	if parts, rest, err := splitExport(json.RawMessage(`{"cursor":3,"requests":[{"request_id":"ended"}]}`), ids); err != nil || parts != nil || len(rest) != 40 {
		t.Fatalf("an export of none that move: %v %v %v", parts, rest, err)
	}
	if _, _, err := splitExport(json.RawMessage(`{"requests":[]}`), ids); err == nil {
		t.Fatal("an export without its cursor was taken")
	}
}

// The pause exports only tails: it asks for the export when the target
// staged every moving request, and not otherwise.
func TestThePauseExportsOnlyWhatTheTargetStagedAll(t *testing.T) {
	var m migration
	m.recordStaged(json.RawMessage(`[{"request_id":"a","output_token_ids":"AQAAAA=="},{"request_id":"b","output_token_ids":"AQAAAA=="}]`), []string{"a", "b"})
	if e := m.exportWithPause([]string{"a", "b"}); e == nil || !reflect.DeepEqual(e.OutputFrom, map[string]int{"a": 1, "b": 1}) {
		t.Fatalf("all staged: %+v", e)
	}
	if e := m.exportWithPause([]string{"a", "b", "c"}); e != nil {
		t.Fatalf("c not staged: %+v, want no export with the pause", e)
	}
	if e := m.exportWithPause(nil); e != nil {
		t.Fatalf("nothing moving: %+v", e)
	}
}

// roundingAgent answers CopyRound with a cursor one past the one it was
// given, and counts the rounds.
type roundingAgent struct {
	v1.AgentClient
	rounds int
}

func (r *roundingAgent) CopyRound(_ context.Context, req *v1.CopyRoundRequest, _ ...grpc.CallOption) (*v1.CopyRoundResponse, error) {
	r.rounds++
	return &v1.CopyRoundResponse{Cursor: req.GetSinceCursor() + 1, BlockCount: 3}, nil
}

// The stage's wait after the check is copied before the pause when it
// outlasted CatchUpRatio × the last round, and not otherwise (nor with
// catch-up rounds off); the final round then copies from the new cursor.
func TestWhatTheSourceWroteDuringTheStageIsCopiedBeforeThePause(t *testing.T) {
	for _, tc := range []struct {
		name    string
		waited  time.Duration
		rounds  int
		catchUp int
		want    uint64
	}{
		{"a short stage", 15 * time.Millisecond, 0, 2, 7},
		{"a long stage", 25 * time.Millisecond, 1, 2, 8},
		{"catch-up rounds off", time.Second, 0, 0, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := &roundingAgent{}
			cfg := DefaultConfig()
			cfg.CatchUpRounds = tc.catchUp
			m := &migration{log: zap.NewNop(), o: &Orchestrator{cfg: cfg, ctx: context.Background()}, srcA: agentclient.Agent{RPC: src},
				moving: map[string]*v1.RequestBlocks{"a": {RequestId: "a"}}}
			m.st.Rounds = []hostapi.Round{{Kind: roundIncremental, DurationS: 0.010}} // × 2 = 20 ms
			got, err := m.roundAfterStage(context.Background(), 7, tc.waited)
			if err != nil || got != tc.want || src.rounds != tc.rounds {
				t.Fatalf("cursor %d, %d rounds (%v); want %d, %d", got, src.rounds, err, tc.want, tc.rounds)
			}
		})
	}
}
