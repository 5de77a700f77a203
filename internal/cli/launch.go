package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/hostconfig"
	"github.com/vllm-hi/vllm-hi/internal/launch"
)

func newLaunchCommand(g *globalFlags) *cobra.Command {
	var o launch.BackendsOptions
	var configFile, tokenFile string
	cmd := &cobra.Command{
		Use:   "launch --config FILE --pid-file F",
		Short: "Start the switched models' backends one by one, each put to sleep, then wake the startup model",
		Long: `vhi launch reads the Host's configuration (models: with launch_command, env, cwd) and starts
each model's backend in turn, in a session of its own with its output in --log-dir: it waits
until GET /health answers, puts it to sleep (its sleep_level) and checks /is_sleeping, and only
then starts the next. Then it wakes controller.startup_awake_model, and only once the whole
pool is ready writes the PID file (atomically: whole or not at all). Models without a
launch_command are managed elsewhere and left alone. Any failure stops what was started and
writes nothing. The backends keep running after vhi launch exits; vhi stop --pid-file F ends
them. Send traffic only once it has succeeded.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger()
			if err != nil {
				return err
			}
			file, err := hostconfig.Load(configFile)
			if err != nil {
				return err
			}
			if len(file.Models) == 0 {
				return fmt.Errorf("%s has no models: to launch", configFile)
			}
			o.Models, o.Controller, o.Log, o.Out = file.Models, file.Controller, log, cmd.OutOrStdout()
			if o.Token, err = credentials.Resolve(tokenFile, credentials.AgentTokenFile, "--token-file", false); err != nil {
				return err
			}
			_, err = launch.Backends(cmd.Context(), o)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&configFile, "config", "", "the Host's configuration file (models:, controller:)")
	f.StringVar(&o.PIDFile, "pid-file", "", "where to write the PID file once the pool is ready")
	f.StringVar(&o.LogDir, "log-dir", "", "the backends' output, one file per model (default: the PID file's directory)")
	f.DurationVar(&o.Ready, "ready-timeout", 15*time.Minute, "per backend: start → healthy, and each sleep or wake-up")
	f.DurationVar(&o.Grace, "stop-grace", 30*time.Second, "when a failed launch stops what it started: SIGTERM → SIGKILL")
	f.StringVar(&tokenFile, "token-file", "", "the agent token the backends' control routes take (default: the local Host's agent-token, if any)")
	_ = cmd.MarkFlagRequired("config")
	_ = cmd.MarkFlagRequired("pid-file")
	return cmd
}

func newStopCommand() *cobra.Command {
	var o launch.StopOptions
	cmd := &cobra.Command{
		Use:   "stop --pid-file F",
		Short: "Stop the backends vhi launch started, after checking each is still the process it started",
		Long: `vhi stop reads vhi launch's PID file and checks every backend in it against /proc before it
signals any: the PID must still be the process that was started (the same start time) in the
same process group, and never this command's own group. A file of another format (a legacy
one), or one in which a PID now names another process, is refused whole: nothing is signalled.
A backend whose process is gone is reported. Each group gets SIGTERM, then SIGKILL after
--grace; the file is removed once all are gone. Backends vhi launch did not start are never
touched.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.Out = cmd.OutOrStdout()
			return launch.Stop(o)
		},
	}
	cmd.Flags().StringVar(&o.PIDFile, "pid-file", "", "vhi launch's PID file")
	cmd.Flags().DurationVar(&o.Grace, "grace", 30*time.Second, "SIGTERM → SIGKILL")
	_ = cmd.MarkFlagRequired("pid-file")
	return cmd
}
