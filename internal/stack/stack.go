// Package stack starts a whole vllm-hi deployment in one process on
// loopback — a Host, two sims (A active, B standby; MoreActives adds
// active ones beside A) and their agents — for the demo, the migration
// benchmark and tests. Each piece is the real component on its own
// listener; only the processes are shared.
package stack

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/agent"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// Options configure a stack.
type Options struct {
	Model   string
	SimA    sim.Config // Model, ShmPrefix and served names are filled in
	SimB    sim.Config
	Log     *zap.Logger
	HostCfg host.Config
	// TuneHost adjusts the Host's configuration (after the defaults).
	TuneHost func(*host.Config)
	// BActive registers B as active too (type A): two instances serving
	// the model, as a drain or a rebalance needs.
	BActive bool
	// WrapB wraps engine B's HTTP handler (tests of a misbehaving target).
	WrapB func(http.Handler) http.Handler
	// TransferBackend is the agents' --transfer-backend ("": auto).
	TransferBackend string
	// PaceRound0 is the agents' --pace-round0 (0: off).
	PaceRound0 float64
	// MoreHosts starts that many more Hosts on the first one's shared
	// store (its Store must be etcd://…): every one serves, the agents
	// register with all of them (HostURLs).
	MoreHosts int
	// MoreActives starts that many more sims of the model (configured as
	// SimB), each with its agent, active beside A: sim-c, sim-d, …
	MoreActives int
}

// Stack is a running deployment. Every plane is authenticated as in a
// real one: the Host, the agents and the engines' hooks share a fresh
// agent token, and the REST API's mutations need AdminToken.
type Stack struct {
	HostURL    string
	HostURLs   []string // HostURL first, then those of MoreHosts
	AURL, BURL string   // engines
	AID, BID   string   // vllm_hi_ids
	A, B       *sim.Engine
	// More are the sims of Options.MoreActives, in order.
	More       []Sim
	Host       *host.Host
	AdminToken string
	AgentToken string
	client     *hostapi.Client
	stops      []func()
	kills      []func() // stop sim A, sim B at once (their connections cut)
}

// Start brings everything up and waits until both agents registered.
func Start(o Options) (*Stack, error) {
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	s := &Stack{AID: "sim-a", BID: "sim-b", AdminToken: credentials.NewToken(), AgentToken: credentials.NewToken()}
	fail := func(err error) (*Stack, error) { s.Stop(); return nil, err }
	pid := os.Getpid()
	var err error
	if s.A, s.AURL, err = s.startSim(o.SimA, o.Model, fmt.Sprintf("vhi-stack-%d-a", pid), o.Log); err != nil {
		return fail(err)
	}
	var wrapB []func(http.Handler) http.Handler
	if o.WrapB != nil {
		wrapB = append(wrapB, o.WrapB)
	}
	if s.B, s.BURL, err = s.startSim(o.SimB, o.Model, fmt.Sprintf("vhi-stack-%d-b", pid), o.Log, wrapB...); err != nil {
		return fail(err)
	}
	for i := range o.MoreActives {
		name := string(rune('c' + i))
		e, url, err := s.startSim(o.SimB, o.Model, fmt.Sprintf("vhi-stack-%d-%s", pid, name), o.Log)
		if err != nil {
			return fail(err)
		}
		s.More = append(s.More, Sim{ID: "sim-" + name, URL: url, Engine: e})
	}
	cfg := o.HostCfg
	if cfg.Listen == "" {
		cfg = host.DefaultConfig()
		cfg.HeartbeatInterval = 200 * time.Millisecond
		cfg.ShutdownTimeout = 5 * time.Second
		cfg.AccessLog = false // a demo's or a bench's thousands of requests
	}
	if o.TuneHost != nil {
		o.TuneHost(&cfg)
	}
	cfg.AdminToken, cfg.AgentToken = s.AdminToken, s.AgentToken
	var addrs []string
	for i := 0; i <= o.MoreHosts; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fail(err)
		}
		c := cfg
		c.Listen = ln.Addr().String() // what the other Hosts of a shared store reach it at
		h, err := host.New(c, o.Log.Named("host").With(zap.Int("host", i)))
		if err != nil {
			ln.Close()
			return fail(err)
		}
		if i == 0 {
			s.Host = h
		}
		hctx, hcancel := context.WithCancel(context.Background())
		hdone := make(chan struct{})
		go func() { defer close(hdone); _ = h.Serve(hctx, ln) }()
		s.stops = append(s.stops, func() { hcancel(); <-hdone })
		addrs = append(addrs, ln.Addr().String())
		s.HostURLs = append(s.HostURLs, "http://"+ln.Addr().String())
	}
	s.HostURL = s.HostURLs[0]
	bType := "B"
	if o.BActive {
		bType = "A"
	}
	agents := []struct{ typ, id, url string }{{"A", s.AID, s.AURL}, {bType, s.BID, s.BURL}}
	for _, m := range s.More {
		agents = append(agents, struct{ typ, id, url string }{"A", m.ID, m.URL})
	}
	for _, a := range agents {
		ag, err := agent.New(agent.Config{Type: a.typ, HostAddr: strings.Join(addrs, ","), EngineURL: a.url, ID: a.id,
			Listen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1", TP: 1, PP: 1, EngineWait: 10 * time.Second, AgentToken: s.AgentToken,
			TransferBackend: o.TransferBackend, PaceRound0: o.PaceRound0},
			o.Log.Named("agent-"+a.id))
		if err != nil {
			return fail(err)
		}
		actx, acancel := context.WithCancel(context.Background())
		adone := make(chan struct{})
		go func() { defer close(adone); _ = ag.Run(actx) }()
		s.stops = append(s.stops, func() { acancel(); <-adone })
	}
	if s.client, err = hostapi.New(s.HostURL, hostapi.Options{AdminToken: s.AdminToken}); err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := s.client.WaitInstances(ctx, 2+len(s.More)); err != nil {
		return fail(fmt.Errorf("the agents did not register: %w", err))
	}
	return s, nil
}

// Sim is one more active sim of the stack.
type Sim struct {
	ID, URL string
	Engine  *sim.Engine
}

// Client is the typed client of the stack's Host, with the admin token.
func (s *Stack) Client() *hostapi.Client { return s.client }

func (s *Stack) startSim(c sim.Config, model, prefix string, log *zap.Logger, wrap ...func(http.Handler) http.Handler) (*sim.Engine, string, error) {
	c.Model, c.ServedModelNames, c.ShmPrefix, c.HookToken = model, []string{model}, prefix, s.AgentToken
	r, err := sim.Start(c, log.Named(prefix), wrap...)
	if err != nil {
		return nil, "", err
	}
	var once sync.Once
	stop := func() { once.Do(r.Stop) }
	s.stops = append(s.stops, stop)
	s.kills = append(s.kills, stop)
	return r.Engine, r.URL, nil
}

// KillEngine stops engine id (AID, BID or one of More's) at once,
// cutting its connections mid-stream as a crashed process's are; its
// agent stays.
func (s *Stack) KillEngine(id string) {
	switch id {
	case s.AID:
		s.kills[0]()
	case s.BID:
		s.kills[1]()
	}
	for i, m := range s.More {
		if m.ID == id {
			s.kills[2+i]()
		}
	}
}

// WaitRunning waits, at most within, until engines A and B run n
// requests together, then a little more (a migration started then has
// tokens to move however slow the machine is); it reports whether they
// did.
func (s *Stack) WaitRunning(n int, within time.Duration) bool {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		a, _ := s.A.Stats(context.Background())
		b, _ := s.B.Stats(context.Background())
		if a.NumRunning+b.NumRunning >= n {
			time.Sleep(50 * time.Millisecond)
			return true
		}
		time.Sleep(5 * time.Millisecond)
	}
	return false
}

// Stop shuts everything down in reverse order of start.
func (s *Stack) Stop() {
	for i := len(s.stops) - 1; i >= 0; i-- {
		s.stops[i]()
	}
	s.stops = nil
}
