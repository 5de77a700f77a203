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

func newDrainCommand() *cobra.Command {
	var (
		hf      hostClientFlags
		to      []string
		wait    bool
		force   bool
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "drain ID",
		Short: "Move every request off an instance by migration, then retire it",
		Long: `vhi drain stops routing new requests to instance ID, moves its running streams onto the
other active instances of its models (--to names them; by default every eligible one, the
requests spread by free KV) by keep_source_active migrations while they keep streaming, waits
for what cannot move (non-streaming requests) to finish, and retires the instance. With --wait
it shows each migration as it ends and a summary, and exits non-zero unless the drain
succeeded. An instance no other can take requests from is refused (409) with nothing changed,
and so is the last active instance of a model unless --force (the model would go offline);
vhi undrain ID routes to a draining instance again.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := hf.client(true, time.Minute)
			if err != nil {
				return hf.fail(err)
			}
			out := cmd.OutOrStdout()
			id, err := c.Drain(cmd.Context(), args[0], hostapi.DrainRequest{To: to, Force: force})
			if err != nil {
				return hf.fail(err)
			}
			if !wait {
				if hf.output == "json" {
					return json.NewEncoder(out).Encode(hostapi.DrainAnswer{ID: id})
				}
				fmt.Fprintln(out, id)
				return nil
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			progress := func(hostapi.DrainStatus) {}
			if hf.output != "json" {
				progress = drainPrinter(ctx, out, c)
			}
			st, err := c.WaitDrain(ctx, id, 100*time.Millisecond, progress)
			if err != nil {
				return hf.fail(err)
			}
			if hf.output == "json" {
				_ = printJSON(cmd, st)
			} else {
				printDrain(out, st)
			}
			if st.State != hostapi.StateSucceeded {
				err := fmt.Errorf("drain %s %s: %s", st.ID, st.State, st.Error)
				if hf.output == "json" {
					err = errPrinted{err} // the status above says it all
				}
				return exitError{code: 1, err: err}
			}
			return nil
		},
	}
	hf.add(cmd)
	cmd.ValidArgsFunction = hf.completeInstances
	f := cmd.Flags()
	f.StringSliceVar(&to, "to", nil, "instances to move the requests to (default: every other active instance of its models)")
	f.BoolVar(&wait, "wait", false, "follow the drain and print its summary")
	f.BoolVar(&force, "force", false, "drain the last active instance of a model too (the model goes offline until an instance serves it)")
	f.DurationVar(&timeout, "timeout", 15*time.Minute, "with --wait, give up after this long")
	return cmd
}

func newUndrainCommand() *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   "undrain ID",
		Short: "Route new requests to a draining instance again",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return hf.call(cmd, true, time.Minute, func(ctx context.Context, c *hostapi.Client) error {
				v, err := c.Undrain(ctx, args[0])
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, v)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s is %s\n", v.ID, v.Lifecycle)
				return nil
			})
		},
	}
	hf.add(cmd)
	cmd.ValidArgsFunction = hf.completeInstances
	return cmd
}

// drainPrinter prints a line for each migration of the drain once it
// ended.
func drainPrinter(ctx context.Context, out io.Writer, c *hostapi.Client) func(hostapi.DrainStatus) {
	printed := map[string]bool{}
	return func(st hostapi.DrainStatus) {
		for _, id := range st.Migration {
			if printed[id] {
				continue
			}
			m, err := c.Migration(ctx, id)
			if err != nil || !m.Ended() {
				continue
			}
			printed[id] = true
			fmt.Fprintf(out, "%s → %s: %s, %d/%d requests, downtime %.1f ms (%s)\n",
				m.Src, m.Dst, m.State, m.Migrated, m.Requests, m.DowntimeS*1e3, id)
		}
	}
}

// printDrain prints a drain's summary table.
func printDrain(out io.Writer, st hostapi.DrainStatus) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "drain\tinstance\tstate\tmoved\tfinished there\tremaining\tmigrations\ttargets\tsource KV")
	fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%s\t%s\n", st.ID, st.Instance, st.State, st.Moved, st.Finished, st.Remaining,
		len(st.Migration), strings.Join(st.Targets, ","), st.SourceKV)
	_ = tw.Flush()
	if st.SourceKVNote != "" {
		fmt.Fprintf(out, "source KV: %s\n", st.SourceKVNote)
	}
	if st.Error != "" {
		fmt.Fprintf(out, "error: %s\n", st.Error)
	}
}
