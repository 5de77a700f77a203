package host

import (
	"reflect"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/hostconfig"
)

// Reload applies a re-read configuration file (vhi host on SIGHUP):
// the launch targets and the autoscaling policies take effect at once;
// switched models and the switching controller are read at start only,
// so a change there is reported (restart the Host to apply it) and left
// as it was. It returns what it could not apply, if anything.
func (h *Host) Reload(f hostconfig.File) []string {
	h.mig.SetLaunchers(f.Targets)
	h.autoscaler.SetConfig(f.Autoscale)
	var left []string
	if !reflect.DeepEqual(f.Models, h.cfg.Models) || f.Controller != h.cfg.Controller {
		left = append(left, "models and controller (model switching): read at start only, restart the Host to apply")
	}
	h.log.Info("configuration reloaded", zap.Int("targets", len(f.Targets)), zap.Int("autoscaled_models", len(f.Autoscale.Models)),
		zap.Strings("not_applied", left))
	return left
}
