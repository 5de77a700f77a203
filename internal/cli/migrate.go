package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/report"
)

func newMigrateCommand() *cobra.Command {
	var (
		hf      hostClientFlags
		req     hostapi.MigrateRequest
		tp, pp  int
		util    float64
		wait    bool
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Move running requests from one instance to another (hot migration)",
		Long: `vhi migrate asks the Host to move the running requests of --src to --dst while they
keep streaming. Without --dst the Host launches the target from the launch command configured
for the source's model (vhi host --config: targets) with the asked shape — --target-tp,
--target-pp, --target-gpu-memory-utilization — waits for it to register and migrates to it
(the migration's first step, launch_target). With --wait it shows each copy round (blocks, bytes, rate) as it happens and
ends with a summary table (state, requests moved, downtime, rounds, KV moved); it exits non-zero unless the migration succeeded.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("target-tp") {
				req.TargetTP = &tp
			}
			if cmd.Flags().Changed("target-pp") {
				req.TargetPP = &pp
			}
			if cmd.Flags().Changed("target-gpu-memory-utilization") {
				req.TargetGPUMemUtil = &util
			}
			c, err := hf.client(true, time.Minute)
			if err != nil {
				return hf.fail(err)
			}
			out := cmd.OutOrStdout()
			id, err := c.Migrate(cmd.Context(), req)
			if err != nil {
				return hf.fail(err)
			}
			if !wait {
				if hf.output == "json" {
					return json.NewEncoder(out).Encode(hostapi.MigrateAnswer{ID: id})
				}
				fmt.Fprintln(out, id)
				return nil
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			progress := func(hostapi.MigrationStatus) {}
			if hf.output != "json" {
				progress = roundPrinter(out, id)
			}
			st, err := c.WaitMigration(ctx, id, 50*time.Millisecond, progress)
			if err != nil {
				return hf.fail(err)
			}
			if hf.output == "json" {
				_ = printJSON(cmd, st)
			} else {
				report.Migration(out, st)
			}
			if st.State != hostapi.StateSucceeded {
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
	f.StringVar(&req.Dst, "dst", "", "target instance (vllm_hi_id); without it the Host launches one (see above)")
	_ = cmd.RegisterFlagCompletionFunc("src", hf.completeInstances)
	_ = cmd.RegisterFlagCompletionFunc("dst", hf.completeInstances)
	f.IntVar(&tp, "target-tp", 0, "TP of the target (checked against --dst, or the shape to launch)")
	f.IntVar(&pp, "target-pp", 0, "PP of the target (likewise)")
	f.Float64Var(&util, "target-gpu-memory-utilization", 0, "GPU memory share of a launched target")
	f.StringVar(&req.Type, "type", "destroy_source", "destroy_source, preserve_source or keep_source_active")
	f.IntVar(&req.TN, "tn", 0, "parallel data-plane connections (default: the Host's)")
	f.StringVar(&req.RequestFilter, "filter", "", "requests to move: all, longest:N, min_context:T, ids:A,B, expr:CEL (default: VLLM_HI_REQUEST_FILTER or all)")
	f.StringVar(&req.FinalGranularity, "final-granularity", "slot", "what the final round copies: slot (written token slots) or block (whole changed blocks)")
	f.StringVar(&req.PauseInFlight, "pause-in-flight", "", "what the source's pause does with its engine's step in flight: drop or wait (default: the Host's --migration-pause-in-flight)")
	f.BoolVar(&wait, "wait", false, "follow the migration and print its summary")
	f.DurationVar(&timeout, "timeout", 10*time.Minute, "with --wait, give up after this long")
	return cmd
}

// roundPrinter prints each new step and copy round of the statuses it is
// given, once.
func roundPrinter(out io.Writer, id string) func(hostapi.MigrationStatus) {
	seen, step := 0, ""
	return func(st hostapi.MigrationStatus) {
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
			fmt.Fprintf(out, "[%s] round %d %-11s %6d blocks %10s %7.2f GB/s %8.1f ms\n", id, r.Round, r.Kind, r.BlockCount, report.Bytes(r.Bytes), rate, r.DurationS*1000)
		}
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
			return hf.call(cmd, false, 10*time.Second, func(ctx context.Context, c *hostapi.Client) error {
				st, err := c.Migration(ctx, args[0])
				if err != nil {
					return err
				}
				if hf.output == "json" {
					return printJSON(cmd, st)
				}
				report.Migration(cmd.OutOrStdout(), st)
				for _, s := range st.StepHistory {
					fmt.Fprintf(cmd.OutOrStdout(), "  %-20s %s  %8.1f ms\n", s.Step, s.StartedAt.Format("15:04:05.000"), s.DurationS*1000)
				}
				return nil
			})
		},
	}
	hf.add(status)
	cmd.AddCommand(status)
	return cmd
}
