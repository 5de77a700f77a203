package hostconfig

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	f, err := Parse([]byte(`
targets:
  m:
    launch_command: ["vllm", "serve", "/models/m", "--port", "{port}", "--tensor-parallel-size", "{tp}"]
    env: {VLLM_HI_TYPE: B, VLLM_HI_ID: "{id}"}
    ready_timeout_s: 600
`), "host.yaml")
	if err != nil {
		t.Fatal(err)
	}
	s := f.Targets["m"]
	if !s.Uses("tp") || !s.Uses("id") || s.Uses("pp") || s.ReadyTimeout().Seconds() != 600 {
		t.Fatalf("%+v", s)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"targets:\n  m:\n    launch_comand: [x]\n", "line 3: field launch_comand not found"},
		{"targets:\n  m:\n    launch_command: [x, '{tpp}']\n", "unknown placeholder {tpp}"},
		{"targets:\n  m:\n    launch_command: []\n", "targets.m: launch_command is empty"},
		{"target:\n  m: {}\n", "line 1: field target not found"},
		{"targets:\n  m:\n    launch_command: [x]\n    gpu_memory_utilization: 2\n", "gpu_memory_utilization in (0, 1]"},
	} {
		if _, err := Parse([]byte(bad.yaml), "host.yaml"); err == nil || !strings.Contains(err.Error(), bad.want) || !strings.HasPrefix(err.Error(), "host.yaml: ") {
			t.Errorf("%q: %v, want an error with %q", bad.yaml, err, bad.want)
		}
	}
	if f, err := Parse(nil, "empty"); err != nil || len(f.Targets) != 0 {
		t.Fatalf("an empty file: %v %+v", err, f)
	}
}
