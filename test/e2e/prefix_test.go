package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// sharedPreambleLoad is n streams whose prompts begin with one preamble
// of words (a system prompt) and end with their own question.
func sharedPreambleLoad(n, words, tokens int) []loadgen.Request {
	preamble := strings.TrimSpace(strings.Repeat("you are a careful helper who answers in plain words ", words/10))
	var reqs []loadgen.Request
	for i := 0; i < n; i++ {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("%s question %d %s", preamble, i, strings.Repeat(" why", i%5)),
			MaxTokens: tokens + i%7, Seed: &seed, Temperature: float64(i%3) * 0.4, IgnoreEOS: true})
	}
	return reqs
}

// prefixCaching: sims A, B and the reference share prompt prefixes.
var prefixCaching = deployOptions{bBlocks: 4096, simArgs: []string{"--enable-prefix-caching"}, refArgs: []string{"--enable-prefix-caching"}}

// Streams sharing a preamble share its blocks on A (the sim's prefix
// cache); the migration reserves them as one set on B and round 0 sends
// each once: every stream equals its unmigrated run, the status says how
// many block copies the sharing saved, and every block is free on both
// engines once the streams end (a shared block lives until its last
// holder ends).
func TestSharedPrefixesMoveOnce(t *testing.T) {
	d := deployWith(t, prefixCaching)
	reqs := sharedPreambleLoad(24, 120, 400)
	st, got, want := d.migrateUnderLoad(t, reqs, 300*time.Millisecond, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) {
		t.Fatalf("%s, %d of %d moved: %s\n%+v", st.State, st.Migrated, len(reqs), st.Error, st)
	}
	checkExact(t, got, want)
	r0 := st.Rounds[0]
	perBlock := r0.Bytes / int64(r0.BlockCount)
	// 120 words of preamble are several blocks, shared by all 24.
	if r0.SharedBlocks < 3*(len(reqs)-1) || r0.SharedBytesSaved != int64(r0.SharedBlocks)*perBlock {
		t.Fatalf("round 0: %d shared block copies, %d bytes saved (%d a block): want every shared block sent once",
			r0.SharedBlocks, r0.SharedBytesSaved, perBlock)
	}
	var sum int64
	for _, r := range st.Rounds {
		sum += r.Bytes
	}
	if st.Bytes != sum {
		t.Fatalf("the migration's data_size_bytes %d, its rounds' %d", st.Bytes, sum)
	}
	t.Logf("round 0: %d blocks sent, %d copies of shared blocks left out (%.0f %% of what a copy per request would send)",
		r0.BlockCount, r0.SharedBlocks, 100*float64(r0.SharedBytesSaved)/float64(r0.Bytes+r0.SharedBytesSaved))
	waitUntil(t, "A and B back to all blocks free", func() bool {
		a, b := d.stats(t, d.aURL), d.stats(t, d.bURL)
		return a.Free == a.Total && b.Free == b.Total && b.Reserved == 0
	})
}

// A migration of streams sharing a prefix that fails in its final round
// rolls back: A goes on with every stream exact, and B lets go of the
// shared reservations whole.
func TestASharedPrefixMigrationRollsBack(t *testing.T) {
	d := deployWith(t, prefixCaching)
	reqs := sharedPreambleLoad(16, 120, 400)
	st, got, want := d.migrateUnderLoad(t, reqs, 0, hostapi.MigrateRequest{Src: "A", Dst: "B", InjectFault: "cut"})
	if st.State != hostapi.StateAborted || !strings.Contains(st.Error, "final copy round") {
		t.Fatalf("want aborted in the final copy round: %s: %s", st.State, st.Error)
	}
	if st.Rounds[0].SharedBytesSaved == 0 {
		t.Fatalf("round 0 shared nothing: %+v", st.Rounds[0])
	}
	if b := d.stats(t, d.bURL); b.Free != b.Total || b.Reserved != 0 {
		t.Fatalf("B after the rollback: %+v", b)
	}
	checkExact(t, got, want)
}
