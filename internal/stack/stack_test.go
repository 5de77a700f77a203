package stack

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// A whole migration in one process, so the race detector sees the Host's
// relay and splice, the orchestrator, both agents and both engines at once.
func TestMigrationInProcess(t *testing.T) {
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 2048, 512
	c.Step = sim.StepModel{Fixed: 3 * time.Millisecond}
	c.ShmDir = t.TempDir()
	st, err := Start(Options{Model: "m", SimA: c, SimB: c})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	var reqs []loadgen.Request
	for i := 0; i < 16; i++ {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("race %d", i), MaxTokens: 150, Seed: &seed, Temperature: 0.5, IgnoreEOS: true})
	}
	want := loadgen.Run(context.Background(), loadgen.Config{BaseURL: st.AURL, Model: "m"}, reqs)
	done := make(chan []loadgen.Stream, 1)
	go func() {
		done <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: st.HostURL, Model: "m"}, reqs)
	}()
	time.Sleep(150 * time.Millisecond)
	status := migrateAndWait(t, st, hostapi.MigrateRequest{Src: st.AID, Dst: st.BID, Type: hostapi.PreserveSource})
	if status.State != hostapi.StateSucceeded || status.Migrated == 0 {
		t.Fatalf("migration: %+v", status)
	}
	got := <-done
	for i := range reqs {
		if got[i].Err != nil || got[i].Text != want[i].Text || got[i].Done != 1 {
			t.Fatalf("stream %d: %v, equal=%v", i, got[i].Err, got[i].Text == want[i].Text)
		}
	}
}

// migrateAndWait starts a migration through the Host's API and waits for
// its end.
func migrateAndWait(t *testing.T, st *Stack, req hostapi.MigrateRequest) hostapi.MigrationStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	status, err := st.Client().MigrateAndWait(ctx, req, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	return status
}

// A target that takes the requests but will not stream them (its attach
// hook fails) is not a success: the migration says "failed", how many
// streams could not switch, and their clients get an error event rather
// than a stream that silently stops.
func TestFailedSplicesAreNotSuccess(t *testing.T) {
	c := sim.DefaultConfig()
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 2048, 512
	c.Step = sim.StepModel{Fixed: 3 * time.Millisecond}
	c.ShmDir = t.TempDir()
	refuseAttach := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasSuffix(r.URL.Path, "/stream") {
				http.Error(w, "no", http.StatusBadGateway)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	st, err := Start(Options{Model: "m", SimA: c, SimB: c, WrapB: refuseAttach})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Stop()
	var reqs []loadgen.Request
	for i := 0; i < 4; i++ {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("splice %d", i), MaxTokens: 300, Seed: &seed, IgnoreEOS: true})
	}
	done := make(chan []loadgen.Stream, 1)
	go func() {
		done <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: st.HostURL, Model: "m"}, reqs)
	}()
	time.Sleep(150 * time.Millisecond)
	status := migrateAndWait(t, st, hostapi.MigrateRequest{Src: st.AID, Dst: st.BID, Type: hostapi.PreserveSource})
	if status.State != hostapi.StateFailed || !status.Committed || !strings.Contains(status.Error, "could not switch") {
		t.Fatalf("a migration whose streams could not switch: %s (%s)", status.State, status.Error)
	}
	for i, s := range <-done {
		if s.Err == nil || !strings.Contains(s.Err.Error(), "error event") {
			t.Fatalf("stream %d ended without telling its client: %v", i, s.Err)
		}
	}
	// The target's copies nobody listens to are dropped.
	deadline := time.Now().Add(5 * time.Second)
	for {
		sb, _ := st.B.Stats(context.Background())
		if sb.FreeBlocks == sb.TotalBlocks {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("B keeps the orphaned requests: %+v", sb)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
