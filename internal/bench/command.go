package bench

import (
	"github.com/spf13/cobra"
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
