package host

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// budget bounds the request-body bytes the Host holds at once: without
// it, many slow or large uploads pin memory until the machine runs out.
type budget struct {
	mu        sync.Mutex
	used, max int64
}

func newBudget(max int64) *budget { return &budget{max: max} }

func (b *budget) take(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.max {
		return false
	}
	b.used += n
	return true
}

func (b *budget) give(n int64) {
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
}

var (
	errBodyTooLarge = errors.New("request body too large")
	errBodyBudget   = errors.New("the Host holds as many request bodies as it may")
)

// readBody reads a request body within the per-request limits (size, a
// read deadline) and the Host-wide body budget, which it takes as the
// bytes arrive; the caller gives back the returned amount.
func (h *Host) readBody(w http.ResponseWriter, r *http.Request) ([]byte, int64, error) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(h.cfg.RequestBodyTimeout))
	var held int64
	var buf []byte
	chunk := make([]byte, 32<<10)
	for {
		n, err := r.Body.Read(chunk)
		if n > 0 {
			if int64(len(buf)+n) > h.cfg.MaxRequestBody {
				h.bodies.give(held)
				return nil, 0, errBodyTooLarge
			}
			if !h.bodies.take(int64(n)) {
				h.bodies.give(held)
				return nil, 0, errBodyBudget
			}
			held += int64(n)
			buf = append(buf, chunk[:n]...)
		}
		if err == io.EOF {
			_ = rc.SetReadDeadline(time.Time{})
			return buf, held, nil
		}
		if err != nil {
			h.bodies.give(held)
			return nil, 0, err
		}
	}
}

// openAI routes a completion or chat request by its model.
func (h *Host) openAI(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	r, span := h.traced(r)
	defer span.End()
	body, held, err := h.readBody(w, r)
	var released sync.Once
	release := func() { released.Do(func() { h.bodies.give(held) }) }
	defer release()
	rid := newRequestID()
	// The Host's id for the request, answered whatever comes of it: what
	// a client quotes, and what the engine and the Host's log name.
	w.Header().Set("X-Request-Id", rid)
	if err != nil {
		// The rest of the body is not read: close the connection after
		// the answer instead of waiting for bytes that may never come.
		w.Header().Set("Connection", "close")
		h.bodyError(w, err)
		return
	}
	var head struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
		idFields
	}
	if err := json.Unmarshal(body, &head); err != nil {
		h.count("", http.StatusBadRequest)
		proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", "malformed JSON body: "+err.Error())
		return
	}
	if head.Model == "" {
		h.count("", http.StatusBadRequest)
		proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", "the request names no model")
		return
	}
	if h.switcher != nil && h.switcher.Has(head.Model) {
		if !h.leads() {
			// The leader's switcher sleeps and wakes the switched models.
			r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
			h.fromLeader(w, r)
			return
		}
		h.switched(w, r, rid, body, head.Model, head.Stream, release)
		return
	}
	inst, known, ok := h.route(head.Model, nil)
	switch {
	case !known:
		h.count("", http.StatusNotFound)
		proxy.WriteError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", head.Model))
		return
	case !ok:
		h.count(head.Model, http.StatusServiceUnavailable)
		h.observeFailure(head.Model, proxy.Result{Status: http.StatusServiceUnavailable})
		w.Header().Set("Retry-After", "1")
		proxy.WriteError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", fmt.Sprintf("no active, healthy instance serves `%s` right now", head.Model))
		return
	}
	// The engine request id is the Host's own, never the client's: a
	// client's X-Request-Id could name another client's stream (hiding it
	// from migration, or stealing its splice) or carry '/' and '?' into
	// the hook URLs. The client's id is logged for correlation.
	hdr, engineID := h.upstreamHeader(r, rid)
	// With failover on, the relay asks vLLM for a stream's token ids: a
	// survivor then gets exactly the client's tokens, however old the last
	// snapshot.
	idsExact := head.Stream && (inst.Engine.Kind == "vllm" || inst.Engine.Kind == "vhi-sim") && tokenIDsExact(r.URL.Path, head.idFields)
	trackIDs := false
	if idsExact && h.failover.RelaysTokenIDs() {
		body, trackIDs = proxy.WithReturnTokenIDs(body)
	}
	// A client that asked for the ids itself gets them as vLLM sends them;
	// the relay keeps them too, with failover off as well: a migration's
	// switch must carry on from the ids the client got (the target's
	// first event sends the moved tokens' ids after those).
	clientIDs := idsExact && !trackIDs && string(head.ReturnTokenIDs) == "true"

	res := h.proxy.Forward(w, r, proxy.Upstream{
		BaseURL: inst.Engine.URL, Path: r.URL.Path, Body: body, Header: hdr, Model: head.Model, InstanceID: inst.ID, TokenIDs: trackIDs || clientIDs, ClientTokenIDs: clientIDs, Stream: head.Stream, EngineKind: inst.Engine.Kind,
		RequestID: engineID, Sent: release, Hold: h.scaler.Hold, OnFirstToken: h.observeTTFT(head.Model, arrived),
		Reroute: func(tried []string) (string, string, bool) {
			i, _, ok := h.route(head.Model, tried)
			return i.Engine.URL, i.ID, ok
		},
	})
	h.count(head.Model, res.Status)
	h.observeFailure(head.Model, res)
	h.observeDone(r, rid, head.Model, inst.ID, arrived, res)
}

// observeDone records a relayed request's end: its duration and, for a
// stream, its mean time per output token; and its access log line.
func (h *Host) observeDone(r *http.Request, rid, model, instance string, arrived time.Time, res proxy.Result) {
	end := time.Now()
	annotate(r, rid, model, instance, res)
	h.m.duration.WithLabelValues(model).Observe(end.Sub(arrived).Seconds())
	if res.Tokens > 1 && !res.FirstToken.IsZero() {
		h.m.tpot.WithLabelValues(model).Observe(end.Sub(res.FirstToken).Seconds() / float64(res.Tokens-1))
	}
	fields := []zap.Field{zap.String("request_id", rid), zap.String("method", r.Method), zap.String("path", r.URL.Path),
		zap.String("model", model), zap.String("instance", instance), zap.Int("status", res.Status),
		zap.Int("tokens", res.Tokens), zap.Float64("duration_s", end.Sub(arrived).Seconds())}
	if !res.FirstToken.IsZero() {
		fields = append(fields, zap.Float64("ttft_s", res.FirstToken.Sub(arrived).Seconds()))
	}
	if cid := r.Header.Get("X-Request-Id"); cid != "" {
		fields = append(fields, zap.String("client_request_id", cid))
	}
	h.access.Info("request", fields...)
}

// observeTTFT is the proxy's first-token callback for a request of model
// that arrived then: it records the time to first token as it happens
// (not when the stream ends) — what the autoscaler reads.
func (h *Host) observeTTFT(model string, arrived time.Time) func(time.Time) {
	return func(at time.Time) {
		d := at.Sub(arrived)
		h.m.ttft.WithLabelValues(model).Observe(d.Seconds())
		if h.ttft != nil {
			h.ttft.Observe(model, at, d)
		}
	}
}

// observeFailure records a request of model that ended without a first
// token as failed. What the client did (a 4xx, leaving first) is not the
// deployment's doing and counts as nothing.
func (h *Host) observeFailure(model string, res proxy.Result) {
	if h.ttft == nil || !res.FirstToken.IsZero() || res.Status == proxy.StatusClientClosed || (res.Status >= 400 && res.Status < 500) {
		return
	}
	h.ttft.Fail(model, time.Now())
}

func (h *Host) count(model string, status int) {
	if model == "" {
		model = "unknown"
	}
	h.m.requests.WithLabelValues(model, fmt.Sprint(status)).Inc()
}

// upstreamHeader is what goes to the engine with a client's request, and
// the engine's request id. The id is the Host's own, never the client's:
// a client's X-Request-Id could name another client's stream (hiding it
// from migration, or stealing its splice) or carry '/' and '?' into the
// hook URLs. The client's id is logged for correlation.
func (h *Host) upstreamHeader(r *http.Request, rid string) (http.Header, string) {
	if cid := r.Header.Get("X-Request-Id"); cid != "" {
		h.log.Debug("request", zap.String("client_request_id", cid), zap.String("request_id", rid))
	}
	hdr := h.passedHeader(r.Header, rid)
	hdr.Set("Content-Type", "application/json")
	injectTrace(r, hdr)
	// The engine names the request by its response id: vLLM's prefix and
	// the id it was given.
	prefix := "cmpl-"
	if strings.HasSuffix(r.URL.Path, "/chat/completions") {
		prefix = "chatcmpl-"
	}
	return hdr, prefix + rid
}

// route picks a registered instance for model, avoiding those tried and
// the engines model switching owns: those sleep and wake under the
// switcher's leases, so only requests by their alias may reach them.
func (h *Host) route(model string, avoid []string) (registry.Instance, bool, bool) {
	inst, known, ok := h.reg.Route(model)
	if len(avoid) == 0 && (!ok || !h.switchedEngine(inst.Engine.URL)) {
		return inst, known, ok
	}
	avoid = append([]string(nil), avoid...)
	for _, in := range h.reg.List() {
		if h.switchedEngine(in.Engine.URL) {
			avoid = append(avoid, in.ID)
		}
	}
	inst, ok = h.reg.RouteAvoiding(model, avoid)
	return inst, known, ok
}

// idFields are the request fields that say whether its token ids are its
// client's output (tokenIDsExact), kept raw: the body's own validation is
// the engine's.
type idFields struct {
	N           json.RawMessage `json:"n"`
	BestOf      json.RawMessage `json:"best_of"`
	Echo        json.RawMessage `json:"echo"`
	Logprobs    json.RawMessage `json:"logprobs"`
	TopLogprobs json.RawMessage `json:"top_logprobs"`
	// ReturnTokenIDs is the client's own return_token_ids.
	ReturnTokenIDs json.RawMessage `json:"return_token_ids"`
}

// tokenIDsExact reports whether vLLM's token ids of a streamed request
// on path are exactly its client's output tokens, and the chunks with
// them the client's chunks once the relay nulls them: one choice of new
// tokens (with n or best_of above 1 the chunks interleave choices; with
// echo the first chunk's ids are the prompt's), and for chat no logprobs
// (asked for ids, vLLM sends a chat chunk with an empty delta for a token
// a reasoning or tool parser holds back, which the relay drops; with
// logprobs it sends that chunk either way).
func tokenIDsExact(path string, f idFields) bool {
	// absent reports whether a field is left out (or null); atMostOne
	// whether a count is left out or at most 1.
	absent := func(v json.RawMessage) bool { return len(v) == 0 || string(v) == "null" }
	atMostOne := func(v json.RawMessage) bool {
		var n int
		return absent(v) || (json.Unmarshal(v, &n) == nil && n <= 1)
	}
	if !atMostOne(f.N) || !atMostOne(f.BestOf) {
		return false
	}
	switch path {
	case "/v1/completions":
		return absent(f.Echo) || string(f.Echo) == "false"
	case "/v1/chat/completions":
		return (absent(f.Logprobs) || string(f.Logprobs) == "false") && absent(f.TopLogprobs)
	}
	return false
}
