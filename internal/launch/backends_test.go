package launch

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// TestMain doubles as a minimal engine with vLLM's sleep routes when the
// launcher starts the test binary with LAUNCH_FAKE_ENGINE=ADDR.
func TestMain(m *testing.M) {
	if addr := os.Getenv("LAUNCH_FAKE_ENGINE"); addr != "" {
		fakeEngine(addr)
		return
	}
	os.Exit(m.Run())
}

func fakeEngine(addr string) {
	var asleep atomic.Bool
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("POST /sleep", func(w http.ResponseWriter, _ *http.Request) { asleep.Store(true) })
	mux.HandleFunc("POST /wake_up", func(w http.ResponseWriter, _ *http.Request) { asleep.Store(false) })
	mux.HandleFunc("GET /is_sleeping", func(w http.ResponseWriter, _ *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]bool{"is_sleeping": asleep.Load()})
	})
	_ = http.ListenAndServe(addr, mux)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func fakeModel(t *testing.T) switching.Model {
	addr := freeAddr(t)
	return switching.Model{BackendURL: "http://" + addr, Group: "gpu0",
		LaunchCommand: []string{os.Args[0], "-test.run=^$"}, Env: map[string]string{"LAUNCH_FAKE_ENGINE": addr}}
}

func isSleeping(t *testing.T, base string) bool {
	t.Helper()
	resp, err := http.Get(base + "/is_sleeping")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		IsSleeping bool `json:"is_sleeping"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return out.IsSleeping
}

// The launcher starts each backend, puts it to sleep, wakes the startup
// model, writes the PID file; stop ends the groups and removes the file.
func TestLaunchAndStop(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pids.json")
	models := map[string]switching.Model{"chat": fakeModel(t), "coder": fakeModel(t),
		"external": {BackendURL: "http://127.0.0.1:1", Group: "gpu0"}}
	var out bytes.Buffer
	f, err := Backends(context.Background(), BackendsOptions{Models: models, Controller: switching.Controller{StartupAwakeModel: "chat"},
		PIDFile: pidFile, Ready: 20 * time.Second, Grace: 2 * time.Second, Out: &out})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	t.Log(out.String())
	if len(f.Backends) != 2 || !strings.Contains(out.String(), "external: no launch_command") {
		t.Fatalf("%+v\n%s", f, out.String())
	}
	if isSleeping(t, models["chat"].BackendURL) || !isSleeping(t, models["coder"].BackendURL) {
		t.Fatal("chat should be awake, coder asleep")
	}
	read, err := ReadPIDFile(pidFile)
	if err != nil || len(read.Backends) != 2 || read.Backends[0].PGID != read.Backends[0].PID {
		t.Fatalf("the PID file: %+v %v", read, err)
	}
	// A second launch over a running pool is refused.
	if _, err := Backends(context.Background(), BackendsOptions{Models: models, PIDFile: pidFile, Ready: time.Second}); err == nil ||
		!strings.Contains(err.Error(), "still runs") {
		t.Fatalf("a launch over a running pool: %v", err)
	}
	out.Reset()
	if err := Stop(StopOptions{PIDFile: pidFile, Grace: 5 * time.Second, Out: &out}); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, b := range read.Backends {
		if groupAlive(b.PGID) {
			t.Fatalf("%s's group %d still runs", b.Model, b.PGID)
		}
	}
	if _, err := os.Stat(pidFile); !os.IsNotExist(err) {
		t.Fatalf("the PID file is left: %v", err)
	}
}

// A backend that never becomes healthy fails the launch: what was started
// is stopped, no PID file is written.
func TestAFailedLaunchStopsWhatItStarted(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pids.json")
	good := fakeModel(t)
	bad := switching.Model{BackendURL: "http://" + freeAddr(t), LaunchCommand: []string{"sh", "-c", "echo no GPU left >&2; exit 3"}}
	var out bytes.Buffer
	_, err := Backends(context.Background(), BackendsOptions{Models: map[string]switching.Model{"a": good, "b": bad},
		PIDFile: pidFile, Ready: 10 * time.Second, Grace: 2 * time.Second, Out: &out})
	if err == nil || !strings.Contains(err.Error(), "no GPU left") {
		t.Fatalf("launch: %v\n%s", err, out.String())
	}
	if _, err := os.Stat(pidFile); !os.IsNotExist(err) {
		t.Fatal("a failed launch wrote its PID file")
	}
	if resp, err := http.Get(good.BackendURL + "/health"); err == nil {
		resp.Body.Close()
		t.Fatal("the backend started first still serves")
	}
}

func writeFile(t *testing.T, path string, v any) {
	t.Helper()
	b, _ := json.Marshal(v)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// Stop refuses what it cannot prove it owns, and signals nothing then.
func TestStopRefusals(t *testing.T) {
	dir := t.TempDir()
	self, err := readProc(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// A live process (a sleeper in its own group) to aim at.
	p, err := os.StartProcess("/bin/sleep", []string{"sleep", "30"}, &os.ProcAttr{Sys: &syscall.SysProcAttr{Setpgid: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.Kill(); _, _ = p.Wait() }()
	var sleeper procInfo
	for i := 0; i < 100; i++ {
		if sleeper, err = readProc(p.Pid); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, c := range []struct {
		name string
		file any
		want string
	}{
		{"legacy", map[string]any{"chat": 1234}, "not a vhi-launch/1 PID file"},
		{"not json", "garbage", "not a vhi launch PID file"},
		{"reused pid", PIDFile{Format: Format, Backends: []Backend{{Model: "chat", PID: p.Pid, PGID: sleeper.PGID, StartTime: sleeper.StartTime + 1}}}, "another process has the PID now"},
		{"other group", PIDFile{Format: Format, Backends: []Backend{{Model: "chat", PID: p.Pid, PGID: sleeper.PGID + 1, StartTime: sleeper.StartTime}}}, "not"},
		{"own group", PIDFile{Format: Format, Backends: []Backend{{Model: "me", PID: os.Getpid(), PGID: self.PGID, StartTime: self.StartTime}}}, "this command's own"},
	} {
		path := filepath.Join(dir, c.name+".json")
		if s, ok := c.file.(string); ok {
			_ = os.WriteFile(path, []byte(s), 0o600)
		} else {
			writeFile(t, path, c.file)
		}
		err := Stop(StopOptions{PIDFile: path, Grace: time.Second})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
		if _, err := os.Stat(path); err != nil {
			t.Errorf("%s: a refused file was removed", c.name)
		}
	}
	if _, err := readProc(p.Pid); err != nil {
		t.Fatalf("a refused stop signalled the sleeper: %v", err)
	}
	// A file whose processes are gone is done with.
	gone := filepath.Join(dir, "gone.json")
	writeFile(t, gone, PIDFile{Format: Format, Backends: []Backend{{Model: "old", PID: 1 << 22, PGID: 1 << 22, StartTime: 1}}})
	var out bytes.Buffer
	if err := Stop(StopOptions{PIDFile: gone, Grace: time.Second, Out: &out}); err != nil || !strings.Contains(out.String(), "gone already") {
		t.Fatalf("a file of gone processes: %v %s", err, out.String())
	}
}
