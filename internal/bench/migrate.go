package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/report"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

func newBenchMigrateCommand(g *Options) *cobra.Command {
	sc := scenario{Type: hostapi.DestroySource}
	var grans, verifies, preAttach, backends, pace, inFlight []string
	var jsonOut string
	geo := simGeometryFlags{}
	var ext externalFlags
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Full-load migration: downtime, client gaps and rounds, whole-block vs token-slot final round",
		Long: `For each --final-granularity, runs the vhi demo scenario at benchmark scale: a Host, sim A
and sim B with their agents on loopback, --streams streams through the Host, one migration
A→B after --delay, every stream checked against an unmigrated run. Reports downtime (A paused →
B resumed, and → the last moved stream's first token from B), the clients' max inter-token gap
against the median gap, and each round's blocks and bytes.

With --host it starts nothing and runs against a deployment: a running Host with two
migratable instances of --model (real vLLM with the vllm-hi plugin, each with its agent).
The reference is the same load through the Host without a migration; after each
destroy_source migration the retired source is woken, so the next run migrates back and the
deployment is left with an active and a standby instance, as it was found. The Host's own
--migration-verify applies (--verify is for the sims). hack/gpu-vllm-bench.sh sets up
such a deployment and runs this.`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			sc.Log = log
			for _, n := range []string{"tp-a", "pp-a", "tp-b", "pp-b"} {
				v, _ := cmd.Flags().GetInt(n)
				switch {
				case v < 1:
					return fmt.Errorf("--%s %d: a TP or PP size is at least 1", n, v)
				case ext.host != "" && cmd.Flags().Changed(n):
					return fmt.Errorf("--%s is for the sims: with --host the deployment's engines have their own shapes", n)
				}
			}
			if ext.host != "" {
				var err error
				if sc.External, err = ext.resolve(cmd.Context()); err != nil {
					return err
				}
				verifies = []string{""}
				if !cmd.Flags().Changed("greedy") {
					sc.Greedy = true
				}
			}
			for _, p := range pace {
				if v, err := strconv.ParseFloat(p, 64); err != nil || v < 0 || v > 100 {
					return fmt.Errorf("--pace-round0: %q is not a share of the source's step from 0 (off) to 100", p)
				}
				if p != "0" && ext.host != "" {
					return fmt.Errorf("--pace-round0 is for the sims' agents: with --host the deployment's agents have their own (vhi agent --pace-round0)")
				}
			}
			for _, p := range preAttach {
				if p != "on" && p != "off" {
					return fmt.Errorf("--pre-attach: %q is not on or off", p)
				}
			}
			if ext.host != "" && cmd.Flags().Changed("transfer-backend") {
				return fmt.Errorf("--transfer-backend is for the sims' agents: with --host the deployment's agents have their own")
			}
			for _, b := range backends {
				if !slices.Contains(transfer.Names(), b) {
					return fmt.Errorf("--transfer-backend: %q is not one of %v", b, transfer.Names())
				}
			}
			return runBenchMigrate(cmd.Context(), cmd.OutOrStdout(), sc, geo, benchDims{grans: grans, verifies: verifies, preAttach: preAttach, backends: backends, pace: pace, inFlight: inFlight}, jsonOut)
		}),
	}
	f := cmd.Flags()
	f.IntVar(&sc.Streams, "streams", 256, "concurrent streams")
	f.IntVar(&sc.MaxTokens, "max-tokens", 400, "tokens per stream")
	f.IntVar(&sc.PromptWords, "prompt-words", 200, "prompt length scale")
	f.IntVar(&sc.SharedPrefixWords, "shared-prefix-words", 0, "start every prompt with the same system prompt of this many words")
	f.BoolVar(&sc.DistinctPrefix, "distinct-prefix", false, "with --shared-prefix-words: each prompt's system prompt is its own (the same words after the request's number), for a run without sharing of the same length")
	f.DurationVar(&sc.Delay, "delay", 5*time.Second, "load start → migration")
	f.IntVar(&sc.TN, "tn", 2, "data-plane connections")
	f.StringSliceVar(&grans, "final-granularity", []string{"block", "slot"}, "final-round granularities to compare")
	f.StringVar(&sc.Type, "type", sc.Type, "migration type: destroy_source (the source's KV released after), preserve_source, keep_source_active")
	f.StringSliceVar(&backends, "transfer-backend", []string{transfer.Auto}, "the agents' data planes to compare (auto, tcp_shm, cuda_ipc, rdma): each runs with every granularity")
	f.StringSliceVar(&pace, "pace-round0", []string{"0"}, "the sims' agents' round 0 pacing, a share of the source's step per chunk (0: off; vhi agent --pace-round0): each runs with every granularity")
	f.StringSliceVar(&preAttach, "pre-attach", []string{"off"}, "the Host opening the moving streams on the target before the pause (on, off): each runs with every granularity")
	f.StringSliceVar(&inFlight, "pause-in-flight", []string{""}, "what the source's pause does with its engine's step in flight, to compare (drop, wait; empty: the Host's): each runs with every granularity")
	f.StringSliceVar(&verifies, "verify", []string{hostapi.VerifySample}, "checks before the commit to compare (off, sample, full): each runs with every granularity")
	f.StringVar(&jsonOut, "json", "", "also write the statuses as JSON to this file")
	f.StringVar(&sc.CPUProfile, "cpuprofile", "", "write a CPU profile of the migration window")
	_ = f.MarkHidden("cpuprofile")
	f.StringVar(&sc.Trace, "trace", "", "write an execution trace of the migration window (go tool trace)")
	_ = f.MarkHidden("trace")
	f.StringVar(&sc.DeviceA, "device-a", "cpu", "sim A's KV (and the reference run's): cpu or cuda[:N], or GPUs to spread its ranks over (cuda:0,cuda:1)")
	f.StringVar(&sc.DeviceB, "device-b", "cpu", "sim B's KV: cpu or cuda[:N], or GPUs to spread its ranks over (cuda:0,cuda:1)")
	f.IntVar(&sc.ShapeA.TP, "tp-a", 1, "sim A's TP size")
	f.IntVar(&sc.ShapeA.PP, "pp-a", 1, "sim A's PP size")
	f.IntVar(&sc.ShapeB.TP, "tp-b", 1, "sim B's TP size (another shape than A's makes the migration a reshape)")
	f.IntVar(&sc.ShapeB.PP, "pp-b", 1, "sim B's PP size")
	geo.register(f)
	f.BoolVar(&sc.Greedy, "greedy", false, "every stream greedy (default: every other stream samples with a seed; with --host: greedy)")
	f.StringVar(&ext.host, "host", "", "run against this running Host (its URL) instead of starting sims")
	f.StringVar(&ext.model, "model", "", "with --host: the served model to load (default: the source's)")
	f.StringVar(&ext.src, "src", "", "with --host: the source instance (default: the active migratable instance)")
	f.StringVar(&ext.dst, "dst", "", "with --host: the target instance (default: the standby migratable instance)")
	f.StringVar(&ext.tokenFile, "admin-token-file", "", "with --host: file holding the admin token (default: the local Host's)")
	return cmd
}

// externalFlags select a running deployment for vhi bench migrate --host.
type externalFlags struct {
	host, model, src, dst, tokenFile string
}

// resolve finds the source and target among the Host's instances.
func (x externalFlags) resolve(ctx context.Context) (*externalDeployment, error) {
	tok, err := credentials.Resolve(x.tokenFile, credentials.AdminTokenFile, "--admin-token-file", true)
	if err != nil {
		return nil, err
	}
	c, err := hostapi.New(x.host, hostapi.Options{AdminToken: tok, Timeout: 30 * time.Second})
	if err != nil {
		return nil, err
	}
	list, err := c.Instances(ctx)
	if err != nil {
		return nil, fmt.Errorf("the Host's instances: %w", err)
	}
	d := &externalDeployment{Client: c, Model: x.model, Src: x.src, Dst: x.dst}
	for _, in := range list {
		if !in.Migratable || (x.model != "" && in.ServedModelName != x.model) {
			continue
		}
		switch {
		case d.Src == "" && in.Role == "active":
			d.Src = in.ID
		case d.Dst == "" && in.Role == "standby":
			d.Dst = in.ID
		}
	}
	if d.Src == "" || d.Dst == "" {
		of := ""
		if x.model != "" {
			of = " of " + x.model
		}
		return nil, fmt.Errorf("the Host at %s has no migratable active and standby instance%s (source %q, target %q)",
			x.host, of, d.Src, d.Dst)
	}
	if d.Model == "" {
		for _, in := range list {
			if in.ID == d.Src {
				d.Model = in.ServedModelName
			}
		}
	}
	return d, nil
}

// swap makes the target of the last run the next run's source: the
// retired source of a destroy_source migration is woken first.
func (d *externalDeployment) swap(ctx context.Context, typ string) error {
	if typ == hostapi.DestroySource {
		// The source retires once its last requests are gone (the Host
		// releases its KV after the migration ends): wait for that, bounded.
		deadline := time.Now().Add(time.Minute)
		for {
			in, err := d.Client.Instance(ctx, d.Src)
			if err != nil {
				return fmt.Errorf("the retired source %s: %w", d.Src, err)
			}
			if in.Lifecycle == "retired" || in.Lifecycle == "sleeping" {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the source %s did not retire within a minute of the migration (lifecycle %s)", d.Src, in.Lifecycle)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
		if _, err := d.Client.Wake(ctx, d.Src); err != nil {
			return fmt.Errorf("waking the retired source %s: %w", d.Src, err)
		}
	}
	if typ != hostapi.KeepSourceActive {
		d.Src, d.Dst = d.Dst, d.Src
	}
	return nil
}

// register adds the geometry flags to f.
func (g *simGeometryFlags) register(f *pflag.FlagSet) {
	f.StringVar(&g.profile, "profile", "", "KV geometry profile (default: the sim's)")
	f.IntVar(&g.kvScale, "kv-scale", 0, "head-dim divisor (default: the sim's; 1 = the model's real size)")
	f.StringVar(&g.kvLayout, "kv-layout", "", "the sims' KV layout, HND or NHD (vLLM's default; default: the sim's)")
	f.IntVar(&g.numBlocks, "num-blocks", 0, "KV blocks per engine (default: the sim's)")
	f.IntVar(&g.maxNumSeqs, "max-num-seqs", 0, "engine seats (default: the sim's)")
	f.IntVar(&g.maxBatched, "max-num-batched-tokens", 0, "tokens per step, prefill chunks included (default: the sim's)")
	f.IntVar(&g.blockSize, "block-size", 0, "tokens per KV block (default: the sim's)")
	f.BoolVar(&g.prefixCaching, "enable-prefix-caching", false, "the sims share the full blocks of a common prompt prefix (vhi sim --enable-prefix-caching): a migration moves each such block once")
}

// simGeometryFlags override the sims' KV geometry (0 / "" keep the default).
type simGeometryFlags struct {
	profile, kvLayout              string
	kvScale, numBlocks, maxNumSeqs int
	maxBatched, blockSize          int
	prefixCaching                  bool
}

func (g simGeometryFlags) apply(c *sim.Config) {
	if g.profile != "" {
		c.Profile = g.profile
	}
	if g.kvScale > 0 {
		c.KVScale = g.kvScale
	}
	if g.kvLayout != "" {
		c.KVLayout = g.kvLayout
	}
	if g.numBlocks > 0 {
		c.NumBlocks = g.numBlocks
	}
	if g.maxNumSeqs > 0 {
		c.MaxNumSeqs = g.maxNumSeqs
		c.MaxNumBatchedTokens = max(c.MaxNumBatchedTokens, g.maxNumSeqs)
	}
	if g.maxBatched > 0 {
		c.MaxNumBatchedTokens = max(g.maxBatched, c.MaxNumSeqs)
	}
	if g.blockSize > 0 {
		c.BlockSize = g.blockSize
	}
	c.EnablePrefixCaching = g.prefixCaching
}

// benchDims are what bench migrate compares: every combination runs.
type benchDims struct {
	grans, verifies, preAttach, backends, pace, inFlight []string
}

func runBenchMigrate(ctx context.Context, out io.Writer, sc scenario, geo simGeometryFlags, dims benchDims, jsonOut string) (err error) {
	sc.Sim = sim.DefaultConfig()
	geo.apply(&sc.Sim)
	if sc.Log == nil {
		sc.Log = zap.NewNop()
	}
	g := sc.Sim
	if x := sc.External; x != nil {
		fmt.Fprintf(out, "vhi bench migrate: %d streams × %d tokens of %s through the Host at %s, %s → %s, delay %v, tn %d\n",
			sc.Streams, sc.MaxTokens, x.Model, x.Client.Base(), x.Src, x.Dst, sc.Delay, sc.TN)
	} else {
		tpA, ppA := sizes(sc.ShapeA)
		tpB, ppB := sizes(sc.ShapeB)
		fmt.Fprintf(out, "vhi bench migrate: %d streams × %d tokens, sim %s / kv-scale %d / %s, %d blocks, KV on %s TP%d×PP%d → %s TP%d×PP%d, delay %v, tn %d\n",
			sc.Streams, sc.MaxTokens, g.Profile, g.KVScale, g.KVLayout, g.NumBlocks, sc.DeviceA, tpA, ppA, sc.DeviceB, tpB, ppB, sc.Delay, sc.TN)
	}
	var all []hostapi.MigrationStatus
	if jsonOut != "" {
		// The statuses are written whatever happens after the first run: a
		// failed or inexact migration is the one whose rounds and steps
		// someone will want to read.
		defer func() {
			if len(all) == 0 {
				return
			}
			b, _ := json.MarshalIndent(all, "", "  ")
			if werr := os.WriteFile(jsonOut, b, 0o644); werr != nil && err == nil {
				err = fmt.Errorf("writing %s: %w", jsonOut, werr)
			}
		}()
	}
	var runs [][6]string
	if len(dims.inFlight) == 0 {
		dims.inFlight = []string{""}
	}
	if len(dims.backends) == 0 {
		dims.backends = []string{""}
	}
	if len(dims.pace) == 0 {
		dims.pace = []string{"0"}
	}
	for _, b := range dims.backends {
		for _, pace := range dims.pace {
			for _, pa := range dims.preAttach {
				for _, v := range dims.verifies {
					for _, inf := range dims.inFlight {
						for _, gran := range dims.grans {
							runs = append(runs, [6]string{v, gran, pa, b, pace, inf})
						}
					}
				}
			}
		}
	}
	var failed []error
	for _, r := range runs {
		sc.Verify, sc.FinalGranularity, sc.PreAttach, sc.TransferBackend = r[0], r[1], r[2] == "on", r[3]
		sc.PaceRound0, _ = strconv.ParseFloat(r[4], 64)
		sc.PauseInFlight = r[5]
		res, err := sc.run(ctx)
		if err != nil {
			return err
		}
		st := res.Status
		all = append(all, st)
		if sc.External != nil {
			r[0] = "the Host's"
		}
		inf := r[5]
		if inf == "" {
			inf = "the Host's"
		}
		fmt.Fprintf(out, "\n== final round: %s, check before the commit: %s, pre-attach %s (%d streams), data plane %s, round 0 paced %s, the step in flight at the pause: %s (dropped for %d) ==\n",
			r[1], r[0], r[2], st.PreAttached, st.TransferBackend, r[4], inf, st.PauseDroppedInFlight)
		report.Migration(out, st)
		var steps []string
		for _, s := range st.StepHistory {
			switch s.Step {
			case "pause_source", "final_round", "verify", "install_target", "switch":
				steps = append(steps, fmt.Sprintf("%s %.1f", s.Step, s.DurationS*1000))
			}
		}
		fmt.Fprintf(out, "steps (ms): %s\n", strings.Join(steps, ", "))
		var r0, final int64
		for _, r := range st.Rounds {
			if r.Kind == "full" {
				r0 = r.Bytes
			}
			if r.Kind == "final" {
				final = r.Bytes
			}
		}
		pct := 0.0
		if r0 > 0 {
			pct = 100 * float64(final) / float64(r0)
		}
		fmt.Fprintf(out, "final round = %.2f %% of round 0; client inter-token gap: median %v, max during the migration %v (%s; goal ≤ 2×median + 50 ms = %v), max over the whole run %v (prefill stalls included)\n",
			pct, res.MedianGap.Round(100*time.Microsecond), res.MaxGapDuringMigration.Round(100*time.Microsecond), stepsDuring(st, res.MigrationGapFrom, res.MigrationGapTo),
			(2*res.MedianGap + 50*time.Millisecond).Round(100*time.Microsecond), res.MaxGap.Round(100*time.Microsecond))
		if res.Round0Gaps > 0 && res.BaselineGaps > 0 {
			fmt.Fprintf(out, "round 0 and the source's clients: inter-token gap p99 %v during round 0 (%d gaps) against %v just before the migration (%d gaps): ×%.2f (goal ≤ 1.3)\n",
				res.Round0GapP99.Round(100*time.Microsecond), res.Round0Gaps, res.BaselineGapP99.Round(100*time.Microsecond), res.BaselineGaps,
				float64(res.Round0GapP99)/float64(res.BaselineGapP99))
		}
		exact := "every stream exact"
		if n := len(res.Unjudged); n > 0 {
			exact = fmt.Sprintf("%d/%d streams exact; %d went their own way before the source was paused, so the engine "+
				"is not deterministic for this load and they cannot judge it (%s)", len(res.Streams)-n, len(res.Streams), n,
				strings.Join(res.Unjudged[:min(3, n)], "; "))
		}
		if len(res.Mismatches) > 0 {
			exact = fmt.Sprintf("%d MISMATCHES: %s", len(res.Mismatches), strings.Join(res.Mismatches[:min(3, len(res.Mismatches))], "; "))
		}
		if res.ByIDs > 0 {
			exact += fmt.Sprintf(" (%d of %d streams compared by token ids, the rest by text", res.ByIDs, len(res.Streams))
			if n := len(res.ShortOfIDs); n > 0 {
				exact += fmt.Sprintf("; %d carried ids for only some tokens: %s", n, strings.Join(res.ShortOfIDs[:min(3, n)], "; "))
			}
			exact += ")"
		}
		fmt.Fprintf(out, "%s; %s\n", exact, res.StatsA)
		if sc.External != nil && st.State == hostapi.StateSucceeded {
			// Whatever the run proved, the deployment is left as it was
			// found, an active and a standby instance (the retired source
			// woken): the next run, or the next bench, migrates back.
			if err := sc.External.swap(ctx, sc.Type); err != nil {
				return err
			}
		}
		if goOn, err := outcome(st, res); err != nil {
			if !goOn {
				return errors.Join(append(failed, err)...)
			}
			failed = append(failed, fmt.Errorf("final round %s, check %s, pre-attach %s, data plane %s, pace %s: %w", r[1], r[0], r[2], st.TransferBackend, r[4], err))
		}
	}
	return errors.Join(failed...)
}

// outcome judges one run: whether the comparison may go on, and an
// error when it failed. A migration that aborted (and rolled back) or
// moved a token wrong is reported and the next run goes on — each run of
// a GPU bench costs minutes of a lent machine, and the deployment is as
// it was after a rollback; a run that proves nothing says how to fix the
// load instead.
func outcome(st hostapi.MigrationStatus, res scenarioResult) (goOn bool, err error) {
	switch {
	case st.State == hostapi.StateSucceeded && st.Migrated == 0:
		return false, fmt.Errorf("the migration moved no request, so it proves nothing: the streams ended before it began (raise --max-tokens or lower --delay)")
	case st.State != hostapi.StateSucceeded || len(res.Mismatches) > 0:
		if st.Error != "" {
			return true, fmt.Errorf("migration %s with %d mismatches: %s", st.State, len(res.Mismatches), st.Error)
		}
		return true, fmt.Errorf("migration %s with %d mismatches", st.State, len(res.Mismatches))
	case len(res.Unjudged) == len(res.Streams):
		return false, fmt.Errorf("every stream differed from its reference before the source was paused: the engine is not deterministic for this load, so nothing was checked")
	}
	return true, nil
}

// stepsDuring names the migration steps that a client gap from → to
// overlapped, with how much of the gap each took: where the gap came from.
func stepsDuring(st hostapi.MigrationStatus, from, to time.Time) string {
	if from.IsZero() {
		return "no gap"
	}
	var parts []string
	for _, s := range st.StepHistory {
		end := s.EndedAt
		if end.IsZero() {
			end = s.StartedAt.Add(time.Duration(s.DurationS * float64(time.Second)))
		}
		lo, hi := from, to
		if s.StartedAt.After(lo) {
			lo = s.StartedAt
		}
		if end.Before(hi) {
			hi = end
		}
		if hi.After(lo) {
			parts = append(parts, fmt.Sprintf("%s %.0f ms", s.Step, hi.Sub(lo).Seconds()*1000))
		}
	}
	if len(parts) == 0 {
		return "outside the steps"
	}
	return "in " + strings.Join(parts, ", ")
}
