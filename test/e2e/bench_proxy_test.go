package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// vhi bench proxy end to end at a small scale, without nginx: its own
// Host and agent come up with their own tokens, every stream completes
// on both paths, and the Host's CPU per event is reported.
func TestBenchProxySmoke(t *testing.T) {
	out := filepath.Join(t.TempDir(), "proxy.json")
	text, err := vhiRun(t, "bench", "proxy", "--levels", "20", "--tokens", "10", "--interval", "20ms", "--nginx", "off", "--json", out,
		"--log-level", "warn")
	t.Log(text)
	if err != nil {
		t.Fatalf("vhi bench proxy: %v", err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		Path       string  `json:"path"`
		Completed  int     `json:"completed"`
		Tokens     int     `json:"tokens"`
		CPUPerEvnt float64 `json:"proxy_cpu_us_per_event"`
	}
	if err := json.Unmarshal(b, &rows); err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3 {
		t.Fatalf("want the direct, the Host's and the event-loop Host's rows, got %+v", rows)
	}
	for _, r := range rows {
		if r.Completed != 20 || r.Tokens != 200 {
			t.Fatalf("%s: %d streams completed, %d tokens; want 20 and 200", r.Path, r.Completed, r.Tokens)
		}
	}
	if rows[2].Path != "vhi host, event loop" || rows[2].CPUPerEvnt <= 0 {
		t.Fatalf("the event-loop Host's row has no CPU per event: %+v", rows[2])
	}
	if rows[1].Path != "vhi host" || rows[1].CPUPerEvnt <= 0 {
		t.Fatalf("the Host's row has no CPU per event: %+v", rows[1])
	}
}
