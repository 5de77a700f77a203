// Package agentclient is the Host's client of its agents: Engine is an
// engine's hooks as typed calls (hooks.Engine) through the agent's Hook
// relay, with the raw relay beside them for the export → install
// pass-through; Pool dials each agent once. Errors come back as
// internal/errdefs kinds (grpcauth's client interceptor translates them).
package agentclient

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"sync"

	"google.golang.org/grpc"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/grpcauth"
)

// Engine is an engine as its agent relays it. Retire and Wake go through
// the agent's own RPCs, which do more than the hooks (the agent drops its
// mappings of the KV memory).
type Engine struct {
	rpc v1.AgentClient
}

var _ hooks.Engine = (*Engine)(nil)

// NewEngine returns the engine behind an agent connection.
func NewEngine(rpc v1.AgentClient) *Engine { return &Engine{rpc: rpc} }

// Raw relays one hook with a ready JSON body and returns the answer's
// bytes: what the Host forwards without reading (an export into an
// install) need not be decoded and encoded again.
func (e *Engine) Raw(ctx context.Context, name string, body []byte) ([]byte, error) {
	return e.raw(ctx, name, body, 0)
}

func (e *Engine) raw(ctx context.Context, name string, body []byte, since uint64) ([]byte, error) {
	resp, err := e.rpc.Hook(ctx, &v1.HookRequest{Name: name, Body: body, Since: since})
	if err != nil {
		return nil, err
	}
	return resp.GetBody(), nil
}

// call relays one hook: in encoded (when not nil), the answer decoded.
func call[Out any](ctx context.Context, e *Engine, name string, in any, since uint64) (Out, error) {
	var out Out
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return out, err
		}
	}
	raw, err := e.raw(ctx, name, body, since)
	if err != nil {
		return out, err
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		return out, fmt.Errorf("the %s hook's answer: %w", name, err)
	}
	return out, nil
}

// Layout implements hooks.Engine.
func (e *Engine) Layout(ctx context.Context) (hooks.Layout, error) {
	return call[hooks.Layout](ctx, e, hooks.HookLayout, nil, 0)
}

// Requests implements hooks.Engine.
func (e *Engine) Requests(ctx context.Context) (hooks.RequestList, error) {
	return call[hooks.RequestList](ctx, e, hooks.HookRequests, nil, 0)
}

// Changes implements hooks.Engine.
func (e *Engine) Changes(ctx context.Context, since uint64) (hooks.Changes, error) {
	return call[hooks.Changes](ctx, e, hooks.HookChanges, nil, since)
}

// Pause implements hooks.Engine.
func (e *Engine) Pause(ctx context.Context, req hooks.PauseRequest) (hooks.PauseResponse, error) {
	return call[hooks.PauseResponse](ctx, e, hooks.HookPause, req, 0)
}

// Resume implements hooks.Engine.
func (e *Engine) Resume(ctx context.Context, req hooks.ResumeRequest) (hooks.ResumeResponse, error) {
	return call[hooks.ResumeResponse](ctx, e, hooks.HookResume, req, 0)
}

// Export implements hooks.Engine.
func (e *Engine) Export(ctx context.Context, req hooks.ExportRequest) (hooks.ExportResponse, error) {
	return call[hooks.ExportResponse](ctx, e, hooks.HookExport, req, 0)
}

// Allocate implements hooks.Engine.
func (e *Engine) Allocate(ctx context.Context, req hooks.AllocateRequest) (hooks.AllocateResponse, error) {
	return call[hooks.AllocateResponse](ctx, e, hooks.HookAllocate, req, 0)
}

// Install implements hooks.Engine.
func (e *Engine) Install(ctx context.Context, req hooks.InstallRequest) (hooks.InstallResponse, error) {
	return call[hooks.InstallResponse](ctx, e, hooks.HookInstall, req, 0)
}

// Abort implements hooks.Engine.
func (e *Engine) Abort(ctx context.Context, req hooks.AbortRequest) (hooks.AbortResponse, error) {
	return call[hooks.AbortResponse](ctx, e, hooks.HookAbort, req, 0)
}

// Stats implements hooks.Engine.
func (e *Engine) Stats(ctx context.Context) (hooks.Stats, error) {
	return call[hooks.Stats](ctx, e, hooks.HookStats, nil, 0)
}

// Retire implements hooks.Engine through the agent's Retire RPC: it waits
// for the engine's requests, releases the KV and drops the agent's
// mappings of it.
func (e *Engine) Retire(ctx context.Context, req hooks.RetireRequest) (hooks.RetireResponse, error) {
	r, err := e.rpc.Retire(ctx, &v1.RetireRequest{WaitMs: int64(req.WaitS * 1000)})
	if err != nil {
		return hooks.RetireResponse{}, err
	}
	return hooks.RetireResponse{Released: r.GetReleased(), Note: r.GetNote()}, nil
}

// Wake implements hooks.Engine through the agent's Wake RPC.
func (e *Engine) Wake(ctx context.Context) (hooks.WakeResponse, error) {
	if _, err := e.rpc.Wake(ctx, &v1.WakeRequest{}); err != nil {
		return hooks.WakeResponse{}, err
	}
	return hooks.WakeResponse{}, nil
}

// Agent is one agent: its engine, and the data-plane RPCs.
type Agent struct {
	Engine *Engine
	RPC    v1.AgentClient
}

// Pool keeps one connection per agent address.
type Pool struct {
	token string
	tls   *tls.Config
	extra []grpc.DialOption

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// NewPool returns a pool dialing with the agent token; tlsConfig verifies
// agents that serve TLS (nil: such agents are refused); extra dial
// options come after the pool's own (tests add interceptors).
func NewPool(token string, tlsConfig *tls.Config, extra ...grpc.DialOption) *Pool {
	return &Pool{token: token, tls: tlsConfig, extra: extra, conns: map[string]*grpc.ClientConn{}}
}

// Get returns the agent at addr (useTLS: it serves TLS).
func (p *Pool) Get(addr string, useTLS bool) (Agent, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	key := addr
	if useTLS {
		key = "tls://" + addr
	}
	c, ok := p.conns[key]
	if !ok {
		var tlsConfig *tls.Config
		if useTLS {
			if p.tls == nil {
				return Agent{}, fmt.Errorf("the agent at %s serves TLS and the Host has no CA to verify it (--tls-ca-file)", addr)
			}
			tlsConfig = p.tls
		}
		var err error
		if c, err = grpc.NewClient(addr, append(grpcauth.DialOptions(p.token, tlsConfig), p.extra...)...); err != nil {
			return Agent{}, fmt.Errorf("dial the agent at %s: %w", addr, err)
		}
		p.conns[key] = c
	}
	rpc := v1.NewAgentClient(c)
	return Agent{Engine: NewEngine(rpc), RPC: rpc}, nil
}

// Close closes every connection.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, c := range p.conns {
		c.Close()
		delete(p.conns, k)
	}
}
