package stack

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
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
	body, _ := json.Marshal(migrate.Request{Src: st.AID, Dst: st.BID, Type: migrate.PreserveSource})
	req, _ := http.NewRequest(http.MethodPost, st.HostURL+"/vllm_hi/migrate", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+st.AdminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var started struct {
		ID string `json:"migration_id"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&started)
	resp.Body.Close()
	var status migrate.Status
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		r, err := http.Get(st.HostURL + "/vllm_hi/migration/" + started.ID + "/status")
		if err != nil {
			t.Fatal(err)
		}
		_ = json.NewDecoder(r.Body).Decode(&status)
		r.Body.Close()
		if status.State != migrate.StateRunning {
			break
		}
	}
	if status.State != migrate.StateSucceeded || status.Migrated == 0 {
		t.Fatalf("migration: %+v", status)
	}
	got := <-done
	for i := range reqs {
		if got[i].Err != nil || got[i].Text != want[i].Text || got[i].Done != 1 {
			t.Fatalf("stream %d: %v, equal=%v", i, got[i].Err, got[i].Text == want[i].Text)
		}
	}
}
