package engine

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Admin is the one client of an engine's administration routes, as vLLM
// serves them (and vhi sim): sleep mode (sleep, wake_up, is_sleeping,
// the weights' reload), a greedy probe of what its weights compute, and
// elastic EP's reconfiguration. Model switching, scaling and the
// launcher all reach an engine through it; no other package sends to
// those routes.
type Admin struct {
	base, model, token string
	http               *http.Client
}

// NewAdmin is the engine at base serving model (the name the probe
// asks for); token, when set, is sent as a bearer token (the engines'
// control routes take the agent credential).
func NewAdmin(base, model, token string, client *http.Client) *Admin {
	if client == nil {
		client = http.DefaultClient
	}
	return &Admin{base: strings.TrimRight(base, "/"), model: model, token: token, http: client}
}

// adminAnswerLimit bounds what an admin route's answer is read to.
const adminAnswerLimit = 1 << 20

// call sends body (nil: none) and returns the status and the answer.
func (a *Admin) call(ctx context.Context, method, path string, in any) (int, []byte, error) {
	body, err := marshal(in)
	if err != nil {
		return 0, nil, err
	}
	return send(ctx, a.http, a.base, a.token, method, path, body, adminAnswerLimit)
}

// do is call for a route whose answer must be a 2xx, decoded into out
// (nil: ignored).
func (a *Admin) do(ctx context.Context, method, path string, body, out any) error {
	status, b, err := a.call(ctx, method, path, body)
	if err != nil {
		return err
	}
	if status/100 != 2 {
		return fmt.Errorf("%s %s: %d %s", method, path, status, strings.TrimSpace(string(b)))
	}
	return decode(method, path, b, out)
}

// Health is vLLM's GET /health: nil once it answers 2xx.
func (a *Admin) Health(ctx context.Context) error {
	return a.do(ctx, http.MethodGet, "/health", nil, nil)
}

// Sleep is vLLM's POST /sleep?level=N.
func (a *Admin) Sleep(ctx context.Context, level int) error {
	return a.do(ctx, http.MethodPost, fmt.Sprintf("/sleep?level=%d", level), nil, nil)
}

// WakeUp is vLLM's POST /wake_up with these tags (none: everything).
func (a *Admin) WakeUp(ctx context.Context, tags ...string) error {
	path := "/wake_up"
	for i, t := range tags {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		path += sep + "tags=" + t
	}
	return a.do(ctx, http.MethodPost, path, nil, nil)
}

// ReloadWeights is vLLM's collective_rpc reload_weights (after a level-2
// sleep the weights hold nothing until reloaded).
func (a *Admin) ReloadWeights(ctx context.Context) error {
	return a.do(ctx, http.MethodPost, "/collective_rpc", map[string]string{"method": "reload_weights"}, nil)
}

// IsSleeping is vLLM's GET /is_sleeping.
func (a *Admin) IsSleeping(ctx context.Context) (bool, error) {
	var out struct {
		IsSleeping *bool `json:"is_sleeping"`
	}
	if err := a.do(ctx, http.MethodGet, "/is_sleeping", nil, &out); err != nil {
		return false, err
	}
	if out.IsSleeping == nil {
		return false, fmt.Errorf("GET /is_sleeping: no is_sleeping in the answer (is the engine started with --enable-sleep-mode?)")
	}
	return *out.IsSleeping, nil
}

// ProbeTokens is how many tokens a probe generates.
const ProbeTokens = 8

// Probe is a greedy, seeded completion of prompt (ProbeTokens long): what
// the engine's weights compute, to compare before and after a change.
func (a *Admin) Probe(ctx context.Context, prompt string) (string, error) {
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	body := map[string]any{"model": a.model, "prompt": prompt, "max_tokens": ProbeTokens, "temperature": 0, "seed": 0}
	if err := a.do(ctx, http.MethodPost, "/v1/completions", body, &out); err != nil {
		return "", err
	}
	if len(out.Choices) != 1 {
		return "", fmt.Errorf("the probe's answer has %d choices", len(out.Choices))
	}
	return out.Choices[0].Text, nil
}

// scalingBody is what vLLM answers every request with while an elastic
// EP reconfiguration commits.
var scalingBody = []byte("currently scaling")

// ScaleElasticEP is vLLM's POST /scale_elastic_ep: the engine drains
// (up to drainTimeout, at least a second), then reconfigures to newSize
// data-parallel ranks, and answers once it serves again.
func (a *Admin) ScaleElasticEP(ctx context.Context, newSize int, drainTimeout time.Duration) error {
	return a.do(ctx, http.MethodPost, "/scale_elastic_ep",
		map[string]int{"new_data_parallel_size": newSize, "drain_timeout": max(1, int(drainTimeout.Seconds()))}, nil)
}

// Scaling states of an engine, as POST /is_scaling_elastic_ep tells them.
type Scaling int

const (
	// ScalingUnknown: the engine answered neither way (or not at all).
	ScalingUnknown Scaling = iota
	// ScalingServing: the engine serves (200).
	ScalingServing
	// ScalingCommitting: an elastic-EP reconfiguration commits (503,
	// "currently scaling").
	ScalingCommitting
)

// IsScalingElasticEP asks the engine whether an elastic-EP commit is under
// way; err is set only when the engine could not be asked.
func (a *Admin) IsScalingElasticEP(ctx context.Context) (Scaling, error) {
	status, b, err := a.call(ctx, http.MethodPost, "/is_scaling_elastic_ep", nil)
	switch {
	case err != nil:
		return ScalingUnknown, err
	case status == http.StatusOK:
		return ScalingServing, nil
	case status == http.StatusServiceUnavailable && IsScalingAnswer(b):
		return ScalingCommitting, nil
	}
	return ScalingUnknown, nil
}

// IsScalingAnswer reports whether an engine's answer (a 503's body) is
// vLLM's "currently scaling": a request refused while an elastic-EP
// reconfiguration commits, worth holding and sending again.
func IsScalingAnswer(body []byte) bool { return bytes.Contains(body, scalingBody) }
