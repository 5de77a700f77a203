package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/grpcauth"
)

// hostAddrs reads --host: one Host's IP:PORT, or several, comma-separated
// (Hosts sharing a store: each serves clients; the one leading it
// decides).
func hostAddrs(s string) ([]string, error) {
	var out []string
	for _, a := range strings.Split(s, ",") {
		a = strings.TrimSpace(a)
		if _, _, err := net.SplitHostPort(a); err != nil {
			return nil, fmt.Errorf("--host must be IP:PORT of the Host (several: comma-separated), got %q", s)
		}
		out = append(out, a)
	}
	return out, nil
}

// hostLink is the agent's registration with one Host: every Host of a
// shared store lists every instance with its live load (it routes its
// own clients by it), so the agent registers and heartbeats with each.
type hostLink struct {
	addr       string
	conn       *grpc.ClientConn
	reg        v1.RegistryClient
	registered bool // guarded by the agent's mu
}

type hostLinks []*hostLink

// dialHosts opens one connection per Host (gRPC connects lazily: a Host
// that is down now is tried again by its loop).
func (a *Agent) dialHosts(addrs []string) (hostLinks, error) {
	var links hostLinks
	for _, addr := range addrs {
		conn, err := grpc.NewClient(addr, grpcauth.DialOptions(a.cfg.AgentToken, a.clientTLS)...)
		if err != nil {
			links.close()
			return nil, fmt.Errorf("agent: dial host %s: %w", addr, err)
		}
		links = append(links, &hostLink{addr: addr, conn: conn, reg: v1.NewRegistryClient(conn)})
	}
	a.mu.Lock()
	a.links = links
	a.mu.Unlock()
	return links, nil
}

func (ls hostLinks) close() {
	for _, l := range ls {
		_ = l.conn.Close()
	}
}

func (ls hostLinks) anyRegistered() bool {
	for _, l := range ls {
		if l.registered {
			return true
		}
	}
	return false
}

func (a *Agent) linkRegistered(l *hostLink) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return l.registered
}

// loopAll registers and heartbeats with every Host until ctx ends; a
// registration refused for good by one Host (errFatal) ends them all.
func (a *Agent) loopAll(ctx context.Context, links hostLinks, req *v1.RegisterRequest) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	// One reading of the engine for every Host's heartbeats (probe.go),
	// stopped with them.
	pctx, stopProbe := context.WithCancel(ctx)
	probed := make(chan struct{})
	go func() { defer close(probed); a.probeLoop(pctx) }()
	defer func() { stopProbe(); <-probed }()
	for _, l := range links {
		// Each loop sends its own copy: a registration carries the role
		// the agent last heard, written just before it is sent.
		r := proto.Clone(req).(*v1.RegisterRequest)
		wg.Go(func() {
			if err := a.loop(ctx, l, r); err != nil {
				once.Do(func() { first = err; cancel() })
			}
		})
	}
	wg.Wait()
	return first
}

// drain asks the Hosts in turn to drain this instance: the one leading a
// shared store does; the others refuse (UNAVAILABLE).
func (ls hostLinks) drain(ctx context.Context, req *v1.DrainSelfRequest) (*v1.DrainSelfResponse, error) {
	var err error
	for _, l := range ls {
		var resp *v1.DrainSelfResponse
		if resp, err = l.reg.Drain(ctx, req); err == nil {
			return resp, nil
		}
		if !errors.Is(err, errdefs.ErrUnavailable) {
			return nil, err
		}
	}
	return nil, err
}

// deregister tells every Host the agent stops, each bounded.
func (ls hostLinks) deregister(a *Agent) {
	var wg sync.WaitGroup
	for _, l := range ls {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			if _, err := l.reg.Deregister(ctx, &v1.DeregisterRequest{VllmHiId: a.cfg.ID, Session: a.session}); err == nil {
				a.log.Info("deregistered", zap.String("host", l.addr))
			}
		})
	}
	wg.Wait()
}
