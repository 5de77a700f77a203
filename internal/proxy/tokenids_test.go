package proxy

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

func TestWithReturnTokenIDs(t *testing.T) {
	for _, c := range []struct {
		in, want string
		ok       bool
	}{
		{`{"model":"m","stream":true}`, `{"return_token_ids":true,"model":"m","stream":true}`, true},
		{"  {\n \"model\":\"m\"}", "  {\"return_token_ids\":true,\n \"model\":\"m\"}", true},
		{`{}`, `{"return_token_ids":true}`, true},
		{`{ }`, `{"return_token_ids":true }`, true},
		// The client's own choice stands, either way.
		{`{"model":"m","return_token_ids":false}`, `{"model":"m","return_token_ids":false}`, false},
		{`{"model":"m","return_token_ids":true}`, `{"model":"m","return_token_ids":true}`, false},
		{`[1]`, `[1]`, false},
		{``, ``, false},
	} {
		got, ok := WithReturnTokenIDs([]byte(c.in))
		if string(got) != c.want || ok != c.ok {
			t.Errorf("%q: got %q, %v; want %q, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

// Chunks as vLLM 0.26 and 0.32 write them for /v1/completions, with and
// without return_token_ids (the fields are set either way: null without).
const (
	firstAsked  = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" a\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null,\"prompt_token_ids\":[1, 2,3],\"token_ids\":[7]}]}\n\n"
	firstPlain  = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" a\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null,\"prompt_token_ids\":null,\"token_ids\":null}]}\n\n"
	mergedAsked = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" \\\"token_ids\\\":[9]\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null,\"prompt_token_ids\":null,\"token_ids\":[8,9]}]}\n\n"
	mergedPlain = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" \\\"token_ids\\\":[9]\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null,\"prompt_token_ids\":null,\"token_ids\":null}]}\n\n"
)

// The relay gives a client that did not ask the chunks vLLM would have
// sent it, byte for byte, and keeps the ids: the prompt's from the first
// chunk, every output token's in order (several in a merged chunk).
func TestTheRelayKeepsTheTokenIDsAndTheClientsBytes(t *testing.T) {
	var buf []byte
	for _, c := range [][2]string{{firstAsked, firstPlain}, {mergedAsked, mergedPlain}, {"data: [DONE]\n\n", "data: [DONE]\n\n"}} {
		got := withoutTokenIDs([]byte(c[0]), buf)
		if string(got) != c[1] {
			t.Errorf("got  %s\nwant %s", got, c[1])
		}
		buf = got[:0]
	}
	s := &Stream{ids: &streamIDs{}}
	for _, ev := range []string{firstAsked, mergedAsked} {
		data := []byte(ev[len("data: ") : len(ev)-2])
		kind, _, _ := ClassifyText(data)
		s.noteTokenIDs(kind, data)
	}
	prompt, output, ok := s.TokenIDs()
	if !ok || !slices.Equal(prompt, []int{1, 2, 3}) || !slices.Equal(output, []int{7, 8, 9}) {
		t.Fatalf("prompt %v, output %v, ok %v", prompt, output, ok)
	}
	// A token event without ids (an engine that does not report them)
	// makes the relay's ids unusable: they no longer match the client.
	data := []byte(firstPlain[len("data: ") : len(firstPlain)-2])
	s.noteTokenIDs(KindToken, data)
	if _, _, ok := s.TokenIDs(); ok {
		t.Fatal("the ids stayed usable after a token came without its id")
	}
	if _, _, ok := (&Stream{}).TokenIDs(); ok {
		t.Fatal("a stream the Host asked no ids for has ids")
	}
}

// A chat chunk vLLM sends only because it was asked for ids (an empty
// delta: a parser held the token's text back) is kept for its ids and not
// passed on; the last chunk, empty or not, is the client's.
func TestHeldBackChatChunks(t *testing.T) {
	held := []byte(`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[4]}]}`)
	last := []byte(`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":[5]}]}`)
	if kind, _, _ := ClassifyText(held); kind != KindOther || !heldBackChunk(held) {
		t.Fatalf("a held-back chunk: kind %v, held %v", kind, heldBackChunk(held))
	}
	if heldBackChunk(last) {
		t.Fatal("the finishing chunk taken for a held-back one")
	}
	s := &Stream{ids: &streamIDs{prompt: []int{1}}}
	for _, d := range [][]byte{held, last} {
		kind, _, _ := ClassifyText(d)
		s.noteTokenIDs(kind, d)
	}
	if _, out, ok := s.TokenIDs(); !ok || !slices.Equal(out, []int{4, 5}) {
		t.Fatalf("ids %v, ok %v", out, ok)
	}
}

// What keeping a stream's token ids costs the relay per event: reading
// them and giving the client the chunk without them.
func BenchmarkTokenIDsPerEvent(b *testing.B) {
	raw := []byte(mergedAsked)
	data := raw[len("data: ") : len(raw)-2]
	kind, _, _ := ClassifyText(data) // the relay classifies every event anyway
	s := &Stream{ids: &streamIDs{}}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		s.noteTokenIDs(kind, data)
		buf = withoutTokenIDs(raw, buf)[:0]
		if len(s.ids.output) > 1<<16 {
			s.ids.output = s.ids.output[:0]
		}
	}
}

func TestIntList(t *testing.T) {
	for in, want := range map[string][]int{"[]": {}, "[7]": {7}, "[1, 2,3]x": {1, 2, 3}, "[151935]": {151935}} {
		got, n, ok := intList([]byte(in), []int{})
		if !ok || !slices.Equal(got, want) || in[n-1] != ']' {
			t.Errorf("%q: %v %d %v", in, got, n, ok)
		}
	}
	for _, in := range []string{"", "null", "[1,]", "[,1]", "[1", "[-1]", "[1.5]", "[99999999999999999999]"} {
		if got, _, ok := intList([]byte(in), []int{9}); ok || !slices.Equal(got, []int{9}) {
			t.Errorf("%q: parsed %v", in, got)
		}
	}
}

// A hold says how many output token ids the client got with its text
// (counted with each token event, so the two agree), or -1 where the
// relay does not know them.
func TestAHoldCountsTheTokenIDsTheClientGot(t *testing.T) {
	s := &Stream{ids: &streamIDs{}, done: make(chan struct{})}
	for _, ev := range []string{firstAsked, mergedAsked} {
		data := []byte(ev[len("data: ") : len(ev)-2])
		_, textLen, _ := ClassifyText(data)
		if !s.countToken(textLen, time.Now(), data) {
			t.Fatal("a token was not counted")
		}
	}
	text, ids, ok := s.Hold()
	if !ok || text != len(" a")+len(` "token_ids":[9]`) || ids != 3 {
		t.Fatalf("hold at %d code points and %d ids (%v), want %d and 3", text, ids, ok, len(" a")+len(` "token_ids":[9]`))
	}
	s.Release()
	plain := &Stream{done: make(chan struct{})}
	if _, ids, ok := plain.Hold(); !ok || ids != -1 {
		t.Fatalf("a stream without ids held with %d ids (%v), want -1", ids, ok)
	}
	data := []byte(firstPlain[len("data: ") : len(firstPlain)-2])
	_, textLen, _ := ClassifyText(data)
	s.countToken(textLen, time.Now(), data) // a token without its id: the ids are no longer the client's
	if _, ids, _ := s.Hold(); ids != -1 {
		t.Fatalf("held with %d ids after a token came without its id, want -1", ids)
	}
}

// A client that asked for token ids itself gets vLLM's chunks with them,
// byte for byte; one whose ids only the Host asked for gets them nulled.
// Both streams' ids are the relay's.
func TestAClientThatAskedForTokenIDsKeepsThem(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, firstAsked+mergedAsked+"data: [DONE]\n\n")
	}))
	defer engine.Close()
	for _, c := range []struct {
		clients bool
		want    string
	}{{true, firstAsked + mergedAsked}, {false, firstPlain + mergedPlain}} {
		p := newTestProxy(Options{}, testMetrics(), zap.NewNop())
		var ids []int
		front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			p.Forward(w, r, Upstream{BaseURL: engine.URL, Path: "/v1/completions", Body: []byte(`{}`), Model: "m", InstanceID: "A",
				RequestID: "cmpl-1", TokenIDs: true, ClientTokenIDs: c.clients, Stream: true,
				OnFirstToken: func(time.Time) {
					if s := p.Streams().Get("cmpl-1"); s != nil {
						_, ids, _ = s.TokenIDs()
					}
				}})
		}))
		resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		front.Close()
		if string(body) != c.want+"data: [DONE]\n\n" {
			t.Fatalf("client asked for ids: %v; got\n%s\nwant\n%s", c.clients, body, c.want+"data: [DONE]\n\n")
		}
		if !slices.Equal(ids, []int{7}) {
			t.Fatalf("client asked for ids: %v; the relay's ids after the first token %v, want [7]", c.clients, ids)
		}
	}
}

// A chunk that carries a token's id and no text waits out a hold as a
// token event does: the hold's id count is what the client got, and a
// chunk that would have gone out after it is the target's to send (it was
// relayed anyway before, and its id came twice).
func TestAHeldBackChunkWaitsOutAHold(t *testing.T) {
	held := []byte(`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[4]}]}`)
	s := &Stream{ids: &streamIDs{prompt: []int{1}, clients: true}, done: make(chan struct{})}
	if !s.countHeldBackIDs(held) {
		t.Fatal("a held-back chunk outside a hold was not relayed")
	}
	_, ids, ok := s.Hold()
	if !ok || ids != 1 {
		t.Fatalf("held with %d ids (%v), want 1", ids, ok)
	}
	passed := make(chan bool, 1)
	go func() { passed <- s.countHeldBackIDs(held) }()
	select {
	case <-passed:
		t.Fatal("a held-back chunk went past a hold")
	case <-time.After(50 * time.Millisecond):
	}
	if _, again, _ := s.Hold(); again != 1 {
		t.Fatalf("the hold's count moved to %d while held", again)
	}
	s.Release() // no switch: the source goes on, the chunk with it
	if !<-passed {
		t.Fatal("a held-back chunk after a released hold was dropped")
	}
	if _, out, _ := s.TokenIDs(); !slices.Equal(out, []int{4, 4}) {
		t.Fatalf("ids %v, want [4 4]", out)
	}
}

// A cut asked for while the stream is held opens the target where the
// hold put the client: a source token event waiting on the hold is
// dropped, even one without text, whose id the target sends (it went out
// before, and the client got that id twice).
func TestACutAfterAHoldDropsATokenWithoutText(t *testing.T) {
	chunk := func(text string, id int) []byte {
		return fmt.Appendf(nil, `{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[%d]}]}`, text, id)
	}
	s := &Stream{ids: &streamIDs{prompt: []int{1}, clients: true}, done: make(chan struct{}), cancelA: func() {}}
	if !s.countToken(1, time.Now(), chunk("a", 7)) {
		t.Fatal("a token before the hold was not counted")
	}
	if text, ids, ok := s.Hold(); !ok || text != 1 || ids != 1 {
		t.Fatalf("held at %d code points, %d ids (%v)", text, ids, ok)
	}
	passed := make(chan bool, 1)
	go func() { passed <- s.countToken(0, time.Now(), chunk("", 8)) }()
	time.Sleep(20 * time.Millisecond)
	// The source's export reaches exactly the client's text (its last
	// token shows nothing yet): the target opens there with ids from 1.
	s.requestSplice(&spliceTarget{from: 5, text: 1, cut: true, armed: 1})
	if <-passed {
		t.Fatal("a token without text went out after the hold the cut was made at")
	}
	if _, out, _ := s.TokenIDs(); !slices.Equal(out, []int{7}) {
		t.Fatalf("the relay's ids %v, want [7]", out)
	}
}
