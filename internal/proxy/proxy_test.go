package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
)

// newTestProxy is New, with the event loop on where the environment has
// VLLM_HI_RELAY_EVENT_LOOP=true (make test runs the package's tests both ways).
func newTestProxy(o Options, m *Metrics, log *zap.Logger) *Proxy {
	o.EventLoop = o.EventLoop || os.Getenv("VLLM_HI_RELAY_EVENT_LOOP") == "true"
	return New(o, m, log)
}

func testMetrics() *Metrics {
	return &Metrics{
		AddedLatency:    prometheus.NewHistogram(prometheus.HistogramOpts{Name: "l"}),
		UpstreamErrors:  prometheus.NewCounterVec(prometheus.CounterOpts{Name: "e"}, []string{"model", "kind"}),
		StreamsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "s"}),
		StreamTokens:    prometheus.NewCounter(prometheus.CounterOpts{Name: "t"}),
		Rerouted:        prometheus.NewCounter(prometheus.CounterOpts{Name: "r"}),
		LoopStreams:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ls"}, []string{"outcome"}),
	}
}

const upstreamStream = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n" +
	"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" a\"}}]}\n\n" +
	": a comment\n\n" +
	"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" b\"},\"finish_reason\":\"length\"}]}\r\n\r\n" +
	"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n" +
	"data: [DONE]\n\n"

// Events are found however the bytes arrive.
func TestEventReader(t *testing.T) {
	er := NewEventReader(iotest.OneByteReader(strings.NewReader(upstreamStream)))
	var kinds []Kind
	var raw strings.Builder
	for {
		ev, err := er.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		raw.Write(ev.Raw)
		k, err := Classify(ev.Data)
		if err != nil {
			t.Fatal(err)
		}
		kinds = append(kinds, k)
	}
	want := []Kind{KindRole, KindToken, KindOther, KindToken, KindUsage, KindDone}
	if len(kinds) != len(want) {
		t.Fatalf("kinds %v, want %v", kinds, want)
	}
	for i := range want {
		if kinds[i] != want[i] {
			t.Fatalf("kinds %v, want %v", kinds, want)
		}
	}
	if raw.String() != upstreamStream {
		t.Fatal("raw bytes do not reassemble the stream")
	}
	// Cut inside an event: unexpected EOF, not a clean end.
	er = NewEventReader(strings.NewReader("data: {\"a\":1}\n\ndata: {\"b\""))
	if _, err := er.Next(); err != nil {
		t.Fatal(err)
	}
	if _, err := er.Next(); err != io.ErrUnexpectedEOF {
		t.Fatalf("cut event: %v", err)
	}
	if k, _ := Classify([]byte(`{"error":{"message":"x"}}`)); k != KindError {
		t.Fatal("error event")
	}
	if _, err := Classify([]byte(`{not json`)); err == nil {
		t.Fatal("garbage accepted")
	}
	er = NewEventReader(strings.NewReader("data: line1\ndata: line2\n\n"))
	if ev, _ := er.Next(); string(ev.Data) != "line1\nline2" {
		t.Fatalf("multi-line data %q", ev.Data)
	}
}

func serveProxy(t *testing.T, upstream string) (*httptest.Server, *Metrics) {
	t.Helper()
	m := testMetrics()
	p := newTestProxy(Options{ClientWriteTimeout: 200 * time.Millisecond}, m, zap.NewNop())
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		p.Forward(w, r, Upstream{BaseURL: upstream, Path: r.URL.Path, Body: body, Model: "m", InstanceID: "i", Stream: true,
			Header: http.Header{"Content-Type": {"application/json"}}})
	}))
	t.Cleanup(front.Close)
	return front, m
}

// The client receives exactly the upstream's bytes, and tokens are counted.
func TestRelayIsByteExact(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, part := range strings.SplitAfter(upstreamStream, "\n\n") {
			_, _ = io.WriteString(w, part)
			w.(http.Flusher).Flush()
			time.Sleep(time.Millisecond)
		}
	}))
	defer up.Close()
	front, m := serveProxy(t, up.URL)
	resp, err := http.Post(front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != upstreamStream {
		t.Fatalf("relayed bytes differ:\n%q\nwant\n%q", b, upstreamStream)
	}
	if got := testutil.ToFloat64(m.StreamTokens); got != 2 {
		t.Fatalf("counted %v tokens, want 2", got)
	}
	if testutil.ToFloat64(m.StreamsInFlight) != 0 {
		t.Fatal("stream gauge not back to 0")
	}
}

// An upstream that dies mid-stream gives the client an error event and one
// [DONE].
func TestUpstreamDiesMidStream(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // cut the connection
	}))
	defer up.Close()
	front, m := serveProxy(t, up.URL)
	resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	s := string(b)
	if !strings.HasPrefix(s, "data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {\"error\":") || !strings.HasSuffix(s, "\n\ndata: [DONE]\n\n") || strings.Count(s, "[DONE]") != 1 {
		t.Fatalf("stream after upstream death:\n%s", s)
	}
	if testutil.ToFloat64(m.UpstreamErrors.WithLabelValues("m", "read")) != 1 {
		t.Fatal("upstream error not counted")
	}
}

// Non-streaming answers and engine errors pass through unchanged.
func TestPassThrough(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}`)
	}))
	defer up.Close()
	front, _ := serveProxy(t, up.URL)
	resp, _ := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{}`))
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(b), "too long") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// An unreachable engine: 502 in the contract's shape.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := "http://" + ln.Addr().String()
	ln.Close()
	front2, m := serveProxy(t, dead)
	resp, _ = http.Post(front2.URL+"/v1/completions", "application/json", strings.NewReader(`{}`))
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 502 || !strings.Contains(string(b), `"code":502`) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if testutil.ToFloat64(m.UpstreamErrors.WithLabelValues("m", "connect")) != 1 {
		t.Fatal("connect error not counted")
	}
}

// A client that goes away cancels the upstream request; so does a client
// that stops reading (write deadline).
func TestClientGoneCancelsUpstream(t *testing.T) {
	for _, mode := range []string{"disconnect", "stops reading"} {
		t.Run(mode, func(t *testing.T) {
			cancelled := make(chan struct{})
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				payload := "data: {\"choices\":[{\"text\":\"" + strings.Repeat("x", 16<<10) + "\"}]}\n\n"
				for {
					if _, err := io.WriteString(w, payload); err != nil {
						break
					}
					w.(http.Flusher).Flush()
					select {
					case <-r.Context().Done():
						close(cancelled)
						return
					case <-time.After(time.Millisecond):
					}
				}
				close(cancelled)
			}))
			defer up.Close()
			front, _ := serveProxy(t, up.URL)
			conn, err := net.Dial("tcp", strings.TrimPrefix(front.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			if tc, ok := conn.(*net.TCPConn); ok {
				_ = tc.SetReadBuffer(4096)
			}
			_, _ = io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
			br := bufio.NewReader(conn)
			if _, err := br.ReadString('\n'); err != nil {
				t.Fatal(err)
			}
			if mode == "disconnect" {
				conn.Close()
			} else {
				defer conn.Close() // never read again
			}
			select {
			case <-cancelled:
			case <-time.After(10 * time.Second):
				t.Fatal("upstream still streaming after the client left")
			}
		})
	}
}

// The fast path and the full decoder agree on every shape vLLM and the sim
// send.
func TestClassifyFastMatchesSlow(t *testing.T) {
	for _, ev := range []string{
		`{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null}]}`,
		`{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop","stop_reason":"x"}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null}`,
		`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" \"delta\":{\"role\":"},"logprobs":null,"finish_reason":null,"token_ids":null}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":1,"total_tokens":2,"completion_tokens":1}}`,
		`{"error":{"message":"boom","type":"x","param":null,"code":500}}`,
		`{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}`,
	} {
		fast, err1 := Classify([]byte(ev))
		slow, _, err2 := classifySlow([]byte(ev))
		if fast != slow || err1 != nil || err2 != nil {
			t.Errorf("%s: fast %v, slow %v (%v %v)", ev, fast, slow, err1, err2)
		}
	}
}

// FuzzSSE reads arbitrary bytes as an engine's stream: the reader never
// panics, every event it returns is bytes of the input, and on valid JSON
// the fast classification agrees with the full decoder (the relay splices
// by what the fast path counts).
func FuzzSSE(f *testing.F) {
	for _, seed := range []string{
		"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\" a\",\"finish_reason\":null}]}\n\ndata: [DONE]\n\n",
		"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n",
		"data: {\"error\":{\"message\":\"x\"}}\n\n",
		": comment\n\nevent: x\ndata: a\ndata: b\n\n",
		"data: {\"choices\":[{\"text\":\"\\ud83d\\ude00\\u00e9\"}]}\n\n",
		"data: " + strings.Repeat("x", 33000) + "\n\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		er := NewEventReader(bytes.NewReader(in))
		for i := 0; i < 1000; i++ {
			ev, err := er.Next()
			if err != nil {
				return
			}
			if !bytes.Contains(in, ev.Raw) {
				t.Fatalf("event %q is not in the input", ev.Raw)
			}
			kind, n, _ := ClassifyText(ev.Data)
			if n < 0 {
				t.Fatalf("negative text length for %q", ev.Data)
			}
			if json.Valid(ev.Data) {
				slow, sn, err := classifySlow(ev.Data)
				if err == nil && (slow != kind || (kind == KindToken && sn != n)) {
					t.Fatalf("%q: fast %v/%d, slow %v/%d", ev.Data, kind, n, slow, sn)
				}
			}
		}
	})
}

// A request whose engine has not answered yet when failover gives that
// engine up (Streams.Abandon: its agent missed its heartbeats) starts
// afresh on another instance: the client has nothing yet, and gets the
// whole stream from there, not a 502. (TestChaosWithThreeHosts broke a
// stream this way on a loaded machine.)
func TestAStreamAbandonedBeforeItsEngineAnsweredGoesElsewhere(t *testing.T) {
	hung := make(chan struct{})
	stuck := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // then the server sees the connection close
		close(hung)
		<-r.Context().Done() // never answers
	}))
	defer stuck.Close()
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, upstreamStream)
	}))
	defer other.Close()
	m := testMetrics()
	p := newTestProxy(Options{}, m, zap.NewNop())
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		p.Forward(w, r, Upstream{BaseURL: stuck.URL, Path: r.URL.Path, Body: body, Model: "m", InstanceID: "B", RequestID: "r1", Stream: true,
			Header: http.Header{"Content-Type": {"application/json"}},
			Reroute: func(tried []string) (string, string, bool) {
				if slices.Contains(tried, "A") {
					return "", "", false
				}
				return other.URL, "A", true
			}})
	}))
	defer front.Close()
	go func() {
		<-hung
		if n := p.Streams().Abandon("B", 0, nil); n != 1 {
			t.Errorf("abandoned %d streams, want 1", n)
		}
	}()
	resp, err := http.Post(front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(b) != upstreamStream {
		t.Fatalf("%d %q, want the other instance's whole stream", resp.StatusCode, b)
	}
	if got := testutil.ToFloat64(m.Rerouted); got != 1 {
		t.Fatalf("rerouted %v, want 1", got)
	}
}

// A stream a migration moves before its source engine answered (nothing
// produced yet) opens on the target instead of ending in a 502.
// (TestChaosWithThreeHosts broke a stream this way: a drain moved a
// request still waiting for its engine's first answer.)
func TestAStreamMovedBeforeItsEngineAnsweredOpensOnTheTarget(t *testing.T) {
	hung := make(chan struct{})
	source := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		close(hung)
		<-r.Context().Done() // never answers
	}))
	defer source.Close()
	target := tokensTarget("", 0, 3, func(*http.Request) {})
	defer target.Close()
	p := newTestProxy(Options{}, testMetrics(), zap.NewNop())
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		p.Forward(w, r, Upstream{BaseURL: source.URL, Path: r.URL.Path, Body: body, Model: "m", InstanceID: "A", RequestID: "cmpl-x", Stream: true,
			Header: http.Header{"Content-Type": {"application/json"}}})
	}))
	defer front.Close()
	switched := make(chan error, 1)
	go func() {
		<-hung
		switched <- <-p.Streams().Get("cmpl-x").Splice(target.URL, "B", 0, -1)
	}()
	resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	want := tokenEvent(0) + tokenEvent(1) + tokenEvent(2) + "data: [DONE]\n\n"
	if resp.StatusCode != http.StatusOK || string(b) != want {
		t.Fatalf("%d %q, want the target's stream %q", resp.StatusCode, b, want)
	}
	if err := <-switched; err != nil {
		t.Fatalf("the splice: %v", err)
	}
}
