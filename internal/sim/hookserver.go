package sim

import (
	"context"
	"net/http"
	"strconv"

	"github.com/go-chi/chi/v5"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// hookRoutes serves the engine hooks over HTTP (api/hooks has the paths).
func (s *Server) hookRoutes(r chi.Router) {
	r.Get(hooks.PathLayout, noBody(s.eng.Layout))
	r.Get(hooks.PathRequests, noBody(s.eng.Requests))
	r.Get(hooks.PathStats, noBody(s.eng.Stats))
	r.Get(hooks.PathChanges, func(w http.ResponseWriter, r *http.Request) {
		since, err := strconv.ParseUint(r.URL.Query().Get("since"), 10, 64)
		if err != nil {
			writeError(w, badRequest("since", "since must be a cursor (a non-negative integer)"))
			return
		}
		c, err := s.eng.Changes(r.Context(), since)
		reply(w, c, err)
	})
	r.Post(hooks.PathPause, withBody(s.eng.Pause))
	r.Post(hooks.PathResume, withBody(s.eng.Resume))
	r.Post(hooks.PathExport, withBody(s.eng.Export))
	r.Post(hooks.PathAllocate, withBody(s.eng.Allocate))
	r.Post(hooks.PathInstall, withBody(s.eng.Install))
	r.Post(hooks.PathAbort, withBody(s.eng.Abort))
	r.Post(hooks.PathRetire, withBody(s.eng.Retire))
	r.Post(hooks.PathWake, func(w http.ResponseWriter, r *http.Request) {
		v, err := s.eng.Wake(r.Context())
		reply(w, v, err)
	})
	r.Get(hooks.PathAttach, func(w http.ResponseWriter, r *http.Request) {
		from := 0
		if v := r.URL.Query().Get("from"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				writeError(w, badRequest("from", "from must be a non-negative token index"))
				return
			}
			from = n
		}
		s.stream(w, r.Context(), chi.URLParam(r, "request_id"), from, r.URL.Query().Get("role") == "1")
	})
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
