package sim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/openai"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/tokenizer"
	"github.com/vllm-hi/vllm-hi/internal/version"
)

// fingerprint is the sim's system_fingerprint, shaped like vLLM's
// "vllm-<version>-<hash>".
var fingerprint = "vhi-sim-" + version.Version()

// maxBodyBytes bounds request bodies; prompts beyond it are far past any
// max_model_len the sim accepts.
const maxBodyBytes = 16 << 20

// Server is vLLM's HTTP surface in front of an Engine, plus the engine
// hooks under /vllm_hi/engine.
type Server struct {
	eng     *Engine
	log     *zap.Logger
	created int64
	now     func() time.Time
	newID   func() string
}

// NewServer wraps eng.
func NewServer(eng *Engine, log *zap.Logger) *Server {
	return &Server{eng: eng, log: log, created: time.Now().Unix(), now: time.Now, newID: randomID}
}

func randomID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Handler returns the routes.
func (s *Server) Handler() http.Handler {
	r := chi.NewRouter()
	r.Use(s.scalingGate)
	r.Post("/v1/completions", s.completions)
	r.Post("/v1/chat/completions", s.chatCompletions)
	r.Get("/v1/models", s.models)
	r.Get("/health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	r.Get("/version", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"version": version.Version()})
	})
	r.Handle("/metrics", promhttp.HandlerFor(s.eng.met.reg, promhttp.HandlerOpts{}))
	r.Get("/is_sleeping", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]bool{"is_sleeping": s.eng.IsSleeping()})
	})
	r.Get("/is_paused", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]bool{"is_paused": s.eng.IsPaused()})
	})
	r.Post("/is_scaling_elastic_ep", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]bool{"is_scaling_elastic_ep": s.eng.Scaling()})
	})
	// What changes the engine's state or reads its requests needs the
	// agent's credential.
	r.Group(func(r chi.Router) {
		r.Use(func(next http.Handler) http.Handler {
			return credentials.Require(s.eng.cfg.HookToken, func(w http.ResponseWriter) {
				writeError(w, &Error{Status: http.StatusUnauthorized, Type: "AuthenticationError",
					Message: "this route needs the agent's credential (Authorization: Bearer …)"})
			}, next)
		})
		r.Post("/sleep", s.sleep)
		r.Post("/wake_up", s.wakeUp)
		r.Post("/collective_rpc", s.collectiveRPC)
		r.Post("/pause", s.pause)
		r.Post("/resume", func(w http.ResponseWriter, _ *http.Request) {
			s.eng.ResumeGeneration()
			writeJSON(w, http.StatusOK, map[string]string{"status": "resumed"})
		})
		r.Post("/scale_elastic_ep", s.scaleElasticEP)
		r.Post("/vhi_sim/hold_tail", s.holdTail)
		if err := s.hookRoutes(r); err != nil {
			panic(err) // the table and the handlers disagree: a bug every test meets
		}
	})
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"detail": "Method Not Allowed"})
	})
	return r
}

// scalingGate answers every request with 503 while an elastic-EP scale runs,
// exactly as vLLM's ScalingMiddleware does (health and metrics included).
func (s *Server) scalingGate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.eng.Scaling() {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "The model is currently scaling. Please try again later."})
			return
		}
		next.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, err error) {
	e := asError(err)
	writeJSON(w, e.Status, openai.NewError(e.Status, e.Type, e.Param, e.Message))
}

// decodeBody reads a JSON body into v with vLLM's leniency (unknown fields
// are ignored) and its errors.
func decodeBody(r *http.Request, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(strings.ToLower(ct), "application/json") {
		return badRequest("", "Unsupported Media Type: Only 'application/json' is allowed")
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes+1))
	if err != nil {
		return badRequest("", "Could not read the request body: %v", err)
	}
	if len(body) > maxBodyBytes {
		return badRequest("", "Request body exceeds %d bytes.", maxBodyBytes)
	}
	if err := json.Unmarshal(body, v); err != nil {
		// vLLM (FastAPI) reports a validation error of the body.
		return &Error{Status: http.StatusBadRequest, Type: "Bad Request", Param: "body", Message: fmt.Sprintf("1 validation error: JSON decode error: %v", err)}
	}
	return nil
}

// decodeFor decodes a request's body into v and checks the model it
// names (*model, a field of v).
func (s *Server) decodeFor(r *http.Request, v any, model *string) error {
	if err := decodeBody(r, v); err != nil {
		return err
	}
	return s.checkModel(*model)
}

func (s *Server) checkModel(name string) error {
	for _, m := range s.eng.cfg.ServedModelNames {
		if m == name {
			return nil
		}
	}
	return notFound("model", "The model `%s` does not exist. Valid aliases: %s.", name, strings.Join(s.eng.cfg.ServedModelNames, ", "))
}

// sampling validates the shared fields and returns the engine's params.
func (s *Server) sampling(f openai.SamplingFields, defaultMax int) (hooks.SamplingParams, bool, error) {
	p := hooks.SamplingParams{Temperature: 1, TopP: 1, MaxTokens: defaultMax, IgnoreEOS: f.IgnoreEOS, Stop: f.Stop, StopTokenIDs: f.StopTokenIDs}
	if f.N != nil && *f.N != 1 {
		return p, false, badRequest("n", "vhi sim supports n=1 only, got n=%d.", *f.N)
	}
	if f.MaxTokens != nil {
		p.MaxTokens = *f.MaxTokens
		if p.MaxTokens < 1 {
			return p, false, badRequest("max_tokens", "max_tokens must be at least 1, got %d. (parameter=max_tokens, value=%d)", p.MaxTokens, p.MaxTokens)
		}
		if p.MaxTokens > s.eng.cfg.MaxModelLen {
			return p, false, badRequest("max_tokens", "max_tokens=%d cannot be greater than max_model_len=%d. Please request fewer output tokens. (parameter=max_tokens, value=%d)",
				p.MaxTokens, s.eng.cfg.MaxModelLen, p.MaxTokens)
		}
	}
	if f.Temperature != nil {
		if *f.Temperature < 0 {
			return p, false, badRequest("temperature", "temperature must be non-negative, got %g.", *f.Temperature)
		}
		p.Temperature = *f.Temperature
	}
	if f.TopP != nil {
		if *f.TopP <= 0 || *f.TopP > 1 {
			return p, false, badRequest("top_p", "top_p must be in (0, 1], got %g.", *f.TopP)
		}
		p.TopP = *f.TopP
	}
	if f.Seed != nil {
		p.Seed = *f.Seed
	}
	return p, f.Seed != nil, nil
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	var req openai.CompletionRequest
	if err := s.decodeFor(r, &req, &req.Model); err != nil {
		writeError(w, err)
		return
	}
	if req.Prompt == nil {
		writeError(w, badRequest("prompt", "Field required: prompt"))
		return
	}
	if req.Prompt.Count != 1 {
		writeError(w, badRequest("prompt", "vhi sim accepts exactly one prompt per request, got %d.", req.Prompt.Count))
		return
	}
	prompt := req.Prompt.Tokens
	if req.Prompt.IsText {
		prompt = s.eng.tok.Encode(req.Prompt.Text)
	}
	for _, t := range prompt {
		if t < 0 || t >= s.eng.tok.VocabSize() {
			writeError(w, badRequest("prompt", "Token id %d is out of vocabulary (size %d).", t, s.eng.tok.VocabSize()))
			return
		}
	}
	params, seeded, err := s.sampling(req.SamplingFields, 16)
	if err != nil {
		writeError(w, err)
		return
	}
	s.generate(w, r, "completion", "cmpl-", req.SamplingFields, prompt, params, seeded)
}

func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var req openai.ChatCompletionRequest
	if err := s.decodeFor(r, &req, &req.Model); err != nil {
		writeError(w, err)
		return
	}
	if len(req.Messages) == 0 {
		writeError(w, badRequest("messages", "messages must contain at least one message."))
		return
	}
	msgs := make([]tokenizer.ChatMessage, 0, len(req.Messages))
	for i, m := range req.Messages {
		text, err := m.Text()
		if err != nil {
			writeError(w, badRequest("messages", "messages[%d]: %v", i, err))
			return
		}
		if m.Role == "" {
			writeError(w, badRequest("messages", "messages[%d]: role is required.", i))
			return
		}
		msgs = append(msgs, tokenizer.ChatMessage{Role: m.Role, Content: text})
	}
	prompt := s.eng.tok.ApplyChatTemplate(msgs)
	if req.MaxTokens == nil && req.MaxCompletionTokens != nil {
		req.MaxTokens = req.MaxCompletionTokens
	}
	params, seeded, err := s.sampling(req.SamplingFields, max(1, s.eng.cfg.MaxModelLen-len(prompt)))
	if err != nil {
		writeError(w, err)
		return
	}
	s.generate(w, r, "chat", "chatcmpl-", req.SamplingFields, prompt, params, seeded)
}

// generate submits the request and answers it, streaming or not.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, kind, idPrefix string, f openai.SamplingFields, prompt []int, params hooks.SamplingParams, seeded bool) {
	if len(prompt) >= s.eng.cfg.MaxModelLen {
		writeError(w, badRequest("prompt", "This model's maximum context length is %d tokens. However, your prompt has %d tokens.", s.eng.cfg.MaxModelLen, len(prompt)))
		return
	}
	base := r.Header.Get("X-Request-Id")
	if base == "" {
		base = s.newID()
	}
	meta := hooks.ResponseMeta{Kind: kind, ResponseID: idPrefix + base, Model: f.Model, Created: s.now().Unix(), Stream: f.Stream}
	if f.StreamOptions != nil {
		meta.IncludeUsage = f.StreamOptions.IncludeUsage
		meta.ContinuousUsage = f.StreamOptions.ContinuousUsageStats
	}
	meta.ReturnTokenIDs = f.ReturnTokenIDs
	nr := NewRequest{ID: meta.ResponseID, Prompt: prompt, Params: params, Meta: meta, Priority: f.Priority, SeedSet: seeded}
	if err := s.eng.Submit(nr); err != nil {
		writeError(w, err)
		return
	}
	if f.Stream {
		s.stream(w, r.Context(), meta.ResponseID, 0, 0, true, prompt)
		return
	}
	s.respond(w, r.Context(), meta.ResponseID, kind, prompt)
}

// respond waits for the whole output and writes one JSON response.
func (s *Server) respond(w http.ResponseWriter, ctx context.Context, id, kind string, prompt []int) {
	wt, err := s.eng.Watcher(id)
	if err != nil {
		s.eng.AbortClient(id)
		return
	}
	var o Output
	for {
		o, err = wt.Next(ctx, len(o.Tokens)+o.From)
		if err != nil {
			s.eng.AbortClient(id)
			return
		}
		if o.Finished {
			break
		}
	}
	if o.Silent {
		panic(http.ErrAbortHandler)
	}
	usage := openai.Usage{PromptTokens: o.NumPrompt, CompletionTokens: o.NumOutput, TotalTokens: o.NumPrompt + o.NumOutput,
		PromptTokensDetails: openai.Null(), CompletionTokensDetails: openai.Null()}
	m := o.Meta
	if kind == "chat" {
		writeJSON(w, http.StatusOK, openai.ChatResponse{
			ID: m.ResponseID, Object: "chat.completion", Created: m.Created, Model: m.Model,
			Choices: []openai.ChatChoice{{Message: openai.ChatMessageOut{Role: "assistant", Content: o.Text},
				FinishReason: o.Reason, StopReason: o.StopReason}},
			SystemFingerprint: fingerprint, Usage: usage,
		})
		return
	}
	writeJSON(w, http.StatusOK, openai.CompletionResponse{
		ID: m.ResponseID, Object: "text_completion", Created: m.Created, Model: m.Model,
		Choices:           []openai.CompletionChoice{{Text: o.Text, FinishReason: o.Reason, StopReason: o.StopReason}},
		SystemFingerprint: fingerprint, Usage: usage,
	})
}

// stream writes a request's SSE events from output index from: one event
// per token, the finishing event, the usage event when asked for, [DONE].
// It serves both the client's own stream and the attach hook, so a stream
// continued on another engine is byte-compatible with the original.
//
// from −1 is a pre-attach: it waits up to wait for a migration to install
// the request, then streams from where it was installed.
//
// prompt, given for a new request's own stream, goes in its first chunk
// when the request asked for token ids (as vLLM's does).
func (s *Server) stream(w http.ResponseWriter, ctx context.Context, id string, from int, wait time.Duration, sendRole bool, prompt []int) {
	// Check the request exists before committing to a 200.
	var wt *Watcher
	var err error
	if from < 0 {
		wt, from, err = s.eng.AwaitInstalled(ctx, id, wait)
	} else {
		wt, err = s.eng.Watcher(id)
	}
	var o Output
	if err == nil {
		o, err = wt.Next(ctx, from)
	}
	if err != nil {
		if ctx.Err() == nil {
			writeError(w, err)
		}
		return
	}
	flusher, _ := w.(http.Flusher)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	enc := newEventWriter(w)
	m := o.Meta
	if sendRole && m.Kind == "chat" {
		empty := ""
		var null, promptIDs any
		if m.ReturnTokenIDs && prompt != nil {
			promptIDs = prompt
		}
		first := openai.ChatChunk{
			ID: m.ResponseID, Object: "chat.completion.chunk", Created: m.Created, Model: m.Model,
			Choices:        []openai.ChatStreamChoice{{Delta: openai.Delta{Role: "assistant", Content: &empty}}},
			PromptTokenIDs: &promptIDs, PromptText: &null,
		}
		if m.ContinuousUsage {
			first.Usage = &openai.Usage{PromptTokens: o.NumPrompt, TotalTokens: o.NumPrompt, CompletionTokensDetails: openai.Null()}
		}
		enc.event(first)
	}
	prev := o.TextBefore
	for {
		for i, tok := range o.Tokens {
			idx := o.From + i
			end := o.TextOffsets[i]
			delta := o.Text[prev:end]
			prev = end
			last := o.Finished && idx == o.NumOutput-1
			var promptIDs []int
			if idx == 0 && m.Kind != "chat" && m.ReturnTokenIDs {
				promptIDs = prompt
			}
			enc.event(s.chunk(m, delta, tok, idx, o, last, promptIDs))
		}
		if o.Finished {
			if o.Silent {
				// The request moved or was dropped by a hook: end this
				// connection without a finish so the reader knows it was cut.
				if flusher != nil {
					flusher.Flush()
				}
				panic(http.ErrAbortHandler)
			}
			if len(o.Tokens) == 0 {
				enc.event(s.chunk(m, "", -1, o.NumOutput, o, true, nil))
			}
			if m.IncludeUsage {
				enc.usage(m, o)
			}
			enc.done()
			if flusher != nil {
				flusher.Flush()
			}
			return
		}
		if enc.err != nil {
			s.eng.AbortClient(id)
			return
		}
		if flusher != nil {
			flusher.Flush()
		}
		from = o.From + len(o.Tokens)
		o, err = wt.Next(ctx, from)
		if err != nil {
			s.eng.AbortClient(id)
			return
		}
	}
}

// chunk builds the event of output token idx (tok < 0: a finish with no new
// token).
// prompt: the prompt's ids, for a completion's first chunk when the
// request asked for ids.
func (s *Server) chunk(m hooks.ResponseMeta, delta string, tok, idx int, o Output, last bool, prompt []int) any {
	var finish, stop any
	if last {
		finish, stop = o.Reason, o.StopReason
	}
	var usage *openai.Usage
	if m.ContinuousUsage {
		n := min(idx+1, o.NumOutput)
		usage = &openai.Usage{PromptTokens: o.NumPrompt, CompletionTokens: n, TotalTokens: o.NumPrompt + n}
		if m.Kind == "chat" {
			usage.CompletionTokensDetails = openai.Null()
		}
	}
	// vLLM stamps its fingerprint on the finishing chunk unless a usage
	// chunk follows, which then carries it.
	fp := ""
	if last && !m.IncludeUsage {
		fp = fingerprint
	}
	// The new token's id, when the request asked (vLLM sends the ids of
	// what the chunk adds: none for a finish without a token).
	var ids []int
	if m.ReturnTokenIDs {
		ids = []int{}
		if tok >= 0 {
			ids = append(ids, tok)
		}
	}
	if m.Kind == "chat" {
		var tokenIDs any
		if ids != nil {
			tokenIDs = ids
		}
		c := openai.ChatStreamChoice{Delta: openai.Delta{Content: &delta}, FinishReason: finish, TokenIDs: &tokenIDs}
		if last {
			c.StopReason = &stop
		}
		return openai.ChatChunk{ID: m.ResponseID, Object: "chat.completion.chunk", Created: m.Created, Model: m.Model,
			Choices: []openai.ChatStreamChoice{c}, Usage: usage, SystemFingerprint: fp}
	}
	return openai.CompletionChunk{ID: m.ResponseID, Object: "text_completion", Created: m.Created, Model: m.Model,
		Choices: []openai.CompletionStreamChoice{{Text: delta, FinishReason: finish, StopReason: stop, PromptTokenIDs: prompt, TokenIDs: ids}},
		Usage:   usage, SystemFingerprint: fp}
}

// eventWriter writes SSE events and remembers the first write error.
type eventWriter struct {
	w   io.Writer
	buf []byte
	err error
}

func newEventWriter(w io.Writer) *eventWriter { return &eventWriter{w: w} }

func (e *eventWriter) raw(b []byte) {
	if e.err != nil {
		return
	}
	e.buf = append(e.buf[:0], "data: "...)
	e.buf = append(e.buf, b...)
	e.buf = append(e.buf, "\n\n"...)
	_, e.err = e.w.Write(e.buf)
}

func (e *eventWriter) event(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		e.err = err
		return
	}
	e.raw(b)
}

func (e *eventWriter) usage(m hooks.ResponseMeta, o Output) {
	u := openai.Usage{PromptTokens: o.NumPrompt, CompletionTokens: o.NumOutput, TotalTokens: o.NumPrompt + o.NumOutput}
	if m.Kind == "chat" {
		e.event(openai.ChatChunk{ID: m.ResponseID, Object: "chat.completion.chunk", Created: m.Created, Model: m.Model,
			Choices: []openai.ChatStreamChoice{}, Usage: &u, SystemFingerprint: fingerprint})
		return
	}
	e.event(openai.CompletionChunk{ID: m.ResponseID, Object: "text_completion", Created: m.Created, Model: m.Model,
		Choices: []openai.CompletionStreamChoice{}, Usage: &u, SystemFingerprint: fingerprint})
}

func (e *eventWriter) done() { e.raw([]byte("[DONE]")) }

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	list := openai.ModelList{Object: "list", Data: []openai.ModelCard{}}
	root := s.eng.cfg.Model
	maxLen := s.eng.cfg.MaxModelLen
	for _, name := range s.eng.cfg.ServedModelNames {
		list.Data = append(list.Data, openai.ModelCard{
			ID: name, Object: "model", Created: s.created, OwnedBy: "vllm", Root: &root, MaxModelLen: &maxLen,
			Permission: []openai.ModelPermission{{
				ID: "modelperm-" + s.newID(), Object: "model_permission", Created: s.created,
				AllowSampling: true, AllowLogprobs: true, AllowView: true, Organization: "*",
			}},
		})
	}
	writeJSON(w, http.StatusOK, list)
}

func (s *Server) sleep(w http.ResponseWriter, r *http.Request) {
	level := 1
	if v := r.URL.Query().Get("level"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			writeError(w, badRequest("level", "level must be an integer, got %q", v))
			return
		}
		level = n
	}
	mode := PauseMode(r.URL.Query().Get("mode"))
	if mode == "" {
		mode = PauseAbort
	}
	if err := s.eng.Sleep(r.Context(), level, mode); err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "sleeping", "level": level})
}

func (s *Server) wakeUp(w http.ResponseWriter, r *http.Request) {
	tags := r.URL.Query()["tags"]
	if err := s.eng.WakeUp(r.Context(), tags...); err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "awake", "tags": tags})
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	mode := PauseMode(r.URL.Query().Get("mode"))
	if mode == "" {
		mode = PauseAbort
	}
	if err := s.eng.PauseGeneration(r.Context(), mode); err != nil {
		var e *Error
		if errors.As(err, &e) && e.Status == http.StatusBadRequest {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": e.Message})
			return
		}
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": fmt.Sprintf("Failed to pause generation: %v", err)})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "paused"})
}

func (s *Server) scaleElasticEP(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	if err := decodeBody(r, &body); err != nil {
		writeError(w, err)
		return
	}
	asInt := func(key string, def int) (int, bool) {
		v, ok := body[key]
		if !ok {
			return def, true
		}
		f, isNum := v.(float64)
		if !isNum || f != float64(int(f)) || f <= 0 {
			return 0, false
		}
		return int(f), true
	}
	if _, ok := body["new_data_parallel_size"]; !ok {
		writeError(w, badRequest("new_data_parallel_size", "new_data_parallel_size is required"))
		return
	}
	dp, ok := asInt("new_data_parallel_size", 0)
	if !ok {
		writeError(w, badRequest("new_data_parallel_size", "new_data_parallel_size must be a positive integer"))
		return
	}
	drain, ok := asInt("drain_timeout", 120)
	if !ok {
		writeError(w, badRequest("drain_timeout", "drain_timeout must be a positive integer"))
		return
	}
	err := s.eng.ScaleElasticEP(r.Context(), dp, time.Duration(drain)*time.Second)
	switch {
	case errors.Is(err, ErrScaleDrainTimeout):
		writeError(w, &Error{Status: http.StatusRequestTimeout, Type: "RequestTimeoutError",
			Message: fmt.Sprintf("Scale failed due to request drain timeout after %d seconds", drain)})
	case err != nil:
		writeError(w, err)
	default:
		writeJSON(w, http.StatusOK, map[string]string{"message": fmt.Sprintf("Scaled to %d data parallel engines", dp)})
	}
}

// collectiveRPC is vLLM's dev-mode POST /collective_rpc for the one method
// a sleep-mode controller calls: reload_weights.
func (s *Server) collectiveRPC(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Method string `json:"method"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&req); err != nil {
		writeError(w, badRequest("method", "malformed JSON body: %v", err))
		return
	}
	if req.Method != "reload_weights" {
		writeError(w, badRequest("method", "the sim runs only reload_weights, not %q", req.Method))
		return
	}
	if err := s.eng.ReloadWeights(r.Context()); err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"results": []any{nil}})
}
