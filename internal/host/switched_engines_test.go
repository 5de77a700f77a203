package host

import (
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// The engines model switching owns are found by their backend URL, a
// trailing slash either side not mattering.
func TestSwitchedEnginesByBackendURL(t *testing.T) {
	owned := switchedEngines(map[string]switching.Model{"a": {BackendURL: "http://10.0.0.1:8001/"}, "b": {BackendURL: "http://10.0.0.1:8002"}})
	for url, want := range map[string]bool{
		"http://10.0.0.1:8001": true, "http://10.0.0.1:8002/": true, "http://10.0.0.1:8003": false, "": false,
	} {
		if got := owned(registry.Instance{Registration: registry.Registration{Engine: registry.Engine{URL: url}}}); got != want {
			t.Errorf("%q: owned %v, want %v", url, got, want)
		}
	}
	if switchedEngines(nil)(registry.Instance{}) {
		t.Error("no switched models: an instance owned")
	}
}
