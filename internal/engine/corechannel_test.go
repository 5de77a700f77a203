package engine

import (
	"bufio"
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// startCoreServer runs the plugin's own core channel server (Python,
// deploy/vllm-plugin/vllm_hi/core_channel.py) on a loop that steps every
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
