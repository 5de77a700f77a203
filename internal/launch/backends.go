package launch

// The backends of switched models (`vhi launch`, `vhi stop`): Backends
// starts each model's backend in turn (start, healthy, put to sleep and
// checked, next), wakes the startup model, and only then writes its PID
// file, atomically; Stop signals a process group only after checking,
// from /proc, that the PID is still the process it started (same process
// group, same start time).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// BackendsOptions configure Backends.
type BackendsOptions struct {
	Models     map[string]switching.Model
	Controller switching.Controller
	PIDFile    string
	LogDir     string        // the backends' output (default: the PID file's directory)
	Ready      time.Duration // from start to healthy, per backend
	Token      string        // presented to the engines' control routes
	Grace      time.Duration // SIGTERM → SIGKILL when a failed launch stops what it started
	Out        io.Writer     // progress lines
	Log        *zap.Logger
}

// Launch starts the pool and writes the PID file once it is ready. On any
// failure it stops what it started, writes nothing and says why.
func Backends(ctx context.Context, o BackendsOptions) (PIDFile, error) {
	if o.Out == nil {
		o.Out = io.Discard
	}
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	if o.LogDir == "" {
		o.LogDir = filepath.Dir(o.PIDFile)
	}
	if err := checkPrevious(o.PIDFile); err != nil {
		return PIDFile{}, err
	}
	client := &http.Client{}
	out := PIDFile{Format: Format, LauncherPID: os.Getpid()}
	var started []*Process
	fail := func(err error) (PIDFile, error) {
		for i := len(started) - 1; i >= 0; i-- {
			started[i].Stop(o.Grace)
		}
		return PIDFile{}, err
	}
	aliases := make([]string, 0, len(o.Models))
	for a := range o.Models {
		aliases = append(aliases, a)
	}
	sort.Strings(aliases)
	for _, alias := range aliases {
		m := o.Models[alias]
		be := engine.NewAdmin(m.BackendURL, m.ServedName(alias), o.Token, client)
		if len(m.LaunchCommand) == 0 {
			fmt.Fprintf(o.Out, "%s: no launch_command, managed elsewhere: not started\n", alias)
			continue
		}
		logFile := filepath.Join(o.LogDir, alias+".log")
		t0 := time.Now()
		p, err := StartSession(Spec{Command: m.LaunchCommand, Env: m.Env, Cwd: m.Cwd}, logFile)
		if err != nil {
			return fail(fmt.Errorf("%s: %w", alias, err))
		}
		started = append(started, p)
		info, err := readProc(p.Pid())
		if err != nil {
			// An engine that exits at once is gone before it can be read:
			// say why it exited, not that it could not be read.
			select {
			case <-p.Exited():
				return fail(fmt.Errorf("%s: %w", alias, p.Why()))
			case <-time.After(time.Second):
			}
			return fail(fmt.Errorf("%s: reading the started process: %w (its log: %s)", alias, err, logFile))
		}
		fmt.Fprintf(o.Out, "%s: started pid %d (log %s)\n", alias, p.Pid(), logFile)
		if err := waitHealthy(ctx, be, m.BackendURL, p, o.Ready); err != nil {
			return fail(fmt.Errorf("%s: %w", alias, err))
		}
		healthy := time.Since(t0)
		sctx, cancel := context.WithTimeout(ctx, o.Ready)
		err = switching.SleepAndVerify(sctx, be, m.Level())
		cancel()
		if err != nil {
			return fail(fmt.Errorf("%s: putting it to sleep: %w", alias, err))
		}
		fmt.Fprintf(o.Out, "%s: healthy after %.1f s, asleep (level %d) after %.1f s\n", alias, healthy.Seconds(), m.Level(), time.Since(t0).Seconds())
		out.Backends = append(out.Backends, Backend{Model: alias, PID: p.Pid(), PGID: info.PGID, StartTime: info.StartTime,
			Argv: p.Argv(), BackendURL: m.BackendURL, Log: logFile})
	}
	if st := o.Controller.StartupAwakeModel; st != "" {
		m := o.Models[st]
		be := engine.NewAdmin(m.BackendURL, m.ServedName(st), o.Token, client)
		t0 := time.Now()
		sctx, cancel := context.WithTimeout(ctx, o.Ready)
		err := switching.WakeAndVerify(sctx, be, m)
		cancel()
		if err != nil {
			return fail(fmt.Errorf("waking the startup model %s: %w", st, err))
		}
		fmt.Fprintf(o.Out, "%s: awake (the startup model) after %.1f s\n", st, time.Since(t0).Seconds())
	}
	out.CreatedAt = time.Now().UTC()
	if err := out.write(o.PIDFile); err != nil {
		return fail(fmt.Errorf("writing %s: %w", o.PIDFile, err))
	}
	fmt.Fprintf(o.Out, "pool ready: %d backends started, PID file %s\n", len(out.Backends), o.PIDFile)
	return out, nil
}

// checkPrevious refuses to replace a PID file that is not ours, or whose
// processes still run.
func checkPrevious(path string) error {
	f, err := ReadPIDFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("%w; not overwriting it", err)
	}
	var alive []string
	for _, b := range f.Backends {
		if info, err := readProc(b.PID); err == nil && info.StartTime == b.StartTime {
			alive = append(alive, fmt.Sprintf("%s (pid %d)", b.Model, b.PID))
		}
	}
	if len(alive) > 0 {
		return fmt.Errorf("the pool of %s still runs: %s; vhi stop --pid-file %s first", path, strings.Join(alive, ", "), path)
	}
	return nil
}

// waitHealthy polls GET /health until it answers 200, the process exits
// or the ready timeout passes.
func waitHealthy(ctx context.Context, be *engine.Admin, base string, p *Process, ready time.Duration) error {
	deadline := time.Now().Add(ready)
	for {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := be.Health(rctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not healthy at %s/health within %v (last: %v)", strings.TrimRight(base, "/"), ready, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.Exited():
			return p.Why()
		case <-time.After(250 * time.Millisecond):
		}
	}
}
