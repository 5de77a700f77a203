package agent

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/host/hosttest"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// runHost serves a Host on addr ("127.0.0.1:0" for any port) until stop.
func runHost(t *testing.T, addr string, token string) (h *host.Host, bound string, stop func()) {
	t.Helper()
	var ln net.Listener
	var err error
	for i := 0; i < 50; i++ { // a restarted Host may need its port back
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	cfg := host.DefaultConfig()
	cfg.HeartbeatInterval, cfg.ShutdownTimeout, cfg.AgentToken = 100*time.Millisecond, time.Second, token
	h, stop = hosttest.Serve(t, cfg, ln)
	return h, ln.Addr().String(), stop
}

func runSim(t *testing.T) string {
	t.Helper()
	c := sim.DefaultConfig()
	c.Model, c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "m", "tiny", 1, 128, 128
	c.Step = sim.StepModel{Fixed: time.Millisecond}
	c.ShmDir, c.ShmPrefix = t.TempDir(), "agent-test"
	r, err := sim.Start(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	return r.URL
}

func runAgent(t *testing.T, cfg Config) (*Agent, func() error) {
	t.Helper()
	a, err := New(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	return a, func() error { cancel(); return <-done }
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func baseConfig(hostAddr, engineURL, typ string) Config {
	return Config{Type: typ, HostAddr: hostAddr, EngineURL: engineURL, Listen: "127.0.0.1:0", TP: 1, PP: 1, EngineWait: 5 * time.Second, DataPort: 0}
}

// Register, survive a Host restart by registering again, deregister on
// shutdown.
func TestAgentLifecycle(t *testing.T) {
	h, addr, stopHost := runHost(t, "127.0.0.1:0", "")
	eng := runSim(t)
	a, stopAgent := runAgent(t, baseConfig(addr, eng, "A"))
	waitFor(t, "registration", func() bool { _, err := h.Registry().Get(a.ID()); return err == nil })
	inst, _ := h.Registry().Get(a.ID())
	if !inst.Engine.Migratable || inst.Engine.Kind != "vhi-sim" || inst.Role != registry.RoleActive || inst.Engine.ServedModels[0] != "m" {
		t.Fatalf("registered as %+v", inst)
	}
	if inst.DataAddress == "" || inst.AgentAddress == "" {
		t.Fatalf("addresses: %+v", inst.Registration)
	}
	waitFor(t, "heartbeat stats", func() bool { i, _ := h.Registry().Get(a.ID()); return i.Stats.TotalBlocks == 127 })

	stopHost()
	h2, _, stopHost2 := runHost(t, addr, "")
	defer stopHost2()
	waitFor(t, "re-registration with the restarted Host", func() bool { _, err := h2.Registry().Get(a.ID()); return err == nil })

	if err := stopAgent(); err != nil {
		t.Fatal(err)
	}
	if _, err := h2.Registry().Get(a.ID()); err == nil {
		t.Fatal("still registered after the agent stopped")
	}
}

// An OpenAI server without the hooks registers as routing-only.
func TestRoutingOnlyEngine(t *testing.T) {
	h, addr, stop := runHost(t, "127.0.0.1:0", "")
	defer stop()
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
		case "/v1/models":
			_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"plain","object":"model","root":"/models/plain","max_model_len":4096}]}`))
		default:
			http.NotFound(w, r)
		}
	}))
	defer plain.Close()
	cfg := baseConfig(addr, plain.URL, "A")
	cfg.TP = 2
	a, stopAgent := runAgent(t, cfg)
	defer stopAgent()
	waitFor(t, "registration", func() bool { _, err := h.Registry().Get(a.ID()); return err == nil })
	inst, _ := h.Registry().Get(a.ID())
	if inst.Engine.Migratable || inst.Engine.TP != 2 || inst.Engine.Model != "/models/plain" || inst.Engine.MaxModelLen != 4096 {
		t.Fatalf("routing-only registration: %+v", inst.Engine)
	}
}

// A refused registration (bad token, id held by a live agent) stops the
// agent with a clear error instead of retrying forever.
func TestFatalRegistration(t *testing.T) {
	_, addr, stop := runHost(t, "127.0.0.1:0", "tok")
	defer stop()
	eng := runSim(t)
	// Run it directly: runAgent's stop function cancels the agent, which
	// would end it cleanly before the refusal arrives.
	refused, err := New(baseConfig(addr, eng, "B"), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithCancel(context.Background())
	defer rcancel()
	errc := make(chan error, 1)
	go func() { errc <- refused.Run(rctx) }()
	select {
	case err := <-errc:
		if err == nil {
			t.Fatal("agent without the token ran")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("agent kept retrying a refused registration")
	}
	cfg := baseConfig(addr, eng, "B")
	cfg.AgentToken = "tok"
	_, stop1 := runAgent(t, cfg)
	defer stop1()
	time.Sleep(300 * time.Millisecond)
	a2, err := New(cfg, zap.NewNop()) // same id, another session
	if err != nil {
		t.Fatal(err)
	}
	// It retries for a while (the id could be held by its own killed
	// predecessor), then gives up.
	ctx, cancel := context.WithTimeout(context.Background(), 3*takeoverWait)
	defer cancel()
	if err := a2.Run(ctx); err == nil || ctx.Err() != nil {
		t.Fatalf("a second agent for the same engine: %v", err)
	}
}

func TestConfigErrors(t *testing.T) {
	for name, cfg := range map[string]Config{
		"bad type":    {Type: "C", HostAddr: "h:1", EngineURL: "http://e", TP: 1, PP: 1},
		"bad host":    {Type: "A", HostAddr: "nohost", EngineURL: "http://e", TP: 1, PP: 1},
		"bad engine":  {Type: "A", HostAddr: "h:1", EngineURL: "ftp://e", TP: 1, PP: 1},
		"bad backend": {Type: "A", HostAddr: "h:1", EngineURL: "http://e", TP: 1, PP: 1, TransferBackend: "pigeon"},
		"bad port":    {Type: "A", HostAddr: "h:1", EngineURL: "http://e", TP: 1, PP: 1, DataPort: 70000},
	} {
		if _, err := New(cfg, zap.NewNop()); err == nil {
			t.Errorf("%s accepted", name)
		}
	}
}

// The agent's health, on /healthz and the gRPC health service: not ready
// (saying what it waits for) until it registered with a Host and its
// engine answered healthy; ready then; not ready again when the Host is
// gone and the agent registers anew.
func TestAgentHealth(t *testing.T) {
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	healthAddr := l.Addr().String()
	l.Close()
	hl, _ := net.Listen("tcp", "127.0.0.1:0")
	hostAddr := hl.Addr().String()
	hl.Close() // no Host yet: the agent waits to register
	eng := runSim(t)
	cfg := baseConfig(hostAddr, eng, "A")
	cfg.HealthListen, cfg.AgentToken = healthAddr, "health-t0ken"
	a, stopAgent := runAgent(t, cfg)
	defer func() { _ = stopAgent() }()
	get := func() (int, map[string]any) {
		resp, err := http.Get("http://" + healthAddr + "/healthz")
		if err != nil {
			return 0, nil
		}
		defer resp.Body.Close()
		var body map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return resp.StatusCode, body
	}
	waitFor(t, "the health endpoint", func() bool { code, _ := get(); return code != 0 })
	waitFor(t, "registering", func() bool { _, b := get(); return b["phase"] == phaseRegistering })
	if code, b := get(); code != 503 || b["status"] != "not ready" {
		t.Fatalf("before registering: %d %v", code, b)
	}
	h, _, stopHost := runHost(t, hostAddr, "health-t0ken")
	waitFor(t, "registration", func() bool { _, err := h.Registry().Get(a.ID()); return err == nil })
	waitFor(t, "healthy", func() bool { code, _ := get(); return code == 200 })
	// The gRPC health service answers without the agent token (as a
	// Kubernetes probe asks); everything else there needs it.
	inst, _ := h.Registry().Get(a.ID())
	conn, err := grpc.NewClient(inst.AgentAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil || hc.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("gRPC health: %v %v", hc, err)
	}
	if _, err := v1.NewAgentClient(conn).Hook(context.Background(), &v1.HookRequest{Name: "stats"}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("an agent call without the token: %v", err)
	}
	stopHost()
	// Restarted on the same address, the Host does not know the agent
	// until it registers again: the first heartbeat says so.
	h2, _, stopHost2 := runHost(t, hostAddr, "health-t0ken")
	defer stopHost2()
	waitFor(t, "re-registration", func() bool { _, err := h2.Registry().Get(a.ID()); return err == nil })
	waitFor(t, "healthy again", func() bool { code, _ := get(); return code == 200 })
}
