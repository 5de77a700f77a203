package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// Two vhi sim processes (TP1 and TP2×PP2) give identical streams for the
// same requests under concurrent load. Their KV memory has no name in the
// KV directory (unlinked at creation, mapped through /proc/<pid>/fd), so
// a sim killed by SIGKILL leaves nothing behind, and its space comes back.
func TestSimProcessesAgree(t *testing.T) {
	shm := t.TempDir()
	free := func() int64 {
		var st syscall.Statfs_t
		if err := syscall.Statfs(shm, &st); err != nil {
			t.Fatal(err)
		}
		return int64(st.Bavail) * st.Bsize
	}
	before := free()
	tk := newTokens(t)
	var urls []string
	var procs []*proc
	for _, extra := range [][]string{{}, {"--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"}} {
		port := freePort(t)
		args := append([]string{"sim", "--port", fmt.Sprint(port), "--served-model-name", "m", "--shm-dir", shm,
			"--num-gpu-blocks", "2048", "--step-fixed", "2ms", "--log-level", "warn", "--engine-token-file", tk.agentFile}, extra...)
		procs = append(procs, startVHI(t, args...))
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		waitHealthy(t, url+"/health")
		urls = append(urls, url)
	}
	if files, _ := filepath.Glob(filepath.Join(shm, "*")); len(files) != 0 {
		t.Fatalf("KV files left with a name: %v", files)
	}
	for i, u := range urls {
		open, err := http.Get(u + "/vllm_hi/engine/layout")
		if err != nil {
			t.Fatal(err)
		}
		open.Body.Close()
		if open.StatusCode != http.StatusUnauthorized {
			t.Fatalf("sim %d answers its layout without the agent token: %s", i, open.Status)
		}
		resp, err := authGet(u+"/vllm_hi/engine/layout", tk.agent)
		if err != nil {
			t.Fatal(err)
		}
		var lay struct {
			Regions []struct {
				Memory struct {
					Path string `json:"path"`
				} `json:"memory"`
			} `json:"regions"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&lay)
		resp.Body.Close()
		prefix := fmt.Sprintf("/proc/%d/fd/", procs[i].cmd.Process.Pid)
		if len(lay.Regions) != []int{1, 4}[i] {
			t.Fatalf("sim %d: %d regions", i, len(lay.Regions))
		}
		for _, r := range lay.Regions {
			if !strings.HasPrefix(r.Memory.Path, prefix) {
				t.Fatalf("sim %d maps its KV as %q, want %s<n>", i, r.Memory.Path, prefix)
			}
		}
	}
	const kv = 2 * 2048 * 72 << 10 // two sims of 2,048 blocks of 72 KiB
	if used := before - free(); used < kv*9/10 {
		t.Fatalf("the sims' KV holds %d bytes of the directory, want ~%d (allocated up front)", used, kv)
	}
	defer func() {
		procs[0].kill()
		procs[1].kill()
		waitUntil(t, "the killed sims' KV space back", func() bool { return free() > before-kv/10 })
	}()
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
		// KV larger than the directory's free space: a clear error at
		// start, not a SIGBUS at the first write into a page that cannot
		// be backed.
		{"sim", "--num-gpu-blocks", "100000000", "--port", "0", "--shm-dir", t.TempDir()},
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
