package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// Two vhi sim processes (TP1 and TP2×PP2) give identical streams for the
// same requests under concurrent load, and clean their KV files up on exit.
func TestSimProcessesAgree(t *testing.T) {
	shm := t.TempDir()
	var urls []string
	for _, extra := range [][]string{{}, {"--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"}} {
		port := freePort(t)
		args := append([]string{"sim", "--port", fmt.Sprint(port), "--served-model-name", "m", "--shm-dir", shm,
			"--num-gpu-blocks", "2048", "--step-fixed", "2ms", "--log-level", "warn"}, extra...)
		startVHI(t, args...)
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		waitHealthy(t, url+"/health")
		urls = append(urls, url)
	}
	files, _ := filepath.Glob(filepath.Join(shm, "*.kv"))
	if len(files) != 1+4 {
		t.Fatalf("want 5 KV files (1 + 2×2 shards), got %v", files)
	}
	var reqs []loadgen.Request
	for i := 0; i < 64; i++ {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("stream %d says %s", i, strings.Repeat(" word", i%23)), MaxTokens: 24 + i%17, Seed: &seed, Temperature: 0.5, IgnoreEOS: i%2 == 0})
	}
	a := loadgen.Run(context.Background(), loadgen.Config{BaseURL: urls[0], Model: "m"}, reqs)
	b := loadgen.Run(context.Background(), loadgen.Config{BaseURL: urls[1], Model: "m"}, reqs)
	for i := range reqs {
		if a[i].Err != nil || b[i].Err != nil {
			t.Fatalf("stream %d: %v / %v", i, a[i].Err, b[i].Err)
		}
		if a[i].Text != b[i].Text || a[i].Usage == nil || a[i].Usage.CompletionTokens != len(a[i].Pieces) {
			t.Fatalf("stream %d differs or bad usage: %q vs %q (%+v)", i, a[i].Text, b[i].Text, a[i].Usage)
		}
	}
}

func TestSimFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{"sim", "--tensor-parallel-size", "3"},
		{"sim", "--profile", "gpt-9"},
		{"sim", "--kv-scale", "5"},
		{"sim", "--port", "99999999"},
		{"sim", "--bogus-flag"},
	} {
		out, err := exec.Command(vhiBin, args...).CombinedOutput()
		if err == nil {
			t.Errorf("%v exited 0", args)
			continue
		}
		if !strings.Contains(string(out), "vhi:") {
			t.Errorf("%v: no clear error message: %s", args, out)
		}
	}
	out, err := exec.Command(vhiBin, "version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "vhi ") {
		t.Fatalf("version: %v %s", err, out)
	}
}
