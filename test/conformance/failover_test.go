package conformance

import (
	"context"
	"encoding/json"
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

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/hostmetrics"
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
	cfg := host.DefaultConfig()
	cfg.Failover.SnapshotInterval = 300 * time.Millisecond
	hostURL, engines, ids := twoActiveVLLMs(t, cfg)

	// n greedy streams, then guided ones (structured outputs: the grammar's
	// position is in no state a survivor can take).
	const n, guided = 6, 4
	want := runFailoverStreams(t, hostURL, n, guided, 400, nil)
	for i, w := range want {
		if strings.Contains(w.raw, "token_ids\":[") {
			t.Fatalf("stream %d: the client got token ids it did not ask for: %s", i, w.raw[:min(len(w.raw), 300)])
		}
	}
	victim := engines[0]
	got := runFailoverStreams(t, hostURL, n, guided, 400, func() {
		// Past a snapshot (the sampling state comes from one), well before
		// the streams end.
		time.Sleep(900 * time.Millisecond)
		// The engine running more of the guided streams dies, so that
		// their failover is exercised whatever the Host's round-robin did.
		if guidedOn(t, engines[1].url) > guidedOn(t, engines[0].url) {
			victim = engines[1]
		}
		if err := syscall.Kill(-victim.pgid, syscall.SIGKILL); err != nil {
			t.Errorf("kill the engine's process group: %v", err)
		}
	})
	sameStreams(t, want[:n], got[:n])
	// A guided stream on the killed engine that had tokens ends with an
	// error event (the survivor refuses its install) and never goes on
	// under a grammar started over; one on the survivor, or one with no
	// token yet (replayed), finishes as the unfailed run did.
	ended := 0
	for i := n; i < n+guided; i++ {
		switch {
		case strings.Contains(got[i].raw, `{"error":`):
			ended++
			if !strings.HasPrefix(want[i].text, got[i].text) {
				t.Errorf("guided stream %d ended with an error event after text its unfailed run never had: %q", i, got[i].text)
			}
			if !strings.Contains(got[i].raw, "structured output") {
				t.Errorf("guided stream %d's error event does not say why it could not go on: %s", i, got[i].raw[max(0, len(got[i].raw)-400):])
			}
		case got[i].done:
			if got[i].text != want[i].text {
				t.Errorf("guided stream %d finished with other text than its unfailed run:\n got  %q\n want %q\n its last events: %s", i, got[i].text, want[i].text, got[i].raw[max(0, len(got[i].raw)-600):])
			}
		default:
			t.Errorf("guided stream %d ended with neither [DONE] nor an error event: %q", i, got[i].raw[max(0, len(got[i].raw)-300):])
		}
	}
	t.Logf("%d of %d guided streams ended with an error event (on the killed engine, with tokens)", ended, guided)
	if ended == 0 {
		t.Errorf("no guided stream was on the killed engine with tokens: their failover went untested")
	}
	metrics := hostGet(t, hostURL+"/metrics")
	if ended > 0 && !strings.Contains(metrics, `vhi_failovers_total{outcome="failed"} `) {
		t.Errorf("guided streams ended with an error event, but no failover counted as failed:\n%s", grepLines(metrics, "vhi_failover"))
	}
	if !strings.Contains(metrics, `vhi_failovers_total{outcome="recovered"}`) {
		t.Fatalf("no stream was recovered (the killed engine had none?):\n%s", grepLines(metrics, "vhi_failover"))
	}
	t.Logf("killed %s; %s", ids[victim.url], strings.ReplaceAll(grepLines(metrics, "vhi_failovers_total"), "\n", "; "))
}

// failoverEngine is one of the two active vLLM servers of a failover test.
type failoverEngine struct {
	url, core string
	pgid      int
	hostAddr  string // the Host's gRPC address its agent registers with
}

// twoActiveVLLMs starts two vLLM servers of their own, both active (A),
// a Host with cfg and their agents, and waits until both are registered:
// the Host's URL, the engines, and the instance id of each engine URL.
func twoActiveVLLMs(t *testing.T, cfg host.Config) (string, []failoverEngine, map[string]string) {
	t.Helper()
	needVLLM(t)
	venv := os.Getenv("VHI_VLLM_VENV")
	engines := make([]failoverEngine, 2)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range engines {
		engines[i].core = filepath.Join(tokDir, fmt.Sprintf("core-failover-%d-%d.sock", i, time.Now().UnixNano()%1e6))
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
	hostURL, hostAddr, _ := startHostWith(t, cfg)
	for i, e := range engines {
		startAgentWith(t, hostAddr, e.url, "A", e.core)
		engines[i].hostAddr = hostAddr
	}
	ids := map[string]string{} // engine URL → instance id
	for _, e := range engines {
		ids[e.url] = waitActive(t, hostURL, e.url)
	}
	return hostURL, engines, ids
}

// waitActive waits until the Host lists the engine at url as an active,
// migratable instance and returns its id.
func waitActive(t *testing.T, hostURL, url string) string {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		list, _ := hostClient(t, hostURL).Instances(context.Background())
		for _, in := range list {
			if in.EngineURL == url && in.Migratable && in.Lifecycle == "active" {
				return in.ID
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the Host did not list the engine at %s as active: %+v", url, list)
		}
	}
}

// Chaos on real vLLM: the engines are killed in turn under load, each
// whole process group SIGKILLed mid-stream — one, then (once a new engine
// took its place, its agent registering with the running Host) the other
// — and every stream of each round equals its run without a crash.
func TestVLLMEnginesKilledInTurn(t *testing.T) {
	cfg := host.DefaultConfig()
	cfg.Failover.SnapshotInterval = 300 * time.Millisecond
	hostURL, engines, ids := twoActiveVLLMs(t, cfg)
	const n = 6
	want := runFailoverStreams(t, hostURL, n, 0, 400, nil)
	kill := func(e failoverEngine) func() {
		return func() {
			time.Sleep(900 * time.Millisecond) // past a snapshot, well before the streams end
			if err := syscall.Kill(-e.pgid, syscall.SIGKILL); err != nil {
				t.Errorf("kill the engine's process group: %v", err)
			}
		}
	}
	sameStreams(t, want, runFailoverStreams(t, hostURL, n, 0, 400, kill(engines[0])))
	t.Logf("round 1: %s killed, every stream exact", ids[engines[0].url])

	// A new engine in the dead one's place.
	next := failoverEngine{core: filepath.Join(tokDir, fmt.Sprintf("core-failover-next-%d.sock", time.Now().UnixNano()%1e6)), hostAddr: engines[0].hostAddr}
	var stop func()
	var err error
	next.url, next.pgid, stop, err = startVLLMGroup(os.Getenv("VHI_VLLM_VENV"), tinyModel, "A", next.core)
	t.Cleanup(stop)
	if err != nil {
		t.Fatalf("%v\n%s", err, tail(vllmLogs.String()))
	}
	startAgentWith(t, next.hostAddr, next.url, "A", next.core)
	ids[next.url] = waitActive(t, hostURL, next.url)

	sameStreams(t, want, runFailoverStreams(t, hostURL, n, 0, 400, kill(engines[1])))
	t.Logf("round 2: %s killed, every stream exact on %s", ids[engines[1].url], ids[next.url])
	metrics := hostGet(t, hostURL+"/metrics")
	if metricOf(t, hostURL, `vhi_failovers_total{outcome="recovered"}`) < 2 {
		t.Fatalf("want streams recovered in both rounds:\n%s", grepLines(metrics, "vhi_failover"))
	}
	t.Logf("%s", strings.ReplaceAll(grepLines(metrics, "vhi_failovers_total"), "\n", "; "))
}

// With warm standbys on (copies every 200 ms), a killed vLLM engine's
// streams go on from the copies of their KV the other engine holds: the
// survivor installs each client's tokens with what its copy covers
// computed and computes only the tokens since the copy's last round —
// vLLM's scheduler takes the rest as a chunk of prefill in the reserved
// blocks — and every stream equals its run without the crash.
func TestAKilledVLLMEnginesStreamsGoOnFromWarmCopies(t *testing.T) {
	cfg := host.DefaultConfig()
	cfg.Failover.SnapshotInterval = 300 * time.Millisecond
	cfg.Failover.WarmTokens, cfg.Failover.WarmInterval = 1, 200*time.Millisecond
	hostURL, engines, ids := twoActiveVLLMs(t, cfg)
	// 1,200 tokens: vLLM CPU's blocks (128 tokens) are opaque, so a copy
	// is checked, and can be installed, a whole block at a time; with
	// asynchronous scheduling the tiny model decodes 400 tokens in ~0.7 s.
	const n, tokens = 6, 1200
	want := runFailoverStreams(t, hostURL, n, 0, tokens, nil)
	// The gauge counts the reference run's copies until a cycle after its
	// streams ended drops them: read before that, it says nothing of the
	// run below (a clean-clone run killed the engine at once, before its
	// streams' copies had a block checked, and nothing could be installed).
	for deadline := time.Now().Add(20 * time.Second); metricOf(t, hostURL, "vhi_failover_warm_copies") != 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the reference run's warm copies were not dropped once its streams ended")
		}
	}
	victim := engines[0]
	var copies float64
	got := runFailoverStreams(t, hostURL, n, 0, tokens, func() {
		// Until every stream has a copy a failover can install (checked
		// against its source), and a round or two since.
		deadline := time.Now().Add(20 * time.Second)
		for copies = metricOf(t, hostURL, "vhi_failover_warm_copies"); copies < n && time.Now().Before(deadline); copies = metricOf(t, hostURL, "vhi_failover_warm_copies") {
			time.Sleep(50 * time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond)
		if err := syscall.Kill(-victim.pgid, syscall.SIGKILL); err != nil {
			t.Errorf("kill the engine's process group: %v", err)
		}
	})
	sameStreams(t, want, got)
	metrics := hostGet(t, hostURL+"/metrics")
	warm := metricOf(t, hostURL, `vhi_failovers_total{outcome="warm"}`)
	t.Logf("killed %s with %v warm copies held; %s", ids[victim.url], copies, strings.ReplaceAll(grepLines(metrics, "vhi_failover"), "\n", "; "))
	if copies < n || warm == 0 || metricOf(t, hostURL, "vhi_failover_warm_tokens_total") == 0 ||
		metricOf(t, hostURL, "vhi_failover_warm_copies_differed_total") != 0 {
		t.Fatalf("%v copies of %d streams; %v streams recovered from a copy:\n%s", copies, n, warm, grepLines(metrics, "vhi_failover"))
	}
}

// metricOf is the Host's metric (name with its labels as the exposition
// writes them), 0 when absent.
func metricOf(t *testing.T, hostURL, name string) float64 {
	t.Helper()
	v, err := hostmetrics.Value(hostURL, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// guidedOn counts the structured-output requests an engine runs (its
// request list names them unmovable).
func guidedOn(t *testing.T, engine string) int {
	t.Helper()
	var list hooks.RequestList
	if err := json.Unmarshal(send(t, "GET", engine+hooks.PathRequests, "").body, &list); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range list.Requests {
		if r.Unmovable != "" {
			n++
		}
	}
	return n
}

// runFailoverStreams runs n greedy streams, completions and chat in turn,
// then guided greedy completions (a regular expression), all spread over
// the model's engines by the Host, and calls during once each had its
// first token.
func runFailoverStreams(t *testing.T, hostURL string, n, guided, tokens int, during func()) []streamResult {
	t.Helper()
	reqs := make([]streamRequest, n, n+guided)
	for i := range reqs {
		reqs[i] = streamRequest{path: "/v1/completions",
			body: fmt.Sprintf(`{"model":"tiny","prompt":"failover number %d failover","max_tokens":%d,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, i, tokens)}
		if i%2 == 1 {
			reqs[i] = streamRequest{path: "/v1/chat/completions",
				body: fmt.Sprintf(`{"model":"tiny","messages":[{"role":"user","content":"failover chat %d"}],"max_tokens":%d,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, i, tokens)}
		}
	}
	for i := range guided {
		reqs = append(reqs, streamRequest{path: "/v1/completions",
			body: fmt.Sprintf(`{"model":"tiny","prompt":"guided number %d","max_tokens":%d,"temperature":0,"stream":true,`+
				`"structured_outputs":{"regex":"[a-z ]{%d}"}}`, i, tokens, tokens)})
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
