package host

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/protobuf/proto"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// seen is what a plain OpenAI-compatible engine of the test's own got.
type seen struct {
	Method, Path, Query, Model string
	RequestID, Traceparent     string
	Tracestate, Authorization  string
}

// echoEngine answers every route with what it got; /v1/responses with
// "stream": true answers three events, a flush and a pause between them.
func echoEngine(t *testing.T, name string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		model, _ := modelOf(r.Header.Get("Content-Type"), body)
		s := seen{Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Model: model, RequestID: r.Header.Get("X-Request-Id"),
			Traceparent: r.Header.Get("Traceparent"), Tracestate: r.Header.Get("Tracestate"), Authorization: r.Header.Get("Authorization")}
		if strings.Contains(string(body), `"stream":true`) {
			w.Header().Set("Content-Type", "text/event-stream")
			for i := 0; i < 3; i++ {
				fmt.Fprintf(w, "event: response.output_text.delta\ndata: {\"n\":%d,\"engine\":%q}\n\n", i, name)
				w.(http.Flusher).Flush()
				time.Sleep(100 * time.Millisecond)
			}
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"engine": name, "seen": s})
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// Every route vLLM serves beyond completions and chat goes through the
// Host to an engine serving the body's model (a form field for audio),
// or to any active one where the body names none; the Host's request id
// is answered and is what the engine got, the trace context reaches the
// engine, a client's own id is not used; streams arrive as they are made.
func TestEveryVLLMRouteIsRelayed(t *testing.T) {
	h := startHost(t, nil)
	c := grpcClient(t, h.addr)
	ctx := context.Background()
	for id, model := range map[string]string{"e1": "embed", "e2": "whisper"} {
		if err := register(t, c, ctx, id, v1.InstanceType_INSTANCE_TYPE_A, echoEngine(t, id), model); err != nil {
			t.Fatal(err)
		}
	}
	hdr := map[string]string{"X-Request-Id": "client-1", "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"Tracestate": "vendor=x", "Authorization": "Bearer engine-key"}
	for _, p := range vllmPostRoutes {
		if strings.HasPrefix(p, "/v1/audio/") {
			continue
		}
		code, body, rh := httpDo(t, "POST", h.url+p+"?x=1", `{"model":"embed","input":"hi"}`, hdr)
		var got struct {
			Engine string
			Seen   seen
		}
		if err := json.Unmarshal([]byte(body), &got); code != 200 || err != nil {
			t.Fatalf("%s: %d %s", p, code, body)
		}
		s := got.Seen
		if got.Engine != "e1" || s.Path != p || s.Query != "x=1" || s.Method != "POST" || s.Model != "embed" {
			t.Fatalf("%s reached %s as %+v", p, got.Engine, s)
		}
		if rid := rh.Get("X-Request-Id"); rid == "" || rid == "client-1" || s.RequestID != rid {
			t.Fatalf("%s: answered X-Request-Id %q, the engine got %q", p, rid, s.RequestID)
		}
		if s.Traceparent != hdr["Traceparent"] || s.Tracestate != "vendor=x" || s.Authorization != "Bearer engine-key" {
			t.Fatalf("%s: the engine got %+v", p, s)
		}
	}
	// Audio: the model is a form field.
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	_ = mw.WriteField("model", "whisper")
	fw, _ := mw.CreateFormFile("file", "a.wav")
	_, _ = fw.Write([]byte("RIFF...."))
	_ = mw.Close()
	req, _ := http.NewRequest("POST", h.url+"/v1/audio/transcriptions", &mp)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"engine":"e2"`) || !strings.Contains(string(b), `"Model":"whisper"`) {
		t.Fatalf("audio: %d %s", resp.StatusCode, b)
	}
	// No model: any active instance; a stored response by its id.
	if code, body, _ := httpDo(t, "POST", h.url+"/tokenize", `{"prompt":"hi"}`, nil); code != 200 || !strings.Contains(body, `"Path":"/tokenize"`) {
		t.Fatalf("a body without a model: %d %s", code, body)
	}
	if code, body, _ := httpDo(t, "GET", h.url+"/v1/responses/resp_1", "", nil); code != 200 || !strings.Contains(body, `"Path":"/v1/responses/resp_1"`) || !strings.Contains(body, `"Method":"GET"`) {
		t.Fatalf("a stored response: %d %s", code, body)
	}
	// Errors in the contract's shape.
	for _, tc := range []struct{ body, want string }{{`{"model":"nope"}`, `"code":404`}, {`{"model":`, `"code":400`}} {
		if code, body, rh := httpDo(t, "POST", h.url+"/v1/embeddings", tc.body, nil); !strings.Contains(body, tc.want) || rh.Get("X-Request-Id") == "" {
			t.Fatalf("%s: %d %s", tc.body, code, body)
		}
	}
	// A stream arrives as the engine makes it, not at its end.
	req, _ = http.NewRequest("POST", h.url+"/v1/responses", strings.NewReader(`{"model":"embed","input":"hi","stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, 64)
	if _, err := io.ReadAtLeast(resp.Body, first, 10); err != nil {
		t.Fatal(err)
	}
	firstAt := time.Since(start)
	rest, _ := io.ReadAll(resp.Body)
	if total := time.Since(start); firstAt > total-150*time.Millisecond || !strings.Contains(string(first)+string(rest), `"n":2`) {
		t.Fatalf("the stream's first event came %v after the request, its end %v: buffered", firstAt, total)
	}
}

// /livez answers while the process runs; /readyz says whether the Host
// can do its work, and why not.
func TestLivezAndReadyz(t *testing.T) {
	h := startHost(t, func(c *Config) { c.DataDir = t.TempDir() })
	for _, p := range []string{"/livez", "/readyz"} {
		if code, body, _ := httpDo(t, "GET", h.url+p, "", nil); code != 200 || !strings.Contains(body, `"status":"ok"`) {
			t.Fatalf("%s: %d %s", p, code, body)
		}
	}
	h.serving.Store(false)
	if code, body, _ := httpDo(t, "GET", h.url+"/readyz", "", nil); code != 503 || !strings.Contains(body, "not serving") {
		t.Fatalf("readyz of a Host not serving: %d %s", code, body)
	}
}

// Each relayed request gets one access log line saying what became of it.
func TestAccessLog(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	cfg := DefaultConfig()
	h, err := New(cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Registry().Register(registry.Registration{ID: "e1", Type: "A", Session: "s",
		Engine: registry.Engine{URL: echoEngine(t, "e1"), ServedModels: []string{"embed"}, TP: 1, PP: 1}}); err != nil {
		t.Fatal(err)
	}
	_ = h.Registry().Heartbeat("e1", "s", registry.Stats{Healthy: true})
	req := httptest.NewRequest("POST", "/v1/embeddings", strings.NewReader(`{"model":"embed","input":"hi"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", "mine")
	rec := httptest.NewRecorder()
	h.Handler().ServeHTTP(rec, req)
	lines := logs.FilterLoggerName("access").All()
	if rec.Code != 200 || len(lines) != 1 {
		t.Fatalf("%d, %d access lines", rec.Code, len(lines))
	}
	f := lines[0].ContextMap()
	if f["request_id"] != rec.Header().Get("X-Request-Id") || f["client_request_id"] != "mine" || f["model"] != "embed" ||
		f["instance"] != "e1" || f["status"] != int64(200) || f["path"] != "/v1/embeddings" {
		t.Fatalf("the access line: %v", f)
	}
}

// With --otlp-traces-endpoint, each relayed request is a span exported
// over OTLP/HTTP: the child of the client's trace, and the parent of the
// engine's (the traceparent the engine gets names it).
func TestRequestSpansAreExported(t *testing.T) {
	got := make(chan *coltracepb.ExportTraceServiceRequest, 16)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if r.URL.Path != "/v1/traces" || proto.Unmarshal(b, &req) != nil {
			http.Error(w, "bad", http.StatusBadRequest)
			return
		}
		got <- &req
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer collector.Close()
	h := startHost(t, func(c *Config) { c.OTLPTracesEndpoint = collector.URL })
	c := grpcClient(t, h.addr)
	if err := register(t, c, context.Background(), "e1", v1.InstanceType_INSTANCE_TYPE_A, echoEngine(t, "e1"), "embed"); err != nil {
		t.Fatal(err)
	}
	const clientTrace = "0af7651916cd43dd8448eb211c80319c"
	_, body, rh := httpDo(t, "POST", h.url+"/v1/embeddings", `{"model":"embed","input":"hi"}`,
		map[string]string{"Traceparent": "00-" + clientTrace + "-b7ad6b7169203331-01"})
	var echo struct{ Seen seen }
	_ = json.Unmarshal([]byte(body), &echo)
	h.stop() // flushes the batch
	var span *tracepb.Span
	for len(got) > 0 {
		for _, rs := range (<-got).GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					if s.GetName() == "POST /v1/embeddings" {
						span = s
					}
				}
			}
		}
	}
	if span == nil {
		t.Fatal("no span for the request reached the collector")
	}
	if hex.EncodeToString(span.GetTraceId()) != clientTrace || hex.EncodeToString(span.GetParentSpanId()) != "b7ad6b7169203331" {
		t.Fatalf("the request's span is not the client's trace's child: trace %x parent %x", span.GetTraceId(), span.GetParentSpanId())
	}
	want := "00-" + clientTrace + "-" + hex.EncodeToString(span.GetSpanId()) + "-01"
	if echo.Seen.Traceparent != want {
		t.Fatalf("the engine got traceparent %q, want the Host's span's %q", echo.Seen.Traceparent, want)
	}
	attrs := map[string]string{}
	for _, a := range span.GetAttributes() {
		attrs[a.GetKey()] = a.GetValue().String()
	}
	if !strings.Contains(attrs["gen_ai.request.model"], "embed") || !strings.Contains(attrs["vllm_hi.request_id"], rh.Get("X-Request-Id")) {
		t.Fatalf("the span's attributes: %v", attrs)
	}
}
