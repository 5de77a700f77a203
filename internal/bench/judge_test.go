package bench

import (
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

func stream(t0 time.Time, pieces ...string) loadgen.Stream {
	s := loadgen.Stream{Done: 1, Usage: &loadgen.Usage{CompletionTokens: len(pieces)}}
	for i, p := range pieces {
		s.Pieces = append(s.Pieces, p)
		s.Arrivals = append(s.Arrivals, t0.Add(time.Duration(i)*time.Second))
		s.Text += p
	}
	return s
}

// A real engine's stream that went its own way before the source was
// paused (round 0 had begun: the source still decoded on its own) cannot
// judge the migration; one that differs after the pause is a mismatch,
// also when the engine split the common text into other events; on the
// sims (deterministic) every difference is a mismatch.
func TestJudgeTellsEngineNondeterminismFromMigrationErrors(t *testing.T) {
	t0 := time.Unix(1000, 0)
	ref := []loadgen.Stream{
		stream(t0, "a", "b", "c", "d"),
		stream(t0, "a", "b", "c", "d"),
		stream(t0, "ab", "c", "d"),
		stream(t0, "a", "b", "c", "d"),
	}
	got := []loadgen.Stream{
		stream(t0, "a", "X", "c", "d"), // differs at event 1 (t0+1s): in round 0, before the pause (t0+2.5s)
		stream(t0, "a", "b", "c", "X"), // differs at event 3 (t0+3s), after
		stream(t0, "a", "b", "c", "X"), // same text split otherwise, then differs after
		stream(t0, "a", "b", "c", "d"),
	}
	st := hostapi.MigrationStatus{StepHistory: []hostapi.Step{
		{Step: "copy_rounds", StartedAt: t0.Add(500 * time.Millisecond)},
		{Step: "pause_source", StartedAt: t0.Add(2500 * time.Millisecond)},
	}}
	res := scenarioResult{Streams: got, Status: st, MigrationStart: t0.Add(500 * time.Millisecond)}
	res.judge(ref, false, 1)
	if len(res.Unjudged) != 1 || !strings.HasPrefix(res.Unjudged[0], "stream 0 ") || !strings.Contains(res.Unjudged[0], "before the source was paused") {
		t.Fatalf("unjudged %q", res.Unjudged)
	}
	if len(res.Mismatches) != 2 || !strings.HasPrefix(res.Mismatches[0], "stream 1 ") || !strings.HasPrefix(res.Mismatches[1], "stream 2 ") ||
		!strings.Contains(res.Mismatches[0], "from byte 3 of 4") {
		t.Fatalf("mismatches %q", res.Mismatches)
	}

	sim := scenarioResult{Streams: got, Status: st, MigrationStart: res.MigrationStart}
	sim.judge(ref, true, 1)
	if len(sim.Unjudged) != 0 || len(sim.Mismatches) != 3 {
		t.Fatalf("sim: unjudged %q, mismatches %q", sim.Unjudged, sim.Mismatches)
	}

	// A migration that never paused the source (it failed before) has
	// only its start to go by: the stream that differed at t0+1s is then
	// judged, a mismatch.
	early := scenarioResult{Streams: got, MigrationStart: res.MigrationStart}
	early.judge(ref, false, 1)
	if len(early.Unjudged) != 0 || len(early.Mismatches) != 3 || !strings.Contains(early.Mismatches[0], "after the migration began") {
		t.Fatalf("no pause step: unjudged %q, mismatches %q", early.Unjudged, early.Mismatches)
	}
}
