package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/launch"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// vhiRun runs one vhi command to its end and returns its output.
func vhiRun(t *testing.T, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, vhiBin, args...).CombinedOutput()
	return string(out), err
}

// switchLoad is n streams of tokens each for model, through the Host.
func switchLoad(hostURL, model string, n, tokens int) <-chan []loadgen.Stream {
	done := make(chan []loadgen.Stream, 1)
	reqs := make([]loadgen.Request, n)
	for i := range reqs {
		seed := int64(100 + i)
		reqs[i] = loadgen.Request{Prompt: fmt.Sprintf("switch %s %d: tell me a story", model, i), MaxTokens: tokens, IgnoreEOS: true, Seed: &seed}
		if i%2 == 0 {
			reqs[i].Temperature = 0.7
		}
	}
	go func() {
		done <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: hostURL, Model: model}, reqs)
	}()
	return done
}

func allComplete(t *testing.T, what string, streams []loadgen.Stream, tokens int) {
	t.Helper()
	for i, s := range streams {
		if s.Err != nil || s.Done != 1 || s.Usage == nil || s.Usage.CompletionTokens != tokens {
			t.Fatalf("%s stream %d: %v, %d [DONE], usage %+v", what, i, s.Err, s.Done, s.Usage)
		}
	}
}

// The switching deployment as an operator runs it, every piece a process:
// vhi launch starts two sims that share "gpu0" (chat at level 1, coder at
// level 2), each put to sleep, chat woken; a Host routes by alias; chat's
// backend also has an agent, and a second chat engine serves beside it
// with its own, so a switch away from chat moves chat's streams there by
// migration instead of waiting for them. A-B-B-A with overlap: no request
// fails, the moved streams are exact. Then vhi stop refuses a stale PID
// file and stops the pool with the real one.
func TestSwitchingWithLaunchedBackends(t *testing.T) {
	tk := newTokens(t)
	dir, shm := t.TempDir(), t.TempDir()
	ports := map[string]int{"chat": freePort(t), "coder": freePort(t), "chat2": freePort(t)}
	simArgs := func(name, served string, extra ...string) []string {
		return append([]string{vhiBin, "sim", "--port", fmt.Sprint(ports[name]), "--served-model-name", served, "--shm-dir", shm,
			"--num-gpu-blocks", "2048", "--max-model-len", "1024", "--step-fixed", "5ms", "--log-level", "warn",
			"--engine-token-file", tk.agentFile, "--enable-sleep-mode", "--sleep-time", "50ms", "--wake-up-time", "300ms",
			"--weights-load-time", "200ms"}, extra...)
	}
	url := func(name string) string { return fmt.Sprintf("http://127.0.0.1:%d", ports[name]) }
	quote := func(argv []string) string {
		b, _ := json.Marshal(argv)
		return string(b)
	}
	config := fmt.Sprintf(`models:
  chat:
    served_model_name: served-chat
    backend_url: %s
    group: gpu0
    launch_command: %s
  coder:
    served_model_name: served-coder
    backend_url: %s
    sleep_level: 2
    group: gpu0
    launch_command: %s
controller:
  startup_awake_model: chat
  switch_timeout_s: 60
`, url("chat"), quote(simArgs("chat", "served-chat")), url("coder"), quote(simArgs("coder", "served-coder")))
	cfgFile, pidFile := filepath.Join(dir, "host.yaml"), filepath.Join(dir, "pids.json")
	if err := os.WriteFile(cfgFile, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := vhiRun(t, "launch", "--config", cfgFile, "--pid-file", pidFile, "--token-file", tk.agentFile, "--ready-timeout", "30s")
	if err != nil {
		t.Fatalf("vhi launch: %v\n%s", err, out)
	}
	t.Logf("vhi launch:\n%s", out)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_, _ = vhiRun(t, "stop", "--pid-file", pidFile, "--grace", "5s")
		}
	})
	if !strings.Contains(out, "pool ready: 2 backends started") || !strings.Contains(out, "chat: awake (the startup model)") {
		t.Fatalf("vhi launch said:\n%s", out)
	}
	if out, err := vhiRun(t, "launch", "--config", cfgFile, "--pid-file", pidFile, "--token-file", tk.agentFile); err == nil || !strings.Contains(out, "still runs") {
		t.Fatalf("a second launch over the running pool: %v\n%s", err, out)
	}

	// The second chat engine and the agents, then the Host.
	chat2 := startVHI(t, simArgs("chat2", "served-chat")[1:]...)
	waitHealthy(t, url("chat2")+"/health")
	hostAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	hostURL := "http://" + hostAddr
	startVHI(t, append([]string{"host", "--listen", hostAddr, "--config", cfgFile, "--heartbeat-interval", "300ms",
		"--log-level", "warn", "--data-dir", t.TempDir()}, tk.hostArgs()...)...)
	waitHealthy(t, hostURL+"/health")
	for _, a := range [][2]string{{"chat", url("chat")}, {"chat2", url("chat2")}} {
		startVHI(t, "agent", "--type", "A", "--id", a[0], "--host", hostAddr, "--engine", a[1], "--log-level", "warn", "--token-file", tk.agentFile)
	}
	c := hostClient(t, hostURL, tk.admin)
	waitUntil(t, "both chat engines registered", func() bool { return len(listInstances(t, hostURL)) == 2 })
	waitUntil(t, "chat awake at the Host", func() bool {
		st, err := c.AdminState(context.Background())
		return err == nil && st.Models["chat"].State == "awake" && st.Models["coder"].State == "sleeping"
	})

	// A-B-B-A with overlap: chat's long streams run when coder's requests
	// come; the switch moves them to chat2 and coder serves at once.
	long := switchLoad(hostURL, "chat", 6, 300)
	waitUntil(t, "chat's streams running", func() bool {
		st, err := c.AdminState(context.Background())
		return err == nil && st.Models["chat"].Active == 6
	})
	time.Sleep(200 * time.Millisecond)
	coder := switchLoad(hostURL, "coder", 8, 20)
	allComplete(t, "coder", <-coder, 20)
	st, err := c.AdminState(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	rep := st.Models["coder"].LastSwitch
	if st.Models["coder"].State != "awake" || rep == nil || !strings.Contains(rep.Drain, "by migration") {
		t.Fatalf("coder's switch: %+v %+v", st.Models["coder"], rep)
	}
	t.Logf("switch to coder: %.2f s, drain %.2f s (%s)", rep.DurationS, rep.DrainS, rep.Drain)
	longStreams := <-long
	allComplete(t, "chat (moved)", longStreams, 300)
	// Exact: the same requests on chat2 alone, unmigrated.
	var reqs []loadgen.Request
	for i := range 6 {
		seed := int64(100 + i)
		r := loadgen.Request{Prompt: fmt.Sprintf("switch chat %d: tell me a story", i), MaxTokens: 300, IgnoreEOS: true, Seed: &seed}
		if i%2 == 0 {
			r.Temperature = 0.7
		}
		reqs = append(reqs, r)
	}
	ref := loadgen.Run(context.Background(), loadgen.Config{BaseURL: url("chat2"), Model: "served-chat"}, reqs)
	for i := range ref {
		if ref[i].Text != longStreams[i].Text {
			t.Fatalf("moved chat stream %d differs from its unmigrated run", i)
		}
	}
	allComplete(t, "coder again", <-switchLoad(hostURL, "coder", 3, 10), 10)
	allComplete(t, "chat again", <-switchLoad(hostURL, "chat", 3, 10), 10)
	// Requests by the served name go to the registered engines that no
	// switched model owns: never to chat's, whose sleep and wake follow the
	// switcher's leases.
	before := successes(t, url("chat"))
	allComplete(t, "served-chat", <-switchLoad(hostURL, "served-chat", 4, 5), 5)
	if after := successes(t, url("chat")); after != before {
		t.Fatalf("requests by the served name reached the switched engine: %v → %v", before, after)
	}
	if out, err := vhiRun(t, "state", "--host", hostURL, "--admin-token-file", tk.adminFile); err != nil ||
		!strings.Contains(out, "chat   awake") || !strings.Contains(out, "coder  sleeping") {
		t.Fatalf("vhi state: %v\n%s", err, out)
	}
	chat2.stop(t)

	// vhi stop: a PID file whose start time another process would have is
	// refused whole, nothing signalled; the real one stops the pool.
	f, err := launch.ReadPIDFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	stale := f
	stale.Backends = append([]launch.Backend(nil), f.Backends...)
	stale.Backends[1].StartTime++
	b, _ := json.Marshal(stale)
	staleFile := filepath.Join(dir, "stale.json")
	if err := os.WriteFile(staleFile, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := vhiRun(t, "stop", "--pid-file", staleFile); err == nil || !strings.Contains(out, "another process has the PID now") {
		t.Fatalf("vhi stop of a stale file: %v\n%s", err, out)
	}
	for _, name := range []string{"chat", "coder"} {
		if resp, err := http.Get(url(name) + "/health"); err != nil {
			t.Fatalf("%s stopped by a refused stop: %v", name, err)
		} else {
			resp.Body.Close()
		}
	}
	out, err = vhiRun(t, "stop", "--pid-file", pidFile, "--grace", "10s")
	stopped = err == nil
	if err != nil || strings.Count(out, "exited") != 2 {
		t.Fatalf("vhi stop: %v\n%s", err, out)
	}
	for _, name := range []string{"chat", "coder"} {
		if resp, err := http.Get(url(name) + "/health"); err == nil {
			resp.Body.Close()
			t.Fatalf("%s still serves after vhi stop", name)
		}
	}
}

// vhi bench switch runs its trace through the Host's switching end to end
// (here without llama-swap, tiny): every request completes, the switches
// are reported.
func TestBenchSwitchSmoke(t *testing.T) {
	out, err := vhiRun(t, "bench", "switch", "--phases", "3", "--phase", "1s", "--interval", "250ms", "--long-tokens", "60",
		"--levels", "1,2", "--sleep1-time", "20ms", "--wake1-time", "30ms", "--reload-time", "50ms", "--log-level", "warn")
	if err != nil {
		t.Fatalf("vhi bench switch: %v\n%s", err, out)
	}
	t.Log(out)
	for _, want := range []string{"vllm-hi, level 1   0/12 failed", "vllm-hi, level 2   0/12 failed", "2 switches"} {
		if !strings.Contains(out, want) {
			t.Fatalf("the report lacks %q:\n%s", want, out)
		}
	}
}

// successes is an engine's vllm:request_success_total.
func successes(t *testing.T, engine string) string {
	t.Helper()
	resp, err := http.Get(engine + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "vllm:request_success_total") {
			sum = append(sum, line)
		}
	}
	return strings.Join(sum, "; ")
}

// SIGHUP reloads the switched models of a running Host: a model added to
// the file joins its GPU group (the Host finds it awake beside the group's
// awake model and puts it to sleep) and serves once asked for; a model
// left out of the file, idle, is let go (a request for it is refused as
// an unknown model); what needs a restart (a
// model's backend) is said and left as it was.
func TestSIGHUPReloadsTheSwitchedModels(t *testing.T) {
	tk := newTokens(t)
	shm := t.TempDir()
	ports := map[string]int{"chat": freePort(t), "coder": freePort(t)}
	url := func(name string) string { return fmt.Sprintf("http://127.0.0.1:%d", ports[name]) }
	for name := range ports {
		startVHI(t, "sim", "--port", fmt.Sprint(ports[name]), "--served-model-name", "served-"+name, "--shm-dir", shm,
			"--num-gpu-blocks", "512", "--max-model-len", "512", "--step-fixed", "2ms", "--log-level", "warn",
			"--engine-token-file", tk.agentFile, "--enable-sleep-mode", "--sleep-time", "20ms", "--wake-up-time", "50ms")
		waitHealthy(t, url(name)+"/health")
	}
	model := func(name, extra string) string {
		return fmt.Sprintf("  %s:\n    served_model_name: served-%s\n    backend_url: %s\n    group: gpu0\n%s", name, name, url(name), extra)
	}
	conf := filepath.Join(t.TempDir(), "host.yaml")
	write := func(body string) {
		t.Helper()
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("models:\n" + model("chat", "") + "controller:\n  startup_awake_model: chat\n")
	hostAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	hostURL := "http://" + hostAddr
	h := startVHI(t, append([]string{"host", "--listen", hostAddr, "--config", conf, "--log-level", "info", "--data-dir", t.TempDir()},
		tk.hostArgs()...)...)
	waitHealthy(t, hostURL+"/health")
	c := hostClient(t, hostURL, tk.admin)
	state := func() map[string]string {
		st, err := c.AdminState(context.Background())
		if err != nil {
			return nil
		}
		out := map[string]string{}
		for alias, m := range st.Models {
			out[alias] = m.State
		}
		return out
	}
	waitUntil(t, "chat awake", func() bool { return state()["chat"] == "awake" })
	allComplete(t, "chat", <-switchLoad(hostURL, "chat", 2, 10), 10)

	// coder joins gpu0; its sim is awake, as chat is: the Host puts it to sleep.
	write("models:\n" + model("chat", "") + model("coder", "") + "controller:\n  startup_awake_model: chat\n")
	if err := h.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "coder joined and asleep beside chat", func() bool {
		st := state()
		return st["coder"] == "sleeping" && st["chat"] == "awake"
	})
	allComplete(t, "coder", <-switchLoad(hostURL, "coder", 3, 10), 10)
	waitUntil(t, "coder awake, chat asleep", func() bool {
		st := state()
		return st["coder"] == "awake" && st["chat"] == "sleeping"
	})

	// chat leaves the file, and coder's backend changes (a restart's
	// matter): chat is let go, coder keeps its backend.
	write("models:\n" + strings.Replace(model("coder", ""), url("coder"), "http://127.0.0.1:1", 1))
	_ = h.cmd.Process.Signal(syscall.SIGHUP)
	waitUntil(t, "chat let go", func() bool {
		st := state()
		_, has := st["chat"]
		return st != nil && !has && st["coder"] == "awake"
	})
	allComplete(t, "coder after the second reload", <-switchLoad(hostURL, "coder", 1, 10), 10)
	if got := <-switchLoad(hostURL, "chat", 1, 10); got[0].Err == nil {
		t.Fatal("a request for chat, let go by the reload, succeeded")
	}
	if !strings.Contains(h.stderr.String(), "models.coder: its group and backend_url are read at start only") {
		t.Fatalf("the Host did not say what it left:\n%s", h.stderr.String())
	}
}
