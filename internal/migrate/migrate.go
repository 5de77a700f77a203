// Package migrate is the Host's migration orchestrator: reserve both
// instances, prepare the target, copy KV in a full round and incremental
// rounds while the source keeps decoding, then pause, copy the last delta
// and the scheduler state, check that the target holds what the source
// held, commit on the target, splice every client stream onto it, and
// apply the migration type. Any failure before the commit aborts: the
// source resumes, the target frees what it reserved, and the client
// streams go on from the source. Every phase has a deadline.
package migrate

import (
	"crypto/tls"
	"fmt"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"sync"
	"time"

	"context"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpccreds "google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/grpcauth"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// Config tunes the orchestrator (the seed's env vars).
type Config struct {
	MaxIncrRounds    int           // VLLM_HI_MAX_INCR_ROUNDS, default 8
	StallRounds      int           // VLLM_HI_INCR_STALL_ROUNDS, default 2
	DefaultFilter    string        // VLLM_HI_REQUEST_FILTER, default all
	DefaultTN        int           // data-plane connections, default 2
	PauseLease       time.Duration // how long the source stays paused without confirmation
	ReservationLease time.Duration // how long the target holds unclaimed blocks; bounds the migration up to its commit
	SpliceTimeout    time.Duration
	// RPCTimeout bounds one control call to an agent (list, pause,
	// abort…); copy rounds are bounded by the migration's deadline.
	RPCTimeout time.Duration
	// Verify is the check before the commit (sample, full, off);
	// VerifySamples the random blocks per request it adds in sample mode.
	Verify        string
	VerifySamples int
	// RetireWait bounds how long a destroy_source source waits for the
	// requests left on it before its KV is released.
	RetireWait time.Duration
	// MaxHistory bounds the migrations kept (oldest finished ones go).
	MaxHistory int
	AgentToken string
	AgentTLS   *tls.Config // dialing agents that serve TLS
	// AllowFaultInjection accepts the inject_fault field (tests only).
	AllowFaultInjection bool
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{MaxIncrRounds: 8, StallRounds: 2, DefaultTN: 2, PauseLease: 10 * time.Second, ReservationLease: 60 * time.Second,
		SpliceTimeout: 5 * time.Second, RPCTimeout: 10 * time.Second, Verify: hostapi.VerifySample, VerifySamples: 2,
		RetireWait: 10 * time.Minute, MaxHistory: 1000}
}

// margin is how long before a lease ends the Host stops relying on it: a
// call sent at the margin still lands before the lease.
func margin(lease time.Duration) time.Duration {
	return max(500*time.Millisecond, lease/5)
}

func (c Config) check() error {
	switch {
	case c.PauseLease < 2*time.Second:
		return fmt.Errorf("the migration pause lease %v is too short (at least 2s)", c.PauseLease)
	case c.ReservationLease < 2*time.Second:
		return fmt.Errorf("the migration reservation lease %v is too short (at least 2s)", c.ReservationLease)
	case c.RPCTimeout <= 0 || c.SpliceTimeout <= 0:
		return fmt.Errorf("migration timeouts must be positive")
	case c.Verify != hostapi.VerifySample && c.Verify != hostapi.VerifyFull && c.Verify != hostapi.VerifyOff:
		return fmt.Errorf("migration verify %q: want sample, full or off", c.Verify)
	case c.VerifySamples < 0:
		return fmt.Errorf("migration verify samples must not be negative")
	case c.MaxHistory < 1:
		return fmt.Errorf("the migration history must keep at least one")
	}
	return nil
}

// Error is a refusal of a migrate request, with its HTTP status.
type Error struct {
	Status int
	Msg    string
}

func (e *Error) Error() string { return e.Msg }

func refuse(code int, format string, a ...any) error {
	return &Error{Status: code, Msg: fmt.Sprintf(format, a...)}
}

// Orchestrator runs migrations.
type Orchestrator struct {
	cfg     Config
	reg     *registry.Registry
	proxy   *proxy.Proxy
	streams *proxy.Streams
	met     *Metrics
	log     *zap.Logger
	rec     *recorder

	// ctx ends at Close: background work (a source's retirement) stops.
	ctx    context.Context
	cancel context.CancelFunc

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
	all   map[string]*migration
	order []string          // migration ids, oldest first
	busy  map[string]string // instance → migration (or operation) id
	wg    sync.WaitGroup
}

// New returns an orchestrator; met and records may be nil (nothing is
// then counted, or kept across restarts).
func New(cfg Config, reg *registry.Registry, px *proxy.Proxy, met *Metrics, records RecordStore, log *zap.Logger) (*Orchestrator, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	o := &Orchestrator{cfg: cfg, reg: reg, proxy: px, streams: px.Streams(), met: met, log: log,
		conns: map[string]*grpc.ClientConn{}, all: map[string]*migration{}, busy: map[string]string{}}
	o.ctx, o.cancel = context.WithCancel(context.Background())
	o.rec = newRecorder(records, o, log)
	if err := o.restore(); err != nil {
		return nil, err
	}
	return o, nil
}

// Close stops background work, waits for running migrations, writes the
// last records and closes agent connections.
func (o *Orchestrator) Close() {
	o.cancel()
	o.wg.Wait()
	o.rec.close()
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, c := range o.conns {
		c.Close()
	}
}

// agent returns a client of an instance's agent (connections are kept).
func (o *Orchestrator) agent(inst registry.Instance) (v1.AgentClient, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	key := inst.AgentAddress
	if inst.TLS {
		key = "tls://" + key
	}
	if c, ok := o.conns[key]; ok {
		return v1.NewAgentClient(c), nil
	}
	transport := insecure.NewCredentials()
	if inst.TLS {
		if o.cfg.AgentTLS == nil {
			return nil, fmt.Errorf("agent %s serves TLS and the Host has no CA to verify it (--tls-ca-file)", inst.ID)
		}
		transport = grpccreds.NewTLS(o.cfg.AgentTLS)
	}
	c, err := grpc.NewClient(inst.AgentAddress, grpc.WithTransportCredentials(transport), grpc.WithPerRPCCredentials(grpcauth.Token(o.cfg.AgentToken)))
	if err != nil {
		return nil, err
	}
	o.conns[key] = c
	return v1.NewAgentClient(c), nil
}

// claim marks instances busy with op, or says which op holds one.
func (o *Orchestrator) claim(op string, ids ...string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, id := range ids {
		if m, ok := o.busy[id]; ok {
			return refuse(409, "instance %s is busy with %s", id, m)
		}
	}
	for _, id := range ids {
		o.busy[id] = op
	}
	return nil
}

func (o *Orchestrator) release(ids ...string) {
	o.mu.Lock()
	for _, id := range ids {
		delete(o.busy, id)
	}
	o.mu.Unlock()
}

// Busy reports whether an instance is part of a running migration.
func (o *Orchestrator) Busy(instance string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.busy[instance]
	return ok
}

// Get returns a migration's status.
func (o *Orchestrator) Get(id string) (hostapi.MigrationStatus, bool) {
	o.mu.Lock()
	m, ok := o.all[id]
	o.mu.Unlock()
	if !ok {
		return hostapi.MigrationStatus{}, false
	}
	return m.status(), true
}

// List returns every migration, newest first.
func (o *Orchestrator) List() []hostapi.MigrationStatus {
	o.mu.Lock()
	ids := append([]string(nil), o.order...)
	o.mu.Unlock()
	out := make([]hostapi.MigrationStatus, 0, len(ids))
	for i := len(ids) - 1; i >= 0; i-- {
		if s, ok := o.Get(ids[i]); ok {
			out = append(out, s)
		}
	}
	return out
}

// add records a new migration, dropping the oldest finished ones beyond
// the history bound.
func (o *Orchestrator) add(m *migration) {
	o.mu.Lock()
	o.all[m.st.ID] = m
	o.order = append(o.order, m.st.ID)
	var dropped []string
	for i := 0; len(o.order)-len(dropped) > o.cfg.MaxHistory && i < len(o.order); i++ {
		id := o.order[i]
		if o.all[id].status().State != hostapi.StateRunning {
			dropped = append(dropped, id)
		}
	}
	if len(dropped) > 0 {
		gone := map[string]bool{}
		for _, id := range dropped {
			gone[id] = true
			delete(o.all, id)
		}
		kept := o.order[:0]
		for _, id := range o.order {
			if !gone[id] {
				kept = append(kept, id)
			}
		}
		o.order = kept
	}
	o.mu.Unlock()
	for _, id := range dropped {
		o.rec.forget(id)
	}
}
