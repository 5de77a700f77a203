// Package cli holds the cobra commands of the vhi binary.
package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/logging"
	"github.com/vllm-hi/vllm-hi/internal/version"
)

type globalFlags struct {
	logLevel  string
	logFormat string
}

func (g *globalFlags) logger() (*zap.Logger, error) { return logging.New(g.logLevel, g.logFormat) }

// NewRootCommand builds the command tree.
func NewRootCommand() *cobra.Command {
	g := &globalFlags{}
	root := &cobra.Command{
		Use:           "vhi",
		Short:         "vllm-hi: hot migration of live LLM inference between vLLM instances",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", envDefault("VLLM_HI_LOG_LEVEL", "info"), "log level: debug, info, warn, error [VLLM_HI_LOG_LEVEL]")
	root.PersistentFlags().StringVar(&g.logFormat, "log-format", "console", "log format: console or json")
	root.AddCommand(newVersionCommand(), newHostCommand(g), newAgentCommand(g), newSimCommand(g), newDemoCommand(g),
		newBenchCommand(g), newInstancesCommand(), newMigrateCommand(), newMigrationCommand(), newWakeCommand(),
		newDrainCommand(), newUndrainCommand(), newSwitchCommand(), newPrewarmCommand(), newStateCommand(),
		newLaunchCommand(g), newStopCommand(), newScaleCommand(), newAutoscaleCommand(),
		newMigrationsCommand(), newDrainsCommand(), newScalesCommand())
	markUsage(root)
	return root
}

// Execute runs the CLI and returns the process exit code.
func Execute(args []string) int {
	root := NewRootCommand()
	root.SetArgs(args)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := root.ExecuteContext(ctx); err != nil {
		var je jsonError
		var printed errPrinted
		switch {
		case errors.As(err, &printed):
		case errors.As(err, &je):
			fmt.Fprintln(os.Stdout, string(errorJSON(je.err)))
		default:
			fmt.Fprintln(os.Stderr, "vhi:", err)
		}
		return exitCode(err)
	}
	return 0
}

// exitError carries a specific exit code.
type exitError struct {
	code int
	err  error
}

func (e exitError) Error() string { return e.err.Error() }
func (e exitError) Unwrap() error { return e.err }

// errPrinted is an error whose output was already written (a JSON status
// that says what went wrong): only the exit code is left to give.
type errPrinted struct{ err error }

func (e errPrinted) Error() string { return e.err.Error() }
func (e errPrinted) Unwrap() error { return e.err }

func newVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit and Go version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintf(cmd.OutOrStdout(), "vhi %s (commit %s, %s)\n", version.Version(), version.Commit(), version.GoVersion())
			return nil
		},
	}
}
