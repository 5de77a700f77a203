package engine

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
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
func startCoreServer(t *testing.T, token string) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 is not installed")
	}
	sock := filepath.Join(t.TempDir(), "core.sock")
	plugin, _ := filepath.Abs("../../deploy/vllm-plugin")
	cmd := exec.Command(py, "testdata/core_channel_server.py", plugin, sock, token)
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
// needs the API server's stream metadata; the install) over HTTP.
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
	c, err := NewClient(srv.URL, Options{Token: "tok", CoreSocket: sock})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
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
