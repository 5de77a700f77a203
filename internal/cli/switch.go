package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

func newSwitchCommand() *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   "switch MODEL",
		Short: "Wake a switched model now: its group's awake model is drained and put to sleep first",
		Long: `vhi switch asks the Host to make MODEL (an alias of the Host's --config models:) the awake
model of its GPU group, as a request for it would: the awake one is drained (its streams moved
to another instance by migration where one exists), put to sleep and checked, MODEL woken,
checked and probed. It answers when MODEL is awake, with the switch's steps.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return hf.call(cmd, true, 10*time.Minute, func(ctx context.Context, c *hostapi.Client) error {
				res, err := c.Switch(ctx, args[0])
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, res)
				}
				out := cmd.OutOrStdout()
				if res.Switch == nil || res.Switch.StartedAt.IsZero() {
					fmt.Fprintf(out, "%s is %s\n", res.Model, res.State)
					return nil
				}
				from := ""
				if res.Switch.From != "" {
					from = " from " + res.Switch.From
				}
				fmt.Fprintf(out, "%s is %s: switched%s in %.2f s (drain %.2f s: %s)\n", res.Model, res.State, from,
					res.Switch.DurationS, res.Switch.DrainS, res.Switch.Drain)
				var steps []string
				for _, s := range res.Switch.Steps {
					steps = append(steps, fmt.Sprintf("%s %s %.3f s", s.Step, s.Model, s.DurationS))
				}
				fmt.Fprintf(out, "steps: %s\n", strings.Join(steps, ", "))
				return nil
			})
		},
	}
	hf.add(cmd)
	return cmd
}

func newPrewarmCommand() *cobra.Command {
	var hf hostClientFlags
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "prewarm MODEL",
		Short: "Wake a switched model and keep it awake for --ttl",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return hf.call(cmd, true, 10*time.Minute, func(ctx context.Context, c *hostapi.Client) error {
				res, err := c.Prewarm(ctx, args[0], ttl)
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, res)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s is %s, kept awake until %s\n", res.Model, res.State, res.PinnedUntil.Format(time.RFC3339))
				return nil
			})
		},
	}
	cmd.Flags().DurationVar(&ttl, "ttl", 10*time.Minute, "how long no other model of its group may put it to sleep")
	hf.add(cmd)
	return cmd
}

func newStateCommand() *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   "state",
		Short: "The switched models: state, requests running and queued, the latest switch",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return hf.call(cmd, true, 30*time.Second, func(ctx context.Context, c *hostapi.Client) error {
				st, err := c.AdminState(ctx)
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, st)
				}
				aliases := make([]string, 0, len(st.Models))
				for a := range st.Models {
					aliases = append(aliases, a)
				}
				sort.Strings(aliases)
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "model\tstate\tactive\tqueued\tgroup\tbackend\tlast switch\terror")
				for _, a := range aliases {
					m := st.Models[a]
					last := "-"
					if s := m.LastSwitch; s != nil {
						last = fmt.Sprintf("%s %.2f s", s.State, s.DurationS)
					}
					fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\t%s\n", a, m.State, m.Active, m.Queued, m.Group, m.BackendURL, last, m.LastError)
				}
				return tw.Flush()
			})
		},
	}
	hf.add(cmd)
	return cmd
}
