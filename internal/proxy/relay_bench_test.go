package proxy

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// BenchmarkRelayPerEvent is one token event's way through the relay, one
// at a time: the engine sends the next event once the client got the
// last, so every event is a read of its own on each side, as in a stream
// of one token per engine step (issue 35's relay cost; `vhi bench proxy`
// compares whole loads with nginx). The engine and the client allocate
// nothing per event, so allocs/op is the relay's (Go's HTTP client and
// server included).
func BenchmarkRelayPerEvent(b *testing.B) {
	event := []byte(`data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]}` + "\n\n")
	next := make(chan bool, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for more := range next {
			if !more {
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
				return
			}
			_, _ = w.Write(event)
			_ = rc.Flush()
		}
	}))
	defer up.Close()
	p := newTestProxy(Options{}, testMetrics(), zap.NewNop())
	defer p.Close()
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Forward(w, r, Upstream{BaseURL: up.URL, Path: "/v1/completions", Body: []byte(`{}`), Model: "m", InstanceID: "i", Stream: true,
			Header: http.Header{"Content-Type": {"application/json"}}})
	}))
	defer front.Close()
	// The relay answers its client with the first event: one goes ahead.
	next <- true
	resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	readEvent := func() {
		for { // an event ends at its blank line
			line, err := br.ReadSlice('\n')
			if err != nil {
				b.Fatal(err)
			}
			if len(bytes.TrimSpace(line)) == 0 {
				return
			}
		}
	}
	readEvent()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		next <- true
		readEvent()
	}
	b.StopTimer()
	next <- false
	close(next)
	_, _ = io.Copy(io.Discard, br)
}
