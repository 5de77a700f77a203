package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/test/framework"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// hostClient is the typed client of the Host at hostURL (reads need no
// token; admin may be "").
func hostClient(t *testing.T, hostURL, admin string) *hostapi.Client {
	t.Helper()
	c, err := hostapi.New(hostURL, hostapi.Options{AdminToken: admin, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// instance returns one instance as the Host lists it (zero if absent).
func instance(t *testing.T, hostURL, id string) hostapi.Instance {
	t.Helper()
	for _, i := range listInstances(t, hostURL) {
		if i.ID == id {
			return i
		}
	}
	return hostapi.Instance{}
}

// listInstances lists the Host's instances (none while it cannot be
// reached: callers wait for a condition).
func listInstances(t *testing.T, hostURL string) []hostapi.Instance {
	t.Helper()
	list, _ := hostClient(t, hostURL, "").Instances(context.Background())
	return list
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	framework.WaitFor(t, what, cond)
}

// vhi host, vhi sim and vhi agent as real processes on loopback: streams
// through the Host equal streams straight from the engine; the agent
// survives a Host restart and deregisters on SIGTERM.
func TestHostSimAgentProcesses(t *testing.T) {
	shm := t.TempDir()
	tk := newTokens(t)
	dataDir := t.TempDir()
	simPort, hostPort := freePort(t), freePort(t)
	startVHI(t, "sim", "--port", fmt.Sprint(simPort), "--served-model-name", "m", "--shm-dir", shm,
		"--num-gpu-blocks", "4096", "--step-fixed", "2ms", "--log-level", "warn", "--engine-token-file", tk.agentFile)
	simURL := fmt.Sprintf("http://127.0.0.1:%d", simPort)
	waitHealthy(t, simURL+"/health")
	hostAddr := fmt.Sprintf("127.0.0.1:%d", hostPort)
	hostURL := "http://" + hostAddr
	hostArgs := append([]string{"host", "--listen", hostAddr, "--heartbeat-interval", "200ms", "--log-level", "warn", "--data-dir", dataDir}, tk.hostArgs()...)
	host := startVHI(t, hostArgs...)
	waitHealthy(t, hostURL+"/health")
	agent := startVHI(t, "agent", "--type", "A", "--host", hostAddr, "--engine", simURL, "--data-port", "19999", "--log-level", "warn",
		"--token-file", tk.agentFile)
	waitUntil(t, "the agent's registration", func() bool { return len(listInstances(t, hostURL)) == 1 })
	if v := listInstances(t, hostURL); v[0].Role != "active" || !v[0].Migratable {
		t.Fatalf("instance: %+v", v)
	}

	var reqs []loadgen.Request
	for i := 0; i < 64; i++ {
		seed := int64(i)
		reqs = append(reqs, loadgen.Request{Prompt: fmt.Sprintf("through the host %d", i), MaxTokens: 20 + i%13, Seed: &seed, Temperature: 0.7, IgnoreEOS: true})
	}
	via := loadgen.Run(context.Background(), loadgen.Config{BaseURL: hostURL, Model: "m"}, reqs)
	direct := loadgen.Run(context.Background(), loadgen.Config{BaseURL: simURL, Model: "m"}, reqs)
	for i := range reqs {
		if via[i].Err != nil {
			t.Fatalf("stream %d via the Host: %v", i, via[i].Err)
		}
		if via[i].Text != direct[i].Text || via[i].Done != 1 || via[i].Usage == nil || via[i].Usage.CompletionTokens != reqs[i].MaxTokens {
			t.Fatalf("stream %d via the Host differs: %q vs %q (%+v)", i, via[i].Text, direct[i].Text, via[i].Usage)
		}
	}

	out, err := exec.Command(vhiBin, "instances", "--host", hostURL).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "active") {
		t.Fatalf("vhi instances: %v\n%s", err, out)
	}
	out, err = exec.Command(vhiBin, "instances", "--host", hostURL, "-o", "json").Output()
	var parsed hostapi.InstanceList
	if err != nil || json.Unmarshal(out, &parsed) != nil || len(parsed.Instances) != 1 {
		t.Fatalf("vhi instances -o json: %v\n%s", err, out)
	}
	if out, err := exec.Command(vhiBin, "instances", "--host", "http://127.0.0.1:1").CombinedOutput(); err == nil {
		t.Fatalf("vhi instances against no Host exited 0: %s", out)
	}

	// Restart the Host: the agent registers again by itself.
	host.stop(t)
	startVHI(t, hostArgs...)
	waitHealthy(t, hostURL+"/health")
	// The restarted Host knows the instance from its state (listed, not
	// yet reachable) until the agent registers again by itself.
	waitUntil(t, "re-registration after a Host restart", func() bool {
		v := listInstances(t, hostURL)
		return len(v) == 1 && v[0].State == "active"
	})
	resp, err := http.Post(hostURL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"again","max_tokens":2}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("routing after the restart: %v %v", err, resp)
	}
	resp.Body.Close()

	agent.stop(t)
	waitUntil(t, "deregistration", func() bool { return len(listInstances(t, hostURL)) == 0 })
}

// SIGHUP makes the Host read --config again: autoscaling policies added
// to the file take effect without a restart; a file that does not check
// changes nothing and the Host goes on.
func TestSIGHUPReloadsTheConfiguration(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "host.yaml")
	if err := os.WriteFile(conf, []byte("autoscale:\n  dry_run: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--config", conf}})
	c := hostClient(t, d.hostURL, "")
	if st, err := c.Autoscale(context.Background()); err != nil || st.Enabled {
		t.Fatalf("before the reload: %+v %v", st, err)
	}
	policy := "autoscale:\n  dry_run: true\n  models:\n    m:\n      kind: replicas\n      min: 1\n      max: 2\n      ttft_p95_slo_s: 2\n"
	if err := os.WriteFile(conf, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.host.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the policy reloaded", func() bool {
		st, err := c.Autoscale(context.Background())
		return err == nil && st.Enabled && len(st.Models) == 1 && st.Models[0].Model == "m" && st.Models[0].Max == 2
	})
	// A misspelt field: refused, the running policy stays.
	if err := os.WriteFile(conf, []byte("autoscale:\n  modelz: {}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = d.host.cmd.Process.Signal(syscall.SIGHUP)
	time.Sleep(500 * time.Millisecond)
	if st, err := c.Autoscale(context.Background()); err != nil || !st.Enabled || len(st.Models) != 1 {
		t.Fatalf("after a bad file's SIGHUP: %+v %v", st, err)
	}
	if !strings.Contains(d.host.stderr.String(), "does not check") {
		t.Fatalf("the Host did not say the file was refused:\n%s", d.host.stderr.String())
	}
}
