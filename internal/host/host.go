// Package host is vhi host: the instance registry, OpenAI routing with its
// own SSE proxy, the REST API and metrics, and the agents' gRPC service, all
// on one address.
package host

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/autoscale"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/drain"
	"github.com/vllm-hi/vllm-hi/internal/failover"
	"github.com/vllm-hi/vllm-hi/internal/grpcauth"
	"github.com/vllm-hi/vllm-hi/internal/listener"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/periodic"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/rebalance"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/scale"
	"github.com/vllm-hi/vllm-hi/internal/slo"
	"github.com/vllm-hi/vllm-hi/internal/store"
	"github.com/vllm-hi/vllm-hi/internal/switching"
	"github.com/vllm-hi/vllm-hi/internal/tracing"
)

// Config configures the Host.
type Config struct {
	Listen string
	// DataDir holds the Host's durable state (roles, lifecycle, migration
	// records) in the embedded store, and its generated tokens. Empty:
	// nothing survives a restart (in-process stacks).
	DataDir string
	// Store is where the durable state goes: "" or "bolt" (DataDir's
	// embedded store, one Host), or etcd://HOST:PORT[,…] — shared by
	// several Hosts, which all serve and one of which leads (decides):
	// StorePrefix is its key prefix, StoreLease how long a dead leader
	// holds it, EtcdTLS how to reach etcd over TLS.
	// AccessLog logs a line per relayed request (logger "access", info).
	AccessLog bool
	// OTLPTracesEndpoint, when set, exports OpenTelemetry spans there
	// (OTLP/HTTP): relayed requests, migrations and their steps.
	OTLPTracesEndpoint string
	Store              string
	StorePrefix        string
	StoreLease         time.Duration
	EtcdTLS            credentials.TLSFiles
	// AdminToken guards the REST API's mutations; AgentToken is what
	// agents register with and what the Host presents to agents and to
	// engines' hooks. Empty: not required (a deployment without
	// authentication, which the CLI never builds by default).
	AdminToken string
	AgentToken string
	// TLS serves the Host's one address over TLS (HTTP/1.1, HTTP/2 and
	// gRPC); its CAFile (else its ClientCAFile) verifies agents the Host
	// dials.
	TLS                credentials.TLSFiles
	HeartbeatInterval  time.Duration
	MissedHeartbeats   int
	ShutdownTimeout    time.Duration // how long shutdown waits for streams to finish
	ClientWriteTimeout time.Duration
	// Limits on what clients can make the Host hold.
	MaxConnections     int           // client connections at once
	MaxRequestBody     int64         // bytes of one OpenAI request body
	RequestBodyTimeout time.Duration // to read one request body
	BodyMemory         int64         // bytes of request bodies held at once
	UpstreamTimeout    time.Duration // for an engine's response headers
	StreamIdleTimeout  time.Duration // between two events of a stream
	// RelayEventLoop relays plain HTTP/1.1 streams on epoll loops of the
	// proxy's own instead of a goroutine each (proxy.Options.EventLoop).
	RelayEventLoop bool
	// InstanceRetention bounds how long an instance without an agent is
	// remembered.
	InstanceRetention time.Duration
	Migration         migrate.Config
	// Rebalance is the automatic rebalancing (off unless its Interval is
	// set).
	Rebalance rebalance.Config
	// Failover continues streams whose engine died on another instance
	// (off when its SnapshotInterval is 0).
	Failover failover.Config
	// Models are the switched models (vhi host --config's models:) and
	// Controller their policy; none: no switching.
	Models     map[string]switching.Model
	Controller switching.Controller
	// Scale is how the Host scales deployments (POST /vllm_hi/scale).
	Scale scale.Config
	// Autoscale is the autoscaler (vhi host --config's autoscale:); off
	// without policies.
	Autoscale autoscale.Config
}

// DefaultConfig returns the documented defaults.
func DefaultConfig() Config {
	return Config{
		Listen: "0.0.0.0:8002", HeartbeatInterval: time.Second, MissedHeartbeats: 3,
		ShutdownTimeout: 30 * time.Second, ClientWriteTimeout: 30 * time.Second,
		MaxConnections: 16384, MaxRequestBody: 16 << 20, RequestBodyTimeout: 30 * time.Second, BodyMemory: 1 << 30,
		UpstreamTimeout: proxy.DefaultUpstreamTimeout, StreamIdleTimeout: proxy.DefaultStreamIdleTimeout,
		InstanceRetention: 24 * time.Hour, AccessLog: true,
		Migration: migrate.DefaultConfig(),
		Rebalance: rebalance.DefaultConfig(),
		Failover:  failover.DefaultConfig(),
		Scale:     scale.DefaultConfig(),
	}
}

// Host is one vhi host.
type Host struct {
	cfg   Config
	log   *zap.Logger
	store store.Store // nil without a data directory or a shared store
	// shared is store when several Hosts share it (nil: bolt, or none);
	// forward carries what a Host that follows hands to the leader.
	shared   sharedStore
	tookOver atomic.Bool // this Host leads shared and took the last leader's state over
	forward  http.RoundTripper
	reg      *registry.Registry
	prom     *prometheus.Registry
	m        *metrics
	proxy    *proxy.Proxy
	// agents are the Host's connections to agents, which the orchestrator,
	// the drains and failover share.
	agents   *agentclient.Pool
	mig      *migrate.Orchestrator
	drainer  *drain.Drainer
	balancer *rebalance.Balancer
	// ttft is the rolling TTFT per model the autoscaler reads (nil when
	// it is off).
	ttft         *slo.Window
	autoscaler   *autoscale.Autoscaler
	failover     *failover.Manager
	switcher     *switching.Switcher // nil without switched models
	scaler       *scale.Scaler
	grpc         *grpc.Server
	bodies       *budget
	serverTLS    *tls.Config
	started      time.Time
	serving      atomic.Bool // Serve accepts connections (gRPC included)
	tracer       trace.Tracer
	switchTracer trace.Tracer
	stopTraces   func(context.Context) error // flushes the spans batched
	access       *zap.Logger                 // one line per relayed request
}

// New builds a Host (opening its state in cfg.DataDir); Serve runs it.
func New(cfg Config, log *zap.Logger) (*Host, error) {
	return NewContext(context.Background(), cfg, log)
}

// NewContext is New, bounded by ctx while it connects to its store.
func NewContext(ctx context.Context, cfg Config, log *zap.Logger) (*Host, error) {
	if cfg.MaxRequestBody <= 0 || cfg.BodyMemory < cfg.MaxRequestBody {
		return nil, fmt.Errorf("the request body limits are inconsistent (%d per body, %d in all)", cfg.MaxRequestBody, cfg.BodyMemory)
	}
	access := zap.NewNop()
	if cfg.AccessLog {
		access = log.Named("access")
	}
	h := &Host{cfg: cfg, log: log, access: access, started: time.Now(), prom: prometheus.NewRegistry(), bodies: newBudget(cfg.BodyMemory)}
	var err error
	if h.serverTLS, err = cfg.TLS.ServerVerifyIfGiven("h2", "http/1.1"); err != nil {
		return nil, err
	}
	var agentTLS *tls.Config
	if cfg.TLS.Enabled() || cfg.TLS.CAFile != "" || cfg.TLS.ClientCAFile != "" {
		files := cfg.TLS
		if files.CAFile == "" {
			files.CAFile = files.ClientCAFile
		}
		if agentTLS, err = files.Client(); err != nil {
			return nil, err
		}
	}
	var persist registry.Persister
	var records []store.Instance
	if h.store, err = openStore(ctx, cfg, log); err != nil {
		return nil, err
	}
	if h.store != nil {
		if records, err = h.store.Instances(); err != nil {
			h.store.Close()
			return nil, fmt.Errorf("read the Host's state: %w", err)
		}
		persist = h.store
		if shared, ok := h.store.(sharedStore); ok {
			h.shared, persist = shared, leaderWrites{shared}
		}
	}
	h.forward = &http.Transport{TLSClientConfig: agentTLS, ForceAttemptHTTP2: true, IdleConnTimeout: 90 * time.Second}
	h.reg = registry.New(registry.Options{HeartbeatInterval: cfg.HeartbeatInterval, MissedHeartbeats: cfg.MissedHeartbeats,
		Retention: cfg.InstanceRetention, Persist: persist, Log: log.Named("registry")})
	h.reg.Restore(records)
	h.prom.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	h.m = newMetrics(h.prom, h.reg)
	h.proxy = proxy.New(proxy.Options{ClientWriteTimeout: cfg.ClientWriteTimeout, UpstreamTimeout: cfg.UpstreamTimeout,
		StreamIdleTimeout: cfg.StreamIdleTimeout, EngineToken: cfg.AgentToken, TLS: agentTLS, EventLoop: cfg.RelayEventLoop}, h.m.proxy, log.Named("proxy"))
	tp, stopTraces, err := tracing.Setup(ctx, cfg.OTLPTracesEndpoint, "vhi-host")
	if err != nil {
		h.closeStore()
		return nil, err
	}
	h.tracer, h.stopTraces = tp.Tracer("github.com/vllm-hi/vllm-hi/internal/host"), stopTraces
	h.switchTracer = tp.Tracer("github.com/vllm-hi/vllm-hi/internal/switching")
	mcfg := cfg.Migration
	mcfg.AgentToken, mcfg.AgentTLS = cfg.AgentToken, agentTLS
	if cfg.Scale.Tracer == nil {
		cfg.Scale.Tracer = tp.Tracer("github.com/vllm-hi/vllm-hi/internal/scale")
	}
	if mcfg.Tracer == nil { // tests may give their own
		mcfg.Tracer = tp.Tracer("github.com/vllm-hi/vllm-hi/internal/migrate")
	}
	var migrationRecords migrate.RecordStore
	if h.store != nil {
		migrationRecords = h.store
	}
	mcfg.RestoreLater = h.shared != nil // the records are the leader's until this Host leads
	h.agents = agentclient.NewPool(cfg.AgentToken, agentTLS, mcfg.AgentDialOptions...)
	if h.mig, err = migrate.New(mcfg, h.reg, h.proxy, h.agents, h.m.migrations, migrationRecords, log.Named("migrate")); err != nil {
		h.closeStore()
		return nil, err
	}
	if h.shared != nil {
		h.mig.SetRelays(relays{h})
	}
	h.drainer = drain.New(drain.Config{Timeout: mcfg.DrainTimeout, RPCTimeout: mcfg.RPCTimeout, Tracer: tp.Tracer("github.com/vllm-hi/vllm-hi/internal/drain")}, h.reg, h.mig, h.agents,
		h.proxy.Streams(), h.m.drains, log.Named("drain"))
	if err := cfg.Rebalance.Check(); err != nil {
		h.closeStore()
		return nil, err
	}
	h.balancer = rebalance.New(cfg.Rebalance, h.reg, h.mig, h.proxy.Streams().On, h.m.rebalance, log.Named("rebalance"))
	if err := cfg.Failover.Check(); err != nil {
		h.closeStore()
		return nil, err
	}
	h.failover = failover.New(cfg.Failover, h.reg, h.agents, h.proxy.Streams(), h.m.failover, log.Named("failover"))
	if h.failover.Enabled() {
		h.proxy.SetRecover(h.failover.Recover)
		h.mig.SetWarmCopies(h.failover)
	}
	if err := cfg.Scale.Check(); err != nil {
		h.closeStore()
		return nil, err
	}
	h.scaler = scale.New(cfg.Scale, h.reg, scaleMover{h.mig, h.drainer}, h.proxy.Streams().On, cfg.AgentToken, h.m.scales, log.Named("scale"))
	// The switched models' engines as they are now (a reload adds and
	// lets go of models).
	h.scaler.NotSpare(func(in registry.Instance) bool { return h.switchedEngine(in.Engine.URL) })
	if h.store != nil {
		launched, err := h.store.LaunchedEngines()
		if err != nil {
			h.closeStore()
			return nil, fmt.Errorf("the replicas an earlier Host launched: %w", err)
		}
		h.scaler.Remember(h.store, launched)
	}
	if err := cfg.Autoscale.Check(); err != nil {
		h.closeStore()
		return nil, err
	}
	if cfg.Autoscale.Enabled() {
		h.ttft = slo.New(cfg.Autoscale.Window(), cfg.Autoscale.Penalty())
	}
	h.autoscaler = autoscale.New(cfg.Autoscale, h.scaler, h.ttft, h.m.autoscale, log.Named("autoscale"))
	if h.switcher, err = h.newSwitcher(cfg); err != nil {
		h.closeStore()
		return nil, err
	}
	// With a client CA, agents (the gRPC side of the one address) must
	// present a certificate it signed; OpenAI and REST clients need none.
	h.grpc = grpc.NewServer(grpcauth.ServerOptions(cfg.AgentToken, cfg.TLS.ClientCAFile != "", func(string) {
		h.m.registrations.WithLabelValues("unauthenticated").Inc()
	})...)
	v1.RegisterRegistryServer(h.grpc, &registryService{h: h})
	return h, nil
}

func (h *Host) closeStore() {
	if h.store != nil {
		if err := h.store.Close(); err != nil {
			h.log.Warn("closing the Host's state", zap.Error(err))
		}
	}
}

// Registry exposes the instance registry (tests, the migration orchestrator).
func (h *Host) Registry() *registry.Registry { return h.reg }

// Failover is the Host's engine-crash failover (its warm copies: what
// benchmarks report).
func (h *Host) Failover() *failover.Manager { return h.failover }

// Handler serves gRPC (HTTP/2 with a gRPC content type) and everything else
// on one address.
func (h *Host) Handler() http.Handler {
	r := chi.NewRouter()
	r.Post("/v1/chat/completions", h.openAI)
	r.Post("/v1/completions", h.openAI)
	r.Get("/v1/models", h.models)
	h.mountVLLMRoutes(r)
	r.Get(hostapi.PathHealth, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	r.Get("/livez", h.livez)
	r.Get("/", h.root)
	r.Handle("/ui", http.RedirectHandler("/ui/", http.StatusMovedPermanently))
	r.Handle("/ui/*", h.uiHandler())
	r.Get("/readyz", h.readyz)
	r.Get("/metrics", promhttp.HandlerFor(h.prom, promhttp.HandlerOpts{}).ServeHTTP)
	r.Get(hostapi.PathStatus, h.status)
	r.Get(hostapi.PathInstances, h.instances)
	r.Get(hostapi.PathInstance, h.instance)
	// The operations and what decides them are the leader's (a Host that
	// follows a shared store's leader forwards them there).
	r.Group(func(r chi.Router) {
		r.Use(h.toLeader)
		r.Get(hostapi.PathMigrationStatus, h.migrationStatus)
		r.Get(hostapi.PathMigrations, h.migrations)
		r.Get(hostapi.PathDrainStatus, h.drainStatus)
		r.Get(hostapi.PathDrains, h.drains)
		r.Get(hostapi.PathRebalance, h.rebalanceDecisions)
		r.Get(hostapi.PathScaleStatus, h.scaleStatus)
		r.Get(hostapi.PathScales, h.scales)
		r.Get(hostapi.PathAutoscale, h.autoscaleStatus)
	})
	r.Group(func(r chi.Router) {
		r.Use(h.toLeader, h.requireAdmin)
		r.Post(hostapi.PathDrain, h.drain)
		r.Post(hostapi.PathUndrain, h.undrain)
		r.Post(hostapi.PathWake, h.wake)
		r.Delete(hostapi.PathInstance, h.forget)
		r.Post(hostapi.PathMigrate, h.migrate)
		r.Post(hostapi.PathScale, h.scale)
		r.Get(hostapi.PathAdminState, h.adminState)
		r.Post(hostapi.PathAdminSwitch, h.adminSwitch)
		r.Post(hostapi.PathAdminPrewarm, h.adminPrewarm)
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
// wait for migrations, close upstream connections and the state.
func (h *Host) Serve(ctx context.Context, ln net.Listener) error {
	defer h.closeStore()
	srv := &http.Server{
		Handler: h.Handler(),
		// No WriteTimeout: SSE streams are long-lived; slow clients are
		// capped per write by the proxy instead. Bodies are bounded per
		// request (RequestBodyTimeout).
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		Protocols:         new(http.Protocols),
		ErrorLog:          zap.NewStdLog(h.log.Named("http")),
	}
	srv.Protocols.SetHTTP1(true)
	if h.serverTLS != nil {
		srv.Protocols.SetHTTP2(true)
		srv.TLSConfig = h.serverTLS
	} else {
		srv.Protocols.SetUnencryptedHTTP2(true) // gRPC from agents, without TLS
	}
	// The client listener bounds the connections served at once, and
	// takes back a connection whose stream the relay's event loop ended,
	// for its next request (keep-alive).
	cl := listener.New(ln, h.cfg.MaxConnections)
	ln = cl
	h.proxy.SetKeepAlive(cl.Reserve)
	sweepCtx, stopSweep := context.WithCancel(context.Background())
	defer stopSweep()
	go h.sweep(sweepCtx)
	// The balancer and failover's snapshots start new work on engines:
	// they stop before the migrations are waited for. On a shared store
	// the balancer and the autoscaler (and switching) run on the Host
	// that leads it, from when it does; failover on every Host, for the
	// streams it relays.
	bgCtx, stopBackground := context.WithCancel(context.Background())
	var background sync.WaitGroup
	leading := h.leadership(bgCtx, &background)
	background.Go(func() { whenLeading(bgCtx, leading, h.balancer.Run) })
	background.Go(func() { h.failover.Run(bgCtx) })
	background.Go(func() { whenLeading(bgCtx, leading, h.autoscaler.Run) })
	defer func() { stopBackground(); background.Wait() }()
	// Switching stops first at shutdown: the requests it queues fail
	// (503) instead of holding the server's drain open.
	switchCtx, stopSwitching := context.WithCancel(context.Background())
	switching := make(chan struct{})
	go func() {
		defer close(switching)
		if h.switcher != nil {
			whenLeading(switchCtx, leading, h.switcher.Run)
		}
	}()
	defer func() {
		stopSwitching()
		<-switching
		if h.switcher != nil {
			h.switcher.Wait()
		}
	}()

	errc := make(chan error, 1)
	go func() {
		if h.serverTLS != nil {
			errc <- srv.ServeTLS(ln, "", "")
			return
		}
		errc <- srv.Serve(ln)
	}()
	h.serving.Store(true)
	h.log.Info("vhi host serving", zap.String("addr", ln.Addr().String()), zap.Bool("tls", h.serverTLS != nil),
		zap.Bool("admin_token", h.cfg.AdminToken != ""), zap.Bool("agent_token", h.cfg.AgentToken != ""), zap.String("data_dir", h.cfg.DataDir))
	var lost <-chan struct{}
	if h.store != nil {
		lost = h.store.Lost()
	}
	var lostErr error
	select {
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serve: %w", err)
		}
	case <-ctx.Done():
	case <-lost:
		// This Host's lease on the shared store ended (a partition, a long
		// pause): another Host leads it now, and this one can neither
		// decide nor take over. Stop, as a SIGTERM would, and exit
		// non-zero — restarted, this Host follows again.
		lostErr = errors.New("this Host's lease on the shared store ended; another Host leads it now")
		h.log.Error("stopping", zap.Error(lostErr))
	}
	h.serving.Store(false) // out of rotation from here
	if h.shared != nil && h.shared.Leads() && lostErr == nil {
		r := h.shared
		// A shared store: hand it over before the streams drain, so that
		// another Host decides at once instead of after this one's drain. This Host decides nothing more first — switching,
		// background work, drains and migrations end (a running migration
		// rolls back or finishes) — then gives the leadership up; its own
		// clients' streams go on to their end below.
		stopSwitching()
		stopBackground()
		background.Wait()
		hctx, hcancel := context.WithTimeout(context.Background(), h.cfg.ShutdownTimeout)
		h.drainer.Close(hctx)
		h.mig.Close(hctx)
		if err := r.Resign(hctx); err != nil {
			h.log.Warn("handing the shared store over failed (the next Host leads when this one's lease ends)", zap.Error(err))
		} else {
			h.log.Info("handed the shared store over to the next Host; finishing this Host's streams")
		}
		hcancel()
	}
	h.log.Info("shutting down: draining streams", zap.Duration("timeout", h.cfg.ShutdownTimeout))
	stopSwitching()
	sctx, cancel := context.WithTimeout(context.Background(), h.cfg.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		h.log.Warn("streams still open at the shutdown timeout; closing them", zap.Error(err))
		_ = srv.Close()
	}
	grpcauth.Stop(h.grpc, 5*time.Second)
	stopBackground() // no new migrations from here
	background.Wait()
	mctx, mcancel := context.WithTimeout(context.Background(), h.cfg.ShutdownTimeout)
	h.drainer.Close(mctx) // before the migrations: a drain starts them
	h.mig.Close(mctx)
	mcancel()
	h.agents.Close()
	h.proxy.Close()
	tctx, tcancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := h.stopTraces(tctx); err != nil {
		h.log.Warn("flushing the last spans failed", zap.Error(err))
	}
	tcancel()
	return lostErr
}

func (h *Host) sweep(ctx context.Context) {
	periodic.Do(ctx, h.reg.HeartbeatInterval()/2, h.reg.Sweep)
}

func (h *Host) logInstance(what string, i registry.Instance) {
	h.log.Info("instance "+what, zap.String("vllm_hi_id", i.ID), zap.String("type", i.Type), zap.String("role", string(i.Role)),
		zap.Strings("served_model_names", i.Engine.ServedModels), zap.String("engine_url", i.Engine.URL),
		zap.Bool("migratable", i.Engine.Migratable))
}

func (h *Host) requireAdmin(next http.Handler) http.Handler {
	return credentials.Require(h.cfg.AdminToken, func(w http.ResponseWriter) {
		proxy.WriteError(w, http.StatusUnauthorized, "AuthenticationError", "missing or wrong admin token (Authorization: Bearer …)")
	}, next)
}

// scaleMover is what the scaler drives: migrations and drains.
type scaleMover struct {
	*migrate.Orchestrator
	drains *drain.Drainer
}

var _ scale.Mover = scaleMover{}

func (m scaleMover) StartDrain(id string, req hostapi.DrainRequest) (string, error) {
	return m.drains.Start(id, req)
}

func (m scaleMover) WaitDrain(ctx context.Context, id string) (hostapi.DrainStatus, bool) {
	return m.drains.Wait(ctx, id)
}

// openStore opens the Host's durable state as cfg says (nil: none).
func openStore(ctx context.Context, cfg Config, log *zap.Logger) (store.Store, error) {
	switch {
	case strings.HasPrefix(cfg.Store, "etcd://"):
		eps, err := store.ParseEtcdURL(cfg.Store)
		if err != nil {
			return nil, err
		}
		var etls *tls.Config
		if cfg.EtcdTLS.Enabled() || cfg.EtcdTLS.CAFile != "" {
			if etls, err = cfg.EtcdTLS.Client(); err != nil {
				return nil, fmt.Errorf("etcd TLS: %w", err)
			}
		}
		addr := cfg.Migration.HostAddr
		if addr == "" {
			addr = cfg.Listen
		}
		hostname, _ := os.Hostname()
		s, err := store.ConnectEtcd(ctx, store.EtcdOptions{Endpoints: eps, Prefix: cfg.StorePrefix, TLS: etls,
			LeaseTTL: cfg.StoreLease, ID: fmt.Sprintf("%s-%d", hostname, os.Getpid()), Address: addr, Log: log.Named("store")})
		if err != nil {
			return nil, err
		}
		return s, nil
	case cfg.Store == "" || cfg.Store == "bolt":
		if cfg.DataDir == "" {
			return nil, nil
		}
		s, err := store.OpenBolt(cfg.DataDir)
		if err != nil {
			return nil, err
		}
		return s, nil
	}
	return nil, fmt.Errorf("--store %q: want bolt or etcd://HOST:PORT[,HOST:PORT…]", cfg.Store)
}
