package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

func newInstancesCommand() *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   "instances",
		Short: "List the instances registered with the Host",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return hf.call(cmd, false, 10*time.Second, func(ctx context.Context, c *hostapi.Client) error {
				list, err := c.Instances(ctx)
				if err != nil {
					return err
				}
				return printInstances(cmd.OutOrStdout(), hf.output, list)
			})
		},
	}
	hf.add(cmd)
	return cmd
}

func printInstances(w io.Writer, format string, list []hostapi.Instance) error {
	switch format {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(hostapi.InstanceList{Instances: list})
	case "table":
	default:
		return fmt.Errorf("-o %q: want table or json", format)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTYPE\tROLE\tLIFECYCLE\tSTATE\tMODEL\tENGINE\tTP\tPP\tMIGRATABLE\tRUNNING\tFREE BLOCKS\tRDMA")
	for _, i := range list {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%v\t%d\t%d/%d\t%s\n", i.ID, i.Type, i.Role, i.Lifecycle, i.State,
			i.ServedModelName, i.EngineURL, i.TP, i.PP, i.Migratable, i.Stats.NumRunning, i.Stats.FreeBlocks, i.Stats.TotalBlocks, rdmaColumn(i))
	}
	for _, i := range list {
		if i.Migratable && !i.HooksAuthenticated {
			fmt.Fprintf(tw, "warning: %s's engine serves its hooks without credentials (start it with VLLM_HI_ENGINE_TOKEN_FILE)\n", i.ID)
		}
	}
	if len(list) == 0 {
		fmt.Fprintln(tw, "(no instances registered)")
	}
	return tw.Flush()
}

// rdmaColumn is an instance's rdma data plane in a word: its RDMA
// devices, "tcp/shm" when UCX has none, "-" without UCX.
func rdmaColumn(i hostapi.Instance) string {
	switch {
	case i.RDMA == nil:
		return "-"
	case len(i.RDMA.Devices) > 0:
		return strings.Join(i.RDMA.Devices, ",")
	}
	return "tcp/shm (ucx " + i.RDMA.UCXVersion + ")"
}
