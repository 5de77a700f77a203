package bench

import (
	"github.com/spf13/cobra"
	"go.uber.org/zap"
)

// NewCommand is `vhi bench` and its benchmarks.
func NewCommand(o *Options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks (results belong in docs/benchmarks.md)",
	}
	cmd.AddCommand(newBenchSimCommand(o), newBenchProxyCommand(), newBenchUpstreamCommand(), newBenchMigrateCommand(o), newBenchSeedCommand(o), newBenchCUDACopyCommand(),
		newBenchDrainCommand(o), newBenchFailoverCommand(o), newBenchRebalanceCommand(o), newBenchSwitchCommand(o), newBenchScaleCommand(o), newBenchAutoscaleCommand(o))
	return cmd
}

// runLogged is a benchmark's RunE: run gets the logger that the root
// command's --log-level and --log-format built.
func (o *Options) runLogged(run func(cmd *cobra.Command, log *zap.Logger) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		log, err := o.Logger()
		if err != nil {
			return err
		}
		return run(cmd, log)
	}
}
