package conformance

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/host"
)

// When a vLLM engine dies mid-stream — its whole process group killed —
// its streams (completions and chat) go on from another active engine of
// the model,
// every one equal to its run without the crash, token for token: the
// relay knew each client's tokens (vLLM's token ids, which the Host asks
// for and the client never sees), and the survivor recomputed prompt and
// output and went on from the next token. A client that did not ask for
// token ids gets none.
func TestAKilledVLLMEnginesStreamsGoOnElsewhere(t *testing.T) {
	needVLLM(t)
	venv := os.Getenv("VHI_VLLM_VENV")
	// Two engines of their own, both active (A): one of them is killed.
	type engine struct {
		url, core string
		pgid      int
	}
	engines := make([]engine, 2)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range engines {
		engines[i].core = filepath.Join(tokDir, fmt.Sprintf("core-failover-%d.sock", i))
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			var stop func()
			engines[i].url, engines[i].pgid, stop, errs[i] = startVLLMGroup(venv, tinyModel, "A", engines[i].core)
			t.Cleanup(stop)
		}(i)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("%v\n%s", err, tail(vllmLogs.String()))
		}
	}
	cfg := host.DefaultConfig()
	cfg.Failover.SnapshotInterval = 300 * time.Millisecond
	hostURL, hostAddr, _ := startHostWith(t, cfg)
	for _, e := range engines {
		startAgentWith(t, hostAddr, e.url, "A", e.core)
	}
	ids := map[string]string{} // engine URL → instance id
	for deadline := time.Now().Add(60 * time.Second); len(ids) < 2; time.Sleep(100 * time.Millisecond) {
		list, _ := hostClient(t, hostURL).Instances(context.Background())
		for _, in := range list {
			if in.Migratable && in.Role == "active" {
				ids[in.EngineURL] = in.ID
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agents did not register both engines as active: %v", ids)
		}
	}

	const n = 6
	want := runFailoverStreams(t, hostURL, n, nil)
	for i, w := range want {
		if strings.Contains(w.raw, "token_ids\":[") {
			t.Fatalf("stream %d: the client got token ids it did not ask for: %s", i, w.raw[:min(len(w.raw), 300)])
		}
	}
	victim := engines[0]
	got := runFailoverStreams(t, hostURL, n, func() {
		// Past a snapshot (the sampling state comes from one), well before
		// the streams end.
		time.Sleep(900 * time.Millisecond)
		if err := syscall.Kill(-victim.pgid, syscall.SIGKILL); err != nil {
			t.Errorf("kill the engine's process group: %v", err)
		}
	})
	sameStreams(t, want, got)
	metrics := hostGet(t, hostURL+"/metrics")
	if !strings.Contains(metrics, `vhi_failovers_total{outcome="recovered"}`) {
		t.Fatalf("no stream was recovered (the killed engine had none?):\n%s", grepLines(metrics, "vhi_failover"))
	}
	t.Logf("killed %s; %s", ids[victim.url], strings.ReplaceAll(grepLines(metrics, "vhi_failovers_total"), "\n", "; "))
}

// runFailoverStreams runs n greedy streams, completions and chat in turn
// (spread over the model's engines by the Host), and calls during once
// each had its first token.
func runFailoverStreams(t *testing.T, hostURL string, n int, during func()) []streamResult {
	t.Helper()
	reqs := make([]streamRequest, n)
	for i := range reqs {
		reqs[i] = streamRequest{path: "/v1/completions",
			body: fmt.Sprintf(`{"model":"tiny","prompt":"failover number %d failover","max_tokens":400,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, i)}
		if i%2 == 1 {
			reqs[i] = streamRequest{path: "/v1/chat/completions",
				body: fmt.Sprintf(`{"model":"tiny","messages":[{"role":"user","content":"failover chat %d"}],"max_tokens":400,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, i)}
		}
	}
	return runRequests(t, hostURL, reqs, 0, during)
}

func hostGet(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
