package engine

import (
	"net/http"
	"testing"
	"time"
)

// The clients of engines drop idle connections before vLLM's HTTP server
// does (uvicorn's keep-alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE: 5 s by
// default): else a request sent as the engine closes the connection fails
// with EOF.
func TestIdleConnectionsCloseBeforeVLLMsKeepAlive(t *testing.T) {
	c, err := NewClient("http://127.0.0.1:1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	tr, ok := c.http.Transport.(*http.Transport)
	if !ok || tr.IdleConnTimeout <= 0 || tr.IdleConnTimeout >= 5*time.Second {
		t.Fatalf("idle connections kept for %v, want less than vLLM's 5 s keep-alive", tr.IdleConnTimeout)
	}
}
