// Package hosttest runs a Host in a test's process.
package hosttest

import (
	"context"
	"net"
	"os"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/vllm-hi/vllm-hi/internal/host"
)

// Serve makes a Host of cfg and serves it on ln until stop, which waits
// for the Host's shutdown. The Host logs at debug level into a buffer of
// its last lines, which the test prints if it fails: a failure under
// load that does not come again is understood from its log or not at all.
func Serve(t testing.TB, cfg host.Config, ln net.Listener) (h *host.Host, stop func()) {
	t.Helper()
	// VLLM_HI_RELAY_EVENT_LOOP=true runs a test's Hosts with the relay's
	// event loop (as vhi host reads it).
	cfg.RelayEventLoop = cfg.RelayEventLoop || os.Getenv("VLLM_HI_RELAY_EVENT_LOOP") == "true"
	h, err := host.New(cfg, TailLogger(t, "the Host"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.Serve(ctx, ln) }()
	return h, func() { cancel(); <-done }
}

// TailLogger is a debug-level logger whose last lines the test prints,
// naming them whose, if it fails (or always, with VHI_TEST_LOGS=1 in the
// environment).
func TailLogger(t testing.TB, whose string) *zap.Logger {
	tail := &lastLines{max: 600}
	always := os.Getenv("VHI_TEST_LOGS") == "1"
	t.Cleanup(func() {
		if t.Failed() || always {
			t.Logf("%s: its last %d log lines:\n%s", whose, tail.max, tail.String())
		}
	})
	return zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()), tail, zapcore.DebugLevel))
}

// lastLines keeps the last max lines written to it.
type lastLines struct {
	mu    sync.Mutex
	max   int
	lines []string
}

func (l *lastLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, strings.TrimRight(string(p), "\n"))
	if over := len(l.lines) - l.max; over > l.max {
		l.lines = append(l.lines[:0], l.lines[over:]...)
	}
	return len(p), nil
}

func (l *lastLines) Sync() error { return nil }

func (l *lastLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	lines := l.lines
	if len(lines) > l.max {
		lines = lines[len(lines)-l.max:]
	}
	return strings.Join(lines, "\n")
}
