package e2e

import (
	"strings"
	"testing"
)

// vhi bench scale runs each elastic-EP mode through the Host end to end
// (tiny costs): every request through the Host completes in every mode.
func TestBenchScaleSmoke(t *testing.T) {
	out, err := vhiRun(t, "bench", "scale", "--prepare-time", "150ms", "--graph-time", "200ms", "--activate-time", "20ms",
		"--interval", "50ms", "--direct-interval", "50ms", "--log-level", "warn")
	if err != nil {
		t.Fatalf("vhi bench scale: %v\n%s", err, out)
	}
	t.Log(out)
	for _, mode := range []string{"blocking", "async", "async_graph_reuse"} {
		if !strings.Contains(out, mode) || strings.Count(out, ", 0 errors, longest stall") != 3 {
			t.Fatalf("the report lacks %s or shows client errors through the Host:\n%s", mode, out)
		}
	}
}
