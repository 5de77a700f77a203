package sim

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// hookRoutes serves the engine hooks over HTTP: every route of
// api/hooks, each with its handler here (a route without one, or a
// handler without a route, is an error).
func (s *Server) hookRoutes(r chi.Router) error {
	handlers := map[string]http.HandlerFunc{
		hooks.HookLayout:   noBody(s.eng.Layout),
		hooks.HookRequests: noBody(s.eng.Requests),
		hooks.HookStats:    noBody(s.eng.Stats),
		hooks.HookChanges: func(w http.ResponseWriter, r *http.Request) {
			since, err := strconv.ParseUint(r.URL.Query().Get("since"), 10, 64)
			if err != nil {
				writeError(w, badRequest("since", "since must be a cursor (a non-negative integer)"))
				return
			}
			c, err := s.eng.Changes(r.Context(), since)
			reply(w, c, err)
		},
		hooks.HookPause:    withBody(s.eng.Pause),
		hooks.HookResume:   withBody(s.eng.Resume),
		hooks.HookExport:   withBody(s.eng.Export),
		hooks.HookAllocate: withBody(s.eng.Allocate),
		hooks.HookInstall:  withBody(s.eng.Install),
		// The sim derives nothing from a request's tokens ahead of its
		// install (its layout does not say stages_state): none staged.
		hooks.HookStage: withBody(func(_ context.Context, req hooks.StageRequest) (hooks.StageResponse, error) {
			return hooks.StageResponse{Staged: []string{}}, nil
		}),
		hooks.HookAbort:  withBody(s.eng.Abort),
		hooks.HookRetire: withBody(s.eng.Retire),
		hooks.HookWake:   noBody(s.eng.Wake),
		hooks.HookAttach: func(w http.ResponseWriter, r *http.Request) {
			q := r.URL.Query()
			from, wait := 0, time.Duration(0)
			if v := q.Get("from"); v != "" {
				n, err := strconv.Atoi(v)
				if err != nil || n < -1 {
					writeError(w, badRequest("from", "from must be a token index, or -1 with wait_ms (a pre-attach)"))
					return
				}
				from = n
			}
			if from == -1 {
				ms, err := strconv.Atoi(q.Get("wait_ms"))
				if err != nil || ms < 1 || ms > 600_000 {
					writeError(w, badRequest("wait_ms", "a pre-attach (from=-1) needs wait_ms in 1..600000"))
					return
				}
				wait = time.Duration(ms) * time.Millisecond
			}
			s.stream(w, r.Context(), chi.URLParam(r, "request_id"), from, wait, q.Get("role") == "1", nil)
		},
	}
	for _, route := range hooks.Routes() {
		h, ok := handlers[route.Name]
		if !ok {
			return fmt.Errorf("the sim has no handler for the %s hook", route.Name)
		}
		r.Method(route.Method, route.Path, h)
		delete(handlers, route.Name)
	}
	for name := range handlers {
		return fmt.Errorf("the sim serves a %s hook api/hooks does not know", name)
	}
	return nil
}

func reply(w http.ResponseWriter, v any, err error) {
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

func noBody[T any](fn func(context.Context) (T, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v, err := fn(r.Context())
		reply(w, v, err)
	}
}

func withBody[Req, Resp any](fn func(context.Context, Req) (Resp, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req Req
		if err := decodeBody(r, &req); err != nil {
			writeError(w, err)
			return
		}
		v, err := fn(r.Context(), req)
		reply(w, v, err)
	}
}
