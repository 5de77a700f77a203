package host

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"sort"
	"time"

	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/store"
	"github.com/vllm-hi/vllm-hi/internal/version"
)

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// decodeStrict decodes one JSON object into v, refusing unknown fields
// and anything after the object: a typo in a field name must not silently
// fall back to a default (a misspelt migration_type retired an engine).
func decodeStrict(r io.Reader, v any) error {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if err := dec.Decode(&struct{}{}); err != io.EOF {
		return errors.New("trailing data after the JSON object")
	}
	return nil
}

// ModelCard is one /v1/models entry.
type ModelCard struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	Root        string `json:"root,omitempty"`
	MaxModelLen int    `json:"max_model_len,omitempty"`
}

func (h *Host) models(w http.ResponseWriter, _ *http.Request) {
	out := struct {
		Object string      `json:"object"`
		Data   []ModelCard `json:"data"`
	}{Object: "list", Data: []ModelCard{}}
	for _, i := range h.reg.Models() {
		out.Data = append(out.Data, ModelCard{ID: i.Engine.ServedModels[0], Object: "model", Created: i.RegisteredAt.Unix(),
			OwnedBy: "vllm-hi", Root: i.Engine.Model, MaxModelLen: i.Engine.MaxModelLen})
	}
	if h.switcher != nil {
		for _, alias := range h.switcher.Aliases() {
			out.Data = append(out.Data, ModelCard{ID: alias, Object: "model", Created: h.started.Unix(), OwnedBy: "vllm-hi",
				Root: h.switcher.State()[alias].ServedModelName})
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func rdmaView(r *registry.RDMA) *hostapi.RDMA {
	if r == nil {
		return nil
	}
	return &hostapi.RDMA{UCXVersion: r.UCXVersion, Devices: r.Devices, Transports: r.Transports, CUDA: r.CUDA}
}

func gpusView(gs []registry.GPU) []hostapi.GPU {
	var out []hostapi.GPU
	for _, g := range gs {
		out = append(out, hostapi.GPU{Index: g.Index, UUID: g.UUID, Name: g.Name, MemoryBytes: g.MemoryBytes, PCIBusID: g.PCIBusID})
	}
	return out
}

func view(i registry.Instance) hostapi.Instance {
	v := hostapi.Instance{
		ID: i.ID, Type: i.Type, Role: string(i.Role), State: string(i.EffectiveState()), Lifecycle: string(i.Lifecycle()),
		ServedModelNames: i.Engine.ServedModels, Model: i.Engine.Model, EngineURL: i.Engine.URL,
		EngineKind: i.Engine.Kind, EngineVersion: i.Engine.Version, TP: i.Engine.TP, PP: i.Engine.PP,
		MaxModelLen: i.Engine.MaxModelLen, Migratable: i.Engine.Migratable, HooksAuthenticated: i.Engine.HooksAuthenticated,
		AgentAddress: i.AgentAddress, DataAddress: i.DataAddress, TransferBackend: i.TransferBackend, TLS: i.TLS, Hostname: i.Hostname,
		RegisteredAt: i.RegisteredAt.UTC(), LastHeartbeatAt: i.LastHeartbeat.UTC(), GPUNote: i.GPUNote, GPUs: gpusView(i.GPUs),
		RDMA: rdmaView(i.RDMA), RDMANote: i.RDMANote,
		Stats: hostapi.InstanceStats{Healthy: i.Stats.Healthy, NumRunning: i.Stats.Running, NumWaiting: i.Stats.Waiting,
			FreeBlocks: i.Stats.FreeBlocks, TotalBlocks: i.Stats.TotalBlocks, Sleeping: i.Stats.Sleeping},
	}
	if len(i.Engine.ServedModels) > 0 {
		v.ServedModelName = i.Engine.ServedModels[0]
	}
	return v
}

func (h *Host) status(w http.ResponseWriter, r *http.Request) {
	list := h.reg.List()
	byState := map[string]int{}
	models := map[string]bool{}
	for _, i := range list {
		byState[string(i.EffectiveState())]++
		for _, m := range i.Engine.ServedModels {
			models[m] = true
		}
	}
	names := make([]string, 0, len(models))
	for m := range models {
		names = append(names, m)
	}
	sort.Strings(names)
	st := hostapi.Status{
		Status: "ok", InstanceCount: len(list), InstancesByState: byState, Models: names,
		Version: version.Version(), UptimeS: time.Since(h.started).Seconds(),
	}
	if shared, ok := h.store.(interface {
		Members(context.Context) ([]store.Member, error)
	}); ok {
		ms, err := shared.Members(r.Context())
		if err != nil {
			h.log.Warn("listing the shared store's Hosts", zap.Error(err))
		}
		for _, m := range ms {
			st.Hosts = append(st.Hosts, hostapi.HostInfo{ID: m.ID, Address: m.Address, Leader: m.Leader, LastSeen: m.LastSeen})
		}
	}
	if h.switcher != nil {
		st.SwitchedModels = map[string]hostapi.SwitchedModelSummary{}
		for alias, m := range h.switcher.State() {
			st.SwitchedModels[alias] = hostapi.SwitchedModelSummary{State: m.State, Active: m.Active, Queued: m.Queued, Group: m.Group}
		}
	}
	writeJSON(w, http.StatusOK, st)
}

func (h *Host) instances(w http.ResponseWriter, _ *http.Request) {
	out := hostapi.InstanceList{Instances: []hostapi.Instance{}}
	for _, i := range h.reg.List() {
		out.Instances = append(out.Instances, view(i))
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *Host) instance(w http.ResponseWriter, r *http.Request) {
	i, err := h.reg.Get(chi.URLParam(r, "id"))
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, view(i))
}

// drain empties an active instance by migration (its requests move to
// the other active instances of its models) and retires it; the answer
// comes at once with the drain's id. An empty body drains onto every
// eligible instance.
func (h *Host) drain(w http.ResponseWriter, r *http.Request) {
	var req hostapi.DrainRequest
	if err := decodeOptional(r, &req); err != nil {
		fail(w, errdefs.Newf(errdefs.ErrInvalidArgument, "malformed drain body: %v", err))
		return
	}
	id, err := h.drainer.Start(chi.URLParam(r, "id"), req)
	if err != nil {
		fail(w, err)
		return
	}
	if i, err := h.reg.Get(chi.URLParam(r, "id")); err == nil {
		h.logInstance("draining", i)
	}
	writeJSON(w, http.StatusOK, hostapi.DrainAnswer{ID: id})
}

func (h *Host) drainStatus(w http.ResponseWriter, r *http.Request) {
	writeRecord(w, r, "drain", h.drainer.Get)
}

func (h *Host) drains(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, hostapi.DrainList{Drains: h.drainer.List()})
}

// rebalanceDecisions lists the balancer's latest decisions, newest first
// (empty while it is off), with its settings.
func (h *Host) rebalanceDecisions(w http.ResponseWriter, _ *http.Request) {
	c := h.cfg.Rebalance
	writeJSON(w, http.StatusOK, hostapi.RebalanceStatus{Enabled: c.Interval > 0, DryRun: c.DryRun, IntervalS: c.Interval.Seconds(),
		KVHigh: c.KVHigh, WaitingHigh: c.WaitingHigh, KVSpread: c.Spread, MaxRequests: c.MaxRequests, CooldownS: c.Cooldown.Seconds(),
		Decisions: h.balancer.Decisions()})
}

func (h *Host) undrain(w http.ResponseWriter, r *http.Request) {
	i, err := h.reg.SetState(chi.URLParam(r, "id"), registry.StateActive, registry.StateDraining)
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, view(i))
}

// wake brings a retired or sleeping engine's KV back so it can be a
// migration target again.
func (h *Host) wake(w http.ResponseWriter, r *http.Request) {
	var req hostapi.WakeRequest
	if err := decodeOptional(r, &req); err != nil {
		fail(w, errdefs.Newf(errdefs.ErrInvalidArgument, "malformed wake body: %v", err))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Minute)
	defer cancel()
	i, err := h.mig.Wake(ctx, chi.URLParam(r, "id"))
	if err != nil {
		fail(w, err)
		return
	}
	if req.Active {
		// Back to serving: an instance taken out of service (a drain, a
		// destroy_source migration) returns to its models' rotation.
		if err := h.reg.SetRole(i.ID, registry.RoleActive); err != nil {
			fail(w, err)
			return
		}
		if i, err = h.reg.Get(i.ID); err != nil {
			fail(w, err)
			return
		}
	}
	h.logInstance("woken", i)
	writeJSON(w, http.StatusOK, view(i))
}

// forget drops an instance whose agent is gone, freeing its id.
func (h *Host) forget(w http.ResponseWriter, r *http.Request) {
	id := chi.URLParam(r, "id")
	if err := h.reg.Forget(id); err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"forgotten": id})
}

// fail answers an error in the contract's shape, its status by its kind
// (internal/errdefs): the REST API's one translation.
// writeRecord answers GET …/{id} for an operation's record: the record,
// or 404 naming the unknown id.
func writeRecord[T any](w http.ResponseWriter, r *http.Request, what string, get func(id string) (T, bool)) {
	id := chi.URLParam(r, "id")
	rec, ok := get(id)
	if !ok {
		fail(w, errdefs.Newf(errdefs.ErrNotFound, "unknown %s %s", what, id))
		return
	}
	writeJSON(w, http.StatusOK, rec)
}

func fail(w http.ResponseWriter, err error) {
	status := errdefs.HTTPStatus(err)
	proxy.WriteError(w, status, errdefs.Type(status), err.Error())
}

// migrate starts a migration: 202-style immediate answer with its id.
func (h *Host) migrate(w http.ResponseWriter, r *http.Request) {
	var req hostapi.MigrateRequest
	if err := decodeStrict(io.LimitReader(r.Body, 1<<20), &req); err != nil {
		h.m.migrations.Refused()
		fail(w, errdefs.Newf(errdefs.ErrInvalidArgument, "malformed migrate body: %v", err))
		return
	}
	id, err := h.mig.Start(req)
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, hostapi.MigrateAnswer{ID: id})
}

func (h *Host) migrationStatus(w http.ResponseWriter, r *http.Request) {
	writeRecord(w, r, "migration", h.mig.Get)
}

func (h *Host) migrations(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, hostapi.MigrationList{Migrations: h.mig.List()})
}

// scale starts a scale operation (POST /vllm_hi/scale).
func (h *Host) scale(w http.ResponseWriter, r *http.Request) {
	var req hostapi.ScaleRequest
	if err := decodeStrict(io.LimitReader(r.Body, 1<<16), &req); err != nil {
		fail(w, errdefs.Newf(errdefs.ErrInvalidArgument, "malformed scale body: %v", err))
		return
	}
	id, err := h.scaler.Start(req)
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, hostapi.ScaleAnswer{ID: id})
}

func (h *Host) scaleStatus(w http.ResponseWriter, r *http.Request) {
	writeRecord(w, r, "scale operation", h.scaler.Get)
}

func (h *Host) scales(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, hostapi.ScaleList{Scales: h.scaler.List()})
}

// autoscaleStatus is the autoscaler's view of each model and its latest
// decisions.
func (h *Host) autoscaleStatus(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, h.autoscaler.Status())
}

// decodeOptional decodes a request's optional JSON body (at most 1 MiB,
// every field known) into v; an empty body leaves v as it is.
func decodeOptional(r *http.Request, v any) error {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err == nil && len(bytes.TrimSpace(body)) > 0 {
		err = decodeStrict(bytes.NewReader(body), v)
	}
	return err
}
