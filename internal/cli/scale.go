package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

func newScaleCommand() *cobra.Command {
	var (
		hf        hostClientFlags
		model, id string
		dp, reps  int
		wait      bool
		timeout   time.Duration
	)
	cmd := &cobra.Command{
		Use:   "scale (--model M | --id ID) (--dp N | --replicas N) [--wait]",
		Short: "Scale a deployment to an absolute size: elastic EP by vLLM's prepare and commit, dense replicas by migration",
		Long: `vhi scale asks the Host to bring a deployment to --dp N data-parallel ranks (elastic EP: vLLM's
POST /scale_elastic_ep, prepared while the engine serves, then committed) or a dense model to
--replicas N instances (out: standbys, woken retired instances or ones launched from the model's
launch command, each checked by a greedy probe, then streams moved onto them by migration; in:
replicas drained onto the rest by migration). The target is absolute and idempotent: asking
again for the size being scaled to answers the same operation, another size while one runs is
refused (409, naming it). Through an elastic commit the Host holds the requests that meet vLLM's
503 and sends them again, so clients see latency, never an error; after it a greedy probe is
checked against the answer before, and a failed check scales back.
With --wait it follows the phases and exits non-zero unless the operation succeeded.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req := hostapi.ScaleRequest{Model: model, ID: id}
			if cmd.Flags().Changed("dp") {
				req.DataParallelSize = &dp
			}
			if cmd.Flags().Changed("replicas") {
				req.Replicas = &reps
			}
			c, err := hf.client(true, time.Minute)
			if err != nil {
				return hf.fail(err)
			}
			out := cmd.OutOrStdout()
			sid, err := c.Scale(cmd.Context(), req)
			if err != nil {
				return hf.fail(err)
			}
			if !wait {
				if hf.output == "json" {
					return json.NewEncoder(out).Encode(hostapi.ScaleAnswer{ID: sid})
				}
				fmt.Fprintln(out, sid)
				return nil
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			seen := 0
			progress := func(st hostapi.ScaleStatus) {
				if hf.output == "json" {
					return
				}
				for ; seen < len(st.Phases); seen++ {
					p := st.Phases[seen]
					fmt.Fprintf(out, "%s: %s%s %.3f s\n", st.ID, p.Phase, on(p.Instance), p.DurationS)
				}
			}
			st, err := c.WaitScale(ctx, sid, 50*time.Millisecond, progress)
			if err != nil {
				return hf.fail(err)
			}
			progress(st)
			if hf.output == "json" {
				_ = printJSON(cmd, st)
			} else {
				printScale(out, st)
			}
			if st.State != hostapi.StateSucceeded {
				err := fmt.Errorf("scale %s %s: %s", st.ID, st.State, st.Error)
				if hf.output == "json" {
					err = errPrinted{err}
				}
				return exitError{code: 1, err: err}
			}
			return nil
		},
	}
	hf.add(cmd)
	f := cmd.Flags()
	f.StringVar(&model, "model", "", "the deployment by served model name")
	f.StringVar(&id, "id", "", "the deployment by vllm_hi_id")
	f.IntVar(&dp, "dp", 0, "data-parallel size to scale to (elastic EP)")
	f.IntVar(&reps, "replicas", 0, "replicas to scale to (dense models)")
	f.BoolVar(&wait, "wait", false, "follow the operation and print its summary")
	f.DurationVar(&timeout, "timeout", 30*time.Minute, "with --wait: how long to follow it")
	return cmd
}

// on names a phase's replica.
func on(instance string) string {
	if instance == "" {
		return ""
	}
	return " " + instance
}

func printScale(out io.Writer, st hostapi.ScaleStatus) {
	from := "?"
	if st.From > 0 || st.Kind == "replicas" {
		from = fmt.Sprint(st.From)
	}
	var phases []string
	for _, p := range st.Phases {
		phases = append(phases, fmt.Sprintf("%s%s %.3f s", p.Phase, on(p.Instance), p.DurationS))
	}
	if st.Kind == "replicas" {
		fmt.Fprintf(out, "%s %s: %s replicas %s → %d; %d streams moved by %d migrations (longest client pause %.3f s), total %.3f s; added [%s], removed [%s], now [%s] (%s)\n",
			st.ID, st.State, st.Model, from, st.To, st.Moved, len(st.Migrations), st.DowntimeS, st.TotalS, strings.Join(st.Added, " "),
			strings.Join(st.Removed, " "), strings.Join(st.Instances, " "), strings.Join(phases, ", "))
	} else {
		fmt.Fprintf(out, "%s %s: %s %s → %d; downtime %.3f s, total %.3f s, %d requests held through the commit (%s)\n",
			st.ID, st.State, st.Instance, from, st.To, st.DowntimeS, st.TotalS, st.HeldRequests, strings.Join(phases, ", "))
	}
	if st.Error != "" {
		fmt.Fprintf(out, "error: %s\n", st.Error)
	}
}
