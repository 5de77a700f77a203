package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

func newWakeCommand() *cobra.Command {
	var hf hostClientFlags
	var active bool
	cmd := &cobra.Command{
		Use:   "wake ID",
		Short: "Wake a retired or sleeping engine so it can be a migration target again",
		Long: `vhi wake asks the Host to bring back the KV of an instance that a destroy_source
migration retired (or whose engine sleeps). It answers with the instance, now standby — or, with
--active, active: serving its models' requests again (after a drain, say).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return hf.call(cmd, true, 6*time.Minute, func(ctx context.Context, c *hostapi.Client) error {
				v, err := c.WakeWith(ctx, args[0], hostapi.WakeRequest{Active: active})
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, v)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s is %s (%s)\n", v.ID, v.Lifecycle, v.Role)
				return nil
			})
		},
	}
	hf.add(cmd)
	cmd.ValidArgsFunction = hf.completeInstances
	cmd.Flags().BoolVar(&active, "active", false, "make the woken instance active (serving requests) rather than standby")
	return cmd
}
