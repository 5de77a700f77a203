package launch

import (
	"os"
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
