package e2e

import (
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// A source agent started with --pace-round0 sends round 0 in steps of
// its engine (issue 35): the round's status says how many chunks and the
// engine's step time, and every stream still moves and equals its
// unmigrated run.
func TestAPacedRound0MovesEveryStreamExactly(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, kvScale: 16, agentArgs: [2][]string{{"--pace-round0", "0.5"}, nil}})
	reqs := load(32, 600)
	st, got, want := d.migrateUnderLoad(t, reqs, 300*time.Millisecond, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) {
		t.Fatalf("%s, %d of %d moved: %s\n%+v", st.State, st.Migrated, len(reqs), st.Error, st)
	}
	r0 := st.Rounds[0]
	if r0.Kind != "full" || r0.PacedChunks < 2 || r0.SourceStepBeforeS <= 0 || r0.SourceStepSlowestS <= 0 {
		t.Fatalf("round 0 not paced: %+v", r0)
	}
	// The Host saw the moving streams' tokens before and during the round.
	if r0.SourceGapP99S <= 0 || r0.SourceGapP99BeforeS <= 0 {
		t.Fatalf("round 0 reports no gaps of the source's clients: %+v", r0)
	}
	t.Logf("round 0: %d blocks, %d bytes in %.2f s, %d chunks; the source's step %.1f ms before, %.1f ms at the slowest; its clients' p99 gap %.1f ms during, %.1f ms before",
		r0.BlockCount, r0.Bytes, r0.DurationS, r0.PacedChunks, 1000*r0.SourceStepBeforeS, 1000*r0.SourceStepSlowestS,
		1000*r0.SourceGapP99S, 1000*r0.SourceGapP99BeforeS)
	checkExact(t, got, want)
}
