// Package engine is the agent's client for its engine: discovery over
// vLLM's OpenAI surface and the engine hooks (api/hooks) over HTTP.
package engine

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/httpjson"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// Client talks to one engine.
type Client struct {
	base  string
	token string
	http  *http.Client
	// coreSocket, when set, is the engine's core channel: the hooks whose
	// whole work is the engine core's (requests, changes, pause, resume,
	// allocate, stats) go there instead of through its API server.
	coreSocket string
	coreMu     sync.Mutex
	core       *CoreChannel
	log        *zap.Logger
	// paused keeps the final round's inputs the last pause carried.
	paused pausedRounds
}

var _ hooks.Engine = (*Client)(nil)

// Options configure a Client.
type Options struct {
	// Token is sent as "Authorization: Bearer" on every call: engines
	// refuse hook calls without the agent's credential.
	Token string
	// TLS verifies an https engine (nil: the system roots).
	TLS *tls.Config
	// CoreSocket is the engine's core channel (the vLLM plugin's
	// --vllm-hi-core-socket); empty: every hook over HTTP.
	CoreSocket string
	// Log gets, at debug level, each hook call's timing (nil: none).
	Log *zap.Logger
}

// hookPathPrefix begins every hook route (api/hooks' Path constants).
const hookPathPrefix = "/vllm_hi/engine/"

// IdleConnTimeout is how long a connection to an engine's HTTP server
// stays open unused: less than vLLM's keep-alive (uvicorn's, 5 s by
// default: VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so that a request never goes out
// on a connection the engine is closing. With Go's 90 s a POST sent as the
// engine closed its end failed with EOF (a hook call, or a client's
// completion relayed by the Host: 502), seen on the 2-core VM, 2026-12-06.
const IdleConnTimeout = 4 * time.Second

// defaultTimeout bounds a call whose context has no deadline.
const defaultTimeout = 30 * time.Second

// NewClient returns a client for the engine at base (e.g.
// http://127.0.0.1:8000).
func NewClient(base string, o Options) (*Client, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("engine URL %q: want http(s)://host:port", base)
	}
	tr := &http.Transport{Proxy: nil, TLSClientConfig: o.TLS, MaxIdleConnsPerHost: 64, IdleConnTimeout: IdleConnTimeout}
	log := o.Log
	if log == nil {
		log = zap.NewNop()
	}
	return &Client{base: strings.TrimRight(base, "/"), token: o.Token, http: &http.Client{Transport: tr}, coreSocket: o.CoreSocket, log: log}, nil
}

// coreChannel is the engine's core channel, dialled on first use; nil
// when the client has none.
func (c *Client) coreChannel(ctx context.Context) (*CoreChannel, error) {
	if c.coreSocket == "" {
		return nil, nil
	}
	c.coreMu.Lock()
	defer c.coreMu.Unlock()
	if c.core == nil {
		ch, err := DialCore(ctx, c.coreSocket, c.token)
		if err != nil {
			return nil, err
		}
		c.core = ch
	}
	return c.core, nil
}

// viaCore runs op over the core channel when the client has one: ok is
// false when it has none (the caller uses HTTP).
func (c *Client) viaCore(ctx context.Context, op string, in, out any) (ok bool, t CoreTiming, err error) {
	ch, err := c.coreChannel(ctx)
	if ch == nil || err != nil {
		return err != nil, CoreTiming{}, err
	}
	if _, has := ctx.Deadline(); !has {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultTimeout)
		defer cancel()
	}
	t, err = ch.Call(ctx, op, in, out)
	c.logCore(op, t, err)
	return true, t, err
}

// logCore logs a core channel call's timing at debug level: inside a
// migration's pause, where each call's time went (the wait for a step
// boundary, the engine core's work, the way through the channel, the
// decoding here) is what the pause is made of. The stats that heartbeats
// poll are left out.
func (c *Client) logCore(op string, t CoreTiming, err error) {
	if op == "stats" || !c.log.Core().Enabled(zap.DebugLevel) {
		return
	}
	c.log.Debug("engine core call", zap.String("op", op), zap.Duration("total", t.Total), zap.Duration("wait", t.Wait),
		zap.Duration("core", t.Core), zap.Duration("conn", t.Conn), zap.Duration("decode", t.Decode),
		zap.Duration("transit", t.Total-t.Wait-t.Core-t.Conn-t.Decode), zap.Int("sent", t.Sent), zap.Int("received", t.Received),
		zap.Error(err))
}

// Hook relays one hook (api/hooks' routes) with a ready JSON body and
// returns the answer's bytes. With a core channel, the hooks whose whole
// work is the engine core's go there — the pause path's calls reach the
// engine at its next step boundary without waiting on the API server's
// event loop, which also serves every client stream; a snapshot export
// with the streams' metadata (only the API server has it), stage and
// abort go over HTTP, and an install goes both ways at once (install.go).
func (c *Client) Hook(ctx context.Context, route hooks.Route, since uint64, body []byte) ([]byte, error) {
	if op, ok := c.coreOp(route.Name, body); ok {
		var payload any = json.RawMessage(body)
		if route.Name == hooks.HookChanges {
			payload = map[string]uint64{"since": since}
		} else if len(body) == 0 {
			payload = nil
		}
		var out json.RawMessage
		handled, t, err := c.viaCore(ctx, op, payload, &out)
		if handled {
			if route.Name == hooks.HookResume {
				c.paused.forget()
			}
			if err != nil || route.Name != hooks.HookPause {
				return out, err
			}
			var req hooks.PauseRequest
			if err := json.Unmarshal(body, &req); err != nil {
				return nil, fmt.Errorf("engine core pause: the request: %w", err)
			}
			p, err := c.notePause(req, out, t.Wait)
			if err != nil {
				return nil, err
			}
			return json.Marshal(p)
		}
	}
	if route.Name == hooks.HookInstall {
		return c.install(ctx, body)
	}
	path := route.Path
	if route.Name == hooks.HookChanges {
		path += "?since=" + strconv.FormatUint(since, 10)
	}
	if route.Method == http.MethodPost && len(body) == 0 {
		body = []byte("{}")
	}
	return c.Raw(ctx, route.Method, path, body)
}

// coreOp is the core channel's op for a hook call, if the channel takes it.
func (c *Client) coreOp(name string, body []byte) (string, bool) {
	if c.coreSocket == "" {
		return "", false
	}
	switch name {
	case hooks.HookRequests, hooks.HookChanges, hooks.HookPause, hooks.HookResume, hooks.HookAllocate, hooks.HookStats:
		return name, true
	case hooks.HookExport:
		// A snapshot with its streams' metadata needs the API server.
		var req hooks.ExportRequest
		if json.Unmarshal(body, &req) != nil || req.Snapshot && !req.TokensOnly {
			return "", false
		}
		return name, true
	}
	return "", false
}

// Close closes the client's core channel, if it has one.
func (c *Client) Close() error {
	c.coreMu.Lock()
	defer c.coreMu.Unlock()
	if c.core != nil {
		c.core.Close()
		c.core = nil
	}
	return nil
}

// BaseURL is the engine's base URL.
func (c *Client) BaseURL() string { return c.base }

// HTTPError is a non-2xx answer from the engine.
type HTTPError struct {
	Status  int
	Message string
}

func (e *HTTPError) Error() string { return fmt.Sprintf("engine answered %d: %s", e.Status, e.Message) }

// Unwrap is the failure's kind, by the status the hooks contract gives it.
func (e *HTTPError) Unwrap() error { return errdefs.FromHTTP(e.Status) }

// IsStatus reports whether err is an HTTPError with that status.
func IsStatus(err error, status int) bool {
	var he *HTTPError
	return errors.As(err, &he) && he.Status == status
}

// Raw sends body (JSON, or nil) and returns the engine's 2xx body as is.
func (c *Client) Raw(ctx context.Context, method, path string, body []byte) ([]byte, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultTimeout)
		defer cancel()
	}
	start := time.Now()
	status, b, err := send(ctx, c.http, c.base, c.token, method, path, body, 256<<20)
	if strings.HasPrefix(path, hookPathPrefix) && !strings.HasPrefix(path, hooks.PathStats) && c.log.Core().Enabled(zap.DebugLevel) {
		c.log.Debug("engine hook over HTTP", zap.String("path", path), zap.Duration("total", time.Since(start)),
			zap.Int("sent", len(body)), zap.Int("received", len(b)), zap.Int("status", status), zap.Error(err))
	}
	if err != nil {
		return nil, err
	}
	if status/100 != 2 {
		return nil, &HTTPError{Status: status, Message: errorMessage(b)}
	}
	return b, nil
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	body, err := marshal(in)
	if err != nil {
		return err
	}
	b, err := c.Raw(ctx, method, path, body)
	if err != nil {
		return err
	}
	return decode(method, path, b, out)
}

// marshal is a call's JSON body (nil: none).
func marshal(in any) ([]byte, error) {
	if in == nil {
		return nil, nil
	}
	return json.Marshal(in)
}

// send sends body to an engine's route with its bearer token and returns
// the status and at most limit bytes of the answer: what the hooks' and
// the admin routes' clients share.
func send(ctx context.Context, hc *http.Client, base, token, method, path string, body []byte, limit int64) (int, []byte, error) {
	status, b, err := httpjson.Do(ctx, hc, method, base+path, token, body, limit)
	if err != nil {
		return status, b, fmt.Errorf("%s %s: %w", method, path, err)
	}
	return status, b, nil
}

// decode reads a 2xx answer into out (nil: the answer is not needed).
func decode(method, path string, b []byte, out any) error {
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%s %s: decode: %w", method, path, err)
	}
	return nil
}

// errorMessage extracts the message of vLLM's error shapes.
func errorMessage(b []byte) string {
	var e struct {
		Error json.RawMessage `json:"error"`
		Msg   string          `json:"message"`
		Det   any             `json:"detail"`
	}
	if json.Unmarshal(b, &e) == nil {
		var inner struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(e.Error, &inner) == nil && inner.Message != "" {
			return inner.Message
		}
		var s string
		if json.Unmarshal(e.Error, &s) == nil && s != "" {
			return s
		}
		if e.Msg != "" {
			return e.Msg
		}
		if e.Det != nil {
			return fmt.Sprint(e.Det)
		}
	}
	return strings.TrimSpace(string(b))
}

// Health checks GET /health.
func (c *Client) Health(ctx context.Context) error {
	return c.do(ctx, http.MethodGet, "/health", nil, nil)
}

// Model is one entry of the engine's /v1/models.
type Model struct {
	ID          string `json:"id"`
	Root        string `json:"root"`
	MaxModelLen int    `json:"max_model_len"`
}

// Models lists GET /v1/models.
func (c *Client) Models(ctx context.Context) ([]Model, error) {
	var out struct {
		Data []Model `json:"data"`
	}
	if err := c.do(ctx, http.MethodGet, "/v1/models", nil, &out); err != nil {
		return nil, err
	}
	return out.Data, nil
}

// Layout implements hooks.Engine.
func (c *Client) Layout(ctx context.Context) (out hooks.Layout, err error) {
	return out, c.do(ctx, http.MethodGet, hooks.PathLayout, nil, &out)
}

// KVLayout is the engine's layout as the data plane needs it (its KV
// regions, geometry and generation): over the core channel where the
// engine's channel takes "layout" — at the engine core's next step
// boundary, not behind the API server's event loop, which under load
// answered in ~80–100 ms inside a migration's pause (H100, 2026-12-06) —
// else Layout. The channel's answer names the model, not the API
// server's served names: registration reads Layout.
func (c *Client) KVLayout(ctx context.Context) (hooks.Layout, error) {
	if ch, err := c.coreChannel(ctx); err == nil && ch != nil && ch.Takes(opLayout) {
		var out hooks.Layout
		_, _, err := c.viaCore(ctx, opLayout, nil, &out)
		return out, err
	}
	return c.Layout(ctx)
}

// The core channel's ops for a copy round's inputs.
const (
	opLayout = "layout"
	opRound  = "round"
)

// RoundInputs is what a copy round reads from its source engine, of one
// instant: the KV layout, the request list and, when asked for, the
// changes since a cursor.
type RoundInputs struct {
	Layout   hooks.Layout      `json:"layout"`
	Requests hooks.RequestList `json:"requests"`
	Changes  *hooks.Changes    `json:"changes"`
	// FromPause: read with the pause that preceded the round
	// (hooks.PauseRequest.RoundSince), not by an op of the round's own.
	FromPause bool `json:"-"`
}

// RoundInputs reads a copy round's inputs in one step boundary of the
// engine core where its channel takes "round" (ok false otherwise: read
// them one by one). Outside a pause each boundary op waits up to a step,
// and inside it each is a round trip; one op for the three is one wait.
// A round since the cursor the last pause read them at takes those
// instead, with no call at all.
func (c *Client) RoundInputs(ctx context.Context, since uint64, withChanges bool) (in RoundInputs, ok bool, err error) {
	if withChanges {
		if in, ok, err := c.takePausedRound(since); ok {
			return in, true, err
		}
	}
	ch, err := c.coreChannel(ctx)
	if err != nil || ch == nil || !ch.Takes(opRound) {
		return in, false, nil
	}
	payload := map[string]any{}
	if withChanges {
		payload["since"] = since
	}
	if _, _, err := c.viaCore(ctx, opRound, payload, &in); err != nil {
		return in, true, err
	}
	if withChanges && in.Changes == nil {
		return in, true, fmt.Errorf("engine core %s: no changes in the answer", opRound)
	}
	return in, true, nil
}

// Requests implements hooks.Engine.
func (c *Client) Requests(ctx context.Context) (out hooks.RequestList, err error) {
	if ok, _, err := c.viaCore(ctx, "requests", nil, &out); ok {
		return out, err
	}
	return out, c.do(ctx, http.MethodGet, hooks.PathRequests, nil, &out)
}

// Changes implements hooks.Engine.
func (c *Client) Changes(ctx context.Context, since uint64) (out hooks.Changes, err error) {
	if ok, _, err := c.viaCore(ctx, "changes", map[string]uint64{"since": since}, &out); ok {
		return out, err
	}
	return out, c.do(ctx, http.MethodGet, hooks.PathChanges+"?since="+strconv.FormatUint(since, 10), nil, &out)
}

// Pause implements hooks.Engine.
func (c *Client) Pause(ctx context.Context, req hooks.PauseRequest) (out hooks.PauseResponse, err error) {
	var raw json.RawMessage
	if ok, t, err := c.viaCore(ctx, "pause", req, &raw); ok {
		if err != nil {
			return out, err
		}
		return c.notePause(req, raw, t.Wait)
	}
	return out, c.do(ctx, http.MethodPost, hooks.PathPause, req, &out)
}

// Resume implements hooks.Engine.
func (c *Client) Resume(ctx context.Context, req hooks.ResumeRequest) (out hooks.ResumeResponse, err error) {
	c.paused.forget()
	if ok, _, err := c.viaCore(ctx, "resume", req, &out); ok {
		return out, err
	}
	return out, c.do(ctx, http.MethodPost, hooks.PathResume, req, &out)
}

// Export implements hooks.Engine.
func (c *Client) Export(ctx context.Context, req hooks.ExportRequest) (out hooks.ExportResponse, err error) {
	return out, c.do(ctx, http.MethodPost, hooks.PathExport, req, &out)
}

// Allocate implements hooks.Engine.
func (c *Client) Allocate(ctx context.Context, req hooks.AllocateRequest) (out hooks.AllocateResponse, err error) {
	if ok, _, err := c.viaCore(ctx, "allocate", req, &out); ok {
		return out, err
	}
	return out, c.do(ctx, http.MethodPost, hooks.PathAllocate, req, &out)
}

// Install implements hooks.Engine.
func (c *Client) Install(ctx context.Context, req hooks.InstallRequest) (out hooks.InstallResponse, err error) {
	body, err := json.Marshal(req)
	if err != nil {
		return out, err
	}
	b, err := c.install(ctx, body)
	if err != nil {
		return out, err
	}
	return out, decode(http.MethodPost, hooks.PathInstall, b, &out)
}

// Abort implements hooks.Engine.
func (c *Client) Abort(ctx context.Context, req hooks.AbortRequest) (out hooks.AbortResponse, err error) {
	return out, c.do(ctx, http.MethodPost, hooks.PathAbort, req, &out)
}

// Stats implements hooks.Engine.
func (c *Client) Stats(ctx context.Context) (out hooks.Stats, err error) {
	if ok, _, err := c.viaCore(ctx, "stats", nil, &out); ok {
		return out, err
	}
	return out, c.do(ctx, http.MethodGet, hooks.PathStats, nil, &out)
}

// Retire implements hooks.Engine.
func (c *Client) Retire(ctx context.Context, req hooks.RetireRequest) (out hooks.RetireResponse, err error) {
	return out, c.do(ctx, http.MethodPost, hooks.PathRetire, req, &out)
}

// Wake implements hooks.Engine.
func (c *Client) Wake(ctx context.Context) (out hooks.WakeResponse, err error) {
	return out, c.do(ctx, http.MethodPost, hooks.PathWake, struct{}{}, &out)
}

// HooksOpen reports whether the engine serves its hooks to a caller
// without credentials (an engine started without a token).
func (c *Client) HooksOpen(ctx context.Context) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+hooks.PathStats, nil)
	if err != nil {
		return false
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
