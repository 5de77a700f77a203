// Package hosttest runs a Host in a test's process.
package hosttest

import (
	"context"
	"net"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/host"
)

// Serve makes a Host of cfg and serves it on ln until stop, which waits
// for the Host's shutdown.
func Serve(t testing.TB, cfg host.Config, ln net.Listener) (h *host.Host, stop func()) {
	t.Helper()
	h, err := host.New(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.Serve(ctx, ln) }()
	return h, func() { cancel(); <-done }
}
