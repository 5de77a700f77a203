package hooks

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the vLLM plugin's routes.json from Routes")

// pluginRoutes is the table the vLLM plugin builds its router from.
const pluginRoutes = "../../deploy/vllm-plugin/vllm_hi_plugin/routes.json"

// The plugin's routes.json is Routes, as the plugin reads it (go test
// ./api/hooks -update rewrites it).
func TestRoutesFile(t *testing.T) {
	want, err := json.MarshalIndent(Routes(), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	want = append(want, '\n')
	if *update {
		if err := os.WriteFile(pluginRoutes, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(pluginRoutes)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s is stale: run go test ./api/hooks -update", pluginRoutes)
	}
}

func TestRoutes(t *testing.T) {
	seen := map[string]bool{}
	for _, r := range Routes() {
		if seen[r.Name] || seen[r.Method+" "+r.Path] {
			t.Fatalf("%s twice", r.Name)
		}
		seen[r.Name], seen[r.Method+" "+r.Path] = true, true
		if got, ok := RouteOf(r.Name); !ok || got != r {
			t.Fatalf("RouteOf(%s)", r.Name)
		}
	}
	if _, ok := RouteOf("nope"); ok {
		t.Fatal("an unknown hook has a route")
	}
	if p := AttachPath("cmpl-1/x", 7); p != "/vllm_hi/engine/requests/cmpl-1%2Fx/stream?from=7" {
		t.Fatal(p)
	}
}
