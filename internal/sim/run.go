package sim

import (
	"context"
	"net"
	"net/http"
	"time"

	"go.uber.org/zap"
)

// Running is an engine serving its HTTP API on a loopback port, in this
// process: what the demo, the benchmarks and tests start.
type Running struct {
	URL    string
	Engine *Engine
	stop   func()
}

// Start runs an engine for cfg on 127.0.0.1 (any free port). wrap, when
// given, wraps the engine's HTTP handler (tests that make an engine
// misbehave).
func Start(cfg Config, log *zap.Logger, wrap ...func(http.Handler) http.Handler) (*Running, error) {
	if log == nil {
		log = zap.NewNop()
	}
	e, err := NewEngine(cfg, log)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		e.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); e.Run(ctx) }()
	h := NewServer(e, log).Handler()
	for _, w := range wrap {
		h = w(h)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return &Running{URL: "http://" + ln.Addr().String(), Engine: e, stop: func() {
		_ = srv.Close()
		cancel()
		<-done
		e.Close()
	}}, nil
}

// Stop closes the server, stops the engine and removes its KV files.
func (r *Running) Stop() { r.stop() }
