package cli

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

func newAutoscaleCommand() *cobra.Command {
	var (
		hf   hostClientFlags
		last int
	)
	cmd := &cobra.Command{
		Use:   "autoscale",
		Short: "The autoscaler: each model's rolling p95 TTFT, queue and size against its policy, and the latest decisions",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return hf.call(cmd, false, 30*time.Second, func(ctx context.Context, c *hostapi.Client) error {
				st, err := c.Autoscale(ctx)
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, st)
				}
				out := cmd.OutOrStdout()
				if !st.Enabled {
					fmt.Fprintln(out, "autoscaling is off (no autoscale.models in vhi host --config)")
					return nil
				}
				tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "model\tkind\tsize\tmin..max\tp95 TTFT\tSLO\trequests\twaiting\tnow")
				for _, m := range st.Models {
					now := "-"
					switch {
					case m.Scaling != "":
						now = "scaling " + m.Scaling
					case !m.CoolingUntil.IsZero():
						now = "cooling until " + m.CoolingUntil.Local().Format(time.TimeOnly)
					}
					fmt.Fprintf(tw, "%s\t%s\t%d\t%d..%d\t%.3f s\t%.3f s\t%d\t%d\t%s\n", m.Model, m.Kind, m.Size, m.Min, m.Max, m.TTFTP95S, m.SLOS, m.Samples, m.Waiting, now)
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				for i, d := range st.Decisions {
					if i == last {
						break
					}
					what := d.ScaleID
					switch {
					case d.DryRun:
						what = "dry run"
					case d.Error != "":
						what = "refused: " + d.Error
					}
					fmt.Fprintf(out, "%s %s %s %d → %d (%s: %s): %s\n", d.At.Local().Format(time.DateTime), d.Model, d.Direction, d.From, d.To, d.Reason, d.Detail, what)
				}
				return nil
			})
		},
	}
	hf.add(cmd)
	cmd.Flags().IntVar(&last, "last", 10, "how many of the latest decisions to print")
	return cmd
}
