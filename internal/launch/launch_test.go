package launch

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The placeholders are filled in argv, env and cwd; a process that exits
// says why with its last output; Stop ends the whole process group.
func TestStartAndStop(t *testing.T) {
	dir := t.TempDir()
	s := Spec{Command: []string{"sh", "-c", `echo "tp=$TP id={id}" > out; echo bye >&2; exit 4`}, Env: map[string]string{"TP": "{tp}"}, Cwd: dir}
	if err := s.Check("m"); err != nil {
		t.Fatal(err)
	}
	p, err := Start(s, map[string]string{"tp": "2", "id": "b-1"}, filepath.Join(dir, "log", "b-1.log"))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("did not exit")
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "out")); strings.TrimSpace(string(b)) != "tp=2 id=b-1" {
		t.Fatalf("filled: %q", b)
	}
	if why := p.Why(); why == nil || !strings.Contains(why.Error(), "exit status 4") || !strings.Contains(why.Error(), "bye") {
		t.Fatalf("why: %v", why)
	}

	// A shell and its child, one process group.
	p, err = Start(Spec{Command: []string{"sh", "-c", "sleep 300 & echo $! > pid; wait"}, Cwd: dir}, nil, filepath.Join(dir, "log", "b-2.log"))
	if err != nil {
		t.Fatal(err)
	}
	var child int
	for i := 0; i < 100 && child == 0; i++ {
		b, _ := os.ReadFile(filepath.Join(dir, "pid"))
		child, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		time.Sleep(20 * time.Millisecond)
	}
	if p.Why() != nil {
		t.Fatal("running, yet it says why it ended")
	}
	p.Stop(2 * time.Second)
	// Gone, or a zombie its new parent has not reaped yet.
	alive := func() bool {
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(child), "stat"))
		if err != nil {
			return syscall.Kill(child, 0) == nil
		}
		f := strings.Fields(string(b))
		return len(f) > 2 && f[2] != "Z"
	}
	for i := 0; i < 50 && alive(); i++ {
		time.Sleep(20 * time.Millisecond)
	}
	if alive() {
		t.Fatalf("the grandchild %d outlived Stop", child)
	}
	if s := (Spec{Command: []string{"x", "{nope}"}}); s.Check("m") == nil {
		t.Fatal("an unknown placeholder passed")
	}
}

// A restarted Host adopts what an earlier one launched by pid and start
// time, and can stop it; a pid whose start time differs (reused) or that
// has exited is not adopted.
func TestAdoptFindsTheSameProcessAgain(t *testing.T) {
	dir := t.TempDir()
	orig, err := Start(Spec{Command: []string{"sleep", "300"}, Cwd: dir}, nil, filepath.Join(dir, "a.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Stop(time.Second)
	pid, start := orig.Identity()
	if pid <= 0 || start == 0 {
		t.Fatalf("identity %d, %d", pid, start)
	}
	if _, err := Adopt(pid, start+1, ""); !errors.Is(err, ErrGone) {
		t.Fatalf("another start time: %v", err)
	}
	p, err := Adopt(pid, start, filepath.Join(dir, "a.log"))
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Argv(); len(got) != 2 || got[0] != "sleep" || got[1] != "300" || p.LogFile() != filepath.Join(dir, "a.log") {
		t.Fatalf("adopted: argv %q, log %s", got, p.LogFile())
	}
	select {
	case <-p.Exited():
		t.Fatal("adopted, and already exited")
	case <-time.After(2 * adoptPoll):
	}
	p.Stop(5 * time.Second)
	for _, q := range []*Process{p, orig} {
		select {
		case <-q.Exited():
		case <-time.After(5 * time.Second):
			t.Fatal("stopped, still running")
		}
	}
	if _, err := Adopt(pid, start, ""); !errors.Is(err, ErrGone) {
		t.Fatalf("an exited process adopted: %v", err)
	}
}

// A launched engine outlives what launched it, however much it writes
// afterwards: its output goes to its log file, not through a pipe that
// breaks when the launcher exits (the engine's next line would kill it
// with SIGPIPE). The launcher is this test binary, run again.
func TestALaunchedProcessOutlivesItsLauncher(t *testing.T) {
	if dir := os.Getenv("VHI_LAUNCH_HELPER_DIR"); dir != "" {
		script := `sleep 0.3; i=0; while [ $i -lt 50 ]; do echo "line $i after the launcher exited"; i=$((i+1)); done; echo done > marker`
		if _, err := Start(Spec{Command: []string{"sh", "-c", script}, Cwd: dir}, nil, filepath.Join(dir, "engine.log")); err != nil {
			t.Fatal(err)
		}
		os.Exit(0) // at once: the launcher is gone before the engine writes
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestALaunchedProcessOutlivesItsLauncher$")
	cmd.Env = append(os.Environ(), "VHI_LAUNCH_HELPER_DIR="+dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the launcher: %v\n%s", err, out)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if b, _ := os.ReadFile(filepath.Join(dir, "marker")); strings.TrimSpace(string(b)) == "done" {
			log, _ := os.ReadFile(filepath.Join(dir, "engine.log"))
			if n := strings.Count(string(log), "after the launcher exited"); n != 50 {
				t.Fatalf("the log holds %d of 50 lines", n)
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	log, _ := os.ReadFile(filepath.Join(dir, "engine.log"))
	t.Fatalf("the launched process died after its launcher exited; its log:\n%s", log)
}
