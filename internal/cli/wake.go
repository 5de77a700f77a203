package cli

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/host"
)

func newWakeCommand() *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   "wake ID",
		Short: "Wake a retired or sleeping engine so it can be a migration target again",
		Long: `vhi wake asks the Host to bring back the KV of an instance that a destroy_source
migration retired (or whose engine sleeps). It answers with the instance, now standby.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var v host.InstanceView
			if err := hf.do("POST", "/vllm_hi/instances/"+args[0]+"/wake", struct{}{}, &v, 6*time.Minute); err != nil {
				return hf.fail(err)
			}
			if hf.output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(v)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s is %s (%s)\n", v.ID, v.Lifecycle, v.Role)
			return nil
		},
	}
	hf.add(cmd)
	return cmd
}
