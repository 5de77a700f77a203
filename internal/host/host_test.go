package host

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

var update = flag.Bool("update", false, "rewrite golden files")

type testHost struct {
	*Host
	url, addr string
	stop      func()
}

func startHost(t *testing.T, mod func(*Config)) *testHost {
	t.Helper()
	cfg := DefaultConfig()
	cfg.HeartbeatInterval = 100 * time.Millisecond
	cfg.ShutdownTimeout = 2 * time.Second
	if mod != nil {
		mod(&cfg)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h, err := New(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Serve(ctx, ln) }()
	th := &testHost{Host: h, url: "http://" + ln.Addr().String(), addr: ln.Addr().String()}
	th.stop = func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("host Serve: %v", err)
		}
	}
	t.Cleanup(func() {
		if ctx.Err() == nil {
			th.stop()
		}
	})
	return th
}

func grpcClient(t *testing.T, addr string) v1.RegistryClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return v1.NewRegistryClient(conn)
}

func withToken(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}

// startSim serves a small sim engine for routing tests.
func startSim(t *testing.T, name string) string {
	t.Helper()
	c := sim.DefaultConfig()
	c.Model, c.ServedModelNames = name, []string{name}
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 256, 256
	c.Step = sim.StepModel{Fixed: time.Millisecond}
	c.ShmDir, c.ShmPrefix = t.TempDir(), name
	r, err := sim.Start(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	return r.URL
}

func register(t *testing.T, c v1.RegistryClient, ctx context.Context, id string, typ v1.InstanceType, url string, models ...string) error {
	t.Helper()
	_, err := c.Register(ctx, &v1.RegisterRequest{VllmHiId: id, Type: typ, Session: "s-" + id,
		Engine: &v1.EngineInfo{EngineUrl: url, ServedModelNames: models, Tp: 1, Pp: 1, Migratable: true, EngineKind: "vhi-sim"}})
	return err
}

func httpDo(t *testing.T, method, url, body string, hdr map[string]string) (int, string, http.Header) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

func TestRoutingAndErrors(t *testing.T) {
	h := startHost(t, nil)
	c := grpcClient(t, h.addr)
	ctx := context.Background()
	engA := startSim(t, "m")
	if err := register(t, c, ctx, "b1", v1.InstanceType_INSTANCE_TYPE_B, startSim(t, "m"), "m"); err != nil {
		t.Fatal(err)
	}
	// Only a standby: 503 with Retry-After.
	code, body, hdr := httpDo(t, "POST", h.url+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`, nil)
	if code != 503 || hdr.Get("Retry-After") == "" || !strings.Contains(body, `"code":503`) {
		t.Fatalf("no active instance: %d %s %v", code, body, hdr)
	}
	if err := register(t, c, ctx, "a1", v1.InstanceType_INSTANCE_TYPE_A, engA, "m"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, body string
		code             int
		contains         string
	}{
		{"stream", "/v1/completions", `{"model":"m","prompt":"x","max_tokens":3,"stream":true}`, 200, "data: [DONE]"},
		{"chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`, 200, `"chat.completion"`},
		{"unknown model", "/v1/completions", `{"model":"nope","prompt":"x"}`, 404, `"code":404`},
		{"malformed", "/v1/completions", `{"model":`, 400, `"code":400`},
		{"no model", "/v1/completions", `{"prompt":"x"}`, 400, `"code":400`},
		{"engine rejects", "/v1/completions", `{"model":"m","prompt":"x","max_tokens":0}`, 400, "max_tokens"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body, _ := httpDo(t, "POST", h.url+tc.path, tc.body, nil)
			if code != tc.code || !strings.Contains(body, tc.contains) {
				t.Fatalf("%d %s", code, body)
			}
		})
	}
	// The Host names engine requests itself: a client's X-Request-Id —
	// the same for two clients, or with '/' and '?' in it — names nothing.
	ids := map[string]bool{}
	for i := 0; i < 2; i++ {
		var rh http.Header
		_, body, rh = httpDo(t, "POST", h.url+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`, map[string]string{"X-Request-Id": "../abc?x=1"})
		var r struct {
			ID string `json:"id"`
		}
		// The client's id by its characters, not by "abc": the Host's
		// random hex ids hold that about once in 150.
		if err := json.Unmarshal([]byte(body), &r); err != nil || !strings.HasPrefix(r.ID, "cmpl-") || strings.ContainsAny(r.ID, "./?=") {
			t.Fatalf("the client's request id named the engine request: %s", body)
		}
		// The Host's id is answered: the engine's response id names it.
		if r.ID != "cmpl-"+rh.Get("X-Request-Id") {
			t.Fatalf("answered X-Request-Id %q for the engine's %s", rh.Get("X-Request-Id"), r.ID)
		}
		ids[r.ID] = true
	}
	if len(ids) != 2 {
		t.Fatal("two requests with the same client id got the same engine id")
	}
	code, body, _ = httpDo(t, "GET", h.url+"/v1/models", "", nil)
	if code != 200 || !strings.Contains(body, `"id":"m"`) {
		t.Fatalf("models: %s", body)
	}
	var st hostapi.Status
	_, body, _ = httpDo(t, "GET", h.url+"/vllm_hi/status", "", nil)
	if err := json.Unmarshal([]byte(body), &st); err != nil || st.Status != "ok" || st.InstanceCount != 2 {
		t.Fatalf("status: %s", body)
	}
	var list struct {
		Instances []map[string]any `json:"instances"`
	}
	_, body, _ = httpDo(t, "GET", h.url+"/vllm_hi/instances", "", nil)
	if err := json.Unmarshal([]byte(body), &list); err != nil || len(list.Instances) != 2 {
		t.Fatalf("instances: %s", body)
	}
	for _, k := range []string{"vllm_hi_id", "type", "role", "state", "served_model_name", "engine_url", "tp", "pp", "migratable"} {
		if _, ok := list.Instances[0][k]; !ok {
			t.Errorf("instance lacks contract field %q", k)
		}
	}
	if list.Instances[0]["role"] != "active" || list.Instances[1]["role"] != "standby" {
		t.Fatalf("roles: %v", list.Instances)
	}
	if code, _, _ := httpDo(t, "GET", h.url+"/vllm_hi/instances/zzz", "", nil); code != 404 {
		t.Fatalf("unknown instance: %d", code)
	}
}

func TestRegistrationErrors(t *testing.T) {
	h := startHost(t, nil)
	c := grpcClient(t, h.addr)
	ctx := context.Background()
	if err := register(t, c, ctx, "", v1.InstanceType_INSTANCE_TYPE_A, "http://x", "m"); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("empty id: %v", err)
	}
	if err := register(t, c, ctx, "x", v1.InstanceType_INSTANCE_TYPE_UNSPECIFIED, "http://x", "m"); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("no type: %v", err)
	}
	if err := register(t, c, ctx, "x", v1.InstanceType_INSTANCE_TYPE_A, "http://x", "m"); err != nil {
		t.Fatal(err)
	}
	_, err := c.Register(ctx, &v1.RegisterRequest{VllmHiId: "x", Type: v1.InstanceType_INSTANCE_TYPE_A, Session: "another",
		Engine: &v1.EngineInfo{EngineUrl: "http://y", ServedModelNames: []string{"m"}, Tp: 1, Pp: 1}})
	if status.Code(err) != codes.AlreadyExists {
		t.Fatalf("duplicate id from another live agent: %v", err)
	}
	if _, err := c.Heartbeat(ctx, &v1.HeartbeatRequest{VllmHiId: "ghost", Session: "s"}); status.Code(err) != codes.NotFound {
		t.Fatalf("unknown heartbeat: %v", err)
	}
	// Missed heartbeats make the instance unreachable; routing stops.
	time.Sleep(500 * time.Millisecond)
	if i, _ := h.Registry().Get("x"); i.EffectiveState() != registry.StateUnreachable {
		t.Fatalf("after missed heartbeats: %s", i.EffectiveState())
	}
	if code, _, _ := httpDo(t, "POST", h.url+"/v1/completions", `{"model":"m","prompt":"x"}`, nil); code != 503 {
		t.Fatalf("routed to an unreachable instance: %d", code)
	}
}

// Admins and agents hold different credentials: the admin token does not
// register an agent, the agent token does not change the REST API, and
// the bearer scheme is case-insensitive.
func TestAdminAndAgentTokens(t *testing.T) {
	h := startHost(t, func(c *Config) { c.AdminToken, c.AgentToken = "s3cret", "agent-t0ken" })
	c := grpcClient(t, h.addr)
	ctx := context.Background()
	if err := register(t, c, ctx, "a", v1.InstanceType_INSTANCE_TYPE_A, "http://x", "m"); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("registration without token: %v", err)
	}
	if err := register(t, c, withToken(ctx, "s3cret"), "a", v1.InstanceType_INSTANCE_TYPE_A, "http://x", "m"); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("registration with the admin token: %v", err)
	}
	if err := register(t, c, withToken(ctx, "agent-t0ken"), "a", v1.InstanceType_INSTANCE_TYPE_A, "http://x", "m"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Deregister(withToken(ctx, "agent-t0ken"), &v1.DeregisterRequest{VllmHiId: "a"}); status.Code(err) != codes.NotFound {
		t.Fatalf("deregister without the agent's session: %v", err)
	}
	if code, _, _ := httpDo(t, "POST", h.url+"/vllm_hi/instances/a/drain", "", map[string]string{"Authorization": "Bearer agent-t0ken"}); code != 401 {
		t.Fatalf("drain with the agent token: %d", code)
	}
	if code, body, _ := httpDo(t, "POST", h.url+"/vllm_hi/instances/a/drain", "", nil); code != 401 || !strings.Contains(body, `"code":401`) {
		t.Fatalf("drain without token: %d %s", code, body)
	}
	if i, _ := h.Registry().Get("a"); i.State != registry.StateActive {
		t.Fatal("an unauthenticated drain changed state")
	}
	// (a is the model's last active instance: the drain is forced.)
	if code, _, _ := httpDo(t, "POST", h.url+"/vllm_hi/instances/a/drain", `{"force":true}`, map[string]string{"Authorization": "bearer s3cret"}); code != 200 {
		t.Fatalf("drain with token (lower-case scheme): %d", code)
	}
	if code, _, _ := httpDo(t, "POST", h.url+"/vllm_hi/instances/a/drain", `{"force":true}`, map[string]string{"Authorization": "Bearer s3cret"}); code != 409 {
		t.Fatalf("drain twice: %d", code)
	}
	// Reads stay open.
	if code, _, _ := httpDo(t, "GET", h.url+"/vllm_hi/instances", "", nil); code != 200 {
		t.Fatalf("read needs no token: %d", code)
	}
	if got := testutil.ToFloat64(h.m.registrations.WithLabelValues("unauthenticated")); got != 2 {
		t.Fatalf("unauthenticated registrations counted %v", got)
	}
	// Unknown fields and trailing data are refused before anything starts.
	for _, body := range []string{
		`{"src_vllm_hi_id":"a","dst_vllm_hi_id":"b","migration_typ":"preserve_source"}`,
		`{"src_vllm_hi_id":"a","dst_vllm_hi_id":"b"} {"more":1}`,
		`{"src_vllm_hi_id":"a","dst_vllm_hi_id":"b"}garbage`,
		`{"src_vllm_hi_id":"a","dst_vllm_hi_id":"b","target_gpu_memory_utilization":-0.5}`,
	} {
		code, out, _ := httpDo(t, "POST", h.url+"/vllm_hi/migrate", body, map[string]string{"Authorization": "Bearer s3cret"})
		if code != 400 || !strings.Contains(out, `"code":400`) {
			t.Errorf("%s: %d %s", body, code, out)
		}
	}
}

// The vhi_ metric names, types and help are pinned by a golden file.
func TestMetricsGolden(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := registry.New(registry.Options{})
	m := newMetrics(reg, r)
	_, _ = r.Register(registry.Registration{ID: "a", Type: "A", Session: "s", Engine: registry.Engine{URL: "http://e", ServedModels: []string{"m"}, TP: 1, PP: 1}})
	m.requests.WithLabelValues("m", "200").Inc()
	m.heartbeats.WithLabelValues("ok").Add(3)
	m.registrations.WithLabelValues("ok").Inc()
	m.proxy.AddedLatency.Observe(0.00003)
	m.proxy.UpstreamErrors.WithLabelValues("m", "read").Inc()
	m.proxy.StreamsInFlight.Set(2)
	m.proxy.StreamTokens.Add(7)
	m.migrations.Migrations.WithLabelValues("succeeded").Inc()
	m.migrations.Downtime.Observe(0.014)
	m.migrations.ClientDowntime.Observe(0.044)
	m.migrations.Duration.Observe(1.6)
	m.migrations.Bytes.Add(24e9)
	m.migrations.Requests.Add(256)
	m.ttft.WithLabelValues("m").Observe(0.3)
	m.duration.WithLabelValues("m").Observe(4.2)
	m.tpot.WithLabelValues("m").Observe(0.012)
	m.autoscale.Decisions.WithLabelValues("m", "out", "ttft_p95", "started").Inc()
	m.autoscale.P95.WithLabelValues("m").Set(0.42)
	m.autoscale.Size.WithLabelValues("m").Set(2)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	for _, mf := range mfs {
		if mf.GetName() == "vhi_build_info" {
			// Its labels are the build's (the Go version changes with the
			// toolchain): checked apart.
			if l := mf.GetMetric()[0].GetLabel(); len(l) != 3 || l[1].GetName() != "go_version" || l[1].GetValue() != runtime.Version() {
				t.Fatalf("vhi_build_info: %v", l)
			}
			continue
		}
		if _, err := expfmt.MetricFamilyToText(&buf, mf); err != nil {
			t.Fatal(err)
		}
	}
	got := buf.Bytes()
	path := filepath.Join("testdata", "metrics.golden")
	if *update {
		_ = os.WriteFile(path, got, 0o644)
	}
	want, _ := os.ReadFile(path)
	if string(got) != string(want) {
		t.Fatalf("metrics differ from %s (go test -update):\n%s", path, got)
	}
}

// On shutdown the Host lets open streams finish (within the timeout)
// before it stops.
func TestShutdownDrainsStreams(t *testing.T) {
	h := startHost(t, func(c *Config) { c.ShutdownTimeout = 10 * time.Second })
	c := grpcClient(t, h.addr)
	if err := register(t, c, context.Background(), "a", v1.InstanceType_INSTANCE_TYPE_A, startSim(t, "m"), "m"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(h.url+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","prompt":"long","max_tokens":150,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 1)
	if _, err := resp.Body.Read(buf); err != nil { // the stream has started
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	go func() { h.stop(); close(stopped) }()
	rest, err := io.ReadAll(resp.Body)
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("stream cut by shutdown: %v …%q", err, tail(string(rest)))
	}
	<-stopped
}

func tail(s string) string {
	if len(s) > 80 {
		return s[len(s)-80:]
	}
	return s
}

// FuzzMigrateBody posts arbitrary bodies to POST /vllm_hi/migrate: every
// answer is a 4xx in the contract's error shape (the registry is empty,
// so nothing can start), and nothing panics.
func FuzzMigrateBody(f *testing.F) {
	cfg := DefaultConfig()
	h, err := New(cfg, zap.NewNop())
	if err != nil {
		f.Fatal(err)
	}
	handler := h.Handler()
	for _, seed := range []string{
		`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B"}`,
		`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","migration_type":"preserve_source","tn":4,"target_tp":2,"request_filter":"longest:3"}`,
		`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","migration_typ":"preserve_source"}`,
		`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B"} trailing`,
		`{"target_gpu_memory_utilization":1e400}`,
		`[]`, ``, `null`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/vllm_hi/migrate", bytes.NewReader(body))
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, req)
		var e struct {
			Error struct {
				Message string `json:"message"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if w.Code < 400 || w.Code >= 500 || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Code != w.Code || e.Error.Message == "" {
			t.Fatalf("%q: %d %s", body, w.Code, w.Body)
		}
	})
}

// rawPost opens a connection, sends a request's head announcing n body
// bytes and the first sent of them, and returns the connection.
func rawPost(t *testing.T, addr string, n, sent int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", n)
	if _, err := c.Write(bytes.Repeat([]byte(" "), sent)); err != nil {
		t.Fatal(err)
	}
	return c
}

func statusOf(t *testing.T, c net.Conn, within time.Duration) int {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer within %v: %v", within, err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// Slow or large uploads cannot pin the Host's memory: a body that does
// not arrive within the body timeout is answered 408, and beyond the
// Host-wide body budget new uploads are refused with 503 at once.
func TestRequestBodiesAreBounded(t *testing.T) {
	h := startHost(t, func(c *Config) {
		c.RequestBodyTimeout, c.MaxRequestBody, c.BodyMemory = 500*time.Millisecond, 1<<20, 1<<20
	})
	start := time.Now()
	slow := rawPost(t, h.addr, 100000, 10)
	defer slow.Close()
	if code := statusOf(t, slow, 5*time.Second); code != http.StatusRequestTimeout || time.Since(start) > 3*time.Second {
		t.Fatalf("a body that never arrives: %d after %v", code, time.Since(start))
	}
	// One upload holds 700 KiB (and stalls); a second one would take the
	// Host past its 1 MiB budget.
	h2 := startHost(t, func(c *Config) {
		c.RequestBodyTimeout, c.MaxRequestBody, c.BodyMemory = 5*time.Second, 1<<20, 1<<20
	})
	first := rawPost(t, h2.addr, 900<<10, 700<<10)
	defer first.Close()
	time.Sleep(200 * time.Millisecond)
	second := rawPost(t, h2.addr, 900<<10, 700<<10)
	defer second.Close()
	if code := statusOf(t, second, 3*time.Second); code != http.StatusServiceUnavailable {
		t.Fatalf("an upload beyond the body budget: %d", code)
	}
	// Too large at all: 413.
	big := rawPost(t, h2.addr, 2<<20, 2<<20)
	defer big.Close()
	if code := statusOf(t, big, 3*time.Second); code != http.StatusRequestEntityTooLarge && code != http.StatusServiceUnavailable {
		t.Fatalf("an upload over the size limit: %d", code)
	}
}
