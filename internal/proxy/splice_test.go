package proxy

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
)

func tokenEvent(i int) string {
	return fmt.Sprintf("data: {\"id\":\"cmpl-x\",\"choices\":[{\"index\":0,\"text\":\" t%d\",\"finish_reason\":null}]}\n\n", i)
}

// A stream moves from engine A to engine B at token k: the client gets A's
// first k tokens, then B's from k on, one [DONE], whatever was still in
// flight from A when the splice was asked for.
func TestSpliceMovesAStreamAtATokenIndex(t *testing.T) {
	for _, inFlight := range []int{0, 3} { // tokens of A not yet relayed when Splice is called
		t.Run(fmt.Sprintf("%d tokens in flight", inFlight), func(t *testing.T) {
			const k, total = 6, 10
			release := make(chan struct{})
			a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				for i := 0; i < k; i++ {
					if i == k-inFlight {
						w.(http.Flusher).Flush()
						<-release // the rest arrives only after the splice was asked for
					}
					_, _ = io.WriteString(w, tokenEvent(i))
					w.(http.Flusher).Flush()
				}
				<-r.Context().Done() // A is paused: nothing more until the relay leaves
			}))
			defer a.Close()
			var from string
			b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				from = r.URL.Query().Get("from")
				if r.URL.Path != "/vllm_hi/engine/requests/cmpl-x/stream" {
					http.NotFound(w, r)
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				for i := k; i < total; i++ {
					_, _ = io.WriteString(w, tokenEvent(i))
				}
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
			}))
			defer b.Close()

			m := testMetrics()
			p := newTestProxy(Options{}, m, zap.NewNop())
			got := streamThrough(t, p, a.URL)
			s := waitStream(t, p, k-inFlight)
			switched := s.Splice(b.URL, "B", k, -1)
			close(release)
			waitSplice(t, switched)
			if body, want := <-got, tokensThenDone(total); body != want {
				t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
			}
			if from != fmt.Sprint(k) {
				t.Fatalf("attached from %q, want %d", from, k)
			}
		})
	}
}

// A splice asked with fewer tokens than the stream already relayed is
// refused: it would repeat tokens.
func TestSpliceRefusesToRepeatTokens(t *testing.T) {
	s := &Stream{ID: "x", tokens: 5, done: make(chan struct{})}
	if err := <-s.Splice("http://b", "B", 3, -1); err == nil {
		t.Fatal("a splice behind the relayed tokens was accepted")
	}
}

// vLLM merges several tokens into one chunk when its reader lags: the
// splice then goes by the text the client got, not by the chunk count.
func TestSpliceFollowsTextWhenTheSourceMergesTokens(t *testing.T) {
	const k, total = 6, 9
	merged := func(i int) string { // tokens i and i+1 in one chunk
		return fmt.Sprintf("data: {\"id\":\"cmpl-x\",\"choices\":[{\"index\":0,\"text\":\" t%d t%d\",\"finish_reason\":null}]}\n\n", i, i+1)
	}
	a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < k; i += 2 {
			_, _ = io.WriteString(w, merged(i))
			w.(http.Flusher).Flush()
		}
		<-r.Context().Done()
	}))
	defer a.Close()
	var from string
	b := tokensTarget("", k, total, func(r *http.Request) { from = r.URL.Query().Get("from") })
	defer b.Close()
	p := newTestProxy(Options{}, testMetrics(), zap.NewNop())
	got := streamThrough(t, p, a.URL)
	var s *Stream
	for deadline := time.Now().Add(5 * time.Second); s == nil || s.Tokens() < 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("stream never started")
		}
		s = p.Streams().Get("cmpl-x")
	}
	text := len(" t0 t1 t2 t3 t4 t5")
	select {
	case err := <-s.Splice(b.URL, "B", k, text):
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the splice never happened (it waited for a chunk per token)")
	}
	want := merged(0) + merged(2) + merged(4)
	for i := k; i < total; i++ {
		want += tokenEvent(i)
	}
	want += "data: [DONE]\n\n"
	if body := <-got; body != want {
		t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
	}
	if from != fmt.Sprint(k) {
		t.Fatalf("attached from %q, want %d", from, k)
	}
}

func TestTextLenCountsCodePoints(t *testing.T) {
	for data, want := range map[string]int{
		`{"id":"c","choices":[{"index":0,"text":" hello","finish_reason":null}]}`:                             6,
		`{"id":"c","choices":[{"index":0,"delta":{"content":"héllo ✓"},"finish_reason":null}]}`:               7,
		`{"id":"c","choices":[{"index":0,"text":"a\"b\\c\u00e9\ud83d\ude00","finish_reason":null}]}`:          7,
		`{"id":"c","choices":[{"index":0,"text":"😀x","finish_reason":null}]}`:                                 2,
		`{"id":"c","choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":"ab"}}]}`: 2,
		`{"id":"c","choices":[]}`: 0,
	} {
		if got := TextLen([]byte(data)); got != want {
			t.Errorf("TextLen(%s) = %d, want %d", data, got, want)
		}
	}
}

// streamThrough relays one client stream of request cmpl-x from engine
// aURL through p; the channel gets what the client read.
func streamThrough(t *testing.T, p *Proxy, aURL string) <-chan string {
	t.Helper()
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Forward(w, r, Upstream{BaseURL: aURL, Path: "/v1/completions", Body: []byte(`{}`), Model: "m", InstanceID: "A", RequestID: "cmpl-x", Stream: true})
	}))
	t.Cleanup(front.Close)
	got := make(chan string, 1)
	go func() {
		resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{}`))
		if err != nil {
			got <- err.Error()
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got <- string(body)
	}()
	return got
}

// waitStream waits until the relay of cmpl-x has relayed n tokens.
// waitSplice fails the test unless the splice answers, without error,
// within 5 s.
func waitSplice(t *testing.T, switched <-chan error) {
	t.Helper()
	select {
	case err := <-switched:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the splice never happened")
	}
}

func waitStream(t *testing.T, p *Proxy, n int) *Stream {
	t.Helper()
	var s *Stream
	for deadline := time.Now().Add(5 * time.Second); s == nil || s.Tokens() < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("stream never started")
		}
		s = p.Streams().Get("cmpl-x")
	}
	return s
}

// tokensThenDone is what a client sees of tokens 0 … total-1 and [DONE].
func tokensThenDone(total int) string {
	var want strings.Builder
	for i := 0; i < total; i++ {
		want.WriteString(tokenEvent(i))
	}
	want.WriteString("data: [DONE]\n\n")
	return want.String()
}

// The fence: a source whose pause lease ran out goes on decoding past what
// it exported, but none of those tokens reaches the client — the target
// produces them. The client gets the source's k tokens, then the
// target's, each exactly once.
func TestSpliceFencesASourceThatGoesOn(t *testing.T) {
	const k, total = 4, 9
	splice := make(chan struct{})
	a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < k-1; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
		}
		w.(http.Flusher).Flush()
		<-splice
		// The last exported token, and then — the lease ended — more, as
		// if the request had never moved, all in one write.
		var rest strings.Builder
		for i := k - 1; i < total; i++ {
			rest.WriteString(tokenEvent(i))
		}
		_, _ = io.WriteString(w, rest.String())
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer a.Close()
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := k; i < total; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer b.Close()
	p := newTestProxy(Options{StreamIdleTimeout: 3 * time.Second}, testMetrics(), zap.NewNop())
	got := streamThrough(t, p, a.URL)
	s := waitStream(t, p, k-1)
	switched := s.Splice(b.URL, "B", k, -1)
	close(splice)
	waitSplice(t, switched)
	if body, want := <-got, tokensThenDone(total); body != want {
		t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
	}
}

// A cut does not wait for a source that lags (an API server that has not
// sent its last tokens yet): the relay stops reading it at once and the
// target's stream opens with the text the client lacks, from the exact
// code point the client has.
func TestCutSwitchesAtOnceAndTheTargetFillsTheGap(t *testing.T) {
	const k, sent, total = 6, 4, 9 // the source produced k tokens; its client got sent
	a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < sent; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
			w.(http.Flusher).Flush()
		}
		<-r.Context().Done() // its last k-sent tokens never come
	}))
	defer a.Close()
	var from, textFrom string
	b := cutTarget(k, total, func(r *http.Request) {
		from, textFrom = r.URL.Query().Get("from"), r.URL.Query().Get("text_from")
	})
	defer b.Close()
	p := newTestProxy(Options{}, testMetrics(), zap.NewNop())
	got := streamThrough(t, p, a.URL)
	s := waitStream(t, p, sent)
	visible := len(" t0 t1 t2 t3 t4 t5")
	start := time.Now()
	select {
	case err := <-s.Cut(b.URL, "B", k, visible, -1):
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the cut waited for the source")
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the cut took %v", took)
	}
	want := cutBody(sent, k, total)
	if body := <-got; body != want {
		t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
	}
	if from != fmt.Sprint(k) || textFrom != fmt.Sprint(len(" t0 t1 t2 t3")) {
		t.Fatalf("attached from %q text_from %q, want %d and %d", from, textFrom, k, len(" t0 t1 t2 t3"))
	}
	// A cut onto a target whose text is unknown waits like a splice.
	s2 := &Stream{ID: "y", done: make(chan struct{})}
	s2.Cut("http://b", "B", 3, -1, -1)
	if s2.splice == nil || s2.splice.cut {
		t.Fatalf("a cut without the text: %+v, want a plain splice", s2.splice)
	}
}

// A held stream relays nothing more from its source: a commit's cut then
// switches over the pre-attached stream, which opens with the text from
// where the hold kept the client, and no attach is sent; a hold released
// instead (no commit) relays what the source sent meanwhile and goes on.
func TestHoldThenCutReadsThePreAttachedStream(t *testing.T) {
	const k, sent, total = 6, 4, 9 // the source produced k tokens; its client got sent before the hold
	for _, commit := range []bool{true, false} {
		t.Run(fmt.Sprintf("commit=%v", commit), func(t *testing.T) {
			held := make(chan struct{})
			a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				for i := 0; i < total; i++ {
					if i == sent {
						<-held // the rest lags: it comes after the hold
					}
					_, _ = io.WriteString(w, tokenEvent(i))
					w.(http.Flusher).Flush()
					if commit && i == k-1 {
						<-r.Context().Done() // paused: nothing past what it exported
						return
					}
				}
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
			}))
			defer a.Close()
			var attaches []string
			var mu sync.Mutex
			b := cutTarget(k, total, func(r *http.Request) {
				mu.Lock()
				attaches = append(attaches, r.URL.RawQuery)
				mu.Unlock()
			})
			defer b.Close()
			p := newTestProxy(Options{}, testMetrics(), zap.NewNop())
			got := streamThrough(t, p, a.URL)
			s := waitStream(t, p, sent)
			at, _, ok := s.Hold()
			if !ok || at != len(" t0 t1 t2 t3") {
				t.Fatalf("hold at %d (%v), want %d", at, ok, len(" t0 t1 t2 t3"))
			}
			p.PreAttach(s.ID, b.URL, "B", 5*time.Second)
			close(held)
			time.Sleep(100 * time.Millisecond) // the source's lagging tokens reach the relay
			if n := s.Tokens(); n != sent {
				t.Fatalf("a held stream relayed %d tokens, want %d", n, sent)
			}
			want := ""
			if !commit {
				s.Release()
				for i := 0; i < total; i++ {
					want += tokenEvent(i)
				}
				want += "data: [DONE]\n\n"
				if body := <-got; body != want {
					t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
				}
				p.DropPreAttach(s.ID, "B")
				return
			}
			visible := len(" t0 t1 t2 t3 t4 t5")
			waitSplice(t, s.Cut(b.URL, "B", k, visible, at))
			if body, want := <-got, cutBody(sent, k, total); body != want {
				t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(attaches) != 1 || !strings.Contains(attaches[0], "from=-1") || !s.PreAttached() {
				t.Fatalf("attaches %q (pre-attach used: %v), want the one pre-attach", attaches, s.PreAttached())
			}
		})
	}
}

// cutGap is the text a cut's target opens with: the moved tokens t4 and
// t5 that the source produced but never sent its client.
const cutGap = " t4 t5"

// cutTarget is a target engine whose attach opens with cutGap and then
// streams tokens k … total-1; seen sees each attach request.
func cutTarget(k, total int, seen func(*http.Request)) *httptest.Server {
	return tokensTarget(gapEvent(), k, total, seen)
}

// tokensTarget is a target engine's attach: first, then tokens k to
// total and [DONE]; seen gets each request.
func tokensTarget(first string, k, total int, seen func(*http.Request)) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen(r)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, first)
		for i := k; i < total; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
}

func gapEvent() string {
	return fmt.Sprintf("data: {\"id\":\"cmpl-x\",\"choices\":[{\"index\":0,\"text\":%q,\"finish_reason\":null}]}\n\n", cutGap)
}

// cutBody is what the client of a stream cut over to cutTarget gets:
// the sent tokens from the source, the gap, then the target's tokens.
func cutBody(sent, k, total int) string {
	var b strings.Builder
	for i := 0; i < sent; i++ {
		b.WriteString(tokenEvent(i))
	}
	b.WriteString(gapEvent())
	for i := k; i < total; i++ {
		b.WriteString(tokenEvent(i))
	}
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

// A stream moved once is held and fenced on its new engine as on its
// first: moved back (or on) a second time, the engine it reads from now is
// the source. Its client gets every token once, and the second switch's
// gap starts at the last token from the second engine, not the first.
func TestASecondMoveHoldsAndFencesTheEngineTheStreamReadsNow(t *testing.T) {
	const k1, k2, total = 3, 6, 10 // A → B at k1, B → C at k2
	held := make(chan struct{})
	a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < k1; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
		}
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer a.Close()
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := k1; i < k2-1; i++ {
			_, _ = io.WriteString(w, tokenEvent(i))
			w.(http.Flusher).Flush()
		}
		<-held
		// The last token B exports, and then — its lease ended — more,
		// in one write: the hold, then the fence, keep them from the client.
		var rest strings.Builder
		for i := k2 - 1; i < total; i++ {
			rest.WriteString(tokenEvent(i))
		}
		_, _ = io.WriteString(w, rest.String())
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer b.Close()
	var fromC string
	c := tokensTarget("", k2, total, func(r *http.Request) { fromC = r.URL.Query().Get("from") })
	defer c.Close()

	p := newTestProxy(Options{StreamIdleTimeout: 3 * time.Second}, testMetrics(), zap.NewNop())
	got := streamThrough(t, p, a.URL)
	s := waitStream(t, p, k1)
	waitSplice(t, s.Splice(b.URL, "B", k1, -1))
	s = waitStream(t, p, k2-1)
	_, firstOnB := s.SwitchGap()
	if at, _, ok := s.Hold(); !ok || at != len(" t0 t1 t2 t3 t4") {
		t.Fatalf("hold on the second engine at %d (%v), want %d", at, ok, len(" t0 t1 t2 t3 t4"))
	}
	close(held)
	time.Sleep(100 * time.Millisecond) // B's later tokens reach the relay
	if n := s.Tokens(); n != k2-1 {
		t.Fatalf("a stream held on the engine it moved to relayed %d tokens, want %d", n, k2-1)
	}
	waitSplice(t, s.Splice(c.URL, "C", k2, -1))
	if body, want := <-got, tokensThenDone(total); body != want {
		t.Fatalf("client saw:\n%s\nwant:\n%s", body, want)
	}
	if fromC != fmt.Sprint(k2) {
		t.Fatalf("attached to C from %q, want %d", fromC, k2)
	}
	last, first := s.SwitchGap()
	if first.IsZero() || last.Before(firstOnB) {
		t.Fatalf("the second switch's gap runs from %v to %v; the stream read from B since %v", last, first, firstOnB)
	}
}

// Abandon ends the reads of an unhealthy instance's silent streams only:
// not a stream still getting tokens, not one a migration is moving or
// holding, not another instance's.
func TestAbandonEndsOnlySilentStreams(t *testing.T) {
	ss := NewStreams()
	long := time.Now().Add(-time.Minute)
	cancelled := map[string]bool{}
	add := func(id, instance string, last time.Time, moving bool) {
		s := &Stream{ID: id, Instance: instance, Started: long, lastSourceToken: last, done: make(chan struct{})}
		s.cancelA = func() { cancelled[id] = true }
		if moving {
			s.splice = &spliceTarget{}
		}
		ss.add(s)
	}
	add("silent", "a", long, false)
	add("no-token-yet", "a", time.Time{}, false)
	add("streaming", "a", time.Now(), false)
	add("moving", "a", long, true)
	add("elsewhere", "b", long, false)
	// A stream no other engine could take stays with its engine.
	if n := ss.Abandon("a", time.Second, func(s *Stream) bool { return s.ID != "silent" }); n != 1 || !cancelled["no-token-yet"] || len(cancelled) != 1 {
		t.Fatalf("abandoned %d where one had nowhere to go: %v", n, cancelled)
	}
	clear(cancelled)
	if n := ss.Abandon("a", time.Second, nil); n != 2 || !cancelled["silent"] || !cancelled["no-token-yet"] || len(cancelled) != 2 {
		t.Fatalf("abandoned %d: %v", n, cancelled)
	}
}
