package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// withLaunchers restarts the deployment's Host with a configuration whose
// launch command for model m starts a sim and its agent (type B) with the
// asked TP and PP; cmd replaces the command when set.
func (d *deployment) withLaunchers(t *testing.T, cmd string) {
	t.Helper()
	if cmd == "" {
		sim := fmt.Sprintf("%s sim --port {port} --served-model-name m --shm-dir %s --num-gpu-blocks 4096 --max-model-len 1024 "+
			"--step-fixed 6ms --log-level warn --engine-token-file %s --tp {tp} --pp {pp}", vhiBin, d.shm, d.tk.agentFile)
		agent := fmt.Sprintf("%s agent --type B --id {id} --host {host} --engine http://127.0.0.1:{port} --data-port {data_port} "+
			"--log-level warn --token-file %s", vhiBin, d.tk.agentFile)
		cmd = sim + " & exec " + agent
	}
	cfg := filepath.Join(t.TempDir(), "host.yaml")
	yaml := fmt.Sprintf("targets:\n  m:\n    launch_command: [sh, -c, %q]\n    ready_timeout_s: 30\n", cmd)
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	d.host.stop(t)
	d.hostArgs = append(d.hostArgs, "--config", cfg)
	d.host = d.startHost(t)
	waitUntil(t, "both agents back", func() bool {
		return instance(t, d.hostURL, "A").State == "active" && instance(t, d.hostURL, "B").ID != ""
	})
}

// "Scale out to TP2" is one call: a migration that names no target
// launches one with the asked shape from the configured command, waits
// for it to register, and migrates to it under load, every stream exact.
// A shape the command cannot start is refused up front; a launch that
// dies fails the migration with its output, and the source keeps serving.
func TestOnDemandTarget(t *testing.T) {
	d := deploy(t, 4096)
	d.withLaunchers(t, "")
	// The command sets TP and PP but not the memory share.
	if code, body := d.migrate(t, `{"src_vllm_hi_id":"A","target_gpu_memory_utilization":0.5}`); code != 409 || !strings.Contains(body, "has no {gpu_memory_utilization}") {
		t.Fatalf("a share the command cannot set: %d %s", code, body)
	}
	tp := 2
	reqs := load(12, 300)
	want := d.reference(reqs)
	st := d.migrateLoaded(t, reqs, want, hostapi.MigrateRequest{Src: "A", TargetTP: &tp})
	if st.Launched != nil && st.Launched.PID > 0 {
		// The Host leaves the engines it launched running when it exits.
		pg := -st.Launched.PID
		t.Cleanup(func() { _ = syscall.Kill(pg, syscall.SIGTERM) })
	}
	if st.State != "succeeded" || st.Launched == nil || st.Launched.PID == 0 || st.Dst != st.Launched.ID || st.NewActiveInstance != st.Dst {
		t.Fatalf("%+v", st)
	}
	if st.StepHistory[0].Step != "launch_target" || st.StepHistory[0].DurationS <= 0 {
		t.Fatalf("steps %+v", st.StepHistory)
	}
	in := instance(t, d.hostURL, st.Dst)
	if in.TP != 2 || in.Role != "active" {
		t.Fatalf("the launched target: %+v", in)
	}
	if _, err := os.Stat(st.Launched.LogFile); err != nil {
		t.Fatalf("its log: %v", err)
	}

	// A launch that dies: the migration fails with its output; the
	// active instance goes on serving.
	d2 := deploy(t, 4096)
	d2.withLaunchers(t, "echo no GPU left for a target >&2; exit 3")
	id := d2.startMigration(t, hostapi.MigrateRequest{Src: "A"})
	fail := d2.waitEnd(t, id)
	if fail.State != "failed" || !strings.Contains(fail.Error, "no GPU left for a target") || !strings.Contains(fail.Error, "exit status 3") {
		t.Fatalf("%+v", fail)
	}
	got := d2.startLoad(reqs[:2])
	if s := <-got; s[0].Err != nil || s[0].Text != want[0].Text {
		t.Fatalf("the source after a failed launch: %v", s[0].Err)
	}
}
