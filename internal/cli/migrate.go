package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/migrate"
)

func newMigrateCommand() *cobra.Command {
	var (
		hf      hostClientFlags
		req     migrate.Request
		tp, pp  int
		wait    bool
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Move running requests from one instance to another (hot migration)",
		Long: `vhi migrate asks the Host to move the running requests of --src to --dst while they
keep streaming. With --wait it shows each copy round (blocks, bytes, rate) as it happens and
ends with the seed-style summary; it exits non-zero unless the migration succeeded.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("target-tp") {
				req.TargetTP = &tp
			}
			if cmd.Flags().Changed("target-pp") {
				req.TargetPP = &pp
			}
			var started struct {
				ID string `json:"migration_id"`
			}
			if err := hf.postJSON("/vllm_hi/migrate", req, &started); err != nil {
				return hf.fail(err)
			}
			out := cmd.OutOrStdout()
			if !wait {
				if hf.output == "json" {
					return json.NewEncoder(out).Encode(started)
				}
				fmt.Fprintln(out, started.ID)
				return nil
			}
			st, err := watchMigration(out, &hf, started.ID, timeout)
			if err != nil {
				return hf.fail(err)
			}
			if hf.output == "json" {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				_ = enc.Encode(st)
			} else {
				printMigration(out, st)
			}
			if st.State != migrate.StateSucceeded {
				err := exitError{code: 1, err: fmt.Errorf("migration %s %s: %s", st.ID, st.State, st.Error)}
				if hf.output == "json" {
					return exitError{code: 1, err: errPrinted{err}} // the status above says it all
				}
				return err
			}
			return nil
		},
	}
	hf.add(cmd)
	f := cmd.Flags()
	f.StringVar(&req.Src, "src", "", "source instance (vllm_hi_id)")
	f.StringVar(&req.Dst, "dst", "", "target instance (vllm_hi_id)")
	f.IntVar(&tp, "target-tp", 0, "expected TP of the target")
	f.IntVar(&pp, "target-pp", 0, "expected PP of the target")
	f.StringVar(&req.Type, "type", "destroy_source", "destroy_source, preserve_source or keep_source_active")
	f.IntVar(&req.TN, "tn", 0, "parallel data-plane connections (default: the Host's)")
	f.StringVar(&req.RequestFilter, "filter", "", "requests to move: all, longest:N, min_context:T, ids:A,B (default: VLLM_HI_REQUEST_FILTER or all)")
	f.StringVar(&req.FinalGranularity, "final-granularity", "slot", "what the final round copies: slot (written token slots) or block (whole changed blocks)")
	f.BoolVar(&wait, "wait", false, "follow the migration and print its summary")
	f.DurationVar(&timeout, "timeout", 10*time.Minute, "with --wait, give up after this long")
	return cmd
}

// watchMigration polls the status, printing each new round, until it ends.
func watchMigration(out io.Writer, hf *hostClientFlags, id string, timeout time.Duration) (migrate.Status, error) {
	deadline := time.Now().Add(timeout)
	seen, step := 0, ""
	for {
		var st migrate.Status
		if err := hf.getJSON("/vllm_hi/migration/"+id+"/status", &st); err != nil {
			return st, err
		}
		if hf.output != "json" {
			if st.CurrentStep != step {
				step = st.CurrentStep
				fmt.Fprintf(out, "[%s] step %s\n", id, step)
			}
			for ; seen < len(st.Rounds); seen++ {
				r := st.Rounds[seen]
				rate := 0.0
				if r.DurationS > 0 {
					rate = float64(r.Bytes) / r.DurationS / 1e9
				}
				fmt.Fprintf(out, "[%s] round %d %-11s %6d blocks %10s %7.2f GB/s %8.1f ms\n", id, r.Round, r.Kind, r.BlockCount, humanBytes(r.Bytes), rate, r.DurationS*1000)
			}
		}
		if st.State != migrate.StateRunning {
			return st, nil
		}
		if time.Now().After(deadline) {
			return st, fmt.Errorf("migration %s still running after %v", id, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// printMigration prints the seed-style summary table.
func printMigration(out io.Writer, st migrate.Status) {
	var blocks int
	var bytes int64
	for _, r := range st.Rounds {
		blocks += r.BlockCount
		bytes += r.Bytes
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "migration\tstate\tsource\ttarget\ttype\trequests\tdowntime (s)\tclient downtime (s)\trounds\tKV blocks\tdata size (GB)")
	fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d/%d\t%.4f\t%.4f\t%d\t%d\t%.3f\n", st.ID, st.State, st.Src, st.Dst, st.Type,
		st.Migrated, st.Requests, st.DowntimeS, st.ClientDowntimeS, len(st.Rounds), blocks, float64(bytes)/1e9)
	_ = tw.Flush()
	var parts []string
	for _, r := range st.Rounds {
		parts = append(parts, fmt.Sprintf("%s %d / %s", r.Kind, r.BlockCount, humanBytes(r.Bytes)))
	}
	if len(parts) > 0 {
		fmt.Fprintf(out, "rounds (blocks / bytes): %s\n", strings.Join(parts, " | "))
	}
	if v := st.Verification; v != nil && v.Mode != migrate.VerifyOff {
		fmt.Fprintf(out, "checked before the commit (%s): %d blocks, %s on each side, %.1f ms\n", v.Mode, v.Blocks, humanBytes(v.Bytes), v.DurationS*1000)
	}
	if st.SourceKV != "" && st.SourceKV != migrate.SourceKVKept {
		note := ""
		if st.SourceKVNote != "" {
			note = " (" + st.SourceKVNote + ")"
		}
		fmt.Fprintf(out, "source KV: %s%s\n", strings.ReplaceAll(st.SourceKV, "_", " "), note)
	}
	if st.PauseWaitS > 0 {
		fmt.Fprintf(out, "the pause first waited %.1f ms for the source's step in flight (not downtime: the source decoded meanwhile)\n", st.PauseWaitS*1000)
	}
	if st.Error != "" {
		fmt.Fprintf(out, "error: %s\n", st.Error)
	}
}

func newMigrationCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "migration", Short: "Inspect migrations"}
	var hf hostClientFlags
	status := &cobra.Command{
		Use:   "status ID",
		Short: "Show a migration's state, steps and rounds",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var st migrate.Status
			if err := hf.getJSON("/vllm_hi/migration/"+args[0]+"/status", &st); err != nil {
				return hf.fail(err)
			}
			if hf.output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(st)
			}
			printMigration(cmd.OutOrStdout(), st)
			for _, s := range st.StepHistory {
				fmt.Fprintf(cmd.OutOrStdout(), "  %-20s %s  %8.1f ms\n", s.Step, s.StartedAt.Format("15:04:05.000"), s.DurationS*1000)
			}
			return nil
		},
	}
	hf.add(status)
	cmd.AddCommand(status)
	return cmd
}
