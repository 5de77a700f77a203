package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

type instanceView struct {
	ID           string `json:"vllm_hi_id"`
	Role         string `json:"role"`
	State        string `json:"state"`
	Lifecycle    string `json:"lifecycle"`
	Migratable   bool   `json:"migratable"`
	AgentAddress string `json:"agent_address"`
	DataAddress  string `json:"data_address"`
	HooksAuth    bool   `json:"hooks_authenticated"`
}

type instancesView struct {
	Instances []instanceView `json:"instances"`
}

// instance returns one instance as the Host lists it (zero if absent).
func instance(t *testing.T, hostURL, id string) instanceView {
	t.Helper()
	for _, i := range listInstances(t, hostURL).Instances {
		if i.ID == id {
			return i
		}
	}
	return instanceView{}
}

func listInstances(t *testing.T, hostURL string) instancesView {
	t.Helper()
	var v instancesView
	resp, err := http.Get(hostURL + "/vllm_hi/instances")
	if err != nil {
		return v
	}
	defer resp.Body.Close()
	_ = json.NewDecoder(resp.Body).Decode(&v)
	return v
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
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
	waitUntil(t, "the agent's registration", func() bool { return len(listInstances(t, hostURL).Instances) == 1 })
	if v := listInstances(t, hostURL); v.Instances[0].Role != "active" || !v.Instances[0].Migratable {
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
	var parsed instancesView
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
		return len(v.Instances) == 1 && v.Instances[0].State == "active"
	})
	resp, err := http.Post(hostURL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"again","max_tokens":2}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("routing after the restart: %v %v", err, resp)
	}
	resp.Body.Close()

	agent.stop(t)
	waitUntil(t, "deregistration", func() bool { return len(listInstances(t, hostURL).Instances) == 0 })
}
