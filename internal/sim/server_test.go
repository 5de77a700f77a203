package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite golden files")

func post(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func get(t *testing.T, url string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from golden file:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

// The SSE framing and JSON shapes match vLLM's (pinned by golden files).
func TestHTTPGolden(t *testing.T) {
	_, ts := startServer(t, startEngine(t, testConfig(t)))
	cases := []struct{ name, path, body string }{
		{"completion_stream.sse", "/v1/completions", `{"model":"test-model","prompt":"hello world","max_tokens":3,"temperature":0,"stream":true,"ignore_eos":true,"stream_options":{"include_usage":true}}`},
		{"completion_stream_plain.sse", "/v1/completions", `{"model":"test-model","prompt":"hello world","max_tokens":2,"temperature":0,"stream":true,"ignore_eos":true}`},
		{"chat_stream.sse", "/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hello"}],"max_tokens":3,"temperature":0,"stream":true,"ignore_eos":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`},
		{"completion.json", "/v1/completions", `{"model":"test-model","prompt":"hello world","max_tokens":3,"temperature":0,"ignore_eos":true}`},
		{"chat.json", "/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}],"max_completion_tokens":3,"temperature":0,"ignore_eos":true}`},
		{"error_unknown_model.json", "/v1/completions", `{"model":"nope","prompt":"x"}`},
		{"error_max_tokens.json", "/v1/completions", `{"model":"test-model","prompt":"x","max_tokens":0}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, b := post(t, ts.URL+c.path, c.body)
			golden(t, c.name, b)
		})
	}
	_, b := get(t, ts.URL+"/v1/models")
	golden(t, "models.json", b)
}

// Asked for token ids (vLLM's return_token_ids), a stream's chunks carry
// them as vLLM's do: the prompt's in the first chunk, each new token's in
// its own (the same chunks otherwise, the fields null).
func TestStreamsWithTokenIDs(t *testing.T) {
	_, ts := startServer(t, startEngine(t, testConfig(t)))
	for _, c := range []struct{ name, path, body string }{
		{"completion_stream_ids.sse", "/v1/completions", `{"model":"test-model","prompt":"hello world","max_tokens":2,"temperature":0,"stream":true,"ignore_eos":true,"return_token_ids":true}`},
		{"chat_stream_ids.sse", "/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":"hello"}],"max_tokens":2,"temperature":0,"stream":true,"ignore_eos":true,"return_token_ids":true}`},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, b := post(t, ts.URL+c.path, c.body)
			golden(t, c.name, b)
		})
	}
}

func TestBadInput(t *testing.T) {
	e := startEngine(t, testConfig(t))
	_, ts := startServer(t, e)
	long := strings.Repeat(" x", 600)
	for _, c := range []struct {
		name, path, body string
		status           int
	}{
		{"malformed json", "/v1/completions", `{"model":`, 400},
		{"not an object", "/v1/completions", `[1,2]`, 400},
		{"unknown model", "/v1/chat/completions", `{"model":"gpt-x","messages":[{"role":"user","content":"hi"}]}`, 404},
		{"max_tokens < 1", "/v1/completions", `{"model":"test-model","prompt":"hi","max_tokens":-3}`, 400},
		{"max_tokens beyond max_model_len", "/v1/completions", `{"model":"test-model","prompt":"hi","max_tokens":100000}`, 400},
		{"prompt too long", "/v1/completions", `{"model":"test-model","prompt":"` + long + `","max_tokens":1}`, 400},
		{"missing prompt", "/v1/completions", `{"model":"test-model"}`, 400},
		{"empty prompt", "/v1/completions", `{"model":"test-model","prompt":""}`, 400},
		{"bad token id", "/v1/completions", `{"model":"test-model","prompt":[1,99999999]}`, 400},
		{"two prompts", "/v1/completions", `{"model":"test-model","prompt":["a","b"]}`, 400},
		{"n=2", "/v1/completions", `{"model":"test-model","prompt":"a","n":2}`, 400},
		{"negative temperature", "/v1/completions", `{"model":"test-model","prompt":"a","temperature":-1}`, 400},
		{"no messages", "/v1/chat/completions", `{"model":"test-model","messages":[]}`, 400},
		{"bad content part", "/v1/chat/completions", `{"model":"test-model","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, 400},
		{"hook export unknown id", "/vllm_hi/engine/export", `{"request_ids":["nope"]}`, 404},
		{"hook pause unknown id", "/vllm_hi/engine/pause", `{"request_ids":["nope"]}`, 404},
		{"hook abort unknown id", "/vllm_hi/engine/abort", `{"request_ids":["nope"]}`, 404},
		{"hook abort no ids", "/vllm_hi/engine/abort", `{}`, 400},
		{"hook install without reservation", "/vllm_hi/engine/install/commit", `{"requests":[{"request_id":"x","prompt_token_ids":[1]}]}`, 404},
		{"hook allocate too much", "/vllm_hi/engine/install/allocate", `{"requests":[{"request_id":"x","num_tokens":500},{"request_id":"y","num_tokens":500},{"request_id":"z","num_tokens":500},{"request_id":"w","num_tokens":500},{"request_id":"v","num_tokens":500}]}`, 507},
		{"hook allocate bad tokens", "/vllm_hi/engine/install/allocate", `{"requests":[{"request_id":"x","num_tokens":0}]}`, 400},
		{"hook malformed", "/vllm_hi/engine/pause", `{"request_ids":`, 400},
		{"scale without size", "/scale_elastic_ep", `{}`, 400},
		{"scale bad size", "/scale_elastic_ep", `{"new_data_parallel_size":-1}`, 400},
	} {
		t.Run(c.name, func(t *testing.T) {
			resp, b := post(t, ts.URL+c.path, c.body)
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, b)
			}
			var body struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(b, &body); err != nil || body.Error.Message == "" || body.Error.Code != c.status {
				t.Fatalf("error body not in the OpenAI shape: %s", b)
			}
		})
	}
	for _, q := range []string{"/vllm_hi/engine/changes?since=x", "/vllm_hi/engine/changes?since=99999999", "/vllm_hi/engine/requests/nope/stream"} {
		if resp, b := get(t, ts.URL+q); resp.StatusCode/100 != 4 {
			t.Errorf("GET %s: %d %s", q, resp.StatusCode, b)
		}
	}
	// The engine still serves after all of that, and nothing leaked.
	resp, b := post(t, ts.URL+"/v1/completions", `{"model":"test-model","prompt":"still here","max_tokens":4}`)
	if resp.StatusCode != 200 {
		t.Fatalf("engine stopped serving: %d %s", resp.StatusCode, b)
	}
	st, _ := e.Stats(context.Background())
	if st.FreeBlocks != st.TotalBlocks {
		t.Fatalf("blocks leaked: %+v", st)
	}
}

func TestSleepWake(t *testing.T) {
	c := testConfig(t)
	c.SleepMode = true
	e := startEngine(t, c)
	_, ts := startServer(t, e)
	lay, _ := e.Layout(context.Background())
	if resp, b := post(t, ts.URL+"/sleep?level=1", ""); resp.StatusCode != 200 || !strings.Contains(string(b), `"sleeping"`) {
		t.Fatalf("sleep: %d %s", resp.StatusCode, b)
	}
	if _, err := os.Stat(lay.Regions[0].Memory.Path); !os.IsNotExist(err) {
		t.Fatalf("KV file still there while sleeping: %v", err)
	}
	if _, b := get(t, ts.URL+"/is_sleeping"); string(b) != "{\"is_sleeping\":true}\n" {
		t.Fatalf("is_sleeping: %s", b)
	}
	// A request sent while asleep is answered at once, 503 with the
	// reason (as vLLM's sleep mode answers); after wake-up it completes.
	start := time.Now()
	resp, b := post(t, ts.URL+"/v1/completions", `{"model":"test-model","prompt":"after sleep","max_tokens":3}`)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), "sleeping") || time.Since(start) > 5*time.Second {
		t.Fatalf("a request while asleep: %d %s after %v", resp.StatusCode, b, time.Since(start))
	}
	t.Logf("a request while asleep was answered %d in %v", resp.StatusCode, time.Since(start))
	if resp, b := post(t, ts.URL+"/wake_up", ""); resp.StatusCode != 200 {
		t.Fatalf("wake_up: %d %s", resp.StatusCode, b)
	}
	if _, b := post(t, ts.URL+"/v1/completions", `{"model":"test-model","prompt":"after sleep","max_tokens":3}`); !strings.Contains(string(b), `"text_completion"`) {
		t.Fatalf("after wake: %s", b)
	}
	if _, b := get(t, ts.URL+"/is_sleeping"); string(b) != "{\"is_sleeping\":false}\n" {
		t.Fatalf("is_sleeping: %s", b)
	}
}

// Without --enable-sleep-mode /sleep is refused, as vLLM's is.
func TestSleepNeedsSleepMode(t *testing.T) {
	e := startEngine(t, testConfig(t))
	_, ts := startServer(t, e)
	if resp, b := post(t, ts.URL+"/sleep?level=1", ""); resp.StatusCode != 400 || !strings.Contains(string(b), "--enable-sleep-mode") {
		t.Fatalf("sleep without sleep mode: %d %s", resp.StatusCode, b)
	}
	if _, b := get(t, ts.URL+"/is_sleeping"); string(b) != "{\"is_sleeping\":false}\n" {
		t.Fatalf("is_sleeping: %s", b)
	}
}

// A level-2 sleep discards the weights: woken (weights first, as vLLM's
// docs do it) and not reloaded, the engine answers with other tokens than
// before — the corruption a controller's probe must see; after
// reload_weights and the KV's wake-up it answers as before.
func TestLevelTwoWakeNeedsAReload(t *testing.T) {
	c := testConfig(t)
	c.SleepMode, c.SleepTime, c.WeightsLoadTime = true, 5*time.Millisecond, 5*time.Millisecond
	e := startEngine(t, c)
	_, ts := startServer(t, e)
	probe := `{"model":"test-model","prompt":"probe the weights","max_tokens":8,"temperature":0}`
	_, before := post(t, ts.URL+"/v1/completions", probe)
	text := func(b []byte) string {
		var out struct {
			Choices []struct{ Text string } `json:"choices"`
		}
		if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) != 1 {
			t.Fatalf("completion %s: %v", b, err)
		}
		return out.Choices[0].Text
	}
	want := text(before)
	if resp, b := post(t, ts.URL+"/sleep?level=2", ""); resp.StatusCode != 200 {
		t.Fatalf("sleep: %d %s", resp.StatusCode, b)
	}
	if resp, b := post(t, ts.URL+"/wake_up?tags=bogus", ""); resp.StatusCode != 400 {
		t.Fatalf("an unknown tag: %d %s", resp.StatusCode, b)
	}
	if resp, b := post(t, ts.URL+"/wake_up?tags=weights", ""); resp.StatusCode != 200 {
		t.Fatalf("wake weights: %d %s", resp.StatusCode, b)
	}
	if _, b := get(t, ts.URL+"/is_sleeping"); string(b) != "{\"is_sleeping\":true}\n" {
		t.Fatalf("with the KV asleep, is_sleeping: %s", b)
	}
	if resp, b := post(t, ts.URL+"/wake_up?tags=kv_cache", ""); resp.StatusCode != 200 {
		t.Fatalf("wake kv: %d %s", resp.StatusCode, b)
	}
	_, stale := post(t, ts.URL+"/v1/completions", probe)
	if text(stale) == want {
		t.Fatalf("woken from level 2 without a reload, the engine answered as before: %q", want)
	}
	if resp, b := post(t, ts.URL+"/collective_rpc", `{"method":"reload_weights"}`); resp.StatusCode != 200 {
		t.Fatalf("reload: %d %s", resp.StatusCode, b)
	}
	if _, after := post(t, ts.URL+"/v1/completions", probe); text(after) != want {
		t.Fatalf("after the reload: %q, before the sleep %q", text(after), want)
	}
	if resp, b := post(t, ts.URL+"/collective_rpc", `{"method":"shutdown"}`); resp.StatusCode != 400 {
		t.Fatalf("another method: %d %s", resp.StatusCode, b)
	}
}

func TestPauseResume(t *testing.T) {
	e := startEngine(t, testConfig(t))
	_, ts := startServer(t, e)
	if resp, b := post(t, ts.URL+"/pause?mode=keep", ""); resp.StatusCode != 200 || string(b) != "{\"status\":\"paused\"}\n" {
		t.Fatalf("pause: %d %s", resp.StatusCode, b)
	}
	if resp, _ := post(t, ts.URL+"/pause?mode=bogus", ""); resp.StatusCode != 400 {
		t.Fatalf("bogus mode: %d", resp.StatusCode)
	}
	done := make(chan []byte)
	go func() {
		_, b := post(t, ts.URL+"/v1/completions", `{"model":"test-model","prompt":"paused","max_tokens":3}`)
		done <- b
	}()
	select {
	case b := <-done:
		t.Fatalf("completed while paused: %s", b)
	case <-time.After(100 * time.Millisecond):
	}
	if _, b := get(t, ts.URL+"/is_paused"); string(b) != "{\"is_paused\":true}\n" {
		t.Fatalf("is_paused: %s", b)
	}
	if _, b := post(t, ts.URL+"/resume", ""); string(b) != "{\"status\":\"resumed\"}\n" {
		t.Fatalf("resume: %s", b)
	}
	<-done
}

// While scaling, every request (health and metrics too) gets vLLM's 503.
func TestScaleElasticEP(t *testing.T) {
	c := testConfig(t)
	c.ElasticEP, c.ElasticMode, c.ElasticGraphTime = true, ElasticBlocking, 300*time.Millisecond
	e := startEngine(t, c)
	_, ts := startServer(t, e)
	done := make(chan []byte)
	go func() {
		_, b := post(t, ts.URL+"/scale_elastic_ep", `{"new_data_parallel_size":4,"drain_timeout":5}`)
		done <- b
	}()
	deadline := time.Now().Add(2 * time.Second)
	for !e.Scaling() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	for _, path := range []string{"/health", "/metrics", "/v1/models"} {
		resp, b := get(t, ts.URL+path)
		if resp.StatusCode != 503 || !strings.Contains(string(b), "currently scaling") {
			t.Errorf("%s while scaling: %d %s", path, resp.StatusCode, b)
		}
	}
	if b := <-done; string(b) != "{\"message\":\"Scaled to 4 data parallel engines\"}\n" {
		t.Fatalf("scale: %s", b)
	}
	if resp, _ := get(t, ts.URL+"/health"); resp.StatusCode != 200 {
		t.Fatalf("health after scaling: %d", resp.StatusCode)
	}
}

func TestMetricsNames(t *testing.T) {
	e := startEngine(t, testConfig(t))
	_, ts := startServer(t, e)
	post(t, ts.URL+"/v1/completions", `{"model":"test-model","prompt":"count me","max_tokens":5,"ignore_eos":true}`)
	_, b := get(t, ts.URL+"/metrics")
	for _, want := range []string{
		`vllm:num_requests_running{engine="0",model_name="test-model"} 0`,
		`vllm:num_requests_waiting{engine="0",model_name="test-model"} 0`,
		`vllm:kv_cache_usage_perc{engine="0",model_name="test-model"} 0`,
		`vllm:generation_tokens_total{engine="0",model_name="test-model"} 5`,
		`vllm:prompt_tokens_total{engine="0",model_name="test-model"}`,
		`vllm:num_preemptions_total{engine="0",model_name="test-model"} 0`,
		`vllm:request_success_total{engine="0",finished_reason="length",model_name="test-model"} 1`,
		`vllm:time_to_first_token_seconds_count{engine="0",model_name="test-model"} 1`,
		`vllm:inter_token_latency_seconds_count{engine="0",model_name="test-model"} 4`,
		`vllm:e2e_request_latency_seconds_bucket`,
		`vllm:request_queue_time_seconds_bucket`,
		`vllm:cache_config_info{block_size="4",cache_dtype="auto",enable_prefix_caching="False",engine="0",num_gpu_blocks="512"} 1`,
		`vllm:prefix_cache_queries_total{engine="0",model_name="test-model"}`,
		`vllm:engine_sleep_state{engine="0",model_name="test-model",sleep_state="awake"} 1`,
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// readSSE returns the data of each event and whether the stream ended
// cleanly (EOF rather than a cut connection).
func readSSE(r io.Reader) ([]string, error) {
	var events []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events = append(events, d)
		}
	}
	return events, sc.Err()
}
