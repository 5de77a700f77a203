// Package host is vhi host: the instance registry, OpenAI routing with its
// own SSE proxy, the REST API and metrics, and the agents' gRPC service, all
// on one address.
package host

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/version"
)

// maxBodyBytes bounds an OpenAI request body.
const maxBodyBytes = 16 << 20

// Config configures the Host.
type Config struct {
	Listen             string
	AdminToken         string // empty: no authentication
	HeartbeatInterval  time.Duration
	MissedHeartbeats   int
	ShutdownTimeout    time.Duration // how long shutdown waits for streams to finish
	ClientWriteTimeout time.Duration
	Migration          migrate.Config
}

// DefaultConfig returns the documented defaults.
func DefaultConfig() Config {
	return Config{
		Listen: "0.0.0.0:8002", HeartbeatInterval: time.Second, MissedHeartbeats: 3,
		ShutdownTimeout: 30 * time.Second, ClientWriteTimeout: 30 * time.Second,
		Migration: migrate.DefaultConfig(),
	}
}

// ReadAdminToken reads a token file (surrounding whitespace trimmed).
func ReadAdminToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read admin token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("admin token file %s is empty", path)
	}
	return tok, nil
}

// Host is one vhi host.
type Host struct {
	cfg     Config
	log     *zap.Logger
	reg     *registry.Registry
	prom    *prometheus.Registry
	m       *metrics
	proxy   *proxy.Proxy
	mig     *migrate.Orchestrator
	grpc    *grpc.Server
	started time.Time
}

// New builds a Host; Serve runs it.
func New(cfg Config, log *zap.Logger) *Host {
	h := &Host{cfg: cfg, log: log, started: time.Now(), prom: prometheus.NewRegistry()}
	h.reg = registry.New(registry.Options{HeartbeatInterval: cfg.HeartbeatInterval, MissedHeartbeats: cfg.MissedHeartbeats})
	h.prom.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	h.m = newMetrics(h.prom, h.reg)
	h.proxy = proxy.New(proxy.Options{ClientWriteTimeout: cfg.ClientWriteTimeout}, h.m.proxy, log)
	mcfg := cfg.Migration
	mcfg.AgentToken = cfg.AdminToken
	h.mig = migrate.New(mcfg, h.reg, h.proxy, h.m.migrations, log)
	h.grpc = grpc.NewServer(grpc.UnaryInterceptor(authInterceptor(cfg.AdminToken, func(string) {
		h.m.registrations.WithLabelValues("unauthenticated").Inc()
	})))
	v1.RegisterRegistryServer(h.grpc, &registryService{h: h})
	return h
}

// Registry exposes the instance registry (tests, the migration orchestrator).
func (h *Host) Registry() *registry.Registry { return h.reg }

// Handler serves gRPC (HTTP/2 with a gRPC content type) and everything else
// on one address.
func (h *Host) Handler() http.Handler {
	r := chi.NewRouter()
	r.Post("/v1/chat/completions", h.openAI)
	r.Post("/v1/completions", h.openAI)
	r.Get("/v1/models", h.models)
	r.Get("/health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	r.Get("/metrics", promhttp.HandlerFor(h.prom, promhttp.HandlerOpts{}).ServeHTTP)
	r.Route("/vllm_hi", func(r chi.Router) {
		r.Get("/status", h.status)
		r.Get("/instances", h.instances)
		r.Get("/instances/{id}", h.instance)
		r.Get("/migration/{id}/status", h.migrationStatus)
		r.Get("/migrations", h.migrations)
		r.Group(func(r chi.Router) {
			r.Use(h.requireAdmin)
			r.Post("/instances/{id}/drain", h.drain)
			r.Post("/instances/{id}/undrain", h.undrain)
			r.Post("/migrate", h.migrate)
		})
	})
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) {
		proxy.WriteError(w, http.StatusNotFound, "NotFoundError", "no such endpoint")
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, _ *http.Request) {
		proxy.WriteError(w, http.StatusMethodNotAllowed, "MethodNotAllowed", "method not allowed")
	})
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.ProtoMajor == 2 && strings.HasPrefix(req.Header.Get("Content-Type"), "application/grpc") {
			h.grpc.ServeHTTP(w, req)
			return
		}
		r.ServeHTTP(w, req)
	})
}

// Serve runs until ctx ends, then shuts down in reverse order of start:
// stop accepting, let streams finish (up to ShutdownTimeout), stop gRPC,
// close upstream connections.
func (h *Host) Serve(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{
		Handler: h.Handler(),
		// No WriteTimeout: SSE streams are long-lived; slow clients are
		// capped per write by the proxy instead.
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		Protocols:         new(http.Protocols),
	}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true) // gRPC from agents, without TLS
	sweepCtx, stopSweep := context.WithCancel(context.Background())
	defer stopSweep()
	go h.sweep(sweepCtx)

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	h.log.Info("vhi host serving", zap.String("addr", ln.Addr().String()), zap.Bool("admin_token", h.cfg.AdminToken != ""))
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	h.log.Info("shutting down: draining streams", zap.Duration("timeout", h.cfg.ShutdownTimeout))
	sctx, cancel := context.WithTimeout(context.Background(), h.cfg.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		h.log.Warn("streams still open at the shutdown timeout; closing them", zap.Error(err))
		_ = srv.Close()
	}
	stopped := make(chan struct{})
	go func() { h.grpc.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		h.grpc.Stop()
	}
	h.mig.Close()
	h.proxy.Close()
	return nil
}

func (h *Host) sweep(ctx context.Context) {
	t := time.NewTicker(h.reg.HeartbeatInterval() / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			h.reg.Sweep()
		}
	}
}

func (h *Host) logInstance(what string, i registry.Instance) {
	h.log.Info("instance "+what, zap.String("vllm_hi_id", i.ID), zap.String("type", i.Type),
		zap.Strings("served_model_names", i.Engine.ServedModels), zap.String("engine_url", i.Engine.URL),
		zap.Bool("migratable", i.Engine.Migratable))
}

func (h *Host) requireAdmin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h.cfg.AdminToken != "" {
			got := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
			if subtle.ConstantTimeCompare([]byte(got), []byte(h.cfg.AdminToken)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="vllm-hi"`)
				proxy.WriteError(w, http.StatusUnauthorized, "AuthenticationError", "missing or wrong admin token (Authorization: Bearer …)")
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// openAI routes a completion or chat request by its model.
func (h *Host) openAI(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes+1))
	if err != nil {
		proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", "could not read the request body")
		return
	}
	if len(body) > maxBodyBytes {
		proxy.WriteError(w, http.StatusRequestEntityTooLarge, "BadRequestError", fmt.Sprintf("request body over %d bytes", maxBodyBytes))
		return
	}
	var head struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
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
	inst, known, ok := h.reg.Route(head.Model)
	switch {
	case !known:
		h.count("", http.StatusNotFound)
		proxy.WriteError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", head.Model))
		return
	case !ok:
		h.count(head.Model, http.StatusServiceUnavailable)
		w.Header().Set("Retry-After", "1")
		proxy.WriteError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", fmt.Sprintf("no active instance serves `%s` right now", head.Model))
		return
	}
	rid := r.Header.Get("X-Request-Id")
	if rid == "" {
		rid = newRequestID()
	}
	hdr := http.Header{"Content-Type": {"application/json"}, "X-Request-Id": {rid}}
	for _, k := range []string{"Authorization", "Accept"} {
		if v := r.Header.Get(k); v != "" {
			hdr.Set(k, v)
		}
	}
	prefix := "cmpl-"
	if strings.HasSuffix(r.URL.Path, "/chat/completions") {
		prefix = "chatcmpl-"
	}
	res := h.proxy.Forward(w, r, proxy.Upstream{
		BaseURL: inst.Engine.URL, Path: r.URL.Path, Body: body, Header: hdr, Model: head.Model, InstanceID: inst.ID,
		RequestID: prefix + rid,
	})
	h.count(head.Model, res.Status)
}

func (h *Host) count(model string, status int) {
	if model == "" {
		model = "unknown"
	}
	h.m.requests.WithLabelValues(model, fmt.Sprint(status)).Inc()
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
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
	writeJSON(w, http.StatusOK, out)
}

// InstanceView is one entry of GET /vllm_hi/instances.
type InstanceView struct {
	ID               string        `json:"vllm_hi_id"`
	Type             string        `json:"type"`
	Role             string        `json:"role"`
	State            string        `json:"state"`
	ServedModelName  string        `json:"served_model_name"`
	ServedModelNames []string      `json:"served_model_names"`
	Model            string        `json:"model"`
	EngineURL        string        `json:"engine_url"`
	EngineKind       string        `json:"engine_kind"`
	EngineVersion    string        `json:"engine_version"`
	TP               int           `json:"tp"`
	PP               int           `json:"pp"`
	MaxModelLen      int           `json:"max_model_len"`
	Migratable       bool          `json:"migratable"`
	AgentAddress     string        `json:"agent_address"`
	DataAddress      string        `json:"data_address"`
	TransferBackend  string        `json:"transfer_backend"`
	Hostname         string        `json:"hostname"`
	RegisteredAt     time.Time     `json:"registered_at"`
	LastHeartbeatAt  time.Time     `json:"last_heartbeat_at"`
	Stats            InstanceStats `json:"stats"`
}

// InstanceStats is the load an agent last reported.
type InstanceStats struct {
	Healthy     bool `json:"healthy"`
	NumRunning  int  `json:"num_running"`
	NumWaiting  int  `json:"num_waiting"`
	FreeBlocks  int  `json:"free_blocks"`
	TotalBlocks int  `json:"total_blocks"`
	Sleeping    bool `json:"sleeping"`
}

func (h *Host) view(i registry.Instance) InstanceView {
	v := view(i)
	if h.mig.Busy(i.ID) && v.State != string(registry.StateUnreachable) {
		v.State = string(registry.StateMigrating)
	}
	return v
}

func view(i registry.Instance) InstanceView {
	v := InstanceView{
		ID: i.ID, Type: i.Type, Role: string(i.Role), State: string(i.EffectiveState()),
		ServedModelNames: i.Engine.ServedModels, Model: i.Engine.Model, EngineURL: i.Engine.URL,
		EngineKind: i.Engine.Kind, EngineVersion: i.Engine.Version, TP: i.Engine.TP, PP: i.Engine.PP,
		MaxModelLen: i.Engine.MaxModelLen, Migratable: i.Engine.Migratable, AgentAddress: i.AgentAddress,
		DataAddress: i.DataAddress, TransferBackend: i.TransferBackend, Hostname: i.Hostname,
		RegisteredAt: i.RegisteredAt.UTC(), LastHeartbeatAt: i.LastHeartbeat.UTC(),
		Stats: InstanceStats{Healthy: i.Stats.Healthy, NumRunning: i.Stats.Running, NumWaiting: i.Stats.Waiting,
			FreeBlocks: i.Stats.FreeBlocks, TotalBlocks: i.Stats.TotalBlocks, Sleeping: i.Stats.Sleeping},
	}
	if len(i.Engine.ServedModels) > 0 {
		v.ServedModelName = i.Engine.ServedModels[0]
	}
	return v
}

// StatusView is GET /vllm_hi/status.
type StatusView struct {
	Status           string         `json:"status"`
	InstanceCount    int            `json:"instance_count"`
	InstancesByState map[string]int `json:"instances_by_state"`
	Models           []string       `json:"models"`
	Version          string         `json:"version"`
	UptimeS          float64        `json:"uptime_s"`
}

func (h *Host) status(w http.ResponseWriter, _ *http.Request) {
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
	writeJSON(w, http.StatusOK, StatusView{
		Status: "ok", InstanceCount: len(list), InstancesByState: byState, Models: names,
		Version: version.Version, UptimeS: time.Since(h.started).Seconds(),
	})
}

func (h *Host) instances(w http.ResponseWriter, _ *http.Request) {
	out := []InstanceView{}
	for _, i := range h.reg.List() {
		out = append(out, h.view(i))
	}
	writeJSON(w, http.StatusOK, map[string]any{"instances": out})
}

func (h *Host) instance(w http.ResponseWriter, r *http.Request) {
	i, err := h.reg.Get(chi.URLParam(r, "id"))
	if err != nil {
		h.registryError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, h.view(i))
}

// drain stops routing new requests to an active instance; streams in
// flight continue.
func (h *Host) drain(w http.ResponseWriter, r *http.Request) {
	i, err := h.reg.SetState(chi.URLParam(r, "id"), registry.StateDraining, registry.StateActive)
	if err != nil {
		h.registryError(w, err)
		return
	}
	h.logInstance("draining", i)
	writeJSON(w, http.StatusOK, view(i))
}

func (h *Host) undrain(w http.ResponseWriter, r *http.Request) {
	i, err := h.reg.SetState(chi.URLParam(r, "id"), registry.StateActive, registry.StateDraining)
	if err != nil {
		h.registryError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, view(i))
}

func (h *Host) registryError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, registry.ErrNotFound):
		proxy.WriteError(w, http.StatusNotFound, "NotFoundError", err.Error())
	case errors.Is(err, registry.ErrConflict):
		proxy.WriteError(w, http.StatusConflict, "ConflictError", err.Error())
	default:
		proxy.WriteError(w, http.StatusInternalServerError, "InternalServerError", err.Error())
	}
}

// migrate starts a migration: 202-style immediate answer with its id.
func (h *Host) migrate(w http.ResponseWriter, r *http.Request) {
	var req migrate.Request
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	if err := dec.Decode(&req); err != nil {
		proxy.WriteError(w, http.StatusBadRequest, "BadRequestError", "malformed migrate body: "+err.Error())
		return
	}
	id, err := h.mig.Start(req)
	if err != nil {
		var me *migrate.Error
		if errors.As(err, &me) {
			typ := map[int]string{400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}[me.Status]
			proxy.WriteError(w, me.Status, typ, me.Msg)
			return
		}
		proxy.WriteError(w, http.StatusInternalServerError, "InternalServerError", err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"migration_id": id})
}

func (h *Host) migrationStatus(w http.ResponseWriter, r *http.Request) {
	s, ok := h.mig.Get(chi.URLParam(r, "id"))
	if !ok {
		proxy.WriteError(w, http.StatusNotFound, "NotFoundError", "unknown migration "+chi.URLParam(r, "id"))
		return
	}
	writeJSON(w, http.StatusOK, s)
}

func (h *Host) migrations(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"migrations": h.mig.List()})
}
