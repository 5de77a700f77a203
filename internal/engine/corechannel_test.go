package engine

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// startCoreServer runs the plugin's own core channel server (Python,
// deploy/vllm-plugin/vllm_hi_plugin/core_channel.py) on a loop that steps every
// 5 ms, and returns its socket.
func startCoreServer(t *testing.T, token string, flags ...string) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 is not installed")
	}
	sock := filepath.Join(t.TempDir(), "core.sock")
	plugin, _ := filepath.Abs("../../deploy/vllm-plugin")
	cmd := exec.Command(py, append([]string{"testdata/core_channel_server.py", plugin, sock, token}, flags...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &strings.Builder{}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	ready := make(chan bool, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		ready <- strings.TrimSpace(line) == "ready"
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("the core channel server did not start: %s", cmd.Stderr)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the core channel server did not start in 20 s: %s", cmd.Stderr)
	}
	return sock
}

func TestCoreChannelTalksToThePluginsServer(t *testing.T) {
	sock := startCoreServer(t, "tok")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	if _, err := DialCore(ctx, sock, "wrong"); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("a wrong token: %v, want unauthenticated", err)
	}
	ch, err := DialCore(ctx, sock, "tok")
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()

	var p struct {
		Paused []string `json:"paused"`
		Thread string   `json:"thread"`
	}
	tm, err := ch.Call(ctx, "pause", map[string]any{"request_ids": []string{"a", "b"}}, &p)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(p.Paused, ",") != "a,b" || p.Thread != "MainThread" {
		t.Fatalf("pause answered %+v: want a,b, run on the loop's thread", p)
	}
	// A command waits for the next boundary: at most one 5 ms step.
	if tm.Wait > 50*time.Millisecond || tm.Total < tm.Wait {
		t.Fatalf("timing %+v", tm)
	}
	var st struct{ Steps, Paused int }
	deadline := time.Now().Add(5 * time.Second)
	for st.Paused != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the snapshot never showed the pause: %+v", st)
		}
		if _, err := ch.Call(ctx, "stats", nil, &st); err != nil {
			t.Fatal(err)
		}
	}
	if st.Steps == 0 {
		t.Fatalf("stats %+v", st)
	}
	_, err = ch.Call(ctx, "pause", map[string]any{"request_ids": []string{"missing"}}, nil)
	var ce *CoreError
	if !errors.As(err, &ce) || ce.Status != 404 || ce.Param != "request_ids" || !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an unknown request: %v", err)
	}
	if _, err := ch.Call(ctx, "teleport", nil, nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an unknown op: %v", err)
	}
	// Calls side by side each get their answer.
	errs := make(chan error, 16)
	for i := 0; i < 16; i++ {
		go func() {
			var p struct{ Paused []string }
			_, err := ch.Call(ctx, "pause", map[string]any{"request_ids": []string{"x"}}, &p)
			if err == nil && (len(p.Paused) != 1 || p.Paused[0] != "x") {
				err = errors.New("a mixed-up answer")
			}
			errs <- err
		}()
	}
	for i := 0; i < 16; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestHookGoesThroughTheCoreChannel: the agent relays the pause path's
// hooks over the core channel, and the rest (a snapshot export, which
// needs the API server's stream metadata) over HTTP; an install's answer
// is the API server's (TestAnInstallGoesToBothHalvesAtOnce).
// A migration's pause sends about a dozen calls to one engine at once: the
// channel has that many connections open before, so that none is dialled
// inside the pause.
func TestTheChannelOpensItsConnectionsUpFront(t *testing.T) {
	sock := startCoreServer(t, "tok")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ch, err := DialCore(ctx, sock, "tok")
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ch.mu.Lock()
		idle := len(ch.idle)
		ch.mu.Unlock()
		if idle == warmCoreConns {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections open after 10 s, want %d", idle, warmCoreConns)
		}
	}
	before := ch.dials.Load()
	var wg sync.WaitGroup
	for range warmCoreConns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := ch.Call(ctx, "pause", map[string]any{"request_ids": []string{"a"}}, nil); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := ch.dials.Load() - before; n != 0 {
		t.Fatalf("%d calls at once dialled %d connections", warmCoreConns, n)
	}
}

func TestHookGoesThroughTheCoreChannel(t *testing.T) {
	sock := startCoreServer(t, "tok")
	var httpPaths []string
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		httpPaths = append(httpPaths, r.URL.Path)
		mu.Unlock()
		_, _ = w.Write([]byte(`{"via":"http"}`))
	}))
	defer srv.Close()
	c, ctx := channelClient(t, srv.URL, sock)
	route := func(name string) hooks.Route {
		r, ok := hooks.RouteOf(name)
		if !ok {
			t.Fatalf("no route %s", name)
		}
		return r
	}

	out, err := c.Hook(ctx, route(hooks.HookPause), 0, []byte(`{"request_ids":["a"]}`))
	if err != nil {
		t.Fatal(err)
	}
	var p hooks.PauseResponse
	if err := json.Unmarshal(out, &p); err != nil || len(p.Paused) != 1 || p.Paused[0] != "a" {
		t.Fatalf("pause over the channel answered %s (%v)", out, err)
	}
	if !strings.Contains(string(out), `"step_wait_s"`) {
		t.Fatalf("the pause's answer has no step wait: %s", out)
	}
	for _, body := range []string{`{"request_ids":["a"]}`, `{"request_ids":["a"],"snapshot":true,"tokens_only":true}`} {
		out, err = c.Hook(ctx, route(hooks.HookExport), 0, []byte(body))
		if err != nil || !strings.Contains(string(out), "core channel") {
			t.Fatalf("export %s went %s (%v), want the core channel", body, out, err)
		}
	}
	for _, call := range []struct {
		name string
		body string
	}{{hooks.HookExport, `{"request_ids":["a"],"snapshot":true}`}, {hooks.HookInstall, `{"requests":[]}`}} {
		out, err := c.Hook(ctx, route(call.name), 0, []byte(call.body))
		if err != nil || string(out) != `{"via":"http"}` {
			t.Fatalf("%s %s went %s (%v), want HTTP", call.name, call.body, out, err)
		}
	}
	mu.Lock()
	seen := strings.Join(httpPaths, " ")
	mu.Unlock()
	if seen != hooks.PathExport+" "+hooks.PathInstall {
		t.Fatalf("HTTP saw %v", seen)
	}

	// Without a channel every hook goes over HTTP.
	plain, err := NewClient(srv.URL, Options{Token: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := plain.Hook(ctx, route(hooks.HookPause), 0, nil); err != nil || string(out) != `{"via":"http"}` {
		t.Fatalf("pause without a channel went %s (%v)", out, err)
	}
}

// TestAnInstallGoesToBothHalvesAtOnce: with a channel that takes
// "install", the engine core installs over it while the API server only
// registers the streams (skip_engine_core); a failure of either half
// fails the install; an install that also commits goes over HTTP alone.
func TestAnInstallGoesToBothHalvesAtOnce(t *testing.T) {
	sock := startCoreServer(t, "tok")
	var bodies []string
	var mu sync.Mutex
	fail := false
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		f := fail
		mu.Unlock()
		if f {
			w.WriteHeader(http.StatusConflict)
			_, _ = w.Write([]byte(`{"error":{"message":"the stream is gone","type":"conflict","param":"requests","code":409}}`))
			return
		}
		_, _ = w.Write([]byte(`{"installed":["a"],"visible_text":{"a":3},"engine_core":"skipped"}`))
	}))
	defer srv.Close()
	c, ctx := channelClient(t, srv.URL, sock)
	route, _ := hooks.RouteOf(hooks.HookInstall)
	coreInstalled := func() []string {
		ch, err := c.coreChannel(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out struct{ Installed []string }
		if _, err := ch.Call(ctx, "installed", nil, &out); err != nil {
			t.Fatal(err)
		}
		return out.Installed
	}

	out, err := c.Hook(ctx, route, 0, []byte(` {"resume":false,"lease_ms":500,"requests":[{"request_id":"a"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != `{"installed":["a"],"visible_text":{"a":3},"engine_core":"skipped"}` {
		t.Fatalf("the install answered %s, want the API server's answer", out)
	}
	if got := coreInstalled(); strings.Join(got, ",") != "a" {
		t.Fatalf("the engine core installed %v, want a", got)
	}
	var sent map[string]any
	if err := json.Unmarshal([]byte(bodies[0]), &sent); err != nil || sent["skip_engine_core"] != true || sent["lease_ms"] != 500.0 {
		t.Fatalf("the API server was sent %s (%v)", bodies[0], err)
	}

	// The engine core refuses: the install fails, whatever the API server said.
	if _, err := c.Hook(ctx, route, 0, []byte(`{"requests":[{"request_id":"taken"}]}`)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("an install the engine core refused: %v, want a conflict", err)
	}
	// The API server refuses: the install fails.
	mu.Lock()
	fail = true
	mu.Unlock()
	if _, err := c.Install(ctx, hooks.InstallRequest{}); err == nil || !strings.Contains(err.Error(), "the stream is gone") {
		t.Fatalf("an install the API server refused: %v", err)
	}
	mu.Lock()
	fail = false
	mu.Unlock()
	// Install and commit at once: HTTP alone, as sent.
	before := len(coreInstalled())
	if _, err := c.Hook(ctx, route, 0, []byte(`{"resume":true,"requests":[{"request_id":"b"}]}`)); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	last := bodies[len(bodies)-1]
	mu.Unlock()
	if last != `{"resume":true,"requests":[{"request_id":"b"}]}` || len(coreInstalled()) != before {
		t.Fatalf("an install that commits was sent %s, and the core has %v", last, coreInstalled())
	}
	if _, err := c.Hook(ctx, route, 0, []byte(`[]`)); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a body that is not an object: %v", err)
	}
}

// channelClient is a client of the engine at url whose core channel is
// sock, and a context for the test's calls.
func channelClient(t *testing.T, url, sock string) (*Client, context.Context) {
	t.Helper()
	c, err := NewClient(url, Options{Token: "tok", CoreSocket: sock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c, ctx
}

// The data plane's layout comes over the channel where it lists "layout"
// (not behind the API server's loop), the registration's from the API
// server (its served names); a channel without the op leaves both to HTTP.
func TestTheDataPlanesLayoutComesOverTheChannel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != hooks.PathLayout {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte(`{"engine":"vllm","model":"m","served_model_names":["served"],"kv_generation":3}`))
	}))
	defer srv.Close()
	for _, c := range []struct {
		flags []string
		want  string
	}{{nil, "from-the-engine-core"}, {[]string{"--no-layout"}, "m"}} {
		cl, ctx := channelClient(t, srv.URL, startCoreServer(t, "tok", c.flags...))
		kv, err := cl.KVLayout(ctx)
		if err != nil || kv.Model != c.want || kv.KVGeneration != 3 {
			t.Fatalf("%v: the data plane's layout %+v (%v), want the model %q", c.flags, kv, err, c.want)
		}
		reg, err := cl.Layout(ctx)
		if err != nil || !slices.Equal(reg.ServedModels, []string{"served"}) {
			t.Fatalf("%v: the registration's layout %+v (%v), want the API server's", c.flags, reg, err)
		}
	}
}

// A copy round's inputs come in one op of one boundary where the channel
// takes "round": the changes only when asked for; a channel without it
// says so (ok false), and the agent reads them one by one.
func TestARoundsInputsComeInOneOp(t *testing.T) {
	cl, ctx := channelClient(t, "http://127.0.0.1:1", startCoreServer(t, "tok"))
	in, ok, err := cl.RoundInputs(ctx, 4, true)
	if err != nil || !ok || in.Layout.Model != "from-the-engine-core" || in.Requests.Cursor != 9 || len(in.Requests.Requests) != 1 ||
		in.Changes == nil || in.Changes.Since != 4 || len(in.Changes.Written) != 1 || in.Changes.Written[0].Block != 5 {
		t.Fatalf("the round's inputs %+v (ok %v, %v)", in, ok, err)
	}
	if in, ok, err := cl.RoundInputs(ctx, 0, false); err != nil || !ok || in.Changes != nil || in.Requests.Cursor != 9 {
		t.Fatalf("a full round's inputs %+v (ok %v, %v): want no changes", in, ok, err)
	}
	old, ctx := channelClient(t, "http://127.0.0.1:1", startCoreServer(t, "tok", "--no-round"))
	if _, ok, err := old.RoundInputs(ctx, 4, true); ok || err != nil {
		t.Fatalf("a channel without the op: ok %v, %v", ok, err)
	}
}

// A pause with RoundSince brings the final round's inputs along: the
// agent keeps them (the Host's answer carries none of it) and the round
// since that cursor takes them, once, with no op of its own; a resume, or
// a round since another cursor, reads afresh.
func TestTheFinalRoundsInputsComeWithThePause(t *testing.T) {
	cl, ctx := channelClient(t, "http://127.0.0.1:1", startCoreServer(t, "tok"))
	route, _ := hooks.RouteOf(hooks.HookPause)
	out, err := cl.Hook(ctx, route, 0, []byte(`{"request_ids":["a"],"round_since":4,"export":{}}`))
	if err != nil || strings.Contains(string(out), `"round"`) || strings.Contains(string(out), "from-the-engine-core") {
		t.Fatalf("the pause's answer to the Host %s (%v): want no round inputs in it", out, err)
	}
	// The export the pause was asked for goes on to the Host.
	var p hooks.PauseResponse
	if err := json.Unmarshal(out, &p); err != nil || !strings.Contains(string(p.Exported), `"via":"core channel"`) || p.StepWaitS == 0 && !strings.Contains(string(out), "step_wait_s") {
		t.Fatalf("the pause's answer to the Host %s (%v): want the paused requests' export", out, err)
	}
	in, ok, err := cl.RoundInputs(ctx, 4, true)
	if err != nil || !ok || !in.FromPause || in.Requests.Cursor != 11 || in.Changes == nil || in.Changes.Since != 4 || in.Layout.Model != "from-the-engine-core" {
		t.Fatalf("the final round's inputs %+v (ok %v, %v): want those the pause read", in, ok, err)
	}
	if in, _, err := cl.RoundInputs(ctx, 4, true); err != nil || in.FromPause || in.Requests.Cursor != 9 {
		t.Fatalf("a second round %+v (%v): want its own read", in, err)
	}
	if _, err := cl.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"a"}, RoundSince: ptr(uint64(4))}); err != nil {
		t.Fatal(err)
	}
	if in, _, err := cl.RoundInputs(ctx, 5, true); err != nil || in.FromPause {
		t.Fatalf("a round since another cursor %+v (%v): want its own read", in, err)
	}
	if _, err := cl.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"a"}, RoundSince: ptr(uint64(4))}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Resume(ctx, hooks.ResumeRequest{RequestIDs: []string{"a"}}); err != nil {
		t.Fatal(err)
	}
	if in, _, err := cl.RoundInputs(ctx, 4, true); err != nil || in.FromPause {
		t.Fatalf("a round after a resume %+v (%v): want its own read", in, err)
	}
}

func ptr[T any](v T) *T { return &v }
