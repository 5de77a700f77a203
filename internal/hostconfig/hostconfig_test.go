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
	// A duration in seconds may be spelled as the flags spell it.
	f, err = Parse([]byte("targets:\n  m:\n    launch_command: [x]\n    ready_timeout_s: 10m\n"), "host.yaml")
	if err != nil || f.Targets["m"].ReadyTimeout().Minutes() != 10 {
		t.Fatalf("ready_timeout_s: 10m: %v %+v", err, f.Targets["m"])
	}
	if _, err := Parse([]byte("targets:\n  m:\n    launch_command: [x]\n    ready_timeout_s: soon\n"), "host.yaml"); err == nil ||
		!strings.Contains(err.Error(), "line 4") {
		t.Fatalf("ready_timeout_s: soon: %v, want an error naming line 4", err)
	}
	if f, err := Parse(nil, "empty"); err != nil || len(f.Targets) != 0 || len(f.Models) != 0 {
		t.Fatalf("an empty file: %v %+v", err, f)
	}
}

func TestParseModels(t *testing.T) {
	f, err := Parse([]byte(`
models:
  chat:
    served_model_name: Qwen/Qwen3-8B
    backend_url: http://127.0.0.1:8101
    sleep_level: 1
    group: gpu0
    priority: 2
    host_memory_gb: 16
    launch_command: [vllm, serve, Qwen/Qwen3-8B, --port, "8101", --enable-sleep-mode]
    env: {VLLM_SERVER_DEV_MODE: "1"}
  coder:
    backend_url: http://127.0.0.1:8102
    sleep_level: 2
    wake_tags: [weights, kv_cache]
    group: gpu0
controller:
  policy: always_sleep_previous
  startup_awake_model: chat
  request_timeout_s: 60
  switch_timeout_s: 90
  min_awake_s: 5
  host_memory_budget_gb: 40
`), "host.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if m := f.Models["coder"]; m.SleepLevel != 2 || len(m.WakeTags) != 2 || f.Controller.MinAwakeS != 5 || f.Models["chat"].Priority != 2 ||
		f.Models["chat"].HostMemoryGB != 16 || f.Controller.HostMemoryBudgetGB != 40 {
		t.Fatalf("%+v", f)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"models:\n  a:\n    backend_url: http://x:1\n    sleep_levl: 2\n", "line 4: field sleep_levl not found"},
		{"models:\n  a:\n    backend_url: http://x:1\ncontroller:\n  polcy: x\n", "line 5: field polcy not found"},
		{"models:\n  a:\n    backend_url: http://x:1\n    sleep_level: 3\n", "models.a.sleep_level 3"},
		{"controller:\n  policy: always_sleep_previous\n", "without models"},
	} {
		if _, err := Parse([]byte(bad.yaml), "host.yaml"); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want an error with %q", bad.yaml, err, bad.want)
		}
	}
}

func TestParseAutoscale(t *testing.T) {
	f, err := Parse([]byte(`
autoscale:
  interval_s: 1
  models:
    moe:
      kind: data_parallel
      min: 4
      max: 5
      ttft_p95_slo_s: 5
      window_s: 30
    dense: {min: 1, max: 3, ttft_p95_slo_s: 2, queue_high: 4}
`), "host.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !f.Autoscale.Enabled() || f.Autoscale.Models["moe"].Kind != "data_parallel" || f.Autoscale.Models["dense"].QueueHigh != 4 || f.Autoscale.Interval().Seconds() != 1 {
		t.Fatalf("%+v", f.Autoscale)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"autoscale:\n  models:\n    m: {min: 1, max: 2, ttft_slo: 1}\n", "field ttft_slo not found"},
		{"autoscale:\n  models:\n    m: {min: 1, max: 2}\n", "autoscale.models.m: ttft_p95_slo_s is required"},
	} {
		if _, err := Parse([]byte(bad.yaml), "host.yaml"); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want %q", bad.yaml, err, bad.want)
		}
	}
}
