package switching

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// Backend is what a switch does to one engine: vLLM's sleep-mode routes
// and a greedy probe. An interface so the state machine's tests can make
// an engine fail at any step.
type Backend interface {
	Sleep(ctx context.Context, level int) error
	// WakeUp calls /wake_up with these tags (none: everything).
	WakeUp(ctx context.Context, tags ...string) error
	ReloadWeights(ctx context.Context) error
	IsSleeping(ctx context.Context) (bool, error)
	// Probe is a greedy completion of prompt: what the engine's weights
	// compute.
	Probe(ctx context.Context, prompt string) (string, error)
}

// httpBackend is a vLLM (or vhi sim) at a URL.
type httpBackend struct {
	base, model, token string
	client             *http.Client
}

var _ Backend = (*httpBackend)(nil)

// NewHTTPBackend is the engine at base serving model; token, when set, is
// sent as a bearer token (the engines' control routes take the agent
// credential).
func NewHTTPBackend(base, model, token string, client *http.Client) Backend {
	return &httpBackend{base: strings.TrimRight(base, "/"), model: model, token: token, client: client}
}

func (b *httpBackend) do(ctx context.Context, method, path string, body any, out any) error {
	var rd io.Reader
	if body != nil {
		buf, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(buf)
	}
	req, err := http.NewRequestWithContext(ctx, method, b.base+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if b.token != "" {
		req.Header.Set("Authorization", "Bearer "+b.token)
	}
	resp, err := b.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("%s %s: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %d %s", method, path, resp.StatusCode, strings.TrimSpace(string(raw)))
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return fmt.Errorf("%s %s: the answer is not JSON: %w", method, path, err)
		}
	}
	return nil
}

func (b *httpBackend) Sleep(ctx context.Context, level int) error {
	return b.do(ctx, http.MethodPost, fmt.Sprintf("/sleep?level=%d", level), nil, nil)
}

func (b *httpBackend) WakeUp(ctx context.Context, tags ...string) error {
	path := "/wake_up"
	for i, t := range tags {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		path += sep + "tags=" + t
	}
	return b.do(ctx, http.MethodPost, path, nil, nil)
}

func (b *httpBackend) ReloadWeights(ctx context.Context) error {
	return b.do(ctx, http.MethodPost, "/collective_rpc", map[string]string{"method": "reload_weights"}, nil)
}

func (b *httpBackend) IsSleeping(ctx context.Context) (bool, error) {
	var out struct {
		IsSleeping *bool `json:"is_sleeping"`
	}
	if err := b.do(ctx, http.MethodGet, "/is_sleeping", nil, &out); err != nil {
		return false, err
	}
	if out.IsSleeping == nil {
		return false, fmt.Errorf("GET /is_sleeping: no is_sleeping in the answer (is the engine started with --enable-sleep-mode?)")
	}
	return *out.IsSleeping, nil
}

func (b *httpBackend) Probe(ctx context.Context, prompt string) (string, error) {
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	body := map[string]any{"model": b.model, "prompt": prompt, "max_tokens": probeTokens, "temperature": 0, "seed": 0}
	if err := b.do(ctx, http.MethodPost, "/v1/completions", body, &out); err != nil {
		return "", err
	}
	if len(out.Choices) != 1 {
		return "", fmt.Errorf("the probe's answer has %d choices", len(out.Choices))
	}
	return out.Choices[0].Text, nil
}
