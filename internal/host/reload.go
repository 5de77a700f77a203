package host

import (
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/hostconfig"
)

// Reload applies a re-read configuration file (vhi host on SIGHUP): the
// launch targets and the autoscaling policies take effect at once, and
// the switched models and their controller as far as a running switcher
// can take them (switching.Switcher.Reconfigure: not a model's group or
// backend, not the policy, not the first switched models of a Host that
// started without any). It returns what it could not apply, if anything.
func (h *Host) Reload(f hostconfig.File) []string {
	h.mig.SetLaunchers(f.Targets)
	h.autoscaler.SetConfig(f.Autoscale)
	var left []string
	switch {
	case h.switcher != nil:
		l, err := h.switcher.Reconfigure(f.Models, f.Controller)
		if err != nil {
			left = append(left, "models and controller: "+err.Error())
		}
		left = append(left, l...)
	case len(f.Models) > 0:
		left = append(left, "models and controller: this Host started without switched models; restart it to switch models")
	}
	h.log.Info("configuration reloaded", zap.Int("targets", len(f.Targets)), zap.Int("autoscaled_models", len(f.Autoscale.Models)),
		zap.Int("switched_models", len(f.Models)), zap.Strings("not_applied", left))
	return left
}
