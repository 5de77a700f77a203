package migrate

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/launch"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// stepLaunch is the first step of a migration to a target launched for it.
const stepLaunch step = "launch_target"

// launchStopGrace is how long a launched target that the migration no
// longer needs gets to exit after SIGTERM.
const launchStopGrace = 20 * time.Second

// startLaunched admits a migration that names no target: the Host starts
// one from the source model's launch command with the asked shape, waits
// until it registers healthy and migratable as the id it was given, and
// migrates to it. It answers at once; a launch that fails, or a target
// the migration then refuses, is stopped and the migration fails with
// the reason.
func (o *Orchestrator) startLaunched(req hostapi.MigrateRequest) (string, error) {
	if _, err := o.validate(&req); err != nil {
		return "", err
	}
	src, err := o.reg.Get(req.Src)
	if err != nil {
		return "", refuse(errdefs.ErrNotFound, "unknown source instance %s", req.Src)
	}
	conflict := errdefs.ErrConflict
	switch {
	case !src.Reachable || !src.Stats.Healthy:
		return "", refuse(conflict, "the source must be reachable and healthy: %s", src.NotReady(time.Now()))
	case src.Role != registry.RoleActive:
		return "", refuse(conflict, "source %s is %s, not active", src.ID, src.Role)
	case len(src.Engine.ServedModels) == 0:
		return "", refuse(conflict, "source %s serves no model", src.ID)
	}
	model := src.Engine.ServedModels[0]
	spec, ok := o.launchers()[model]
	if !ok {
		return "", refuse(conflict, "no dst_vllm_hi_id, and no launch command for model %q (targets.%s in vhi host --config): name a standby target", model, model)
	}
	tp, pp, util := src.Engine.TP, src.Engine.PP, spec.GPUMemoryUtilization
	if util == 0 {
		util = 0.9
	}
	for _, a := range []struct {
		name  string
		asked bool
		same  bool
	}{
		{"tp", req.TargetTP != nil, req.TargetTP == nil || *req.TargetTP == tp},
		{"pp", req.TargetPP != nil, req.TargetPP == nil || *req.TargetPP == pp},
		{"gpu_memory_utilization", req.TargetGPUMemUtil != nil, req.TargetGPUMemUtil == nil},
	} {
		if a.asked && !a.same && !spec.Uses(a.name) {
			return "", refuse(conflict, "target_%s: the launch command for %q has no {%s}, so it cannot start that shape", a.name, model, a.name)
		}
	}
	if req.TargetTP != nil {
		tp = *req.TargetTP
	}
	if req.TargetPP != nil {
		pp = *req.TargetPP
	}
	if req.TargetGPUMemUtil != nil {
		util = *req.TargetGPUMemUtil
	}
	ports, err := freePorts(2)
	if err != nil {
		return "", refuse(errdefs.ErrUnavailable, "no free port for the target: %v", err)
	}
	id := newID()
	dst := "b-" + id[len("mig-"):len("mig-")+8]
	vars := map[string]string{"id": dst, "model": model, "tp": strconv.Itoa(tp), "pp": strconv.Itoa(pp),
		"gpu_memory_utilization": strconv.FormatFloat(util, 'g', -1, 64), "port": strconv.Itoa(ports[0]),
		"data_port": strconv.Itoa(ports[1]), "host": o.cfg.HostAddr}
	now := time.Now().UTC()
	st := &hostapi.MigrationStatus{ID: id, State: hostapi.StateRunning, CurrentStep: string(stepLaunch), Src: src.ID, Dst: dst,
		Type: req.Type, TN: req.TN, CreatedAt: now, StepHistory: []hostapi.Step{{Step: string(stepLaunch), StartedAt: now}},
		Rounds: []hostapi.Round{}, Dropped: []string{}, Launched: &hostapi.LaunchedTarget{ID: dst, LogFile: filepath.Join(o.cfg.LaunchLogDir, dst+".log")}}
	o.mu.Lock()
	o.launching[id] = st
	o.order = append(o.order, id)
	o.mu.Unlock()
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		o.launchAndMigrate(req, st, spec, vars)
	}()
	return id, nil
}

// launchAndMigrate starts the target, waits for it and begins the
// migration; on any failure the target is stopped and the status says
// why.
func (o *Orchestrator) launchAndMigrate(req hostapi.MigrateRequest, st *hostapi.MigrationStatus, spec launch.Spec, vars map[string]string) {
	log := o.log.With(zap.String("migration_id", st.ID), zap.String("target", st.Dst))
	fail := func(p *launch.Process, err error) {
		if p != nil {
			p.Stop(launchStopGrace)
		}
		log.Warn("on-demand target failed", zap.Error(err))
		o.mu.Lock()
		defer o.mu.Unlock()
		now := time.Now().UTC()
		endStep(st, now)
		st.State, st.CurrentStep, st.Error, st.FinishedAt = hostapi.StateFailed, "done", err.Error(), now
		o.ends.Ended()
	}
	p, err := launch.Start(spec, vars, st.Launched.LogFile)
	if err != nil {
		fail(nil, fmt.Errorf("launch the target: %w", err))
		return
	}
	o.mu.Lock()
	st.Launched.PID = p.Pid()
	o.mu.Unlock()
	log.Info("launched an on-demand target", zap.Int("pid", p.Pid()), zap.String("log", st.Launched.LogFile))
	if err := o.awaitLaunched(p, st.Dst, spec.ReadyTimeout(), st.Launched.LogFile); err != nil {
		fail(p, err)
		return
	}
	req.Dst = st.Dst
	m, err := o.admit(req, st.ID)
	if err != nil {
		fail(p, err)
		return
	}
	o.mu.Lock()
	endStep(st, time.Now().UTC())
	launched := st.StepHistory[0]
	o.mu.Unlock()
	m.launched = p
	m.st.CreatedAt, m.st.Launched = st.CreatedAt, st.Launched
	m.st.StepHistory = append([]hostapi.Step{launched}, m.st.StepHistory...)
	if _, err := o.begin(m); err != nil {
		fail(p, err)
	}
}

// awaitLaunched waits until the launched process p is registered as id,
// reachable, healthy and migratable — at most timeout — and says why not
// (it exited: with the end of its output).
func (o *Orchestrator) awaitLaunched(p *launch.Process, id string, timeout time.Duration, logFile string) error {
	ctx, cancel := context.WithTimeout(o.ctx, timeout)
	defer cancel()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the launched instance %s was not registered healthy and migratable within %v (its log: %s)", id, timeout, logFile)
		case <-p.Exited():
			return p.Why()
		case <-tick.C:
			if in, err := o.reg.Get(id); err == nil && in.Reachable && in.Stats.Healthy && in.Engine.Migratable {
				return nil
			}
		}
	}
}

// Launched is an instance the Host started from a model's launch command.
type Launched struct {
	ID      string
	Process *launch.Process
	LogFile string
}

// CanLaunch reports whether model has a launch command (targets.MODEL).
func (o *Orchestrator) CanLaunch(model string) bool {
	_, ok := o.launchers()[model]
	return ok
}

// LaunchReplica starts one more instance of model from its launch command
// with the shape of like (TP, PP) and waits until it is registered
// healthy and migratable (a standby: its command starts it as type B). A
// launch that fails is stopped, and the error says why.
func (o *Orchestrator) LaunchReplica(model string, like registry.Instance) (Launched, error) {
	spec, ok := o.launchers()[model]
	if !ok {
		return Launched{}, refuse(errdefs.ErrConflict, "no launch command for model %q (targets.%s in vhi host --config)", model, model)
	}
	util := spec.GPUMemoryUtilization
	if util == 0 {
		util = 0.9
	}
	ports, err := freePorts(2)
	if err != nil {
		return Launched{}, refuse(errdefs.ErrUnavailable, "no free port for a replica: %v", err)
	}
	suffix := newID()[len("mig-"):]
	l := Launched{ID: "r-" + suffix[:8]}
	l.LogFile = filepath.Join(o.cfg.LaunchLogDir, l.ID+".log")
	vars := map[string]string{"id": l.ID, "model": model, "tp": strconv.Itoa(max(1, like.Engine.TP)), "pp": strconv.Itoa(max(1, like.Engine.PP)),
		"gpu_memory_utilization": strconv.FormatFloat(util, 'g', -1, 64), "port": strconv.Itoa(ports[0]),
		"data_port": strconv.Itoa(ports[1]), "host": o.cfg.HostAddr}
	p, err := launch.Start(spec, vars, l.LogFile)
	if err != nil {
		return Launched{}, fmt.Errorf("launch a replica of %s: %w", model, err)
	}
	o.log.Info("launched a replica", zap.String("model", model), zap.String("vllm_hi_id", l.ID), zap.Int("pid", p.Pid()), zap.String("log", l.LogFile))
	if err := o.awaitLaunched(p, l.ID, spec.ReadyTimeout(), l.LogFile); err != nil {
		p.Stop(launchStopGrace)
		return Launched{}, err
	}
	l.Process = p
	return l, nil
}

// freePorts returns n TCP ports free on this machine now.
func freePorts(n int) ([]int, error) {
	var out []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}

// launchers are the launch targets now (Config.Launchers, or what a
// reload set).
func (o *Orchestrator) launchers() map[string]launch.Spec {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.cfg.Launchers
}

// SetLaunchers replaces the launch targets (vhi host's SIGHUP reload):
// migrations that launch from here use them; one launching keeps its own.
func (o *Orchestrator) SetLaunchers(l map[string]launch.Spec) {
	o.mu.Lock()
	o.cfg.Launchers = l
	o.mu.Unlock()
}
