package host

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// sleepySim runs a sim with sleep mode serving name, awake or asleep.
func sleepySim(t *testing.T, name string, wake time.Duration, asleep bool) *sim.Running {
	t.Helper()
	c := sim.DefaultConfig()
	c.Model, c.ServedModelNames = name, []string{name}
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 256, 256
	c.Step = sim.StepModel{Fixed: 4 * time.Millisecond}
	c.ShmDir, c.ShmPrefix = t.TempDir(), name
	c.SleepMode, c.SleepTime, c.WakeUpTime, c.WeightsLoadTime = true, 30*time.Millisecond, wake, 50*time.Millisecond
	r, err := sim.Start(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	if asleep {
		if err := r.Engine.Sleep(context.Background(), 1, sim.PauseAbort); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

type switchRig struct {
	t      *testing.T
	h      *testHost
	c      *hostapi.Client
	sims   map[string]*sim.Running
	models map[string]switching.Model
}

func newSwitchRig(t *testing.T, ctl switching.Controller, level2 string, wake map[string]time.Duration, awake ...string) *switchRig {
	r := &switchRig{t: t, sims: map[string]*sim.Running{}, models: map[string]switching.Model{}}
	for _, name := range []string{"chat", "coder", "slow"} {
		d := 100 * time.Millisecond
		if w, ok := wake[name]; ok {
			d = w
		}
		isAwake := false
		for _, a := range awake {
			isAwake = isAwake || a == name
		}
		r.sims[name] = sleepySim(t, "served-"+name, d, !isAwake)
		m := switching.Model{ServedModelName: "served-" + name, BackendURL: r.sims[name].URL, Group: "gpu0"}
		if name == level2 {
			m.SleepLevel = 2
		}
		r.models[name] = m
	}
	r.h = startHost(t, func(c *Config) { c.Models, c.Controller, c.AdminToken = r.models, ctl, "admin" })
	var err error
	if r.c, err = hostapi.New(r.h.url, hostapi.Options{AdminToken: "admin"}); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *switchRig) load(model string, n, tokens int) <-chan []loadgen.Stream {
	done := make(chan []loadgen.Stream, 1)
	reqs := make([]loadgen.Request, n)
	for i := range reqs {
		seed := int64(i)
		reqs[i] = loadgen.Request{Prompt: fmt.Sprintf("%s request %d", model, i), MaxTokens: tokens, IgnoreEOS: true, Seed: &seed}
	}
	go func() {
		done <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: r.h.url, Model: model}, reqs)
	}()
	return done
}

func (r *switchRig) complete(streams []loadgen.Stream, tokens int) {
	r.t.Helper()
	for i, s := range streams {
		if s.Err != nil || s.Done != 1 || s.Usage == nil || s.Usage.CompletionTokens != tokens {
			r.t.Fatalf("stream %d: %v, %d [DONE], usage %+v", i, s.Err, s.Done, s.Usage)
		}
	}
}

func (r *switchRig) state(model string) hostapi.SwitchedModel {
	r.t.Helper()
	st, err := r.c.AdminState(context.Background())
	if err != nil {
		r.t.Fatal(err)
	}
	return st.Models[model]
}

func (r *switchRig) waitState(model, want string) {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for r.state(model).State != want {
		if time.Now().After(deadline) {
			r.t.Fatalf("%s is %+v, want %s", model, r.state(model), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A-B-B-A with overlap, through the Host: streams for chat run while
// requests for coder arrive (queued, not failed: every one completes),
// the switch waits for chat's streams, then coder serves, then chat again.
// The level-2 model is woken weights first, reloaded, then its KV, and its
// probe matches.
func TestSwitchingABBAWithOverlap(t *testing.T) {
	r := newSwitchRig(t, switching.Controller{StartupAwakeModel: "chat"}, "coder", nil, "chat")
	r.waitState("chat", "awake")
	// coder's state is reconciled beside chat's: "unknown" until then.
	r.waitState("coder", "sleeping")
	if st := r.state("coder"); st.State != "sleeping" || st.ServedModelName != "served-coder" {
		t.Fatalf("coder at start: %+v", st)
	}
	long := r.load("chat", 4, 120)
	time.Sleep(100 * time.Millisecond)
	coder := r.load("coder", 6, 10)
	time.Sleep(50 * time.Millisecond)
	if st := r.state("coder"); st.Queued == 0 && st.State == "sleeping" {
		t.Fatalf("coder's requests are neither queued nor served: %+v", st)
	}
	r.complete(<-long, 120)
	r.complete(<-coder, 10)
	st := r.state("coder")
	if st.State != "awake" || st.LastSwitch == nil || st.LastSwitch.From != "chat" || !strings.Contains(st.LastSwitch.Drain, "waited for") {
		t.Fatalf("coder after its switch: %+v %+v", st, st.LastSwitch)
	}
	var steps []string
	for _, s := range st.LastSwitch.Steps {
		steps = append(steps, s.Step+":"+s.Model)
	}
	if got := strings.Join(steps, " "); got != "reconcile:coder drain:chat sleep:chat verify_sleeping:chat wake:coder verify_awake:coder probe:coder" {
		t.Fatalf("steps %s", got)
	}
	r.complete(<-r.load("coder", 2, 10), 10)
	r.complete(<-r.load("chat", 3, 10), 10)
	if got := r.state("chat"); got.State != "awake" || got.Active != 0 || got.Queued != 0 {
		t.Fatalf("chat at the end: %+v", got)
	}
	if r.sims["coder"].Engine.IsSleeping() != true || r.sims["chat"].Engine.IsSleeping() {
		t.Fatal("the engines disagree with the Host's state")
	}
	// The aliases are the models clients see.
	_, body, _ := httpDo(t, "GET", r.h.url+"/v1/models", "", nil)
	for _, alias := range []string{`"chat"`, `"coder"`, `"slow"`} {
		if !strings.Contains(body, alias) {
			t.Fatalf("/v1/models lacks %s: %s", alias, body)
		}
	}
}

// A switch that outlasts its deadline fails its queued requests with a
// clear 503 and leaves the model in error; the next switch reconciles
// and the group goes on serving.
func TestSwitchDeadlineAndADeadBackend(t *testing.T) {
	r := newSwitchRig(t, switching.Controller{SwitchTimeoutS: 0.5}, "", map[string]time.Duration{"slow": 3 * time.Second}, "chat")
	r.waitState("chat", "awake")
	code, body, hdr := httpDo(t, "POST", r.h.url+"/v1/completions", `{"model":"slow","prompt":"x","max_tokens":2}`, nil)
	if code != 503 || !strings.Contains(body, "switch deadline") || hdr.Get("Retry-After") == "" {
		t.Fatalf("a request for a model that wakes too slowly: %d %s", code, body)
	}
	if st := r.state("slow"); st.State != "error" || st.LastError == "" {
		t.Fatalf("slow: %+v", st)
	}
	r.complete(<-r.load("coder", 2, 5), 5)
	// The backend of chat dies mid-switch (while coder → chat wakes it):
	// its requests fail closed, the others go on.
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		time.Sleep(30 * time.Millisecond)
		r.sims["chat"].Stop()
	}()
	code, body, _ = httpDo(t, "POST", r.h.url+"/v1/completions", `{"model":"chat","prompt":"x","max_tokens":2}`, nil)
	wg.Wait()
	if code != 503 || !strings.Contains(body, "switching to chat failed") {
		t.Fatalf("a request for a model whose engine died mid-switch: %d %s", code, body)
	}
	r.waitState("chat", "error")
	r.complete(<-r.load("coder", 2, 5), 5)
}

// The admin routes: switch, prewarm (TTL bounded), state; the admin token
// guards them; unknown models are 404s.
func TestSwitchingAdminAPI(t *testing.T) {
	r := newSwitchRig(t, switching.Controller{}, "", nil, "chat")
	r.waitState("chat", "awake")
	ctx := context.Background()
	res, err := r.c.Switch(ctx, "coder")
	if err != nil || res.State != "awake" || res.Switch == nil || res.Switch.From != "chat" {
		t.Fatalf("switch: %+v %v", res, err)
	}
	if _, err := r.c.Switch(ctx, "nope"); !hostapi.IsStatus(err, 404) {
		t.Fatalf("an unknown model: %v", err)
	}
	if _, err := r.c.Prewarm(ctx, "chat", 100*time.Hour); !hostapi.IsStatus(err, 400) {
		t.Fatalf("a prewarm beyond its bound: %v", err)
	}
	pw, err := r.c.Prewarm(ctx, "chat", time.Minute)
	if err != nil || pw.State != "awake" || time.Until(pw.PinnedUntil) < 50*time.Second {
		t.Fatalf("prewarm: %+v %v", pw, err)
	}
	// While chat is pinned a request for coder waits for the pin (here:
	// its request timeout first).
	if st := r.state("chat"); st.PinnedUntil == nil {
		t.Fatalf("chat not pinned: %+v", st)
	}
	code, _, _ := httpDo(t, "GET", r.h.url+"/admin/state", "", nil)
	if code != 401 {
		t.Fatalf("the state without the admin token: %d", code)
	}
	// The public status (the status page's) says each switched model's
	// state, not its backend.
	code, body, _ := httpDo(t, "GET", r.h.url+"/vllm_hi/status", "", nil)
	var st hostapi.Status
	if err := json.Unmarshal([]byte(body), &st); code != 200 || err != nil || st.SwitchedModels["chat"].State != "awake" ||
		st.SwitchedModels["coder"].State != "sleeping" || strings.Contains(body, "backend_url") {
		t.Fatalf("the status's switched models: %d %s", code, body)
	}
	code, _, _ = httpDo(t, "POST", r.h.url+"/admin/switch/chat", "{}", nil)
	if code != 401 {
		t.Fatalf("a switch without the admin token: %d", code)
	}
}
