package host

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// newSwitcher builds the model switching of cfg's models (nil without).
func (h *Host) newSwitcher(cfg Config) (*switching.Switcher, error) {
	if len(cfg.Models) == 0 {
		return nil, nil
	}
	met := switching.NewMetrics()
	// Every call is bounded by the switch's deadline (its context).
	client := &http.Client{}
	s, err := switching.New(switching.Options{
		Models: cfg.Models, Controller: cfg.Controller, Metrics: met, Log: h.log.Named("switch"), Tracer: h.switchTracer,
		Mover: switchMover{h},
		Backend: func(alias string, m switching.Model) switching.Backend {
			return engine.NewAdmin(m.BackendURL, m.ServedName(alias), cfg.AgentToken, client)
		},
	})
	if err != nil {
		return nil, err
	}
	h.prom.MustRegister(met.Collectors()...)
	return s, nil
}

// switched serves an OpenAI request for a switched model: a lease on the
// model (queued while a switch wakes it), then the request relayed to its
// backend with the served model name.
func (h *Host) switched(w http.ResponseWriter, r *http.Request, rid string, body []byte, alias string, stream bool, sent func()) {
	lease, err := h.switcher.Acquire(r.Context(), alias, stream)
	if err != nil {
		if errors.Is(err, context.Canceled) {
			h.count(alias, 499) // the client left: nobody to answer
			return
		}
		err = switchFailure(err)
		if !errors.Is(err, switching.ErrQueueTimeout) {
			w.Header().Set("Retry-After", "1")
		}
		h.count(alias, errdefs.HTTPStatus(err))
		fail(w, err)
		return
	}
	defer lease.Release()
	served := lease.ServedModelName()
	if served != alias {
		if body, err = withModel(body, served); err != nil {
			h.count(alias, http.StatusBadRequest)
			proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", "malformed JSON body: "+err.Error())
			return
		}
	}
	// A backend that is also a registered instance is relayed under its
	// id, so that a migration (a drain, a switch's move) can splice its
	// streams.
	instanceID := "switched:" + alias
	if inst, ok := h.instanceAt(lease.BackendURL()); ok {
		instanceID = inst.ID
	}
	hdr, engineID := h.upstreamHeader(r, rid)
	res := h.proxy.Forward(w, r, proxy.Upstream{
		BaseURL: lease.BackendURL(), Path: r.URL.Path, Body: body, Header: hdr, Model: served,
		InstanceID: instanceID, RequestID: engineID, Sent: sent, Stream: stream,
	})
	h.count(alias, res.Status)
}

// withModel is body with its model replaced.
func withModel(body []byte, model string) ([]byte, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		return nil, err
	}
	name, _ := json.Marshal(model)
	fields["model"] = name
	return json.Marshal(fields)
}

// switchedEngine says whether url is the engine of a switched model.
func (h *Host) switchedEngine(url string) bool {
	return h.switcher != nil && h.switcher.OwnsBackend(url)
}

// instanceAt is the registered instance whose engine is at url.
func (h *Host) instanceAt(url string) (registry.Instance, bool) {
	url = strings.TrimRight(url, "/")
	for _, in := range h.reg.List() {
		if strings.TrimRight(in.Engine.URL, "/") == url {
			return in, true
		}
	}
	return registry.Instance{}, false
}

// switchMover moves a switched backend's streams by a keep_source_active
// migration onto another serving instance of its model, when the backend
// is a registered, migratable instance and one exists.
type switchMover struct{ h *Host }

func (m switchMover) MoveAway(ctx context.Context, alias string, model switching.Model) (func() int, string, bool) {
	src, ok := m.h.instanceAt(model.BackendURL)
	if !ok || !src.Engine.Migratable {
		return nil, "", false
	}
	served := model.ServedName(alias)
	dst, ok := m.h.reg.RouteAvoiding(served, []string{src.ID})
	if !ok {
		return nil, "no other instance of " + served + " serves", false
	}
	t0 := time.Now()
	id, err := m.h.mig.Start(hostapi.MigrateRequest{Src: src.ID, Dst: dst.ID, Type: hostapi.KeepSourceActive})
	if err != nil {
		return nil, fmt.Sprintf("a migration to %s was refused: %v", dst.ID, err), false
	}
	st, _ := m.h.mig.Wait(ctx, id)
	switch {
	case !st.Ended():
		return nil, fmt.Sprintf("the migration %s to %s outlasted the switch", id, dst.ID), false
	case st.State != hostapi.StateSucceeded:
		return nil, fmt.Sprintf("the migration %s to %s %s: %s", id, dst.ID, st.State, st.Error), false
	}
	onBackend := func() int { return m.h.proxy.Streams().On(src.ID) }
	return onBackend, fmt.Sprintf("moved %d streams to %s by migration %s in %.2f s", st.Migrated, dst.ID, id, time.Since(t0).Seconds()), true
}

// adminState is GET /admin/state.
func (h *Host) adminState(w http.ResponseWriter, _ *http.Request) {
	if !h.switchingOn(w) {
		return
	}
	writeJSON(w, http.StatusOK, hostapi.AdminState{Models: h.switcher.State(), HostMemory: h.switcher.HostMemory()})
}

// adminSwitch is POST /admin/switch/{model}: wake the model now, as a
// request for it would, and answer when it is awake.
func (h *Host) adminSwitch(w http.ResponseWriter, r *http.Request) {
	if !h.switchingOn(w) {
		return
	}
	alias := chi.URLParam(r, "model")
	if !h.switcher.Has(alias) {
		fail(w, errdefs.Newf(errdefs.ErrNotFound, "no switched model %q", alias))
		return
	}
	t0 := time.Now()
	rep, err := h.switcher.Switch(r.Context(), alias)
	if err != nil {
		h.log.Warn("admin switch failed", zap.String("model", alias), zap.Error(err))
		fail(w, switchFailure(err))
		return
	}
	writeJSON(w, http.StatusOK, hostapi.SwitchResult{Model: alias, State: h.switcher.State()[alias].State,
		DurationS: time.Since(t0).Seconds(), Switch: rep})
}

// adminPrewarm is POST /admin/prewarm {"model", "ttl_s"}.
func (h *Host) adminPrewarm(w http.ResponseWriter, r *http.Request) {
	if !h.switchingOn(w) {
		return
	}
	var req hostapi.PrewarmRequest
	if err := decodeStrict(io.LimitReader(r.Body, 1<<16), &req); err != nil {
		fail(w, errdefs.Newf(errdefs.ErrInvalidArgument, "malformed prewarm body: %v", err))
		return
	}
	if !h.switcher.Has(req.Model) {
		fail(w, errdefs.Newf(errdefs.ErrNotFound, "no switched model %q", req.Model))
		return
	}
	until, err := h.switcher.Prewarm(r.Context(), req.Model, time.Duration(req.TTLS*float64(time.Second)))
	var se *switching.SwitchError
	switch {
	case errors.As(err, &se):
		fail(w, switchFailure(err))
		return
	case err != nil:
		fail(w, errdefs.Newf(errdefs.ErrInvalidArgument, "%w", err))
		return
	}
	writeJSON(w, http.StatusOK, hostapi.PrewarmResult{Model: req.Model, State: h.switcher.State()[req.Model].State, PinnedUntil: until})
}

func (h *Host) switchingOn(w http.ResponseWriter) bool {
	if h.switcher == nil {
		fail(w, errdefs.New(errdefs.ErrNotFound, "model switching is not configured (vhi host --config FILE with models:)"))
		return false
	}
	return true
}

// switchFailure is the kind a failed switch answers with: an engine that
// failed to sleep or wake (a SwitchError), or anything the switcher did
// not give a kind, is unavailable for now (503, try again); the
// switcher's own errors keep theirs (a queue timeout is 504).
func switchFailure(err error) error {
	var se *switching.SwitchError
	if errors.As(err, &se) || errdefs.Kind(err) == errdefs.ErrInternal {
		return errdefs.Newf(errdefs.ErrUnavailable, "%w", err)
	}
	return err
}
