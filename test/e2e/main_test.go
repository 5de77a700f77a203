// Package e2e runs the real vhi binary as separate processes on loopback.
package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/credentials"

	"github.com/vllm-hi/vllm-hi/test/framework"
)

var vhiBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "vhi-e2e-")
	if err != nil {
		panic(err)
	}
	vhiBin = filepath.Join(dir, "vhi")
	// Every process these tests start looks for "the local Host's" tokens
	// in the state directory (vhi sim protects its hooks with them when it
	// finds them): give the run its own, empty one, so a Host that once ran
	// on this machine changes nothing here.
	if err := os.Setenv("XDG_STATE_HOME", filepath.Join(dir, "state")); err != nil {
		panic(err)
	}
	// No -race here: these tests time real streams against real migrations,
	// and the race detector's 5-10x slowdown would change what they test.
	// The in-process tests of every package run with -race.
	// VHI_E2E_BIN runs a prebuilt binary (the GPU machines have no Go
	// toolchain: the binary and this test are built elsewhere).
	if prebuilt := os.Getenv("VHI_E2E_BIN"); prebuilt != "" {
		if vhiBin, err = filepath.Abs(prebuilt); err != nil {
			panic(err)
		}
	} else {
		build := exec.Command("go", "build", "-o", vhiBin, "github.com/vllm-hi/vllm-hi/cmd/vhi")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building vhi:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// tokens are a deployment's credentials in files, as an operator keeps
// them.
type tokens struct {
	dir              string
	adminFile, admin string
	agentFile, agent string
}

func newTokens(t *testing.T) tokens {
	t.Helper()
	dir := t.TempDir()
	// Tokens travel in HTTP headers: printable ASCII only, whatever the
	// test's name holds.
	name := strings.Map(func(r rune) rune {
		if r > ' ' && r < 0x7f {
			return r
		}
		return '_'
	}, t.Name())
	// The test's name (which says whose token it is in a failure) and
	// random hex: the Host refuses tokens shorter than 32 bytes.
	tk := tokens{dir: dir, adminFile: filepath.Join(dir, "admin-token"), admin: "admin-" + name + "-" + credentials.NewToken(),
		agentFile: filepath.Join(dir, "agent-token"), agent: "agent-" + name + "-" + credentials.NewToken()}
	for _, f := range [][2]string{{tk.adminFile, tk.admin}, {tk.agentFile, tk.agent}} {
		if err := os.WriteFile(f[0], []byte(f[1]+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return tk
}

// hostArgs are the credential flags of vhi host.
func (tk tokens) hostArgs() []string {
	return []string{"--admin-token-file", tk.adminFile, "--agent-token-file", tk.agentFile}
}

// authGet is a GET with the agent token (what an agent or the Host sends
// an engine's hooks).
func authGet(url, token string) (*http.Response, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	return http.DefaultClient.Do(req)
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// proc is a vhi process that the test stops at cleanup.
type proc struct {
	cmd    *exec.Cmd
	stderr *framework.LockedBuffer
	once   sync.Once
}

func startVHI(t *testing.T, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(vhiBin, args...)
	stderr := &framework.LockedBuffer{}
	cmd.Stderr = stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, stderr: stderr}
	t.Cleanup(func() { p.stop(t) })
	return p
}

func (p *proc) stop(t *testing.T) {
	p.once.Do(func() { p.stopOnce(t) })
}

// kill ends the process at once (SIGKILL), as a crash would.
func (p *proc) kill() {
	p.once.Do(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
			_ = p.cmd.Wait()
		}
	})
}

func (p *proc) stopOnce(t *testing.T) {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("%s exited with %v; stderr:\n%s", p.cmd.Args, err, p.stderr)
		}
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		t.Errorf("%s did not stop on SIGTERM", p.cmd.Args)
	}
}

func waitHealthy(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s never became healthy", url)
}
