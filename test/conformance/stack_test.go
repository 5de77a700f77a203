package conformance

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/agent"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/host/hosttest"
)

func startHost(t *testing.T) (url, addr string) {
	url, addr, _ = startHostWith(t, host.DefaultConfig())
	return url, addr
}

func startHostWith(t *testing.T, cfg host.Config) (url, addr string, h *host.Host) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.HeartbeatInterval, cfg.ShutdownTimeout = 200*time.Millisecond, 2*time.Second
	cfg.AdminToken, cfg.AgentToken = adminToken, agentToken
	h, stop := hosttest.Serve(t, cfg, ln)
	t.Cleanup(stop)
	return "http://" + ln.Addr().String(), ln.Addr().String(), h
}

func startAgent(t *testing.T, hostAddr, engineURL, typ string) {
	t.Helper()
	// The vLLM engines serve their core channel: the agent takes the
	// engine core's hooks (pause, resume, list, changes, allocate, stats)
	// through it, as a deployment with --vllm-hi-core-socket does.
	startAgentWith(t, hostAddr, engineURL, typ, map[string]string{vllmURL: coreSockets["A"], vllmBURL: coreSockets["B"]}[engineURL])
}

// startAgentWith starts an agent for the engine whose core channel is on
// the socket core.
func startAgentWith(t *testing.T, hostAddr, engineURL, typ, core string) {
	t.Helper()
	a, err := agent.New(agent.Config{Type: typ, HostAddr: hostAddr, EngineURL: engineURL, Listen: "127.0.0.1:0",
		AdvertiseHost: "127.0.0.1", TP: 1, PP: 1, EngineWait: time.Minute, AgentToken: agentToken, EngineCoreSocket: core}, hosttest.TailLogger(t, "the agent of "+engineURL))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = a.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}
