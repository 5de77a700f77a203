package host

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// The rest of vLLM's API — embeddings, the Responses API, tokenization,
// scoring, reranking, pooling, classification, audio — goes through the
// Host as it is, routed by the body's model (a JSON field, or a form
// field for audio uploads): a gateway in front of vLLM must not drop half
// of it. These requests are relayed as they are, streams included, but
// are not migrated (only completions and chat streams are spliced).

// vllmPostRoutes are the POST routes routed by their body's model; a body
// without one goes to any active instance.
var vllmPostRoutes = []string{
	"/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize",
	"/v1/score", "/score", "/rerank", "/v1/rerank", "/v2/rerank",
	"/pooling", "/classify", "/v1/classify",
	"/v1/audio/transcriptions", "/v1/audio/translations",
}

// mountVLLMRoutes adds the routes to r. A stored response (GET
// /v1/responses/{id}, its cancel) names no model: it goes to any active
// instance — with several, the one that made it may not be that one.
func (h *Host) mountVLLMRoutes(r chi.Router) {
	for _, p := range vllmPostRoutes {
		r.Post(p, h.vllmRoute)
	}
	r.Get("/v1/responses/{id}", h.vllmRoute)
	r.Post("/v1/responses/{id}/cancel", h.vllmRoute)
}

// vllmRoute relays one request of the routes above.
func (h *Host) vllmRoute(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	r, span := h.traced(r)
	defer span.End()
	rid := newRequestID()
	w.Header().Set("X-Request-Id", rid)
	body, held, err := h.readBody(w, r)
	defer h.bodies.give(held)
	if err != nil {
		w.Header().Set("Connection", "close")
		h.bodyError(w, err)
		return
	}
	model, err := modelOf(r.Header.Get("Content-Type"), body)
	if err != nil {
		h.count("", http.StatusBadRequest)
		proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	var inst registry.Instance
	known, ok := true, false
	if model != "" {
		inst, known, ok = h.route(model, nil)
	} else {
		inst, ok = h.anyInstance()
	}
	switch {
	case !known:
		h.count("", http.StatusNotFound)
		proxy.WriteError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", model))
		return
	case !ok:
		h.count(model, http.StatusServiceUnavailable)
		w.Header().Set("Retry-After", "1")
		proxy.WriteError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "no active, healthy instance serves this request right now")
		return
	}
	target, err := url.Parse(inst.Engine.URL)
	if err != nil {
		proxy.WriteError(w, http.StatusBadGateway, "BadGatewayError", fmt.Sprintf("bad engine URL %q", inst.Engine.URL))
		return
	}
	status := http.StatusBadGateway
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.URL.Path, pr.Out.URL.RawPath = r.URL.Path, r.URL.RawPath
			pr.Out.Body = io.NopCloser(bytes.NewReader(body))
			pr.Out.ContentLength = int64(len(body))
			pr.Out.Header = h.passedHeader(r.Header, rid)
			injectTrace(r, pr.Out.Header)
		},
		// Streams (the Responses API's, audio's) reach the client as the
		// engine writes them.
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			status = resp.StatusCode
			resp.Header.Set("X-Request-Id", rid)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			proxy.WriteError(w, http.StatusBadGateway, "BadGatewayError", fmt.Sprintf("engine %s: %v", inst.ID, err))
		},
	}
	rp.ServeHTTP(w, r)
	h.count(model, status)
	h.observeDone(r, rid, model, inst.ID, arrived, proxy.Result{Status: status})
}

// passedHeader is what reaches the engine of a relayed request: the
// request's content type, the client's credential and preferences, the
// trace context, and the Host's request id (never the client's).
func (h *Host) passedHeader(in http.Header, rid string) http.Header {
	out := http.Header{"X-Request-Id": {rid}}
	for _, k := range passedHeaders {
		if v := in.Values(k); len(v) > 0 {
			out[k] = v
		}
	}
	return out
}

// passedHeaders go from a client to its engine.
var passedHeaders = []string{"Content-Type", "Authorization", "Accept", "Traceparent", "Tracestate"}

// modelOf reads the model a request names: a JSON body's model field, or
// a multipart form's (audio uploads); "" when it names none.
func modelOf(contentType string, body []byte) (string, error) {
	mt, params, _ := mime.ParseMediaType(contentType)
	if mt == "multipart/form-data" {
		mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
		for {
			p, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				return "", nil
			}
			if err != nil {
				return "", fmt.Errorf("malformed multipart body: %v", err)
			}
			if p.FormName() == "model" {
				b, err := io.ReadAll(io.LimitReader(p, 1024))
				if err != nil {
					return "", fmt.Errorf("malformed multipart body: %v", err)
				}
				return strings.TrimSpace(string(b)), nil
			}
		}
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return "", nil
	}
	var head struct {
		Model string `json:"model"`
	}
	if err := json.Unmarshal(body, &head); err != nil {
		return "", fmt.Errorf("malformed JSON body: %v", err)
	}
	return head.Model, nil
}

// anyInstance is an active, healthy instance for a request that names no
// model.
func (h *Host) anyInstance() (registry.Instance, bool) {
	for _, in := range h.reg.List() {
		for _, m := range in.Engine.ServedModels {
			if i, _, ok := h.route(m, nil); ok {
				return i, true
			}
		}
	}
	return registry.Instance{}, false
}

// bodyError answers a request whose body could not be read.
func (h *Host) bodyError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, errBodyTooLarge):
		h.count("", http.StatusRequestEntityTooLarge)
		proxy.WriteError(w, http.StatusRequestEntityTooLarge, "BadRequestError", fmt.Sprintf("request body over %d bytes", h.cfg.MaxRequestBody))
	case errors.Is(err, errBodyBudget):
		h.count("", http.StatusServiceUnavailable)
		w.Header().Set("Retry-After", "1")
		proxy.WriteError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "the Host is holding as many request bodies as it may; retry")
	case errors.Is(err, os.ErrDeadlineExceeded):
		h.count("", http.StatusRequestTimeout)
		proxy.WriteError(w, http.StatusRequestTimeout, "BadRequestError", fmt.Sprintf("the request body did not arrive within %v", h.cfg.RequestBodyTimeout))
	default:
		h.count("", http.StatusBadRequest)
		proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", "could not read the request body")
	}
}
