// Package httpjson sends one JSON request to an HTTP API with a bearer
// token and reads its answer, bounded: what the Host API client and the
// agent's engine client share. Each reads a non-2xx answer its own way.
package httpjson

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
)

// Do sends body (JSON; nil sends none) to url and returns the status and
// at most limit bytes of the answer.
func Do(ctx context.Context, c *http.Client, method, url, token string, body []byte, limit int64) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return resp.StatusCode, nil, fmt.Errorf("read the answer: %w", err)
	}
	return resp.StatusCode, b, nil
}
