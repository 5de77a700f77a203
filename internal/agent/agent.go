// Package agent is vhi agent: the sidecar beside one engine. It discovers
// the engine, registers it with the Host, heartbeats, re-registers when the
// Host restarts and deregisters on shutdown; it serves the Agent gRPC
// service the Host drives it through.
package agent

import (
	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/gpu"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpccreds "google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/grpcauth"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
	"github.com/vllm-hi/vllm-hi/internal/transfer/rdma"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// Config configures an agent.
type Config struct {
	Type          string // "A" or "B"
	HostAddr      string // the Host's address, IP:PORT
	EngineURL     string
	DataPort      int    // KV data-plane port (0: none yet)
	ID            string // vllm_hi_id; default derived from type and engine URL
	Listen        string // the Agent gRPC service's listen address; default: the advertised host, any port
	AdvertiseHost string // host other machines reach this agent at; default: the local address that routes to the Host
	// AgentToken is the agent credential: presented to the Host to
	// register, required from the Host on this agent's gRPC service,
	// presented to the engine's hooks. Empty only in an unauthenticated
	// deployment.
	AgentToken      string
	TLS             credentials.TLSFiles
	TransferBackend string
	// EngineCoreSocket is the engine's core channel (the vLLM plugin's
	// --vllm-hi-core-socket): the hooks whose work is the engine core's
	// alone go there instead of through the engine's API server.
	EngineCoreSocket string
	TP, PP           int           // for engines without hooks
	EngineWait       time.Duration // how long to wait for the engine to become healthy
	// DrainGrace bounds the drain an active instance's agent asks the Host
	// for when it is stopped (SIGTERM), before it deregisters; 0: none.
	DrainGrace time.Duration
	// DrainedFile, when set, is created once that drain is over (whatever
	// came of it), so that an engine's Kubernetes preStop hook can wait
	// for it before the engine is stopped.
	DrainedFile string
	DefaultTN   int // data-plane connections when the Host names none
	// PaceRound0, above 0, sends a full copy round in chunks of about that
	// share of the source's step time, one per step (pace.go), so that
	// the copy does not slow its decode and its clients.
	PaceRound0 float64
	// HealthListen serves GET /healthz there (health.go; "": off).
	HealthListen string
	// Failpoint makes the agent die at a chosen point (failpoint.go;
	// tests only).
	Failpoint string
	// NVML is the GPU library the agent reads its node's GPUs through
	// (nil: the node's libnvidia-ml, dlopened once; tests pass a mock).
	NVML nvml.Interface
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	c.Type = strings.ToUpper(c.Type)
	if c.Type != "A" && c.Type != "B" {
		return fmt.Errorf("--type must be A or B, got %q", c.Type)
	}
	if _, err := hostAddrs(c.HostAddr); err != nil {
		return err
	}
	if c.EngineURL == "" {
		return fmt.Errorf("--engine URL of the engine is required")
	}
	if err := checkFailpoint(c.Failpoint); err != nil {
		return err
	}
	if _, err := engine.NewClient(c.EngineURL, engine.Options{}); err != nil {
		return err
	}
	if c.DataPort < 0 || c.DataPort > 65535 {
		return fmt.Errorf("--data-port %d out of range", c.DataPort)
	}
	if c.TransferBackend != "" && !slices.Contains(transfer.Names(), c.TransferBackend) {
		return fmt.Errorf("transfer backend %q: want one of %v", c.TransferBackend, transfer.Names())
	}
	c.TransferBackend = transfer.Canonical(c.TransferBackend)
	if c.TP < 1 || c.PP < 1 {
		return fmt.Errorf("tp and pp must be ≥ 1")
	}
	return c.TLS.Check()
}

// DefaultID derives a stable id from the type and the engine URL, so an
// agent restarted beside the same engine keeps its id.
func DefaultID(typ, engineURL string) string {
	sum := sha256.Sum256([]byte(engineURL))
	return strings.ToLower(typ) + "-" + hex.EncodeToString(sum[:4])
}

// Agent is one running agent.
type Agent struct {
	cfg     Config
	log     *zap.Logger
	eng     *engine.Client
	session string

	mu         sync.Mutex
	info       engine.Info
	registered bool
	// links are the Hosts the agent registers with (all of them: several
	// Hosts sharing a store each serve and relay); registered: with any.
	links     hostLinks
	lastStats *v1.EngineStats // the probe loop's last reading (probe.go)
	probe     engineProbe
	// role and retired are what the Host last said about this instance;
	// a registration carries them, so a Host that lost its state learns
	// them back from the agents.
	role    v1.Role
	retired bool
	// phase and engineHealthy are what the health answers say (health.go).
	phase         string
	engineHealthy bool
	health        *health.Server

	dp dataPlane
	// gpu is the agent's CUDA state (loaded on first use): cuda_ipc's
	// mappings, and the staging of GPU KV.
	gpu *cudaipc.Plane
	// stagedLayouts are the integrity check's staging layouts of slot
	// ranges, kept from one check to the next (hash.go).
	stagedLayouts stagedLayouts
	// rdma is the UCX data plane (nil: UCX not loaded, rdmaNote says why).
	rdma     *rdma.Plane
	rdmaNote string
	// gpus is the node's GPUs (NVML), read once at start.
	gpus      *gpu.Inventory
	dataAddr  string
	clientTLS *tls.Config // dialing the Host and peers' data planes; nil without TLS
	serverTLS *tls.Config // this agent's gRPC service and data plane; nil without TLS
}

// New returns an agent for cfg (validated).
func New(cfg Config, log *zap.Logger) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var clientTLS, serverTLS *tls.Config
	if cfg.TLS.Enabled() || cfg.TLS.CAFile != "" {
		var err error
		if clientTLS, err = cfg.TLS.Client(); err != nil {
			return nil, err
		}
	}
	serverTLS, err := cfg.TLS.Server()
	if err != nil {
		return nil, err
	}
	if cfg.ID == "" {
		cfg.ID = DefaultID(cfg.Type, strings.TrimRight(cfg.EngineURL, "/")) // the URL as the engine client keeps it
	}
	log = log.With(zap.String("vllm_hi_id", cfg.ID))
	c, err := engine.NewClient(cfg.EngineURL, engine.Options{Token: cfg.AgentToken, TLS: clientTLS, CoreSocket: cfg.EngineCoreSocket,
		Log: log.Named("engine")})
	if err != nil {
		return nil, err
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	if cfg.DefaultTN < 1 {
		cfg.DefaultTN = 2
	}
	return &Agent{cfg: cfg, log: log, eng: c, session: hex.EncodeToString(b[:]),
		dp: dataPlane{sessions: map[string]*targetSession{}}, gpu: cudaipc.NewPlane(log, nil), clientTLS: clientTLS, serverTLS: serverTLS}, nil
}

// ID is the agent's vllm_hi_id.
func (a *Agent) ID() string { return a.cfg.ID }

// Run discovers the engine, serves the Agent service, registers and
// heartbeats until ctx ends, then deregisters. It returns an error when the
// engine never becomes healthy or the Host refuses the registration for
// good (bad token, invalid data, id held by another live agent).
func (a *Agent) Run(ctx context.Context) error {
	if a.cfg.DrainedFile != "" {
		// A file left by an earlier run would let a preStop hook through
		// before this run's drain.
		_ = os.Remove(a.cfg.DrainedFile)
	}
	// UCX first: an agent told to use rdma where there is none says so
	// at once rather than after its engine's start-up.
	closeRDMA, err := a.openRDMA()
	if err != nil {
		return err
	}
	defer closeRDMA()
	a.setPhase(phaseWaitingForEngine)
	if a.cfg.HealthListen != "" {
		if err := a.serveHealthz(ctx, a.cfg.HealthListen); err != nil {
			return err
		}
	}
	wctx, cancel := context.WithTimeout(ctx, a.cfg.EngineWait)
	waited := make(chan struct{})
	go a.logWhileWaiting("the engine at "+a.cfg.EngineURL+" to answer healthy", a.cfg.EngineWait, 10*time.Second, waited)
	err = a.eng.WaitHealthy(wctx, 500*time.Millisecond)
	close(waited)
	cancel()
	if err != nil {
		return err
	}
	a.setEngineHealthy(true)
	info, err := a.eng.Discover(ctx, a.cfg.TP, a.cfg.PP)
	if err != nil {
		return err
	}
	if info.Migratable {
		octx, cancel := context.WithTimeout(ctx, 5*time.Second)
		info.HooksAuthenticated = !a.eng.HooksOpen(octx)
		cancel()
		if !info.HooksAuthenticated {
			a.log.Warn("the engine serves its hooks to anyone who reaches it (it has no agent token): start it with VLLM_HI_ENGINE_TOKEN_FILE",
				zap.String("engine_url", info.URL))
		}
	}
	if info.Layout != nil && transfer.OnGPU(*info.Layout) {
		// The engine's KV is GPU memory: make this agent's CUDA state
		// now, beside the start-up, not in a migration's first round.
		go a.warmGPU(*info.Layout)
	}
	a.gpus = gpu.Discover(a.cfg.NVML)
	defer a.gpus.Close()
	if a.gpus.Unavailable != "" {
		a.log.Info("no GPU inventory", zap.String("reason", a.gpus.Unavailable))
	} else {
		a.log.Info("GPUs", zap.Int("count", len(a.gpus.Devices)), zap.String("first", a.gpus.Devices[0].Name))
	}
	a.mu.Lock()
	a.info = info
	a.mu.Unlock()
	a.log.Info("engine discovered", zap.String("engine_url", info.URL), zap.Strings("served_model_names", info.ServedModels),
		zap.String("kind", info.Kind), zap.Bool("migratable", info.Migratable), zap.Int("tp", info.TP), zap.Int("pp", info.PP))

	advertise := a.cfg.AdvertiseHost
	if advertise == "" {
		hosts, _ := hostAddrs(a.cfg.HostAddr)
		advertise = localAddrTowards(hosts[0])
	}
	// Listeners bind to the address the Host and peers reach this agent
	// at, not to every interface.
	bind := advertise
	if ip := net.ParseIP(advertise); ip == nil {
		bind = "" // a name: let the system resolve every address of it
	}
	dataAddr := ""
	if info.Migratable {
		// The tcp_shm data plane: --data-port, or any free port.
		ds, err := tcpshm.Listen(net.JoinHostPort(bind, strconv.Itoa(a.cfg.DataPort)), a.dataSession, a.dataOptions(), a.log)
		if err != nil {
			return err
		}
		a.dp.server = ds
		defer func() {
			_ = ds.Close()
			a.dp.mu.Lock()
			a.dp.src.Close()
			a.dp.dst.Close()
			a.dp.mu.Unlock()
			a.gpu.Close()
		}()
		_, dport, _ := net.SplitHostPort(ds.Addr().String())
		dataAddr = net.JoinHostPort(advertise, dport)
	} else if a.cfg.DataPort > 0 {
		dataAddr = net.JoinHostPort(advertise, strconv.Itoa(a.cfg.DataPort))
	}
	a.dataAddr = dataAddr

	listen := a.cfg.Listen
	if listen == "" {
		listen = net.JoinHostPort(bind, "0")
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("agent listen %s: %w", listen, err)
	}
	opts := grpcauth.ServerOptions(a.cfg.AgentToken, false, func(method string) {
		a.log.Warn("refused an unauthenticated call", zap.String("method", method))
	})
	if a.serverTLS != nil {
		opts = append(opts, grpc.Creds(grpccreds.NewTLS(a.serverTLS)))
	}
	srv := grpc.NewServer(opts...)
	v1.RegisterAgentServer(srv, &agentService{a: a})
	healthpb.RegisterHealthServer(srv, a.newHealthServer())
	go func() { _ = srv.Serve(ln) }()
	defer grpcauth.Stop(srv, 5*time.Second)
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	agentAddr := net.JoinHostPort(advertise, port)

	hosts, _ := hostAddrs(a.cfg.HostAddr)
	links, err := a.dialHosts(hosts)
	if err != nil {
		return err
	}
	defer links.close()
	req := a.registerRequest(info, agentAddr, dataAddr)
	a.setPhase(phaseRegistering)
	err = a.loopAll(ctx, links, req)
	a.setPhase(phaseStopping)
	if err == nil {
		a.drainOnStop(links, req)
		if a.cfg.DrainedFile != "" {
			if werr := os.WriteFile(a.cfg.DrainedFile, []byte(time.Now().UTC().Format(time.RFC3339)+"\n"), 0o644); werr != nil {
				a.log.Warn("writing the drained file failed", zap.String("path", a.cfg.DrainedFile), zap.Error(werr))
			}
		}
	}
	// Deregister with a fresh context: ctx is already done.
	links.deregister(a)
	return err
}

func (a *Agent) registerRequest(info engine.Info, agentAddr, dataAddr string) *v1.RegisterRequest {
	hostname, _ := os.Hostname()
	typ := v1.InstanceType_INSTANCE_TYPE_A
	if a.cfg.Type == "B" {
		typ = v1.InstanceType_INSTANCE_TYPE_B
	}
	e := &v1.EngineInfo{
		EngineUrl: info.URL, ServedModelNames: info.ServedModels, Model: info.Model,
		Tp: int32(info.TP), Pp: int32(info.PP), MaxModelLen: int32(info.MaxModelLen),
		Migratable: info.Migratable, EngineKind: info.Kind, EngineVersion: info.Version,
		HooksAuthenticated: info.HooksAuthenticated,
	}
	if l := info.Layout; l != nil {
		g := l.Geometry
		e.Geometry = &v1.KVGeometry{NumLayers: int32(g.Layers), NumKvHeads: int32(g.KVHeads), HeadDim: int32(g.HeadDim),
			DtypeBytes: int32(g.DTypeBytes), Dtype: g.DType, BlockSize: int32(g.BlockSize), NumBlocks: int32(g.NumBlocks)}
	}
	backend := a.cfg.TransferBackend
	if backend == "" {
		backend = transfer.Auto
	}
	req := &v1.RegisterRequest{VllmHiId: a.cfg.ID, Type: typ, Engine: e, AgentAddress: agentAddr, DataAddress: dataAddr,
		Session: a.session, Hostname: hostname, TransferBackend: backend, Tls: a.serverTLS != nil,
		Rdma: a.rdmaInfo(), RdmaNote: a.rdmaNote}
	if a.gpus != nil {
		req.GpusNote = a.gpus.Unavailable
		for _, d := range a.gpus.Devices {
			req.Gpus = append(req.Gpus, &v1.GPU{Index: int32(d.Index), Uuid: d.UUID, Name: d.Name, MemoryBytes: d.MemoryBytes, PciBusId: d.PCIBusID})
		}
	}
	return req
}

// takeoverWait is how long an agent retries an id held by another session
// (its killed predecessor's, until the Host sees it miss heartbeats).
const takeoverWait = 8 * time.Second

// errFatal marks registration errors that retrying cannot fix.
var errFatal = errors.New("registration refused")

func fatalRegistration(err error) bool {
	switch errdefs.Kind(err) {
	case errdefs.ErrInvalidArgument, errdefs.ErrUnauthenticated, errdefs.ErrPermissionDenied, errdefs.ErrAlreadyExists:
		return true
	}
	return false
}

// loop registers (with backoff while the Host is unreachable) and then
// heartbeats; a NOT_FOUND heartbeat (the Host restarted and forgot us)
// goes back to registering.
func (a *Agent) loop(ctx context.Context, l *hostLink, req *v1.RegisterRequest) error {
	reg := l.reg
	backoff := 200 * time.Millisecond
	interval := time.Second
	everRegistered := false
	started := time.Now()
	for ctx.Err() == nil {
		if !a.linkRegistered(l) {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			a.mu.Lock()
			req.Role, req.Retired = a.role, a.retired
			a.mu.Unlock()
			resp, err := reg.Register(rctx, req)
			cancel()
			if err != nil {
				// The id may be held by this agent's own predecessor,
				// killed a moment ago: the Host frees it once that session
				// misses its heartbeats. Another live agent holds it for
				// good after that.
				predecessor := errors.Is(err, errdefs.ErrAlreadyExists) && time.Since(started) < takeoverWait
				if fatalRegistration(err) && !everRegistered && !predecessor {
					return fmt.Errorf("%w by the Host: %v", errFatal, err)
				}
				a.log.Warn("registration failed; retrying", zap.String("host", l.addr), zap.Error(err), zap.Duration("in", backoff))
				if !sleep(ctx, backoff) {
					break
				}
				if !predecessor {
					// A predecessor's session ends at a moment the Host
					// decides (its heartbeats missed): retried at the first
					// pace, the instance is back within it, not up to a
					// doubled backoff (3 s) later, unlisted meanwhile.
					backoff = min(backoff*2, 5*time.Second)
				}
				continue
			}
			backoff = 200 * time.Millisecond
			if ms := resp.GetHeartbeatIntervalMs(); ms > 0 {
				interval = time.Duration(ms) * time.Millisecond
			}
			a.probeEvery(interval)
			a.learn(resp.GetRole(), resp.GetLifecycle())
			a.setRegistered(l, true)
			a.setPhase(phaseRegistered)
			if everRegistered {
				a.log.Info("re-registered with the Host", zap.String("host", l.addr))
			} else {
				a.log.Info("registered with the Host", zap.String("host", l.addr), zap.Duration("heartbeat", interval))
			}
			everRegistered = true
		}
		if !sleep(ctx, interval) {
			break
		}
		stats := a.latestStats(ctx)
		hctx, cancel := context.WithTimeout(ctx, interval*3)
		hb, err := reg.Heartbeat(hctx, &v1.HeartbeatRequest{VllmHiId: a.cfg.ID, Session: a.session, Stats: stats})
		cancel()
		switch {
		case err == nil:
			a.learn(hb.GetRole(), hb.GetLifecycle())
		case errdefs.IsNotFound(err):
			a.log.Warn("the Host does not know this agent (it restarted?); registering again", zap.String("host", l.addr))
			if !a.setRegistered(l, false) {
				a.setPhase(phaseRegistering)
			}
		default:
			if ctx.Err() == nil {
				a.log.Warn("heartbeat failed", zap.String("host", l.addr), zap.Error(err))
			}
		}
	}
	return nil
}

// drainOnStop, for an agent being stopped whose instance is active, asks
// the Host to drain it — its streams move to the other instances of its
// models — and waits for the end, at most DrainGrace, heartbeating
// meanwhile (a Host that missed the heartbeats would take the instance
// for gone and refuse to migrate from it). Whatever the outcome the agent
// then exits: the grace bounds a stop.
func (a *Agent) drainOnStop(links hostLinks, req *v1.RegisterRequest) {
	a.mu.Lock()
	active := a.registered && a.role == v1.Role_ROLE_ACTIVE && !a.retired
	a.mu.Unlock()
	if a.cfg.DrainGrace <= 0 || !active {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.DrainGrace)
	heartbeats := make(chan struct{})
	go func() {
		defer close(heartbeats)
		_ = a.loopAll(ctx, links, req)
	}()
	defer func() { cancel(); <-heartbeats }()
	a.log.Info("stopping: asking the Host to drain this instance first", zap.Duration("grace", a.cfg.DrainGrace))
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := links.drain(cctx, &v1.DrainSelfRequest{VllmHiId: a.cfg.ID, Session: a.session})
		ccancel()
		switch {
		case err != nil:
			a.log.Warn("the Host did not drain this instance; stopping with its requests on it", zap.Error(err))
			return
		case resp.GetState() == "succeeded":
			a.log.Info("drained", zap.String("drain_id", resp.GetDrainId()), zap.Int32("moved", resp.GetMoved()))
			return
		case resp.GetState() != "running":
			a.log.Warn("the drain failed; stopping with its requests on it", zap.String("drain_id", resp.GetDrainId()),
				zap.String("error", resp.GetError()), zap.Int32("remaining", resp.GetRemaining()))
			return
		}
		if !sleep(ctx, 200*time.Millisecond) {
			a.log.Warn("the drain grace ended; stopping with requests on this instance", zap.String("drain_id", resp.GetDrainId()),
				zap.Int32("moved", resp.GetMoved()), zap.Int32("remaining", resp.GetRemaining()))
			return
		}
	}
}

// learn keeps what the Host says about this instance.
func (a *Agent) learn(role v1.Role, lifecycle string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if role != v1.Role_ROLE_UNSPECIFIED {
		a.role = role
	}
	if lifecycle != "" {
		a.retired = lifecycle == "retired"
	}
}

// setRegistered records whether the agent is registered with l's Host,
// and returns whether it still is with any Host.
func (a *Agent) setRegistered(l *hostLink, v bool) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	l.registered = v
	a.registered = a.links.anyRegistered()
	return a.registered
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// localAddrTowards is the local IP the kernel would use to reach addr (no
// packet is sent), the address the Host can reach this agent at.
func localAddrTowards(addr string) string {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "127.0.0.1"
	}
	defer c.Close()
	host, _, _ := net.SplitHostPort(c.LocalAddr().String())
	return host
}

// agentService is the Agent gRPC service.
type agentService struct {
	v1.UnimplementedAgentServer
	a *Agent
}

func (s *agentService) Status(context.Context, *v1.AgentStatusRequest) (*v1.AgentStatusResponse, error) {
	a := s.a
	a.mu.Lock()
	defer a.mu.Unlock()
	return &v1.AgentStatusResponse{VllmHiId: a.cfg.ID, Registered: a.registered, Stats: a.lastStats,
		Engine: &v1.EngineInfo{EngineUrl: a.info.URL, ServedModelNames: a.info.ServedModels, Model: a.info.Model,
			Tp: int32(a.info.TP), Pp: int32(a.info.PP), Migratable: a.info.Migratable, EngineKind: a.info.Kind}}, nil
}

// warmGPU makes the CUDA state the data plane needs for lay's GPUs
// (cudaipc.Plane.Warm). A failure costs nothing but the time: the first
// round tries again and says why in the migration's status.
func (a *Agent) warmGPU(lay hooks.Layout) {
	start := time.Now()
	if err := a.gpu.Warm(lay); err != nil {
		a.log.Info("the GPU data plane was not made ahead of a migration", zap.Error(err))
		return
	}
	a.log.Info("GPU data plane ready", zap.Duration("took", time.Since(start)))
}
