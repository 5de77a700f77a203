package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// The Host's histories as lists: vhi migrations, vhi drains, vhi scales
// (the REST API's GET /vllm_hi/migrations, /drains, /scale), newest first,
// as a table, JSON or YAML.

func newMigrationsCommand() *cobra.Command {
	return listCommand("migrations", "List the Host's migrations, newest first",
		func(ctx context.Context, c *hostapi.Client) (any, error) { return c.Migrations(ctx) },
		func(tw io.Writer, v any) {
			fmt.Fprintln(tw, "ID\tSTATE\tSTEP\tSRC\tDST\tTYPE\tMOVED\tDOWNTIME\tSTARTED\tERROR")
			for _, m := range v.([]hostapi.MigrationStatus) {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s\t%s\t%s\n", m.ID, m.State, m.CurrentStep, m.Src, m.Dst, m.Type,
					m.Migrated, m.Requests, ms(m.DowntimeS), when(m.CreatedAt), short(m.Error))
			}
		})
}

func newDrainsCommand() *cobra.Command {
	return listCommand("drains", "List the Host's drains, newest first",
		func(ctx context.Context, c *hostapi.Client) (any, error) { return c.Drains(ctx) },
		func(tw io.Writer, v any) {
			fmt.Fprintln(tw, "ID\tINSTANCE\tSTATE\tCAUSE\tMOVED\tFINISHED THERE\tREMAINING\tMIGRATIONS\tSTARTED\tERROR")
			for _, d := range v.([]hostapi.DrainStatus) {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%s\t%s\n", d.ID, d.Instance, d.State, d.Cause, d.Moved, d.Finished,
					d.Remaining, len(d.Migration), when(d.CreatedAt), short(d.Error))
			}
		})
}

func newScalesCommand() *cobra.Command {
	return listCommand("scales", "List the Host's scale operations, newest first",
		func(ctx context.Context, c *hostapi.Client) (any, error) { return c.Scales(ctx) },
		func(tw io.Writer, v any) {
			fmt.Fprintln(tw, "ID\tSTATE\tKIND\tMODEL\tFROM\tTO\tDOWNTIME\tTOTAL\tERROR")
			for _, s := range v.([]hostapi.ScaleStatus) {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t%.1f s\t%s\n", s.ID, s.State, s.Kind, s.Model, s.From, s.To,
					ms(s.DowntimeS), s.TotalS, short(s.Error))
			}
		})
}

// listCommand is a read-only list of the Host's: fetch gets it, table
// writes its rows.
func listCommand(use, short string, fetch func(context.Context, *hostapi.Client) (any, error), table func(io.Writer, any)) *cobra.Command {
	var hf hostClientFlags
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(hf.output); err != nil {
				return usageError{err}
			}
			return hf.call(cmd, false, 10*time.Second, func(ctx context.Context, c *hostapi.Client) error {
				v, err := fetch(ctx, c)
				if err != nil {
					return err
				}
				return printAs(cmd.OutOrStdout(), hf.output, v, table)
			})
		},
	}
	hf.add(cmd)
	return cmd
}

// checkOutput refuses an -o the lists cannot write, before any call.
func checkOutput(format string) error {
	switch format {
	case "table", "json", "yaml":
		return nil
	}
	return fmt.Errorf("-o %q: want table, json or yaml", format)
}

// printAs writes v as format.
func printAs(w io.Writer, format string, v any, table func(io.Writer, any)) error {
	switch format {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	case "yaml":
		b, err := yaml.Marshal(v) // through the JSON names
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	table(tw, v)
	return tw.Flush()
}

func ms(s float64) string {
	if s == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f ms", s*1e3)
}

func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.Local().Format("2006-01-02 15:04:05")
}

// short is an error cut to a table cell.
func short(s string) string {
	if len(s) > 60 {
		return s[:57] + "..."
	}
	return s
}
