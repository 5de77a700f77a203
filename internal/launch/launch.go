// Package launch starts the engines the Host brings up on demand — a
// migration's target, asked for with a shape no running instance has —
// from a configured command. The command's argv and environment carry
// placeholders the Host fills ({id}, {tp}, …); the process runs in its own
// process group, its output goes to a log file, and it is stopped as a
// group (SIGTERM, then SIGKILL after a grace period). The same for the
// backends of switched models, which `vhi launch` starts one after another
// and `vhi stop` stops after checking they are still the processes it
// started (backends.go).
package launch

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/durations"
)

// Spec is how to start an engine with its agent for one served model.
type Spec struct {
	// Command is the argv; placeholders in it and in Env are filled in.
	Command []string          `yaml:"launch_command"`
	Env     map[string]string `yaml:"env"`
	Cwd     string            `yaml:"cwd"`
	// ReadyTimeoutS bounds the wait from start until the new instance
	// is registered, healthy and migratable (default 900: vLLM compiles
	// for minutes on a fresh machine).
	ReadyTimeoutS durations.Seconds `yaml:"ready_timeout_s"`
	// GPUMemoryUtilization fills {gpu_memory_utilization} when a
	// migration does not ask for a share (default 0.9).
	GPUMemoryUtilization float64 `yaml:"gpu_memory_utilization"`
}

// Placeholders are the names a Spec may use, as {name}:
//   - id: the vllm_hi_id the new instance must register as (its agent's
//     --id, or VLLM_HI_ID for the vLLM plugin);
//   - model: the served model name;
//   - tp, pp, gpu_memory_utilization: the shape asked for;
//   - port: a free TCP port on this machine for the engine;
//   - data_port: another, for the agent's data plane;
//   - host: the address agents register with (the Host's --listen).
var Placeholders = []string{"id", "model", "tp", "pp", "gpu_memory_utilization", "port", "data_port", "host"}

var placeholder = regexp.MustCompile(`\{([a-z_]+)\}`)

// Check reports what is wrong with s, naming the model it is for.
func (s Spec) Check(model string) error {
	if len(s.Command) == 0 || s.Command[0] == "" {
		return fmt.Errorf("targets.%s: launch_command is empty", model)
	}
	if s.ReadyTimeoutS < 0 || (s.GPUMemoryUtilization != 0 && (s.GPUMemoryUtilization <= 0 || s.GPUMemoryUtilization > 1)) {
		return fmt.Errorf("targets.%s: ready_timeout_s must be ≥ 0 and gpu_memory_utilization in (0, 1]", model)
	}
	for _, v := range s.texts() {
		for _, m := range placeholder.FindAllStringSubmatch(v, -1) {
			if !slices.Contains(Placeholders, m[1]) {
				return fmt.Errorf("targets.%s: unknown placeholder {%s} in %q (known: %s)", model, m[1], v, strings.Join(Placeholders, ", "))
			}
		}
	}
	return nil
}

// Uses reports whether the command or its environment has {name}.
func (s Spec) Uses(name string) bool {
	for _, v := range s.texts() {
		if strings.Contains(v, "{"+name+"}") {
			return true
		}
	}
	return false
}

// ReadyTimeout is ReadyTimeoutS as a duration, with its default.
func (s Spec) ReadyTimeout() time.Duration {
	if s.ReadyTimeoutS == 0 {
		return 15 * time.Minute
	}
	return s.ReadyTimeoutS.Duration()
}

func (s Spec) texts() []string {
	out := slices.Clone(s.Command)
	for _, v := range s.Env {
		out = append(out, v)
	}
	return append(out, s.Cwd)
}

func fill(s string, vars map[string]string) string {
	return placeholder.ReplaceAllStringFunc(s, func(m string) string {
		if v, ok := vars[m[1:len(m)-1]]; ok {
			return v
		}
		return m
	})
}

// Process is a started engine: one this process started, or one it
// adopted from an earlier Host (Adopt).
type Process struct {
	cmd   *exec.Cmd // nil when adopted
	pid   int
	start uint64 // its start time (clock ticks after boot): its identity with pid
	argv  []string
	log   string
	done  chan struct{}
	err   error // after done
	once  sync.Once
}

// Start runs s with vars filled in, its output appended to logFile, in a
// process group of its own.
func Start(s Spec, vars map[string]string, logFile string) (*Process, error) {
	return start(s, vars, logFile, false)
}

// StartSession is Start in a session of its own (its group's id is its
// pid): a process that outlives the one that started it (vhi launch's
// backends), out of reach of its terminal's hang-up.
func StartSession(s Spec, logFile string) (*Process, error) {
	return start(s, nil, logFile, true)
}

func start(s Spec, vars map[string]string, logFile string, session bool) (*Process, error) {
	argv := make([]string, len(s.Command))
	for i, a := range s.Command {
		argv[i] = fill(a, vars)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = fill(s.Cwd, vars)
	cmd.Env = os.Environ()
	keys := make([]string, 0, len(s.Env))
	for k := range s.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		cmd.Env = append(cmd.Env, k+"="+fill(s.Env[k], vars))
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: !session, Setsid: session}
	if err := os.MkdirAll(filepath.Dir(logFile), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	p := &Process{cmd: cmd, argv: cmd.Args, log: logFile, done: make(chan struct{})}
	// The file itself, not a pipe through this process: a pipe would
	// break when this process exits, and the engine's next line of output
	// would kill it with SIGPIPE — but a launched engine is to outlive the
	// Host (or vhi launch) that started it.
	cmd.Stdout, cmd.Stderr = f, f
	err = cmd.Start()
	f.Close() // the child holds its own descriptor
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", argv[0], err)
	}
	p.pid = cmd.Process.Pid
	p.start, _ = startTime(p.pid) // read before Wait can reap it
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Exited is closed when the process has ended.
func (p *Process) Exited() <-chan struct{} { return p.done }

// Why says how the process ended, with the end of its output.
func (p *Process) Why() error {
	select {
	case <-p.done:
	default:
		return nil
	}
	what := "exited"
	if p.err != nil {
		what = p.err.Error()
	}
	return fmt.Errorf("the launched target %s (log %s); its last output: %s", what, p.log, strings.TrimSpace(lastBytes(p.log, whyBytes)))
}

// Stop ends the process group: SIGTERM, then SIGKILL after grace. It
// returns when the process has exited (or after grace more).
func (p *Process) Stop(grace time.Duration) {
	p.once.Do(func() {
		pg := -p.pid
		_ = syscall.Kill(pg, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(grace):
			_ = syscall.Kill(pg, syscall.SIGKILL)
			select {
			case <-p.done:
			case <-time.After(grace):
			}
		}
	})
}

// Pid is the process's id.
func (p *Process) Pid() int { return p.pid }

// Identity is what Adopt needs to find the process again: its pid and its
// start time (a pid alone may have been reused).
func (p *Process) Identity() (pid int, start uint64) { return p.pid, p.start }

// LogFile is where its output goes.
func (p *Process) LogFile() string { return p.log }

// Argv is the command it runs.
func (p *Process) Argv() []string { return p.argv }

// ErrGone is Adopt's answer for a process that is no longer running (or
// whose pid now names another process).
var ErrGone = errors.New("the process is no longer running")

// adoptPoll is how often an adopted process is checked for its exit (it
// is not this process's child: nothing to wait on).
const adoptPoll = 200 * time.Millisecond

// Adopt takes over a process an earlier Host started (its Identity, kept
// across the restart), so that it can be stopped: a process of its own
// group, as Start makes them. ErrGone when it has exited, or when its pid
// now names another process.
func Adopt(pid int, start uint64, logFile string) (*Process, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("pid %d: %w", pid, ErrGone)
	}
	if got, err := startTime(pid); err != nil || got != start {
		return nil, fmt.Errorf("pid %d (started at tick %d): %w", pid, start, ErrGone)
	}
	p := &Process{pid: pid, start: start, log: logFile, done: make(chan struct{})}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		p.argv = strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	}
	go func() {
		defer close(p.done)
		for {
			if got, err := startTime(pid); err != nil || got != start {
				return
			}
			time.Sleep(adoptPoll)
		}
	}()
	return p, nil
}

// startTime is when process pid started, in clock ticks after boot
// (field 22 of /proc/pid/stat). A zombie (exited, not yet reaped) counts
// as gone, as does a reaped process.
func startTime(pid int) (uint64, error) {
	info, err := readProc(pid)
	return info.StartTime, err
}

// whyBytes is how much of its log's end Why quotes.
const whyBytes = 2048

// lastBytes is the end of the file at path, at most n bytes ("" where it
// cannot be read).
func lastBytes(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(st.Size()-n, 0)
	b := make([]byte, st.Size()-off)
	k, _ := f.ReadAt(b, off)
	return string(b[:k])
}
