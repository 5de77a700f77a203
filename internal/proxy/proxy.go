package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/openai"
	"github.com/vllm-hi/vllm-hi/internal/engine"
)

// Proxy forwards OpenAI requests to engines.
type Proxy struct {
	client       *http.Client
	log          *zap.Logger
	m            *Metrics
	writeTimeout time.Duration
	idleTimeout  time.Duration
	engineToken  string
	streams      *Streams
	recover      RecoverFunc // nil: a broken stream ends with an error
	// loops relay plain HTTP/1.1 streams (Options.EventLoop; nil: off),
	// over engine connections of the relay's own (dialer).
	loops           *eventLoops
	keepAlive       func(net.Conn) bool // SetKeepAlive
	engines         *enginePool         // engine connections the loop's streams left open
	dialer          *net.Dialer
	upstreamTimeout time.Duration
}

// Options configure a Proxy.
type Options struct {
	// ClientWriteTimeout caps how long one write to a client may block: a
	// client that stops reading is cut off and its upstream cancelled.
	ClientWriteTimeout time.Duration
	// MaxConnsPerEngine bounds idle keep-alive connections kept per engine.
	MaxIdleConnsPerEngine int
	// UpstreamTimeout bounds the wait for an engine's response headers: a
	// hung or sleeping engine answers 504 instead of holding the client
	// for ever. (A non-streaming answer comes whole, so this bounds it.)
	UpstreamTimeout time.Duration
	// StreamIdleTimeout bounds the silence between two events of a
	// stream; a stream that says nothing for longer ends with an error
	// event.
	StreamIdleTimeout time.Duration
	// EngineToken is the agent credential, sent when attaching to an
	// engine's stream hook (hooks refuse callers without it).
	EngineToken string
	// TLS verifies https engines (nil: the system roots).
	TLS *tls.Config
	// EventLoop relays streams on epoll loops of the relay's own, one per
	// CPU Go uses, where client and engine speak plain HTTP/1.1
	// (evloop_linux.go): nginx's cost per event rather than a goroutine's.
	EventLoop bool
}

// Defaults of Options.
const (
	DefaultUpstreamTimeout   = 10 * time.Minute
	DefaultStreamIdleTimeout = 2 * time.Minute
)

// New returns a Proxy.
func New(o Options, m *Metrics, log *zap.Logger) *Proxy {
	if o.ClientWriteTimeout <= 0 {
		o.ClientWriteTimeout = 30 * time.Second
	}
	if o.MaxIdleConnsPerEngine <= 0 {
		o.MaxIdleConnsPerEngine = 4096
	}
	if o.UpstreamTimeout <= 0 {
		o.UpstreamTimeout = DefaultUpstreamTimeout
	}
	if o.StreamIdleTimeout <= 0 {
		o.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	tr := &http.Transport{
		Proxy:               nil, // engines are reached directly, never through HTTP_PROXY
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        0,
		MaxIdleConnsPerHost: o.MaxIdleConnsPerEngine,
		// Below vLLM's HTTP keep-alive (5 s): a completion must never go
		// out on a connection the engine is closing (engine.IdleConnTimeout).
		IdleConnTimeout:       engine.IdleConnTimeout,
		DisableCompression:    true, // pass bytes through; never gzip SSE
		WriteBufferSize:       16 << 10,
		ReadBufferSize:        32 << 10,
		ResponseHeaderTimeout: o.UpstreamTimeout,
		TLSClientConfig:       o.TLS,
	}
	p := &Proxy{client: &http.Client{Transport: tr}, log: log, m: m, writeTimeout: o.ClientWriteTimeout,
		idleTimeout: o.StreamIdleTimeout, engineToken: o.EngineToken, streams: NewStreams(),
		dialer: &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}, upstreamTimeout: o.UpstreamTimeout}
	if o.EventLoop {
		loops, err := newEventLoops(runtime.GOMAXPROCS(0), log)
		if err != nil {
			log.Warn("the relay's event loop is off", zap.Error(err))
		} else {
			p.loops = loops
			p.engines = newEnginePool(o.MaxIdleConnsPerEngine, engine.IdleConnTimeout)
		}
	}
	return p
}

// Streams is the table of live streams (for splicing).
func (p *Proxy) Streams() *Streams { return p.streams }

// Close releases idle upstream connections and stops the event loops
// (their streams go on on their goroutines).
func (p *Proxy) Close() {
	p.client.CloseIdleConnections()
	if p.loops != nil {
		p.loops.close()
		p.engines.close()
	}
}

// Upstream is where one request goes.
type Upstream struct {
	BaseURL    string // engine base URL
	Path       string // e.g. /v1/chat/completions
	Body       []byte
	Header     http.Header // headers to pass on
	Model      string
	InstanceID string
	RequestID  string // the engine's request id; streams are registered under it for splicing
	// Sent, when set, is called once the engine answered (or could not be
	// reached): the body is no longer needed.
	Sent func()
	// Reroute, when set, names another instance for a request whose engine
	// could not be reached (refused, or the connection dropped before it
	// answered: a dead engine the registry still lists); ok false: none.
	Reroute func(tried []string) (baseURL, instanceID string, ok bool)
	// Hold, when set, is asked about an engine's 503 answer (its body
	// given) before the client saw anything: true means it waited until
	// the engine can serve again (an elastic-EP commit ended) and the
	// request is sent again; false passes the 503 on.
	Hold func(ctx context.Context, instanceID string, body []byte) bool
	// TokenIDs says the engine sends the stream's token ids: the relay
	// keeps them for a failover and a migration's switch. Unless the
	// client asked for them itself (ClientTokenIDs), the Host did
	// (WithReturnTokenIDs), and the relay gives the client its chunks as
	// they would have been without them.
	TokenIDs       bool
	ClientTokenIDs bool
	// EngineKind is the kind of the instance's engine (Stream.EngineKind).
	EngineKind string
	// Stream says the client asked for a stream (the body's "stream":
	// true): one a migration moves before its engine answered goes on
	// from the target.
	Stream bool
	// OnFirstToken, when set, is called once, when the client is sent its
	// first token event (a stream) or the answer's head (anything else
	// that succeeded): the time to first token as the client sees it.
	OnFirstToken func(at time.Time)
}

// maxHolds bounds how often one request is held and sent again.
const maxHolds = 4

// post is the request up describes, sent to the engine at baseURL.
func post(ctx context.Context, baseURL string, up Upstream) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(baseURL, "/")+up.Path, bytes.NewReader(up.Body))
	if err != nil {
		return nil, err
	}
	for k, vs := range up.Header {
		req.Header[k] = vs
	}
	return req, nil
}

// isEventStream reports whether an engine answered with a stream.
func isEventStream(resp *http.Response) bool {
	return resp.StatusCode == http.StatusOK && strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
}

// maxReroutes bounds how many other engines an unreachable one's request
// tries.
const maxReroutes = 2

// unreachable reports whether err says the engine never took the request:
// nothing listened, or the connection dropped before any answer.
func unreachable(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF)
}

// TagHeader is the request header whose value a client gives its request
// as a tag, which migration request filters can select on (expr:tag ==
// "batch"). It stays with the Host: the engine is not sent it.
const TagHeader = "X-Vhi-Tag"

// maxTagBytes bounds a tag: it is kept with the stream for its life.
const maxTagBytes = 256

func clientTag(h http.Header) string {
	t := h.Get(TagHeader)
	if len(t) > maxTagBytes {
		t = t[:maxTagBytes]
	}
	return t
}

// Result says how a forwarded request ended.
type Result struct {
	Status    int
	Tokens    int  // token events forwarded (streams)
	Done      bool // the stream ended with [DONE]
	Truncated bool // the upstream died mid-stream; an error event was sent
	// FirstToken is when the client was sent the first token event (a
	// stream) or the answer's head (anything else that succeeded); zero
	// when neither happened.
	FirstToken time.Time
}

// StatusClientClosed is recorded when the client went away first (nginx's
// convention).
const StatusClientClosed = 499

// Forward sends the request upstream and relays the answer. Streams are
// relayed event by event; everything else passes through unchanged.
func (p *Proxy) Forward(w http.ResponseWriter, r *http.Request, up Upstream) Result {
	ctx := r.Context()
	// The upstream request has a context of its own so that a splice can
	// stop reading the source engine while the client stream goes on.
	upCtx, cancelUp := context.WithCancel(ctx)
	defer func() { cancelUp() }() // the last upstream's (a reroute takes a new one)
	req, err := post(upCtx, up.BaseURL, up)
	if err != nil {
		return p.fail(w, up, http.StatusBadGateway, "bad_url", fmt.Sprintf("bad engine URL %q: %v", up.BaseURL, err))
	}
	// Register the stream before the engine answers: a migration that
	// starts while the request is still prefilling must find it.
	s := &Stream{ID: up.RequestID, Instance: up.InstanceID, Model: up.Model, Tag: clientTag(r.Header), EngineKind: up.EngineKind,
		Started: time.Now(), cancelA: cancelUp, done: make(chan struct{}), ctx: ctx}
	if up.TokenIDs {
		s.ids = &streamIDs{clients: up.ClientTokenIDs}
	}
	if p.recover != nil && len(up.Body) <= maxReplayBody {
		s.request = &Upstream{Path: up.Path, Body: up.Body, Header: up.Header}
	}
	if up.RequestID != "" {
		p.streams.add(s)
		defer p.streams.remove(s)
	}
	defer func() {
		s.mu.Lock()
		if s.pre != nil {
			s.pre.drop()
		}
		s.pre = nil
		close(s.done)
		if sp := s.splice; sp != nil && sp.switched != nil {
			sp.switched <- fmt.Errorf("stream %s ended before it could move", s.ID)
			sp.switched = nil
		}
		s.mu.Unlock()
	}()
	resp, err := p.do(req, p.laneFits(r, up.BaseURL, up))
	tried := []string{up.InstanceID}
	for n := 0; err != nil && (unreachable(err) || s.abandonedUnanswered(upCtx)) && up.Reroute != nil && ctx.Err() == nil && n < maxReroutes; n++ {
		url, id, ok := up.Reroute(tried)
		if !ok {
			break
		}
		p.log.Warn("engine unreachable; sending the request to another instance", zap.String("instance", up.InstanceID),
			zap.String("to", id), zap.Error(err))
		p.m.Rerouted.Inc()
		tried = append(tried, id)
		up.BaseURL, up.InstanceID = url, id
		s.mu.Lock()
		s.Instance = id
		s.EngineKind = "" // the other instance's: the registry says
		if upCtx.Err() != nil {
			// Failover gave the unhealthy engine up before it answered
			// (Streams.Abandon): the client has nothing yet, so the
			// request starts afresh elsewhere, on a context of its own.
			upCtx, cancelUp = context.WithCancel(ctx)
			s.cancelA = cancelUp
		}
		s.mu.Unlock()
		if req, err = post(upCtx, url, up); err != nil {
			break
		}
		resp, err = p.do(req, p.laneFits(r, url, up))
	}
	for n := 0; err == nil && resp.StatusCode == http.StatusServiceUnavailable && up.Hold != nil && n < maxHolds; n++ {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(b))
		if !up.Hold(ctx, up.InstanceID, b) {
			break
		}
		p.m.Held.Inc()
		if req, err = post(upCtx, up.BaseURL, up); err != nil {
			break
		}
		resp, err = p.do(req, p.laneFits(r, up.BaseURL, up))
	}
	if up.Sent != nil {
		up.Sent()
	}
	if err != nil && up.Stream && ctx.Err() == nil && s.splicePending() {
		// A migration moved the stream before its engine answered (the
		// source had produced nothing the client has): the stream opens
		// on the target, from the relay's switch.
		return p.relay(ctx, w, failedRead{err}, s, up)
	}
	if err != nil {
		if r.Context().Err() != nil {
			return Result{Status: StatusClientClosed}
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return p.fail(w, up, http.StatusGatewayTimeout, "timeout", fmt.Sprintf("engine %s did not answer within %v", up.InstanceID, p.client.Transport.(*http.Transport).ResponseHeaderTimeout))
		}
		return p.fail(w, up, http.StatusBadGateway, "connect", fmt.Sprintf("engine %s unreachable: %v", up.InstanceID, err))
	}
	defer resp.Body.Close()
	if !isEventStream(resp) {
		return p.passThrough(w, resp, up)
	}
	if res, ok := p.relayOnLoop(ctx, w, r, resp, s, up); ok {
		return res
	}
	return p.relay(ctx, w, resp.Body, s, up)
}

func (p *Proxy) passThrough(w http.ResponseWriter, resp *http.Response, up Upstream) Result {
	for _, k := range []string{"Content-Type", "Retry-After"} {
		if v := resp.Header.Get(k); v != "" {
			w.Header().Set(k, v)
		}
	}
	w.WriteHeader(resp.StatusCode)
	res := Result{Status: resp.StatusCode}
	if resp.StatusCode < 300 {
		res.FirstToken = time.Now()
		if up.OnFirstToken != nil {
			up.OnFirstToken(res.FirstToken)
		}
	}
	_, _ = io.Copy(w, resp.Body)
	return res
}

// relay is the streaming loop: read an event, classify it, write it
// byte-exact, and flush unless the next event is already in hand. A splice
// (see Stream.Splice) swaps the upstream once exactly the source's tokens
// went to the client.
func (p *Proxy) relay(ctx context.Context, w http.ResponseWriter, body io.Reader, s *Stream, up Upstream) Result {
	writeStreamHead(w.Header())
	w.WriteHeader(http.StatusOK)
	p.m.StreamsInFlight.Inc()
	defer p.m.StreamsInFlight.Dec()
	return p.relayFrom(ctx, w, body, s, up, &relayState{res: Result{Status: http.StatusOK}}, nil)
}

// writeStreamHead sets the headers of a relayed stream.
func writeStreamHead(h http.Header) {
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
}

// relayFrom is the relay's loop from state st on, the stream's head
// written; watchdog is the one that watches body (nil: a new one).
func (p *Proxy) relayFrom(ctx context.Context, w http.ResponseWriter, body io.Reader, s *Stream, up Upstream, st *relayState, watchdog *idleWatchdog) Result {
	rc := http.NewResponseController(w)
	res := &st.res
	er := NewEventReader(body)
	onTarget := false
	var pending []time.Time // read times of events written but not yet flushed
	var deadline time.Time  // the client write deadline currently set
	// An engine that goes silent mid-stream (hung, or paused and never
	// resumed) is cut after the idle timeout: the read fails and the
	// client gets an error event instead of waiting for ever.
	if watchdog == nil {
		watchdog = newIdleWatchdog(p.idleTimeout, s.cancelUpstream)
	}
	defer func() { watchdog.stop() }()
	// goOn reads from where a failover took the stream: another engine;
	// a replay's first events, which the client has, are skipped.
	var recoveredBodies []io.Closer
	defer func() {
		for _, b := range recoveredBodies {
			b.Close()
		}
	}()
	goOn := func(next recovered) {
		recoveredBodies = append(recoveredBodies, next.body)
		er = NewEventReader(next.body)
		onTarget = true
		if next.replay {
			st.skipTokens, st.skipRole = res.Tokens, st.sawRole
		}
	}
	for {
		ev, err := er.Next()
		if err != nil {
			if ctx.Err() != nil {
				res.Status = StatusClientClosed
				return *res
			}
			if watchdog.fired() {
				p.m.UpstreamErrors.WithLabelValues(up.Model, "idle").Inc()
				// A hung engine is as good as a dead one: the stream goes on
				// from another where it can.
				next := p.failover(ctx, s)
				if next.body != nil {
					goOn(next)
					watchdog.stop() // fired: a new one watches the new engine
					watchdog = newIdleWatchdog(p.idleTimeout, s.cancelUpstream)
					continue
				}
				p.writeStreamError(w, rc, fmt.Sprintf("the engine sent nothing for %v after %d tokens%s", p.idleTimeout, res.Tokens, next.failedOver()))
				res.Truncated = true
				return *res
			}
			if next, ok := p.trySwitch(ctx, s); ok {
				if next == nil {
					p.writeStreamError(w, rc, fmt.Sprintf("moving the stream to another engine failed after %d tokens", res.Tokens))
					res.Truncated = true
					return *res
				}
				defer next.Close()
				er = NewEventReader(next)
				onTarget = true
				continue
			}
			next := p.failover(ctx, s)
			if next.body != nil {
				goOn(next) // the engine died
				continue
			}
			kind := "read"
			if err == io.EOF {
				kind = "eof_without_done"
			}
			p.m.UpstreamErrors.WithLabelValues(up.Model, kind).Inc()
			p.log.Warn("upstream stream ended early", zap.String("instance", up.InstanceID), zap.Error(err), zap.Int("tokens", res.Tokens))
			p.writeStreamError(w, rc, fmt.Sprintf("the engine stream ended unexpectedly after %d tokens: %v%s", res.Tokens, err, next.failedOver()))
			res.Truncated = true
			return *res
		}
		read := time.Now()
		watchdog.saw(read)
		raw, kind, step := p.admit(st, s, ev, read, true)
		switch step {
		case stepSkip:
			continue
		case stepCut:
			s.cancelUpstream() // switch instead
			continue
		}
		// Moving the deadline costs a runtime timer update; refresh it
		// only when half of it has passed.
		if deadline.Sub(read) < p.writeTimeout/2 {
			deadline = read.Add(p.writeTimeout)
			_ = rc.SetWriteDeadline(deadline)
		}
		if _, err := w.Write(raw); err != nil {
			res.Status = StatusClientClosed
			return *res
		}
		if kind == KindToken && res.FirstToken.IsZero() {
			res.FirstToken = read
			if up.OnFirstToken != nil {
				up.OnFirstToken(read)
			}
		}
		pending = append(pending, read)
		if kind == KindDone || !er.Buffered() {
			if err := rc.Flush(); err != nil {
				res.Status = StatusClientClosed
				return *res
			}
			now := time.Now()
			for _, t := range pending {
				p.m.AddedLatency.Observe(now.Sub(t).Seconds())
			}
			pending = pending[:0]
			if onTarget {
				s.mu.Lock()
				// A stream recovered by failover has no splice record; a
				// stream's next migration has one that has not switched.
				if s.splice != nil && s.splice.moved && s.splice.at.IsZero() {
					s.splice.at = now
				}
				s.mu.Unlock()
			}
		}
		if kind == KindDone {
			res.Done = true
			return *res
		}
	}
}

// trySwitch is called when the upstream read ended: if a splice is due
// (exactly its token count went out), it opens the target's stream. ok
// reports whether a splice was due; next is nil when opening failed.
func (p *Proxy) trySwitch(ctx context.Context, s *Stream) (next io.ReadCloser, ok bool) {
	s.mu.Lock()
	sp := s.splice
	due := s.spliceDueLocked()
	cut, textFrom := s.cutLocked(), s.text
	s.mu.Unlock()
	if !due && !cut {
		return nil, false
	}
	var resp *http.Response
	var cancel context.CancelFunc
	var err error
	if cut {
		// The client lacks the text from textFrom on: the target sends it
		// first — over the pre-attached stream when it opens there (the
		// stream was held at textFrom), else over a new attach.
		if sp.armed == textFrom { // −1 (not armed) never is
			resp, cancel = s.takePreAttach(ctx, sp.instance)
		}
		if resp == nil {
			s.dropPreAttachFor(sp.instance)
			var actx context.Context
			actx, cancel = context.WithCancel(ctx)
			resp, err = p.openAttachURL(actx, sp, s.ID, cutURL(sp.url, s.ID, sp.from, textFrom))
		}
	} else if resp, cancel = s.takePreAttach(ctx, sp.instance); resp == nil {
		var actx context.Context
		actx, cancel = context.WithCancel(ctx)
		resp, err = p.openAttach(actx, sp, s.ID)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		cancel()
		sp.switched <- err
		sp.switched = nil
		p.log.Error("stream splice failed", zap.String("request_id", s.ID), zap.Error(err))
		return nil, true
	}
	s.cancelA = cancel
	s.Instance = sp.instance
	sp.moved, sp.lastSource = true, s.lastSourceToken
	sp.switched <- nil
	sp.switched = nil
	return resp.Body, true
}

// Recovery says where a stream whose engine died goes on: the target's
// base URL and id, and whether the target holds the request already (an
// install: attach from the client's place) or must be sent the original
// request again (Replay: its first events, which the client has, are
// skipped — only for requests whose replay is known to produce the same
// tokens).
type Recovery struct {
	BaseURL, Instance string
	Replay            bool
	// From, when > 0, is the output token index the new stream starts at
	// (the tokens installed there: the relay's token ids); else the token
	// events the client got.
	From int
}

// RecoverFunc finds where a stream whose engine died — after the client
// got sent token events and text code points — goes on
// (internal/failover).
type RecoverFunc func(ctx context.Context, s *Stream, sent, text int) (Recovery, error)

// maxReplayBody bounds the request bodies a stream keeps for a replay
// (larger ones are not replayed).
const maxReplayBody = 256 << 10

// SetRecover turns on failover: a stream whose upstream breaks goes on
// from where recover installs it. Set before serving.
func (p *Proxy) SetRecover(recover RecoverFunc) { p.recover = recover }

// SetKeepAlive sets where a client connection whose stream the event loop
// relayed goes once the stream's body is whole: keepAlive serves it again
// for the client's next request (the Host's listener takes it back);
// false, or none set, closes it — and then the stream's head says
// Connection: close. Call before serving.
func (p *Proxy) SetKeepAlive(keepAlive func(net.Conn) bool) { p.keepAlive = keepAlive }

// recovered is where a broken stream goes on: the new engine's stream
// (nil: nowhere) and whether it replays the request from its start.
type recovered struct {
	body   io.ReadCloser
	replay bool
	why    error // a failover that failed: why
}

// failedOver is what a stream's final error event adds when a failover
// was tried and failed: why the stream could not go on elsewhere (say, a
// structured-output request, which no survivor can take mid-grammar).
func (r recovered) failedOver() string {
	if r.why == nil {
		return ""
	}
	return "; it could not go on on another engine: " + r.why.Error()
}

// failover moves a stream whose upstream broke to another engine and
// returns that engine's stream, from the client's next token or, for a
// replay, from the start; no body when there is no failover or it failed
// (the caller ends the stream with an error, and why it could not go on
// elsewhere where a failover was tried: failedOver).
func (p *Proxy) failover(ctx context.Context, s *Stream) recovered {
	if p.recover == nil {
		return recovered{}
	}
	s.mu.Lock()
	sent, text := s.tokens, s.text
	s.mu.Unlock()
	rec, err := p.recover(ctx, s, sent, text)
	if err != nil {
		return recovered{why: err}
	}
	actx, cancel := context.WithCancel(ctx)
	var body io.ReadCloser
	if rec.Replay {
		body, err = p.replay(actx, s, rec.BaseURL)
	} else {
		var resp *http.Response
		at := &spliceTarget{url: rec.BaseURL, instance: rec.Instance, from: sent, text: -1}
		if rec.From > 0 {
			// Installed with the client's own tokens: the stream opens
			// after them, with whatever of their text the client lacks
			// (text its engine held back for a stop string).
			at.from, at.text = rec.From, text
		}
		if resp, err = p.openAttach(actx, at, s.ID); err == nil {
			body = resp.Body
		}
	}
	if err != nil {
		cancel()
		p.log.Warn("opening the recovered stream failed", zap.String("request_id", s.ID), zap.String("instance", rec.Instance),
			zap.Bool("replay", rec.Replay), zap.Error(err))
		return recovered{why: fmt.Errorf("open the stream on %s: %w", rec.Instance, err)}
	}
	s.mu.Lock()
	s.cancelA, s.Instance = cancel, rec.Instance
	s.mu.Unlock()
	return recovered{body: body, replay: rec.Replay}
}

// CanReplay reports whether the stream kept its request for a replay.
func (s *Stream) CanReplay() bool { return s.request != nil }

// replay sends the stream's original request to the engine at baseURL.
func (p *Proxy) replay(ctx context.Context, s *Stream, baseURL string) (io.ReadCloser, error) {
	up := s.request
	if up == nil {
		return nil, fmt.Errorf("stream %s kept no request to replay", s.ID)
	}
	req, err := post(ctx, baseURL, *up)
	if err != nil {
		return nil, err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, err
	}
	if !isEventStream(resp) {
		resp.Body.Close()
		return nil, fmt.Errorf("the replay answered %d", resp.StatusCode)
	}
	return resp.Body, nil
}

// writeStreamError ends a stream whose upstream died with an OpenAI-style
// error event and [DONE], so clients see a clean, explained end.
func (p *Proxy) writeStreamError(w http.ResponseWriter, rc *http.ResponseController, msg string) {
	b, _ := json.Marshal(openai.NewError(http.StatusBadGateway, "BadGatewayError", "", msg))
	_ = rc.SetWriteDeadline(time.Now().Add(p.writeTimeout))
	_, _ = w.Write(append(append([]byte("data: "), b...), "\n\ndata: [DONE]\n\n"...))
	_ = rc.Flush()
}

func (p *Proxy) fail(w http.ResponseWriter, up Upstream, status int, kind, msg string) Result {
	p.m.UpstreamErrors.WithLabelValues(up.Model, kind).Inc()
	typ := "BadGatewayError"
	if status == http.StatusGatewayTimeout {
		typ = "GatewayTimeoutError"
	}
	WriteError(w, status, typ, msg)
	return Result{Status: status}
}

// WriteError writes the contract's JSON error shape.
func WriteError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(openai.NewError(status, typ, "", msg))
}
