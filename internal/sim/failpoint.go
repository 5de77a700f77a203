package sim

import (
	"fmt"
	"os"
	"syscall"

	"go.uber.org/zap"
)

// Failpoints make a sim fail at a chosen point of a migration, as a
// real engine can, for the chaos suite's tests with real processes: a
// fault timed from outside (a signal sent when a status shows a step)
// lands anywhere in a pause that lasts milliseconds.
const (
	// FailpointStopOnInstall stops the whole process (SIGSTOP, as an
	// operator's or a kernel's freeze would) on the first install hook,
	// before it takes effect: a target frozen inside a migration's pause.
	FailpointStopOnInstall = "stop-on-install"
)

func checkFailpoint(fp string) error {
	switch fp {
	case "", FailpointStopOnInstall:
		return nil
	}
	return fmt.Errorf("--failpoint %q: want %s", fp, FailpointStopOnInstall)
}

// failAt fires the engine's failpoint if it is fp, once.
func (e *Engine) failAt(fp string) {
	if e.cfg.Failpoint != fp || !e.failpointFired.CompareAndSwap(false, true) {
		return
	}
	e.log.Warn("failpoint: stopping this process", zap.String("failpoint", fp))
	_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
}
