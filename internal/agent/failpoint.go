package agent

import (
	"fmt"
	"os"
	"strings"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Failpoints make an agent die at a chosen point of a migration, as a
// crash would, for the chaos suite's tests with real processes: a kill
// timed from outside lands anywhere in a pause that lasts milliseconds.
// "exit-on-<hook>" exits the process (status 2, no cleanup) when the
// Host relays that hook through it, before the engine sees the call:
// exit-on-export is a source agent dying inside the pause, exit-on-install
// a target agent.
const failpointExitOn = "exit-on-"

func checkFailpoint(fp string) error {
	if fp == "" {
		return nil
	}
	name, ok := strings.CutPrefix(fp, failpointExitOn)
	if r, known := hooks.RouteOf(name); ok && known && r.Relayed {
		return nil
	}
	return fmt.Errorf("--failpoint %q: want exit-on-<a relayed hook>, e.g. exit-on-export or exit-on-install", fp)
}

// failAt fires the agent's failpoint if it names hook.
func (a *Agent) failAt(hook string) {
	if a.cfg.Failpoint == failpointExitOn+hook {
		a.log.Warn("failpoint: exiting", zap.String("failpoint", a.cfg.Failpoint))
		_ = a.log.Sync()
		os.Exit(2)
	}
}
