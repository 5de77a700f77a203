package cli

import (
	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/bench"
)

// benchOptions hands the benchmarks what they take from the root flags.
func benchOptions(g *globalFlags) *bench.Options { return &bench.Options{Logger: g.logger} }

func newBenchCommand(g *globalFlags) *cobra.Command { return bench.NewCommand(benchOptions(g)) }

func newDemoCommand(g *globalFlags) *cobra.Command { return bench.NewDemoCommand(benchOptions(g)) }
