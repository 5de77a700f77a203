package launch

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"time"
)

// StopOptions configure Stop.
type StopOptions struct {
	PIDFile string
	Grace   time.Duration // SIGTERM → SIGKILL
	Out     io.Writer
}

// Stop ends the pool of a PID file. Every backend is checked before any
// is signalled: a PID whose process has another start time or process
// group (a reused PID), or a group that is Stop's own, refuses the whole
// file and nothing is signalled. A backend whose process is gone is
// reported and skipped. Each group gets SIGTERM, then SIGKILL after the
// grace period; the file is removed once every group is gone.
func Stop(o StopOptions) error {
	if o.Out == nil {
		o.Out = io.Discard
	}
	f, err := ReadPIDFile(o.PIDFile)
	if err != nil {
		return err
	}
	own := syscall.Getpgrp()
	var live []Backend
	var refused []string
	for _, b := range f.Backends {
		info, err := readProc(b.PID)
		switch {
		case errors.Is(err, errNoProcess):
			fmt.Fprintf(o.Out, "%s: pid %d is gone already\n", b.Model, b.PID)
			continue
		case err != nil:
			refused = append(refused, fmt.Sprintf("%s: %v", b.Model, err))
		case b.PGID == own:
			refused = append(refused, fmt.Sprintf("%s: its process group %d is this command's own", b.Model, b.PGID))
		case info.StartTime != b.StartTime:
			refused = append(refused, fmt.Sprintf("%s: pid %d started at tick %d, not %d: another process has the PID now", b.Model, b.PID, info.StartTime, b.StartTime))
		case info.PGID != b.PGID:
			refused = append(refused, fmt.Sprintf("%s: pid %d is in process group %d, not %d", b.Model, b.PID, info.PGID, b.PGID))
		default:
			live = append(live, b)
		}
	}
	if len(refused) > 0 {
		return fmt.Errorf("%s is stale; refusing it, nothing signalled: %s", o.PIDFile, strings.Join(refused, "; "))
	}
	for _, b := range live {
		if err := syscall.Kill(-b.PGID, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("%s: SIGTERM to group %d: %w", b.Model, b.PGID, err)
		}
		fmt.Fprintf(o.Out, "%s: SIGTERM to process group %d\n", b.Model, b.PGID)
	}
	var stuck []string
	for _, b := range live {
		how := "exited"
		if !waitGroup(b.PGID, o.Grace) {
			_ = syscall.Kill(-b.PGID, syscall.SIGKILL)
			how = fmt.Sprintf("SIGKILLed after %v", o.Grace)
			if !waitGroup(b.PGID, 5*time.Second) {
				stuck = append(stuck, fmt.Sprintf("%s (group %d)", b.Model, b.PGID))
				continue
			}
		}
		fmt.Fprintf(o.Out, "%s: %s\n", b.Model, how)
	}
	if len(stuck) > 0 {
		return fmt.Errorf("still running after SIGKILL: %s; %s kept", strings.Join(stuck, ", "), o.PIDFile)
	}
	if err := os.Remove(o.PIDFile); err != nil {
		return err
	}
	return nil
}

// waitGroup waits until no process is left in group pgid, at most d.
func waitGroup(pgid int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for groupAlive(pgid) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}
