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

// withIDs gives s one token id per event.
func withIDs(s loadgen.Stream, ids ...int) loadgen.Stream {
	s.IDs = ids
	s.PieceIDs = make([]int, len(ids))
	for i := range s.PieceIDs {
		s.PieceIDs[i] = 1
	}
	return s
}

// Streams that carried every token's id are compared by them: a token
// made otherwise after the pause is a mismatch and one before it is the
// engine's own; the same ids with other text is a text slip, a mismatch
// wherever it falls; a stream without ids is compared by text.
func TestJudgeComparesTokenIDsWhereTheStreamsCarriedThem(t *testing.T) {
	t0 := time.Unix(1000, 0)
	st := hostapi.MigrationStatus{StepHistory: []hostapi.Step{{Step: "pause_source", StartedAt: t0.Add(2500 * time.Millisecond)}}}
	ref := []loadgen.Stream{
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4),
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4),
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4),
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4),
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4),
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4),
	}
	short := withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 4) // the event of "c" came without its id
	short.PieceIDs = []int{1, 1, 0, 1}
	got := []loadgen.Stream{
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 4), // exact
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 2, 3, 9), // another last token, the same text: after the pause
		withIDs(stream(t0, "a", "b", "X", "d"), 1, 2, 3, 4), // the same ids, other text (event 2: before the pause)
		withIDs(stream(t0, "a", "b", "c", "d"), 1, 7, 3, 4), // another token before the pause
		stream(t0, "a", "b", "c", "d"),                      // no ids: by text, equal
		short,                                               // some ids: by text, and said
	}
	res := scenarioResult{Streams: got, Status: st, MigrationStart: t0}
	res.judge(ref, false, 1)
	if res.ByIDs != 4 {
		t.Fatalf("%d streams compared by ids, want 4", res.ByIDs)
	}
	if len(res.Mismatches) != 2 || !strings.HasPrefix(res.Mismatches[0], "stream 1 ") || !strings.Contains(res.Mismatches[0], "from token 3 of 4") ||
		!strings.Contains(res.Mismatches[0], "after the source was paused") ||
		!strings.HasPrefix(res.Mismatches[1], "stream 2 has its unmigrated run's token ids but not its text") {
		t.Fatalf("mismatches %q", res.Mismatches)
	}
	if len(res.Unjudged) != 1 || !strings.HasPrefix(res.Unjudged[0], "stream 3 ") || !strings.Contains(res.Unjudged[0], "before the source was paused") {
		t.Fatalf("unjudged %q", res.Unjudged)
	}
	if len(res.ShortOfIDs) != 1 || res.ShortOfIDs[0] != "stream 5 carried ids for 3 of 4 tokens (its first token event without them: 2 of 4)" {
		t.Fatalf("short of ids %q", res.ShortOfIDs)
	}
}
