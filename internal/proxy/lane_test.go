//go:build linux

package proxy

import (
	"context"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/listener"
)

// loopFront serves a proxy with the event loop on, relaying each stream
// (its query passed on) to the engine at engineURL.
func loopFront(t *testing.T, engineURL string) (*httptest.Server, *Metrics) {
	t.Helper()
	m := testMetrics()
	p := New(Options{EventLoop: true}, m, zap.NewNop())
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Forward(w, r, Upstream{BaseURL: engineURL, Path: "/v1/completions?" + r.URL.RawQuery, Body: []byte(`{}`), Model: "m", InstanceID: "A", Stream: true})
	}))
	t.Cleanup(func() { front.Close(); p.Close() })
	return front, m
}

// Many streams at once on the event loop: every client gets exactly its
// engine's bytes, every token is counted, and every stream ended on the
// loop with its [DONE] (none handed back to a goroutine).
func TestTheEventLoopRelaysStreamsByteExact(t *testing.T) {
	const streams, tokens = 64, 40
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		id := r.URL.Query().Get("s")
		for i := 0; i < tokens; i++ {
			_, _ = fmt.Fprintf(w, "data: {\"id\":\"%s\",\"choices\":[{\"index\":0,\"text\":\" t%d\",\"finish_reason\":null}]}\n\n", id, i)
			w.(http.Flusher).Flush()
			if i%8 == 0 {
				time.Sleep(time.Millisecond)
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer engine.Close()
	front, m := loopFront(t, engine.URL)
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	for s := 0; s < streams; s++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(fmt.Sprintf("%s/v1/completions?s=%d", front.URL, s), "application/json", strings.NewReader(`{}`))
			if err != nil {
				errs <- err
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var want strings.Builder
			for i := 0; i < tokens; i++ {
				fmt.Fprintf(&want, "data: {\"id\":\"%d\",\"choices\":[{\"index\":0,\"text\":\" t%d\",\"finish_reason\":null}]}\n\n", s, i)
			}
			want.WriteString("data: [DONE]\n\n")
			if string(b) != want.String() {
				errs <- fmt.Errorf("stream %d: got %q", s, b)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(m.StreamTokens); got != streams*tokens {
		t.Fatalf("counted %v tokens, want %d", got, streams*tokens)
	}
	if got := testutil.ToFloat64(m.LoopStreams.WithLabelValues(LoopDone)); got != streams {
		t.Fatalf("%v streams ended on the loop, want %d (handed back: %v)", got, streams, testutil.ToFloat64(m.LoopStreams.WithLabelValues(LoopHandedBack)))
	}
	if testutil.ToFloat64(m.StreamsInFlight) != 0 {
		t.Fatal("stream gauge not back to 0")
	}
}

// The loop's event parser reads what EventReader reads, from any split of
// the bytes into reads.
func TestNextEventReadsAsTheEventReader(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	pieces := []string{"data: {\"a\":1}\n\n", "data: x\r\ndata: y\r\n\r\n", ": comment\n\n", "\n", "event: e\ndata: z\n\n",
		"data:nospace\n\n", "id: 7\n\n", "data: one\ndata: two\ndata: three\n\n"}
	for round := 0; round < 200; round++ {
		var all strings.Builder
		for i := 0; i < 1+rng.Intn(12); i++ {
			all.WriteString(pieces[rng.Intn(len(pieces))])
		}
		text := all.String()
		var want []Event
		er := NewEventReader(strings.NewReader(text))
		for {
			ev, err := er.Next()
			if err != nil {
				break
			}
			want = append(want, Event{Raw: append([]byte(nil), ev.Raw...), Data: append([]byte(nil), ev.Data...)})
		}
		// The loop sees the bytes arrive in random pieces.
		var buf, scratch []byte
		var got []Event
		for rest := text; len(rest) > 0 || len(buf) > 0; {
			if len(rest) > 0 {
				n := 1 + rng.Intn(len(rest))
				buf, rest = append(buf, rest[:n]...), rest[n:]
			}
			off := 0
			for {
				ev, n, ok, err := nextEvent(buf[off:], &scratch)
				if err != nil {
					t.Fatal(err)
				}
				if !ok {
					break
				}
				got = append(got, Event{Raw: append([]byte(nil), ev.Raw...), Data: append([]byte(nil), ev.Data...)})
				off += n
			}
			buf = buf[off:]
			if len(rest) == 0 {
				break
			}
		}
		if fmt.Sprintf("%q", got) != fmt.Sprintf("%q", want) {
			t.Fatalf("from %q\ngot  %q\nwant %q", text, got, want)
		}
	}
}

// The loop decodes whole chunks only, so what it keeps starts at a chunk
// that a goroutine's chunked reader can go on from.
func TestDecodeTakesWholeChunks(t *testing.T) {
	src := []byte("5;ext=1\r\nhello\r\n3\r\nab")
	used, ended, bad, out := decodeChunks(src, nil)
	if ended || bad || string(out) != "hello" || string(src[used:]) != "3\r\nab" {
		t.Fatalf("ended %v bad %v data %q left %q", ended, bad, out, src[used:])
	}
	src = append(src[used:], "c\r\n0\r\n\r\n"...)
	used, ended, bad, out = decodeChunks(src, out)
	if !ended || bad || string(out) != "helloabc" || string(src[used:]) != "0\r\n\r\n" {
		t.Fatalf("ended %v bad %v data %q left %q", ended, bad, out, src[used:])
	}
	if _, _, bad, _ := decodeChunks([]byte("zz\r\n"), nil); !bad {
		t.Fatal("a size that is not hex was taken")
	}
}

// An HTTP/1.0 client cannot read the loop's chunked body: its stream
// stays on the goroutine relay, and it gets the engine's events whole.
func TestAnHTTP10ClientStaysOffTheLoop(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, tokenEvent(0))
		w.(http.Flusher).Flush() // a chunked body, as an engine's stream is
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer engine.Close()
	front, m := loopFront(t, engine.URL)
	c, err := net.Dial("tcp", strings.TrimPrefix(front.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, _ := io.ReadAll(c)
	if !strings.HasPrefix(string(b), "HTTP/1.0 200") || strings.Contains(string(b), "Transfer-Encoding: chunked") ||
		!strings.HasSuffix(string(b), tokenEvent(0)+"data: [DONE]\n\n") {
		t.Fatalf("the HTTP/1.0 client read:\n%s", b)
	}
	for _, o := range []string{LoopDone, LoopClientClosed, LoopHandedBack} {
		if n := testutil.ToFloat64(m.LoopStreams.WithLabelValues(o)); n != 0 {
			t.Fatalf("the loop took an HTTP/1.0 stream (%s %v)", o, n)
		}
	}
}

// With a listener that takes connections back (the Host's), a client's
// connection outlives its stream on the loop: its next requests go over
// the same connection, each relayed on the loop, each body whole. And
// the engine's connection outlives it too, until the engine closes it:
// the next stream then goes over a new one.
func TestTheLoopKeepsAClientsConnection(t *testing.T) {
	var mu sync.Mutex
	engineConns := 0
	engine := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 3; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
			w.(http.Flusher).Flush()
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	engine.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			mu.Lock()
			engineConns++
			mu.Unlock()
		}
	}
	engine.Start()
	defer engine.Close()
	m := testMetrics()
	p := New(Options{EventLoop: true}, m, zap.NewNop())
	defer p.Close()
	front := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body) // as the Host does: what net/http has buffered is then nobody's
		p.Forward(w, r, Upstream{BaseURL: engine.URL, Path: "/v1/completions", Body: []byte(`{}`), Model: "m", InstanceID: "A", Stream: true})
	}))
	ln := listener.New(front.Listener, 0)
	front.Listener = ln
	p.SetKeepAlive(ln.Reserve)
	front.Start()
	defer front.Close()
	client := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	reused := 0
	for i := 0; i < 4; i++ {
		if i == 3 {
			// The engine closes its idle connections (as vLLM's does after
			// 5 s): the next stream finds its pooled one closed.
			engine.CloseClientConnections()
			time.Sleep(50 * time.Millisecond)
		}
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
			if info.Reused {
				reused++
			}
		}})
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, front.URL+"/v1/completions", strings.NewReader(`{}`))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != tokensThenDone(3) || resp.Close {
			t.Fatalf("request %d: close %v, read %q", i, resp.Close, b)
		}
	}
	if reused != 3 {
		t.Fatalf("%d of the 3 later requests went over the first one's connection", reused)
	}
	if got := testutil.ToFloat64(m.LoopStreams.WithLabelValues(LoopDone)); got != 4 {
		t.Fatalf("%v streams ended on the loop, want 4", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if engineConns != 2 {
		t.Fatalf("the engine served 4 streams over %d connections, want 2 (one, then one after it closed it)", engineConns)
	}
}
