package cli

import (
	"github.com/spf13/cobra"
)

func newBenchCommand(g *globalFlags) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks (results belong in docs/benchmarks.md)",
	}
	cmd.AddCommand(newBenchSimCommand(g), newBenchProxyCommand(), newBenchUpstreamCommand(), newBenchMigrateCommand(g), newBenchSeedCommand(g), newBenchCUDACopyCommand(),
		newBenchDrainCommand(g), newBenchFailoverCommand(g), newBenchRebalanceCommand(g), newBenchSwitchCommand(g), newBenchScaleCommand(g), newBenchAutoscaleCommand(g))
	return cmd
}
